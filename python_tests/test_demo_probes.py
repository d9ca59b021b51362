"""Demo probe maps against the full model (random weights: the wiring, not the training)."""

import pytest
import torch

from pullback_ext.embedded.model import DemoModel
from pullback_ext.embedded.probes import demo_probe
from pullback_ext.embedded.scenes import render
from pullback_ext.probes.cls_row import supports_cls_row


@pytest.fixture(scope="module")
def model_and_images():
    torch.manual_seed(0)
    model = DemoModel().eval()
    return model, render(2, seed=3)["images"]


@pytest.mark.parametrize("layer", [0, 2, 5, 7])
@pytest.mark.parametrize("decoder", ["cls", "embedding", "depth"])
def test_probe_reproduces_model_outputs(model_and_images, layer, decoder):
    model, images = model_and_images
    probe = demo_probe(model, layer, decoder)
    with torch.no_grad():
        full = model(images)
        features = probe.features(images)
        y = probe.bind(features.context)(features.F)
    expected = {"cls": full["logits"], "embedding": full["embedding"], "depth": full["depth"].flatten(1)}[decoder]
    assert y.shape == (2, probe.output_dim)
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)
    assert (probe.layer, probe.num_tokens, probe.dim, probe.num_prefix_tokens) == (layer, 197, 192, 1)
    # cls / embedding run the last block for the CLS row only (pullback_ext.probes.cls_row)
    assert supports_cls_row(probe.model.backbone.blocks[-1])


def test_depth_probe_pooling_and_single_image(model_and_images):
    model, images = model_and_images
    probe = demo_probe(model, 4, "depth", output_size=8)
    with torch.no_grad():
        features = probe.features(images)
        F = features.F
        pooled = probe.bind(features.context)(F)
        full = model(images)["depth"]
        # Row 1 alone must use the frozen hooks of image 1, not of image 0.
        single = probe.bind(features.image(1).context)(F[1:2])
    with pytest.raises(ValueError, match="one per image"):
        probe.bind(features.context)(F[1:2])
    assert pooled.shape == (2, 64)
    torch.testing.assert_close(pooled, torch.nn.functional.avg_pool2d(full[:, None], 14).flatten(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(single, pooled[1:2])


def test_depth_probe_needs_the_context_of_its_features(model_and_images):
    model, _ = model_and_images
    probe = demo_probe(model, 4, "depth", output_size=4)
    assert probe.context_keys and demo_probe(model, 4, "embedding").context_keys == ()
    with pytest.raises(ValueError, match="features"):
        probe(torch.zeros(1, 197, 192))
    with pytest.raises(ValueError, match="context"):
        probe.bind({})
    assert probe.output_dim == 16


def test_interleaved_features_calls_leave_earlier_batches_unchanged(model_and_images):
    """The frozen hooks of batch a travel with its Features: extracting batch b in between changes
    neither ψ of batch a nor its diagnosis (the probe keeps no per-call state)."""
    from pullback_ext import diagnose

    model, images = model_and_images
    probe = demo_probe(model, 4, "depth", output_size=4)
    with torch.no_grad():
        a = probe.features(images[:1])
        before = probe.bind(a.context)(a.F)
        first = diagnose(probe, a, rank=2, oversample=1, power=0, probes=2, slq_steps=0, svd="randomized").to_dict()
        b = probe.features(images[1:])
        torch.testing.assert_close(probe.bind(a.context)(a.F), before, rtol=0, atol=0)
        assert not torch.allclose(probe.bind(b.context)(a.F), before)
    again = diagnose(probe, a, rank=2, oversample=1, power=0, probes=2, slq_steps=0, svd="randomized").to_dict()
    assert again == first


@pytest.mark.parametrize("decoder", ["embedding", "depth"])
def test_forward_mode_jvp_matches_finite_differences(model_and_images, decoder):
    model, images = model_and_images
    probe = demo_probe(model.double(), 3, decoder, output_size=4 if decoder == "depth" else None)
    model.float()
    features = probe.features(images[:1].double())
    F, probe = features.F, probe.bind(features.context)
    v = torch.randn(F.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, jv = torch.func.jvp(probe, (F,), (v,))
    # Small step: the depth head's ReLUs make larger central differences only first-order accurate.
    h = 1e-6
    with torch.no_grad():
        fd = (probe(F + h * v) - probe(F - h * v)) / (2 * h)
    assert jv.abs().max() > 1e-3
    torch.testing.assert_close(jv, fd, rtol=1e-4, atol=1e-6)
    y, vjp = torch.func.vjp(probe, F)
    u = torch.randn(y.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.testing.assert_close((vjp(u)[0] * v).sum(), (u * jv).sum())


@pytest.mark.parametrize("kwargs, match", [
    ({"layer": 8}, "layer"), ({"layer": -1}, "layer"), ({"layer": 2, "decoder": "pose"}, "decoder"),
    ({"layer": 2, "decoder": "cls", "output_size": 4}, "output_size"),
    ({"layer": 2, "decoder": "depth", "output_size": 0}, "output_size"),
])
def test_bad_probe_arguments(model_and_images, kwargs, match):
    with pytest.raises(ValueError, match=match):
        demo_probe(model_and_images[0], **kwargs)


def test_probe_rejects_wrong_feature_shape(model_and_images):
    probe = demo_probe(model_and_images[0], 2, "cls")
    with pytest.raises(ValueError, match="197,192"):
        probe(torch.zeros(1, 196, 192))
