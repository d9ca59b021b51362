"""Probe maps on real architectures (random weights): wiring against the models' own forward,
forward-mode AD through fused attention, and restoring the model."""

import pytest
import torch

from pullback_ext.linalg import JacobianOperator
from pullback_ext.probes import Probe, from_callable, from_hf_dpt, from_timm, linear_probe

from helpers.diagnose import dense_jacobian, images, tiny_depth_anything, tiny_dpt, tiny_timm_vit


def timm_variants():
    import timm

    small = dict(pretrained=False, img_size=28, depth=3, embed_dim=32, num_heads=2)
    return {
        "vit": tiny_timm_vit(),
        "dinov2_reg4": timm.create_model("vit_small_patch14_reg4_dinov2", **small).double().eval(),
        "dinov2": timm.create_model("vit_small_patch14_dinov2", **small).double().eval(),
        "deit_distilled": timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, img_size=32, depth=3, embed_dim=32, num_heads=2).double().eval(),
        "clip": timm.create_model("vit_base_patch16_clip_224", pretrained=False, img_size=32, depth=3, embed_dim=32, num_heads=2).double().eval(),
    }


@pytest.fixture(scope="module")
def variants():
    return timm_variants()


@pytest.mark.parametrize("name", ["vit", "dinov2_reg4", "dinov2", "deit_distilled", "clip"])
def test_timm_probe_reproduces_forward_features_and_head(variants, name):
    model = variants[name]
    size = model.patch_embed.img_size
    x = images(2, size[0])
    depth = len(model.blocks)
    with torch.no_grad():
        tokens = model.forward_features(x)
        pooled = model.forward_head(tokens, pre_logits=True)
    for layer in (0, depth - 1):
        probe = from_timm(model, layer, "tokens")
        features = probe.features(x)
        assert features.context == {}
        F = features.F
        assert F.shape == (2, probe.num_tokens, probe.dim)
        assert probe.num_prefix_tokens == model.num_prefix_tokens
        with torch.no_grad():
            torch.testing.assert_close(probe(F), tokens.flatten(1))
            torch.testing.assert_close(from_timm(model, layer, "cls")(F), tokens[:, 0])
            torch.testing.assert_close(from_timm(model, layer, "pooled")(F), pooled)
            torch.testing.assert_close(from_timm(model, layer, lambda t: t[:, 1:].mean(1))(F), tokens[:, 1:].mean(1))
    expected_prefix = {"vit": 1, "dinov2_reg4": 5, "dinov2": 1, "deit_distilled": 2, "clip": 1}[name]
    assert model.num_prefix_tokens == expected_prefix


@pytest.mark.parametrize("name", ["vit", "dinov2_reg4", "deit_distilled", "clip", "qk_norm_gated"])
def test_cls_row_last_block_matches_the_full_block(variants, name):
    """The CLS-only last block gives the full probe's outputs, JVPs and VJPs (float64)."""
    from pullback_ext.probes.cls_row import supports_cls_row

    if name == "qk_norm_gated":
        model = tiny_timm_vit(qk_norm=True, qkv_bias=False, init_values=0.5)
        for block in model.blocks:  # a gated attention output, as some recent timm models have
            if hasattr(block.attn, "gate"):
                block.attn.gate = torch.nn.Linear(block.attn.qkv.in_features, block.attn.qkv.out_features // 3, dtype=torch.float64)
    else:
        model = variants[name]
    assert supports_cls_row(model.blocks[-1])
    x = images(2, model.patch_embed.img_size[0], seed=3)
    for layer in (0, 1):
        fast, full = from_timm(model, layer, "cls"), from_timm(model, layer, "cls", cls_row=False)
        F = fast.features(x).F
        torch.testing.assert_close(fast(F), full(F), rtol=1e-12, atol=1e-12)
        a, b = JacobianOperator(fast, F[1], chunk_size=4), JacobianOperator(full, F[1], chunk_size=4)
        g = torch.Generator().manual_seed(layer)
        V = torch.randn(a.P, 5, generator=g, dtype=F.dtype)
        Y = torch.randn(a.M, 5, generator=g, dtype=F.dtype)
        torch.testing.assert_close(a.jvp(V), b.jvp(V), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(a.vjp(Y), b.vjp(Y), rtol=1e-10, atol=1e-10)


def test_cls_row_is_skipped_for_blocks_of_unknown_structure():
    from pullback_ext.probes.cls_row import supports_cls_row

    class Wrapped(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.inner = block

        def forward(self, x):
            return self.inner(x) * 0.5

    model = tiny_timm_vit()
    model.blocks[-1] = Wrapped(model.blocks[-1])
    assert not supports_cls_row(model.blocks[-1])
    probe = from_timm(model, 0, "cls")
    F = probe.features(images(1)).F
    with torch.no_grad():
        torch.testing.assert_close(probe(F), model.norm(model.blocks[2](model.blocks[1](F)))[:, 0])


def test_fused_attention_model_gets_jvps_and_is_left_as_found():
    model = tiny_timm_vit()
    assert all(b.attn.fused_attn for b in model.blocks)
    probe = from_timm(model, 0, "cls")
    F = probe.features(images(1)).F[0]
    with pytest.raises(NotImplementedError):  # the model itself has no forward-mode AD
        torch.func.jvp(lambda f: model.norm(model.blocks[1](f[None]))[0, 0], (F,), (torch.ones_like(F),))
    op = JacobianOperator(probe, F, chunk_size=4)
    J = dense_jacobian(probe, F)
    V = torch.randn(J.shape[1], 3, dtype=torch.float64)
    torch.testing.assert_close(op.jvp(V), J @ V, rtol=1e-9, atol=1e-9)
    assert all(b.attn.fused_attn for b in model.blocks)

    def failing(t):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        from_timm(model, 0, failing)(F[None])
    assert all(b.attn.fused_attn for b in model.blocks)


def test_probe_runs_in_eval_mode_and_restores_training_flags(dpt):
    model = tiny_timm_vit(drop_rate=0.5, proj_drop_rate=0.5, attn_drop_rate=0.5).train()
    probe = from_timm(model, 0, "tokens")
    x = images(1)
    F = probe.features(x).F
    torch.testing.assert_close(F, probe.features(x).F)
    with torch.no_grad():
        torch.testing.assert_close(probe(F), probe(F))
    assert all(m.training for m in model.modules())
    dpt.train()
    try:
        depth_probe = from_hf_dpt(dpt, 1)
        G = depth_probe.features(x)
        bound = depth_probe.bind(G.context)
        with torch.no_grad():
            torch.testing.assert_close(bound(G.F), bound(G.F))
        assert all(m.training for m in dpt.modules())
    finally:
        dpt.eval()


def test_output_transform_is_applied_inside_forward():
    model = tiny_timm_vit()
    L = torch.randn(5, model.embed_dim, dtype=torch.float64)
    plain, transformed = from_timm(model, 1, "cls"), from_timm(model, 1, "cls", output_transform=L)
    F = plain.features(images(2)).F
    with torch.no_grad():
        torch.testing.assert_close(transformed(F), plain(F) @ L.T)
    assert transformed.output_dim == 5 and plain.output_dim == model.embed_dim


def test_linear_probe_jacobian_is_kronecker():
    W = torch.randn(3, 6, dtype=torch.float64)
    probe = linear_probe(W, num_tokens=4, bias=torch.ones(3, dtype=torch.float64))
    F = torch.randn(4, 6, dtype=torch.float64)
    J = dense_jacobian(probe, F)
    torch.testing.assert_close(J, torch.kron(torch.eye(4, dtype=torch.float64), W))
    assert probe.output_dim == 12
    with pytest.raises(NotImplementedError, match="feature extractor"):
        probe.features(images(1))


def test_from_callable_with_example_or_extractor():
    net = torch.nn.Sequential(torch.nn.Flatten(1), torch.nn.Linear(12, 2)).double()
    F = torch.randn(2, 3, 4, dtype=torch.float64)
    probe = from_callable(net, F)
    assert (probe.num_tokens, probe.dim, probe.output_dim) == (3, 4, 2)
    torch.testing.assert_close(dense_jacobian(probe, F[0]), net[1].weight.detach())
    extractor = from_callable(net, lambda x: x.reshape(x.shape[0], 3, 4), num_tokens=3, dim=4)
    torch.testing.assert_close(extractor.features(torch.ones(1, 12, dtype=torch.float64)).F, torch.ones(1, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="num_tokens"):
        from_callable(net, lambda x: x)
    with pytest.raises(TypeError, match="fn"):
        from_callable(3, F)


@pytest.fixture(scope="module")
def dpt():
    return tiny_dpt()


@pytest.fixture(scope="module")
def depth_anything():
    return tiny_depth_anything()


@pytest.mark.parametrize("which", ["dpt", "depth_anything"])
@pytest.mark.parametrize("layer", [0, 2])
def test_hf_depth_probe_reproduces_predicted_depth(request, which, layer):
    model = request.getfixturevalue(which)
    x = images(2)
    with torch.no_grad():
        depth = model(pixel_values=x).predicted_depth
    probe = from_hf_dpt(model, layer)
    features = probe.features(x)
    F = features.F
    assert F.shape == (2, 17, 32) and set(features.context) == set(probe.context_keys) == ({"images"} if layer else set())
    with torch.no_grad():
        torch.testing.assert_close(probe.bind(features.context)(F), depth.flatten(1))
        for i in range(2):
            torch.testing.assert_close(probe.bind(features.image(i).context)(F[i : i + 1]), depth[i : i + 1].flatten(1))
    resized = from_hf_dpt(model, layer, output_size=8)
    with torch.no_grad():
        y = resized.bind(resized.features(x).context)(F)
    expected = torch.nn.functional.interpolate(depth[:, None], size=(8, 8), mode="bilinear", align_corners=False).flatten(1)
    torch.testing.assert_close(y, expected)
    assert resized.output_dim == 64


@pytest.mark.parametrize("which", ["dpt", "depth_anything"])
def test_hf_multi_layer_probe_reads_only_the_decoder_inputs(request, which):
    model = request.getfixturevalue(which)
    x = images(1)
    probe = from_hf_dpt(model, multi_layer=True, output_size=4)
    F = probe.features(x).F
    assert probe.context_keys == ()
    hooks = len(probe.hooks)
    assert F.shape == (1, 17, 32 * hooks) and probe.dim == 32 * hooks
    with torch.no_grad():
        expected = torch.nn.functional.interpolate(model(pixel_values=x).predicted_depth[:, None], size=(4, 4), mode="bilinear").flatten(1)
        torch.testing.assert_close(probe(F), expected)
    J = dense_jacobian(probe, F[0])
    # every hooked layer feeds the neck directly; layers between hooks add nothing (the hook overrides them)
    blocks = J.reshape(J.shape[0], 17, hooks, 32)
    assert all(blocks[:, :, k].abs().sum() > 0 for k in range(hooks))
    op = JacobianOperator(probe, F[0], chunk_size=5)
    V = torch.randn(J.shape[1], 3, dtype=torch.float64)
    torch.testing.assert_close(op.jvp(V), J @ V, rtol=1e-8, atol=1e-10)


def test_hf_single_layer_jvp_matches_dense_and_depends_on_the_image_context(dpt):
    x = images(2)
    probe = from_hf_dpt(dpt, 2, output_size=4)
    features = probe.features(x)
    F = features.F
    fn = probe.bind(features.image(1).context)
    J = dense_jacobian(fn, F[1])
    op = JacobianOperator(fn, F[1], chunk_size=4)
    V = torch.randn(J.shape[1], 2, dtype=torch.float64)
    torch.testing.assert_close(op.jvp(V), J @ V, rtol=1e-8, atol=1e-10)
    assert not torch.allclose(fn(F[1:2]), probe.bind(features.image(0).context)(F[1:2]))
    with pytest.raises(ValueError, match="features"):
        probe(F)
    with pytest.raises(ValueError, match="context"):
        probe.bind({})
    with pytest.raises(ValueError, match="one per image"):
        probe.bind(features.context)(F[:1])


def test_interleaved_features_calls_leave_earlier_batches_unchanged(dpt):
    """A probe keeps no per-call state: the context of batch a travels with its Features, so
    extracting batch b in between changes neither ψ of batch a nor its diagnosis."""
    from pullback_ext import diagnose

    probe = from_hf_dpt(dpt, 2, output_size=4)
    a = probe.features(images(2, seed=1))
    with torch.no_grad():
        before = probe.bind(a.context)(a.F)
    settings = dict(rank=3, power=1, probes=4, slq_steps=0, svd="randomized")
    first = diagnose(probe, a, **settings).to_dict()
    b = probe.features(images(3, seed=2))
    with torch.no_grad():
        torch.testing.assert_close(probe.bind(a.context)(a.F), before, rtol=0, atol=0)
        assert not torch.allclose(probe.bind(b.image(0).context)(a.F[:1]), before[:1])
    assert diagnose(probe, a, **settings).to_dict() == first


def test_bad_inputs(dpt):
    model = tiny_timm_vit()
    with pytest.raises(ValueError, match="layer"):
        from_timm(model, 3)
    with pytest.raises(ValueError, match="layer"):
        from_timm(model, -1)
    with pytest.raises(ValueError, match="output"):
        from_timm(model, 0, "logits")
    with pytest.raises(TypeError, match="model"):
        from_timm(torch.nn.Linear(2, 2), 0)
    no_cls = tiny_timm_vit(class_token=False, global_pool="avg")
    with pytest.raises(ValueError, match="CLS"):
        from_timm(no_cls, 0, "cls")
    with pytest.raises(ValueError, match="images"):
        from_timm(model, 0).features(torch.zeros(1, 32, 32))
    with pytest.raises(ValueError, match="F"):
        from_timm(model, 0).check_features(torch.zeros(1, 16, 32))
    with pytest.raises(ValueError, match="layer"):
        from_hf_dpt(dpt, 4)
    with pytest.raises(ValueError, match="layer"):
        from_hf_dpt(dpt)
    with pytest.raises(TypeError, match="model"):
        from_hf_dpt(model, 0)
    with pytest.raises(ValueError, match="images"):
        from_hf_dpt(dpt, 1).features(torch.zeros(1, 3, 48, 48, dtype=torch.float64))
    with pytest.raises(ValueError, match="output_size"):
        from_hf_dpt(dpt, 1, output_size=0)
    with pytest.raises(ValueError, match="W"):
        linear_probe(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="output_transform"):
        from_timm(model, 0, output_transform=torch.zeros(3))
    assert isinstance(from_timm(model, 0), Probe)
