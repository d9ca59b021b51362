"""Recovery endpoints x_t = α·x_t^frozen + (1 − α)·m_t against a loop over the grid."""

import pytest
import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.recovery import kept_neighbour_mean, recover


def loop_neighbour_mean(x, kept, grid):
    b, n, d = x.shape
    h, w = grid
    out = torch.empty_like(x)
    for i in range(b):
        everyone = x[i][kept[i]]
        fallback = everyone.mean(0) if len(everyone) else torch.zeros(d, dtype=x.dtype)
        for t in range(n):
            r, c = divmod(t, w)
            near = [(r + dr) * w + c + dc for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                    if (dr or dc) and 0 <= r + dr < h and 0 <= c + dc < w and kept[i, (r + dr) * w + c + dc]]
            out[i, t] = x[i, near].mean(0) if near else fallback
    return out


@pytest.mark.parametrize("keep_rate", [0.05, 0.5, 0.9])
def test_neighbour_mean_matches_loop(keep_rate):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 20, 5, generator=g, dtype=torch.float64)
    kept = torch.rand(3, 20, generator=g) < keep_rate
    torch.testing.assert_close(kept_neighbour_mean(x, kept, (4, 5)), loop_neighbour_mean(x, kept, (4, 5)))


def test_endpoints_and_kept_tokens():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 12, 4, generator=g, dtype=torch.float64)
    kept = torch.rand(2, 12, generator=g) < 0.5
    m = loop_neighbour_mean(x, kept, (3, 4))
    torch.testing.assert_close(recover(x, kept, (3, 4), 1.0), x)
    zero = recover(x, kept, (3, 4), 0.0)
    torch.testing.assert_close(zero[kept], x[kept])
    torch.testing.assert_close(zero[~kept], m[~kept])
    half = recover(x, kept, (3, 4), torch.full((2, 1, 1), 0.25, dtype=torch.float64))
    torch.testing.assert_close(half[~kept], (0.25 * x + 0.75 * m)[~kept])


def test_bad_inputs_name_the_argument():
    x = torch.randn(1, 6, 2)
    with pytest.raises(PullbackError, match="alpha"):
        recover(x, torch.ones(1, 6, dtype=torch.bool), (2, 3), 1.5)
    with pytest.raises(PullbackError, match="grid"):
        recover(x, torch.ones(1, 6, dtype=torch.bool), (2, 2), 0.5)
    with pytest.raises(PullbackError, match="kept"):
        recover(x, torch.ones(1, 6), (2, 3), 0.5)


def test_recover_pruned_replaces_the_newest_frozen_rows_with_the_recovered_features():
    from pullback_ext.prune.recovery import recover_pruned
    from pullback_ext.prune.tokens import TokenState

    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 1 + 12, 4, generator=g, dtype=torch.float64)  # one prefix token, a 3×4 grid
    state = TokenState.start(x, 1).prune(torch.tensor([[2, 5], [1, 9]]))
    earlier = state.frozen.clone()
    state = state.prune(torch.tensor([[3], [4]]))
    full = state.full()
    kept = torch.zeros(2, 13, dtype=torch.bool).scatter(1, state.positions, True)[:, 1:]
    expected = recover(full[:, 1:], kept, (3, 4), 0.25)
    out = recover_pruned(state, (3, 4), 0.25, newest=1)
    torch.testing.assert_close(out.frozen[:, :2], earlier)  # the earlier stage's rows are left alone
    newest = torch.stack([expected[b, state.frozen_positions[b, 2] - 1] for b in range(2)])
    torch.testing.assert_close(out.frozen[:, 2], newest)
    every = recover_pruned(TokenState.start(x, 1).prune(torch.tensor([[2, 5], [1, 9]])), (3, 4), 0.0)
    assert not torch.allclose(every.frozen, earlier)  # α = 0: all frozen rows are the neighbours' means


# ---- the recovery option of every patched model ------------------------------------------------

def _pruned_output_and_reference(alpha, llf=False):
    """A tiny timm ViT pruned at block 2 by ``norm`` with ``recovery=alpha``, and the reference: the
    unpatched block-2 input with the 8 lowest-norm patch tokens recovered by hand."""
    import pullback_ext.patch as patch
    from helpers.prune import block_inputs, images, tiny_vit

    model, x = tiny_vit(reg_tokens=1), images(3)
    h = block_inputs(model, x)[2]
    p = model.num_prefix_tokens
    pruned = torch.argsort(h[:, p:].norm(dim=-1), dim=1)[:, :8]
    kept = torch.ones(3, 16, dtype=torch.bool).scatter(1, pruned, False)
    recovered = recover(h[:, p:], kept, (4, 4), alpha)
    patch.timm(model, strategy="norm", mode="prune", ratio=0.5, layers=(2,), llf=llf, recovery=alpha)
    return model, x, pruned + p, model.norm(recovered)


@pytest.mark.parametrize("alpha", [0.0, 0.25])
def test_the_recovery_option_reinserts_the_recovered_features_and_leaves_the_kept_tokens_alone(alpha):
    import pullback_ext.patch as patch

    model, x, pruned, reference = _pruned_output_and_reference(alpha)
    out = model.forward_features(x)
    rows = torch.arange(3)[:, None]
    torch.testing.assert_close(out[rows, pruned], reference[rows, pruned - model.num_prefix_tokens], rtol=1e-5, atol=1e-5)
    patch.timm(model, strategy="norm", mode="prune", ratio=0.5, layers=(2,), llf=False)
    frozen = model.forward_features(x)
    keep = torch.ones(out.shape[:2], dtype=torch.bool).scatter(1, pruned, False)
    torch.testing.assert_close(out[keep], frozen[keep], rtol=0, atol=0)  # no kept token attends to a pruned one
    assert not torch.allclose(out[rows, pruned], frozen[rows, pruned])


def test_recovery_at_one_is_the_frozen_copy_and_llf_reads_the_recovered_features():
    import pullback_ext.patch as patch
    from helpers.prune import images, tiny_vit

    x = images(2)
    plain = patch.timm(tiny_vit(), strategy="norm", mode="prune", ratio=0.5, layers=(1, 2)).forward_features(x)
    one = patch.timm(tiny_vit(), strategy="norm", mode="prune", ratio=0.5, layers=(1, 2), recovery=1.0).forward_features(x)
    assert torch.equal(plain, one)
    half = patch.timm(tiny_vit(), strategy="norm", mode="prune", ratio=0.5, layers=(1, 2), recovery=0.5).forward_features(x)
    assert not torch.allclose(half, plain)  # masked LLF's last block reads the recovered tokens


def test_recovery_on_a_hugging_face_depth_model_equals_the_timm_rule():
    """Depth Anything (DINOv2 backbone) pruned with recovery: the layer after the stage is handed the
    pruned tokens' recovered features at their places (hidden_states stay full-length)."""
    import pullback_ext.patch as patch
    from helpers.diagnose import tiny_depth_anything

    model = tiny_depth_anything(dtype=torch.float32).eval()
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    plain = model.backbone(pixels, output_hidden_states=True).hidden_states
    patch.hf_dpt(model, strategy="norm", ratio=0.5, layers=(1,), llf=False, recovery=0.0)
    states = model.backbone(pixels, output_hidden_states=True).hidden_states
    h, p = plain[1], 1
    n = h.shape[1] - p
    side = int(n ** 0.5)
    pruned = torch.argsort(h[:, p:].norm(dim=-1), dim=1)[:, :n // 2]
    kept = torch.ones(2, n, dtype=torch.bool).scatter(1, pruned, False)
    expected = recover(h[:, p:], kept, (side, side), 0.0)
    rows = torch.arange(2)[:, None]
    for later in states[2:]:  # every later read of a pruned token is its recovered feature
        torch.testing.assert_close(later[rows, pruned + p], expected[rows, pruned], rtol=1e-5, atol=1e-5)


def test_recovery_is_refused_where_it_does_not_apply():
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions

    shape = BackboneShape(depth=4, num_prefix=1, has_cls=True)
    with pytest.raises(PullbackError, match=r"recovery must be None or a float α in \[0, 1\]"):
        ReductionOptions(strategy="norm", mode="prune", recovery=1.5)
    with pytest.raises(PullbackError, match="recovery applies to mode='prune'"):
        ReductionOptions(strategy="norm", mode="merge", recovery=0.5).resolve(shape)
    with pytest.raises(PullbackError, match="does not take recovery"):
        ReductionOptions(strategy="tome", r=2, recovery=0.5)
