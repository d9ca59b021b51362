"""RandNLA / exact-SVD targets against dense oracles and closed forms; the on-disk shard cache."""

import pytest
import torch

from helpers.metric import dense_importance, dense_jacobian, head_probe, random_features, tiny_vit
from pullback_ext.errors import CheckpointError
from pullback_ext.metric import TargetCache, TargetConfig, compute_targets
from pullback_ext.metric.losses import subspace_alignment


def test_linear_probe_closed_form():
    from pullback_ext.probes import linear_probe

    g = torch.Generator().manual_seed(0)
    N, D, C = 4, 6, 2
    W = torch.randn(C, D, generator=g, dtype=torch.float64)
    probe = linear_probe(W, N)
    F = torch.randn(2, N, D, generator=g, dtype=torch.float64)
    # g = I_N ⊗ WᵀW: the N·C nonzero modes span I_N ⊗ rowspace(W), every token has imp = ‖W‖_F.
    row_space = torch.linalg.qr(W.T).Q
    basis = torch.block_diag(*[row_space] * N)
    for mode, power in (("exact", 0), ("randnla", 1)):
        t = compute_targets(probe, F, TargetConfig(mode=mode, rank=N * C, power=power, block_norms=True))
        assert t["V"].shape == (2, N * D, N * C)
        assert torch.allclose(subspace_alignment(t["V"], basis.expand(2, -1, -1)), torch.ones(2, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(t["importance"], torch.full((2, N), float(W.norm()), dtype=torch.float64), atol=1e-10)
        assert torch.allclose(t["block_norm"], torch.full((2, N), float(W.norm()), dtype=torch.float64), atol=1e-10)
        S = torch.linalg.svdvals(W)
        assert torch.allclose(t["sigma"][:, : N * C].sort(dim=1).values, S.repeat(N).sort().values.expand(2, -1), atol=1e-10)


@pytest.fixture(scope="module")
def vit_probe():
    model = tiny_vit()
    probe = head_probe(model, layer=1, outputs=6)
    return probe, random_features(probe, 2, seed=5)


def test_exact_and_randnla_targets_match_the_dense_svd(vit_probe):
    probe, F = vit_probe
    rank = 4
    exact = compute_targets(probe, F, TargetConfig(mode="exact", rank=rank, block_norms=True))
    approx = compute_targets(probe, F, TargetConfig(mode="randnla", rank=rank, power=4, oversample=2))
    for b in range(2):
        J = dense_jacobian(probe, F[b])
        _, S, Vh = torch.linalg.svd(J, full_matrices=False)
        V = Vh[:rank].T.unsqueeze(0)
        assert torch.allclose(exact["sigma"][b], S[: rank + 1], rtol=1e-10)
        assert float(subspace_alignment(exact["V"][b : b + 1], V)) == pytest.approx(1.0, abs=1e-10)
        assert float(subspace_alignment(approx["V"][b : b + 1], V)) > 0.999
        assert torch.allclose(approx["sigma"][b, :rank], S[:rank], rtol=1e-3)
        imp = dense_importance(J, rank, probe.num_tokens)
        assert torch.allclose(exact["importance"][b], imp, rtol=1e-8)
        assert torch.allclose(approx["importance"][b], imp, rtol=1e-2)
        blocks = J.view(J.shape[0], probe.num_tokens, -1).pow(2).sum((0, 2)).sqrt()
        assert torch.allclose(exact["block_norm"][b], blocks, rtol=1e-10)


def test_rank_above_output_dim_supervises_the_m_nonzero_modes(vit_probe):
    probe, F = vit_probe
    t = compute_targets(probe, F[:1], TargetConfig(mode="exact", rank=10))
    assert t["V"].shape[-1] == 6 and t["sigma"].shape[-1] == 6


def test_sketches_are_reproducible_per_stream_id(vit_probe):
    probe, F = vit_probe
    cfg = TargetConfig(mode="randnla", rank=3, power=0, oversample=0, seed=7)
    a = compute_targets(probe, F, cfg, stream=[10, 11])
    b = compute_targets(probe, F[1:], cfg, stream=[11])
    c = compute_targets(probe, F[1:], cfg, stream=[12])
    assert torch.equal(a["V"][1:], b["V"])
    assert not torch.equal(b["V"], c["V"])


def test_cache_round_trip_reuse_and_mismatch(tmp_path, vit_probe, monkeypatch):
    probe, F = vit_probe
    cfg = TargetConfig(mode="exact", rank=3)
    source = {"model": "tiny", "layer": 1}
    cache = TargetCache(tmp_path)
    built = cache.build(probe, lambda s, e: F[s:e], 2, cfg, source, shard_size=1, progress=False)
    direct = compute_targets(probe, F, cfg)
    assert torch.equal(built["features"], F) and torch.equal(built["V"], direct["V"])
    import pullback_ext.metric.targets as targets

    monkeypatch.setattr(targets, "compute_targets", lambda *a, **k: pytest.fail("cache was not reused"))
    again = TargetCache(tmp_path).build(probe, lambda s, e: F[s:e], 2, cfg, source, shard_size=1, progress=False)
    assert torch.equal(again["importance"], built["importance"])
    with pytest.raises(CheckpointError, match="another configuration"):
        cache.load(TargetConfig(mode="exact", rank=4), source)
    shard = sorted(tmp_path.glob("targets-*.safetensors"))[0]
    shard.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt target shard"):
        cache.load()
    assert not list(tmp_path.glob(".*tmp*"))


def test_demo_render_shards_are_reused_by_a_larger_run(tmp_path, vit_probe, monkeypatch):
    """Rendered training scenes come in fixed blocks, so the key of their shards does not depend on
    the image count: a larger run recomputes only the new shards."""
    from pullback_ext.sources.preprocess import unit_range_preprocess
    from pullback_ext.sources.scenes import HeldoutScenes, TrainingScenes

    probe, F = vit_probe
    cfg = TargetConfig(mode="exact", rank=3)
    pre = unit_range_preprocess(112)
    small, large = ({"probe": "tiny", "images": TrainingScenes(n, pre).describe()} for n in (1, 2))
    assert small == large and HeldoutScenes(1, 0, pre).describe() != HeldoutScenes(2, 0, pre).describe()
    TargetCache(tmp_path).build(probe, lambda s, e: F[s:e], 1, cfg, small, shard_size=1, progress=False)
    import pullback_ext.metric.targets as targets

    computed = []
    real = targets.compute_targets
    monkeypatch.setattr(targets, "compute_targets", lambda p, f, c, stream: computed.append(list(stream)) or real(p, f, c, stream=stream))
    built = TargetCache(tmp_path).build(probe, lambda s, e: F[s:e], 2, cfg, large, shard_size=1, progress=False)
    assert computed == [[1]]
    assert torch.equal(built["importance"], real(probe, F, cfg)["importance"])


def test_a_probe_with_per_image_context_is_bound_to_each_image():
    """Targets of ``Features`` use image b's context for image b, whatever was extracted since."""
    from helpers.diagnose import images, tiny_dpt
    from pullback_ext.errors import PullbackError
    from pullback_ext.probes import from_hf_dpt

    probe = from_hf_dpt(tiny_dpt(), 2, output_size=4)
    features = probe.features(images(2))
    probe.features(images(1, seed=5))  # a later batch must not matter
    cfg = TargetConfig(mode="exact", rank=3, block_norms=True)
    t = compute_targets(probe, features, cfg)
    for b in range(2):
        J = dense_jacobian(probe.bind(features.image(b).context), features.F[b])
        assert torch.allclose(t["importance"][b], dense_importance(J, 3, probe.num_tokens), rtol=1e-8)
    with pytest.raises(PullbackError, match="context"):
        compute_targets(probe, features.F, cfg)


def test_bad_configs():
    with pytest.raises(ValueError, match="mode"):
        TargetConfig(mode="svd")
    with pytest.raises(ValueError, match="rank"):
        TargetConfig(rank=0)
    with pytest.raises(ValueError, match="power"):
        TargetConfig(power=-1)


@pytest.mark.parametrize("M,P", [(4, 12), (12, 6)])
def test_exact_block_norms_from_either_side(M, P):
    """Exact block norms ‖J_{:,t}‖_F take J from the smaller side (VJPs or JVPs) alike."""
    from pullback_ext.linalg import DenseOperator
    from pullback_ext.metric.targets import block_norms

    J = torch.randn(M, P, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = J.view(M, 3, P // 3).pow(2).sum((0, 2)).sqrt()
    torch.testing.assert_close(block_norms(DenseOperator(J), 3, 8, None), expected)
