"""The patched forward of every method compiles whole and never waits on the device.

CPU: ``torch.compile(..., fullgraph=True)`` (``aot_eager``, one ``inductor`` case) traces the
patched forward in one graph equal to eager, ``torch._dynamo.explain`` finds no graph break, and
the eager forward runs no operator that reads tensor values on the host (:mod:`helpers.host_sync`).
A full graph with dynamo's defaults (``capture_scalar_outputs=False``,
``capture_dynamic_output_shape_ops=False``) proves that the traced Python reads no tensor value
(``.item()``, ``bool(t)``, ``int(t)``) and sizes nothing from values (``nonzero``, mask indexing);
what the CPU cannot prove is what a CUDA kernel or the CUDA caching allocator does underneath (a
kernel that copies to the host, a pinned-memory wait), which the CUDA tests at the end check with
``torch.cuda.set_sync_debug_mode("error")`` and CUDA graphs (``mode="reduce-overhead"``).
"""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.host_sync import NoHostSync, assert_detects_sync
from helpers.prune import images, norm_scorer, tiny_dinov2, tiny_dpt, tiny_eva, tiny_hf, tiny_vit

MERGE = dict(strategy="importance", head=norm_scorer, ratio=0.25, layers=(1,), mode="merge")  # selection "bound"
TIMM_CASES = {
    "merge": MERGE,
    "merge_lowest": dict(MERGE, selection="lowest", weights="importance"),
    "merge_folded": dict(MERGE, prop_attn="folded"),
    "prune_llf_masked": dict(MERGE, mode="prune", llf=True),
    "prune_llf_two_calls": dict(MERGE, mode="prune", llf=True, prop_attn="folded"),
    "prune_llf_full": dict(MERGE, mode="prune", llf="full"),
    "three_stages": dict(MERGE, ratio=0.5, layers=(0, 1, 2)),
    "tome": dict(strategy="tome", r=3),
    "evit": dict(strategy="evit", keep_rate=0.7, evit_layers=(0, 1)),
    "pitome": dict(strategy="pitome", r=3),
    "random": dict(strategy="random", ratio=0.25, layers=(1,), mode="merge", seed=3),
    "tome_score": dict(strategy="tome_score", ratio=0.25, layers=(1,), mode="merge"),
    "evit_score": dict(strategy="evit_score", ratio=0.25, layers=(1,), mode="prune", llf=True),
    "cls_sim": dict(strategy="cls_sim", ratio=0.25, layers=(1,), mode="merge"),
    "asap_score": dict(strategy="asap_score", ratio=0.25, layers=(1,), mode="merge"),
    "asap": dict(strategy="asap", ratio=0.25, layers=(1,)),
    "expedite": dict(strategy="expedite", cluster_grid=(2, 2)),
}
HF_CASES = {
    "hf_dinov2_merge": dict(MERGE),
    "hf_dinov2_registers_prune_llf": dict(MERGE, mode="prune", llf=True),
    "hf_dinov2_tome": dict(strategy="tome", r=3),
    "hf_dinov2_evit": dict(strategy="evit", keep_rate=0.7, evit_layers=(0, 1)),
}
PRUNE = dict(MERGE, mode="prune", llf=True)
FAMILY_CASES = {f"{family}_{name}": (family, options) for family in ("vit", "clip", "siglip", "dinov3", "eva")
                for name, options in (("merge", MERGE), ("prune_llf", PRUNE))}
CASES = tuple(TIMM_CASES) + tuple(HF_CASES) + tuple(FAMILY_CASES)


def patched_forward(case: str, device: str = "cpu"):
    """``forward(images) -> features`` of a tiny random model patched as ``case`` says."""
    if case in TIMM_CASES:
        model = patch.timm(tiny_vit(reg_tokens=1, depth=3).to(device), **TIMM_CASES[case])
        return model.forward_features
    if case in FAMILY_CASES:
        family, options = FAMILY_CASES[case]
        if family == "eva":  # float64 at 56 px: resample the 32 px test images
            model = patch.timm(tiny_eva().to(device), **options)
            return lambda x: model.forward_features(torch.nn.functional.interpolate(x.double(), size=56))
        model = tiny_hf(family, attn="sdpa").to(device)
        patch.auto(model, **options)
        return lambda x: model(pixel_values=x).last_hidden_state
    model = tiny_dinov2(attn="sdpa", registers=2 if "registers" in case else 0).to(device)
    patch.auto(model, **HF_CASES[case])
    return lambda x: model(pixel_values=x).last_hidden_state


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES)
def test_fullgraph_compile_equals_eager(case):
    forward, x = patched_forward(case), images()
    expected = forward(x)
    with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
        compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_explain_finds_no_graph_break(case):
    explanation = torch._dynamo.explain(patched_forward(case))(images())
    assert explanation.graph_break_count == 0, [str(r.reason)[:200] for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_the_patch_adds_no_graph_break_to_dpt():
    """DPT's own forward breaks the graph once (unpatched too): the patched one breaks no more often."""
    def breaks(model):
        torch._dynamo.reset()
        return torch._dynamo.explain(lambda x: model(pixel_values=x).predicted_depth)(images()).graph_break_count

    unpatched = breaks(tiny_dpt())
    assert breaks(patch.auto(tiny_dpt(), **PRUNE)) == unpatched


def test_the_host_sync_guard_catches_host_reads():
    assert_detects_sync()


@pytest.mark.parametrize("case", CASES)
def test_eager_forward_reads_no_tensor_value_on_the_host(case):
    forward, x = patched_forward(case), images()
    with NoHostSync():
        forward(x)


def test_the_guard_fails_on_the_early_exit_the_partner_selection_had():
    """The selection loop used to stop once every image had its budget (``bool(... .all())``):
    the guard must catch that, or the eager test above proves nothing for it."""
    from pullback_ext.prune import matching

    cost = torch.rand(2, 8)
    nearest = torch.randint(1, 9, (2, 8))
    with NoHostSync():
        matching.select_with_partners(cost, nearest, 3, num_prefix=1)
    with pytest.raises(AssertionError, match="_local_scalar_dense"), NoHostSync():
        bool((torch.zeros(2) >= 3).all())


def _early_exit_selection(cost, nearest, count: int, num_prefix: int) -> list[list[int]]:
    """The greedy partner selection written per image with the early exit on the budget."""
    picks = []
    for c, partners in zip(cost.tolist(), (nearest - num_prefix).tolist()):
        order = sorted(range(len(c)), key=lambda j: (c[j], j))
        chosen, protected = [], set()
        for j in order:
            if len(chosen) == count:
                break
            if j not in protected:
                chosen.append(j)
                protected.add(partners[j])
        chosen += [j for j in order if j not in chosen][: count - len(chosen)]
        picks.append(sorted(t + num_prefix for t in chosen))
    return picks


@pytest.mark.parametrize("seed", range(4))
def test_the_shape_bounded_partner_selection_selects_what_the_early_exit_did(seed):
    from pullback_ext.prune import matching

    g = torch.Generator().manual_seed(seed)
    n, num_prefix = 12, 2
    cost = torch.randint(0, 5, (3, n), generator=g).double()  # ties: the order must stay stable
    nearest = torch.randint(num_prefix, n + num_prefix, (3, n), generator=g)
    for count in range(1, n + 1):  # 2·count > n needs the fill-up
        got = matching.select_with_partners(cost, nearest, count, num_prefix)
        assert got.tolist() == _early_exit_selection(cost, nearest, count, num_prefix), count


def test_inductor_compiles_the_patched_merge():
    forward, x = patched_forward("merge"), images()
    expected = forward(x)
    compiled = torch.compile(forward, fullgraph=True, backend="inductor")(x)
    torch.testing.assert_close(compiled, expected, rtol=1e-5, atol=1e-5)


# --- CUDA: a GPU run picks these up -------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("case", CASES)
def test_cuda_patched_forward_never_synchronises(case):
    forward, x = patched_forward(case, "cuda"), images().cuda()
    forward(x)  # first call: lazy initialisation (cuBLAS handles, kernels) may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        forward(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda
@pytest.mark.parametrize("case", ["merge", "prune_llf_masked", "three_stages", "tome", "hf_dinov2_merge"])
def test_cuda_graphs_replay_the_patched_forward(case):
    forward = patched_forward(case, "cuda")
    compiled = torch.compile(forward, fullgraph=True, mode="reduce-overhead")
    for seed in (1, 2, 3):  # warm-up and recording, then replays on new inputs of the same shape
        x = images(seed=seed).cuda()
        torch.testing.assert_close(compiled(x).clone(), forward(x), rtol=1e-4, atol=1e-4)
