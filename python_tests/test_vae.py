"""FeatureVAE and the probe at its latent (ψ ∘ Dec)."""

import pytest
import torch

from helpers.metric import dense_jacobian, random_features, tiny_vit
from pullback_ext.metric import FeatureVAE, LatentProbe, TrainConfig, fit
from pullback_ext.metric.tasks import VAETask


@pytest.fixture(scope="module")
def probe_and_features():
    from pullback_ext.probes import from_timm

    probe = from_timm(tiny_vit(depth=2), 0, "cls")
    return probe, random_features(probe, 48, seed=0)


def test_normalisation_shapes_and_loss_terms():
    vae = FeatureVAE(6, 2, hidden=8).double()
    F = torch.randn(4, 5, 6, dtype=torch.float64) * 3 + 1
    vae.fit_normalization(F)
    assert torch.allclose(vae.feature_mean, F.reshape(-1, 6).mean(0))
    mean, logvar = vae.encode(F)
    assert mean.shape == logvar.shape == (4, 5, 2) and vae.decode(mean).shape == F.shape
    noise = torch.randn(4, 5, 2, dtype=torch.float64)
    loss, terms = vae.loss(F, beta=0.5, noise=noise)
    recon = vae.decode(mean + noise * (0.5 * logvar).exp())
    rec = (((recon - F) / vae.feature_std) ** 2).mean()
    kl = 0.5 * (mean**2 + logvar.exp() - 1 - logvar).mean()
    assert float(loss) == pytest.approx(float(rec + 0.5 * kl), rel=1e-12)
    with pytest.raises(ValueError, match=r"z: expected shape \[..., 2\]"):
        vae.decode(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="noise"):
        vae(F, torch.zeros(1, 2, dtype=torch.float64))


def test_training_reduces_reconstruction_error(probe_and_features, tmp_path):
    probe, F = probe_and_features
    torch.manual_seed(0)
    vae = FeatureVAE(probe.dim, 8, hidden=32).double()
    vae.fit_normalization(F[:32])

    def rel_err():
        with torch.no_grad():
            recon = vae.decode(vae.encode(F[32:])[0])
        return float(((recon - F[32:]).norm(dim=-1) / F[32:].norm(dim=-1)).mean())

    before = rel_err()
    fit(VAETask(beta=1e-3), vae, {"features": F[:32]}, TrainConfig(steps=150, batch_size=8, lr=3e-3, checkpoint_every=150), tmp_path, progress=False)
    after = rel_err()
    print(f"held-out relative reconstruction error {before:.3f} -> {after:.3f}")
    assert after < 0.5 * before


def test_latent_probe_jacobian_is_the_chain_rule(probe_and_features):
    probe, F = probe_and_features
    torch.manual_seed(1)
    vae = FeatureVAE(probe.dim, 3, hidden=8).double().requires_grad_(False)
    vae.fit_normalization(F)
    latent = LatentProbe(probe, vae)
    assert (latent.num_tokens, latent.dim, latent.layer) == (probe.num_tokens, 3, probe.layer)
    images = torch.rand(1, 3, 32, 32, dtype=torch.float64)
    z = latent.features(images).F
    assert torch.allclose(z, vae.encode(probe.features(images).F)[0])
    J_latent = dense_jacobian(latent, z[0])
    J_probe = dense_jacobian(probe, vae.decode(z[0]))
    J_dec = torch.func.jacrev(vae.decode)(z[0]).reshape(probe.num_tokens * probe.dim, -1)
    assert torch.allclose(J_latent, J_probe @ J_dec, atol=1e-10)
    with pytest.raises(ValueError, match="vae: expected a VAE on D=16"):
        LatentProbe(probe, FeatureVAE(8, 2))


def test_latent_probe_passes_the_base_probes_context_on():
    from helpers.diagnose import images, tiny_dpt
    from pullback_ext.errors import PullbackError
    from pullback_ext.probes import from_hf_dpt

    base = from_hf_dpt(tiny_dpt(), 2, output_size=4)  # reads hooks 0, 1 of the image
    torch.manual_seed(2)
    vae = FeatureVAE(base.dim, 3, hidden=8).double().requires_grad_(False)
    latent = LatentProbe(base, vae)
    x = images(2)
    z = latent.features(x)
    assert latent.context_keys == base.context_keys == ("images",)
    torch.testing.assert_close(z.context["images"], x)
    with torch.no_grad():
        want = base.bind(base.features(x).context)(vae.decode(z.F))
        torch.testing.assert_close(latent.bind(z.context)(z.F), want)
        with pytest.raises(PullbackError, match="bind"):
            latent(z.F)
