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
