"""``importance_tome`` (:mod:`pullback_ext.prune.methods.importance_tome`): against a hand-written
float64 loop reference, bit-identical at ``r = 0``, merge-and-restore, whole-graph compilation,
through the patch API on timm and Hugging Face models.

:func:`run_guarded` runs the resolved reduction on a timm ViT's blocks as the patched
``forward_features`` does (without the final norm), so that intermediates can be compared.
"""

from __future__ import annotations


import pytest
import torch

from helpers.importance_tome_reference import reference
from helpers.prune import images, tiny_vit
from pullback_ext.errors import PullbackError
import pullback_ext.patch as patch
from pullback_ext.prune import timm_vit
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import importance_tome, merging, tome
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop
from pullback_ext.prune.methods.merging import SCHEDULES
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.row_rules import row_label


class Head(torch.nn.Module):
    """A stand-in importance head: ``softplus(F w) [B, K]`` for ``F [B, K, D]``."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(dim, dtype=dtype), requires_grad=False)

    def forward(self, F: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(F @ self.w)


def reduction(model, head, r: int, schedule: str = "constant", **extra):
    """The reduction ``patch.timm(model, strategy="importance_tome", ...)`` runs (``early_merges``
    explicit, False unless given, and ``shrink`` 0 unless given: the settings every test below fixes,
    whatever the defaults are)."""
    options = ReductionOptions(strategy="importance_tome", head=head, r=r, schedule=schedule,
                               **{"early_merges": False, "shrink": 0.0, **extra})
    return options.resolve(timm_vit.backbone_shape(model))


def embed(model, x: torch.Tensor) -> torch.Tensor:
    return model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))


def run_guarded(model, x: torch.Tensor, red, take=()):
    """``(final [B, N, D], {i: [B, N, D]})`` of the reduction's method run on a timm ViT's blocks."""
    return red.method.run(red, embed(model, x), loop(model), take)


def loop(model) -> BlockLoop:
    return BlockLoop(model.blocks, timm_vit.call_block, None, timm_vit.SPLIT)


CASES = {
    "cosine": dict(r=3, schedule="constant", score_layer=1, guard=1.0, partner="cosine"),
    "cosine_guard2_decreasing": dict(r=2, schedule="decreasing", score_layer=0, guard=2.0, partner="cosine"),
    "bound": dict(r=3, schedule="constant", score_layer=0, guard=1.0, partner="bound"),
    "bound_decreasing": dict(r=4, schedule="decreasing", score_layer=1, guard=1.0, partner="bound"),
    "bound_block_range": dict(r=3, schedule="decreasing", score_layer=0, guard=1.0, partner="bound", block_range=(2, 4)),
    "tome_before_the_score": dict(r=2, schedule="constant", score_layer=1, guard=1.0, partner="bound", block_range=(0, 4)),
    "bound_shrunk": dict(r=3, schedule="constant", score_layer=0, guard=1.0, partner="bound", shrink=0.3),
    "shrunk_after_tome": dict(r=2, schedule="constant", score_layer=1, guard=2.0, partner="cosine", block_range=(0, 4),
                              shrink=0.6),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_the_float64_loop_reference(case):
    model, kw = tiny_vit(depth=4, dim=32).double(), CASES[case]
    head, x = Head(32, torch.float64), images(2).double()
    take = {1, 3}
    with torch.no_grad():
        final, taken = run_guarded(model, x, reduction(model, head, **kw), take)
        tokens = embed(model, x)
        for b in range(x.shape[0]):
            ref_final, ref_taken, groups = reference(model, head, tokens[b], take=take, **kw)
            torch.testing.assert_close(final[b], ref_final, rtol=0, atol=1e-9)
            for i in take:
                torch.testing.assert_close(taken[i][b], ref_taken[i], rtol=0, atol=1e-9)
            red = reduction(model, head, **kw)
            counts = red.method.patch_tokens_per_block(red, 16)
            assert len(groups) == 1 + counts[-1] < 17


def test_the_reference_sees_the_guard():
    """The guarded merges differ from ToMe's own on this model (else the reference proves nothing)."""
    model, head, x = tiny_vit(depth=4, dim=32).double(), Head(32, torch.float64), images(2).double()
    with torch.no_grad():
        tokens = embed(model, x)[0]
        guarded = reference(model, head, tokens, 3, "constant", 0, 1.0, "bound")[2]
        plain = reference(model, head, tokens, 3, "constant", 0, 0.0, "bound")[2]
    assert sorted(map(sorted, guarded)) != sorted(map(sorted, plain))


def test_r_zero_is_bit_identical_to_the_unpatched_blocks():
    model, x = tiny_vit(depth=4), images(2)
    with torch.no_grad():
        h = embed(model, x)
        expected = model.blocks(h)
        final, taken = run_guarded(model, x, reduction(model, Head(32, torch.float32), 0), take={2})
        assert torch.equal(final, expected)
        assert torch.equal(taken[2], model.blocks[:3](h))


def test_shrink_one_merges_as_without_a_head_and_zero_as_the_head_scores():
    """``shrink=1`` gives every token its image's mean energy: the costs of no head, scaled by one
    number per image, so the same merges; the reference sees the shrink (0.5 differs from 0)."""
    model, head, x = tiny_vit(depth=4, dim=32).double(), Head(32, torch.float64), images(2).double()
    with torch.no_grad():
        full = run_guarded(model, x, reduction(model, head, 3, score_layer=0, shrink=1.0))[0]
        none = run_guarded(model, x, reduction(model, None, 3, score_layer=0))[0]
        torch.testing.assert_close(full, none, rtol=0, atol=1e-12)
        tokens = embed(model, x)[0]
        groups = {s: reference(model, head, tokens, 3, "constant", 0, 1.0, "bound", shrink=s)[2] for s in (0.0, 0.5)}
        assert groups[0.0] != groups[0.5]
    for bad in (-0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(PullbackError, match="shrink must be a number in \\[0, 1\\]"):
            reduction(model, head, 3, shrink=bad)


@pytest.mark.parametrize("partner", importance_tome.PARTNERS)
def test_guard_zero_is_tome(partner):
    model, x = tiny_vit(depth=4), images(2)
    red = reduction(model, Head(32, torch.float32), 3, "decreasing", guard=0.0, partner=partner, score_layer=0, block_range=(1, 4))
    with torch.no_grad():
        ours = run_guarded(model, x, red)[0]
        plain = tome.ToMe().run(red, embed(model, x), loop(model))[0]
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-6)


def test_merge_and_restore_gives_every_position_its_merged_token():
    model, head, x = tiny_vit(depth=4, dim=32).double(), Head(32, torch.float64), images(2).double()
    red = reduction(model, head, 3, partner="cosine")
    with torch.no_grad():
        final, taken = run_guarded(model, x, red, take={0, 3})
        tokens = embed(model, x)
        for b in range(2):
            groups = reference(model, head, tokens[b], 3, "constant", 1, 1.0, "cosine")[2]
            assert final.shape == tokens.shape
            for members in groups:
                first = min(members)
                for t in members:
                    assert torch.equal(final[b, t], final[b, first])
            distinct = torch.unique(final[b], dim=0).shape[0]
            assert distinct == len(groups) == 1 + red.method.patch_tokens_per_block(red, 16)[-1]


def test_merged_energies_add():
    """Energy ``[B, K]`` of a merged token = the sum of its sources' (total energy kept)."""
    head = Head(32, torch.float32)
    state = MergedTokens(x=torch.randn(2, 17, 32, dtype=torch.float64), num_prefix=1)
    energy = torch.rand(2, 17, dtype=torch.float64)
    keys = torch.randn(2, 2, 17, 16, dtype=torch.float64)
    guard = importance_tome.Guard(head, 1, 1.0, "bound")
    matching = importance_tome.guarded_matching(state, energy, keys, 4, guard)
    merged, merged_energy = merging.apply_matching(state, matching), merging.merge_values(energy, matching)
    assert merged.x.shape == (2, 13, 32) and merged_energy.shape == (2, 13)
    torch.testing.assert_close(merged_energy.sum(1), energy.sum(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(merged.sizes.sum(1), torch.full((2,), 17.0, dtype=torch.float64), rtol=0, atol=0)


@pytest.mark.parametrize("block_range, schedule, early", [(None, "decreasing", False), ((0, 3), "decreasing", False),
                                                           (None, "auto", "auto")])
def test_fullgraph_compile_equals_eager(block_range, schedule, early):
    model, head, x = tiny_vit(depth=3), Head(32, torch.float32), images(2)
    red = reduction(model, head, 3, schedule, partner="bound", block_range=block_range, early_merges=early)

    def forward(images):
        return run_guarded(model, images, red, take=(1,))

    torch._dynamo.reset()
    with torch.no_grad():
        expected = forward(x)
        with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
            compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")(x)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled[0], expected[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(compiled[1][1], expected[1][1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("extra, match", [
    (dict(head=[None]), "head"),
    (dict(guard=-1.0), "guard"),
    (dict(partner="pullback"), "partner"),
    (dict(score_layer=3), "score_layer"),
    (dict(early_merges=1), "early_merges"),
    (dict(block_range=(3, 2)), "block_range"),
    (dict(block_range=(0, 5)), "block_range"),
    (dict(r=-1), "r must"),
    (dict(schedule="linear"), "schedule"),
])
def test_invalid_options_name_the_argument(extra, match):
    model = tiny_vit(depth=4)
    kw = dict(head=Head(32, torch.float32), r=2, schedule="constant") | extra
    head, r, schedule = kw.pop("head"), kw.pop("r"), kw.pop("schedule")
    with pytest.raises(PullbackError, match=match):
        run_guarded(model, images(1), reduction(model, head, r, schedule, **kw))


@pytest.mark.parametrize("partner", importance_tome.PARTNERS)
def test_eager_forward_reads_no_tensor_value_on_the_host(partner):
    from helpers.host_sync import NoHostSync

    model, head, x = tiny_vit(depth=3), Head(32, torch.float32), images(2)
    with torch.no_grad(), NoHostSync():
        run_guarded(model, x, reduction(model, head, 3, "decreasing", partner=partner), take=(1,))


def test_patch_timm_runs_the_method_and_r_zero_is_the_unpatched_model():
    model, head, x = tiny_vit(depth=4), Head(32, torch.float32), images(2)
    with torch.no_grad():
        expected = model.forward_features(x)
        patch.timm(model, strategy="importance_tome", head=head, r=0)
        assert torch.equal(model.forward_features(x), expected)
        patch.timm(model, strategy="importance_tome", head=head, r=3)
        final = model.forward_features(x)
        ours = model.norm(run_guarded(model, x, reduction(model, head, 3, early_merges=True, shrink=importance_tome.SHRINK))[0])
    assert torch.equal(final, ours) and not torch.equal(final, expected)
    assert patch.config(model).block_range == (0, 4)  # r = 3 on 16 patches: ToMe would reach 1.62× (auto, below)
    assert patch.config(patch.timm(model, strategy="importance_tome", head=head, r=3, early_merges=False)).block_range == (2, 4)


def test_without_a_head_every_token_counts_one():
    """``head=None``: the energies are the sizes, as a head that rates every token 1."""
    model, x = tiny_vit(depth=4).double(), images(2).double()
    ones = lambda F: torch.ones(F.shape[:2], dtype=F.dtype)  # noqa: E731
    with torch.no_grad():
        torch.testing.assert_close(run_guarded(model, x, reduction(model, None, 3))[0],
                                   run_guarded(model, x, reduction(model, ones, 3))[0], rtol=0, atol=0)


# r alone: schedule and early_merges chosen from it ("auto")

SHAPE = BackboneShape(depth=4, num_prefix=1, has_cls=True, num_patch=16)  # tiny_vit(depth=4)
DEMO = BackboneShape(depth=8, num_prefix=1, has_cls=True, num_patch=196)  # the demo model


@pytest.mark.parametrize("backbone, r, work", [
    # tokens seen by each block's linear layers under ToMe's constant schedule, n_attention + 2 n_mlp
    # (unreduced: 3 · depth · (1 + patches) = 204 on SHAPE, 3 · 8 · 197 = 4728 on DEMO)
    (SHAPE, 2, (17 + 2 * 15) + (15 + 2 * 13) + (13 + 2 * 11) + (11 + 2 * 9)),  # 204/152 = 1.34
    (SHAPE, 3, (17 + 2 * 14) + (14 + 2 * 11) + (11 + 2 * 8) + (8 + 2 * 5)),  # 204/126 = 1.62
    (SHAPE, 4, (17 + 2 * 13) + (13 + 2 * 9) + (9 + 2 * 5) + (5 + 2 * 3)),  # 204/104 = 1.96 (the last block merges 2)
    (SHAPE, 5, (17 + 2 * 12) + (12 + 2 * 7) + (7 + 2 * 4) + (4 + 2 * 3)),  # 204/92 = 2.22
    # the demo model: r = 15, tokens 197, 182, ..., 92 before the blocks: 1.46; r = 16: 197, ..., 85: 1.51
    (DEMO, 15, sum(197 - 15 * i for i in range(8)) + 2 * sum(182 - 15 * i for i in range(8))),
    (DEMO, 16, sum(197 - 16 * i for i in range(8)) + 2 * sum(181 - 16 * i for i in range(8))),
    # r = 23: 197, 174, ..., 36 before the blocks, the last merging 17 (half its 35 patches): 1.94;
    # r = 24: 197, 173, ..., 29, the last merging 14: 2.01
    (DEMO, 23, sum(197 - 23 * i for i in range(8)) + 2 * (sum(174 - 23 * i for i in range(7)) + 19)),
    (DEMO, 24, sum(197 - 24 * i for i in range(8)) + 2 * (sum(173 - 24 * i for i in range(7)) + 15)),
])
@pytest.mark.parametrize("score_layer", [None, 0])  # None: no head, block 1
def test_auto_chooses_schedule_and_early_merges_from_tome_s_ratio_at_r(backbone, r, work, score_layer):
    full = 3 * backbone.depth * (backbone.num_prefix + backbone.num_patch)
    reach = importance_tome.tome_reach(r, "constant", backbone)
    assert reach == pytest.approx(full / work, rel=1e-12)
    if reach <= importance_tome.GUARDED_REACH:
        schedule, early = "constant", False
    elif score_layer == 0:  # the middle setting of a head on block 0's output
        schedule, early = "decreasing", reach > importance_tome.EARLY_REACH
    else:
        schedule, early = "constant", True
    red = ReductionOptions(strategy="importance_tome", r=r, score_layer=score_layer).resolve(backbone)
    assert importance_tome.auto_setting(red.options, backbone) == (schedule, early)
    assert red.options.block_range == ((0 if early else (1 if score_layer is None else score_layer) + 1), backbone.depth)
    assert red.method.block_merges(red) == merging.block_merges(red.options.replace(schedule=schedule), backbone.depth)
    for given in ({"schedule": "constant"}, {"schedule": "decreasing"}, {"early_merges": not early}):
        explicit = ReductionOptions(strategy="importance_tome", r=r, score_layer=score_layer, **given).resolve(backbone)
        assert importance_tome.auto_setting(explicit.options, backbone) == (given.get("schedule", schedule),
                                                                              given.get("early_merges", early))


@pytest.mark.parametrize("score_layer, settings", [
    (None, [("constant", False), ("constant", True)]),
    (0, [("constant", False), ("decreasing", False), ("decreasing", True)])])
def test_auto_reaches_its_settings_in_order_on_the_demo_model(score_layer, settings):
    seen = [importance_tome.auto_setting(ReductionOptions(strategy="importance_tome", r=r, score_layer=score_layer)
                                         .resolve(DEMO).options, DEMO) for r in range(1, 49)]
    assert [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]] == settings


def test_a_head_s_probe_layer_decides_the_middle_setting():
    head = Head(32, torch.float32)
    head.probe_layer = 0
    red = ReductionOptions(strategy="importance_tome", head=head, r=20).resolve(DEMO)  # ToMe's 1.73x: the middle
    assert importance_tome.auto_setting(red.options, DEMO) == ("decreasing", False) and red.options.block_range == (1, 8)
    head.probe_layer = 1
    red = ReductionOptions(strategy="importance_tome", head=head, r=20).resolve(DEMO)
    assert importance_tome.auto_setting(red.options, DEMO) == ("constant", True) and red.options.block_range == (0, 8)


def test_auto_needs_the_patch_count():
    shape = BackboneShape(depth=4, num_prefix=1, has_cls=True)
    with pytest.raises(PullbackError, match="schedule='auto' and early_merges='auto'"):
        ReductionOptions(strategy="importance_tome", r=2).resolve(shape)
    red = ReductionOptions(strategy="importance_tome", r=2, schedule="constant", early_merges=False).resolve(shape)
    assert red.method.block_merges(red) == [0, 0, 2, 2]


@pytest.mark.parametrize("r, score_layer, schedule, early", [(2, 1, "constant", False), (3, 1, "constant", True),
                                                              (3, 0, "decreasing", False), (5, 0, "decreasing", True)])
def test_auto_runs_bit_identically_to_the_explicit_setting_it_chooses(r, score_layer, schedule, early):
    model, head, x = tiny_vit(depth=4), Head(32, torch.float32), images(2)
    auto = ReductionOptions(strategy="importance_tome", head=head, r=r, score_layer=score_layer).resolve(timm_vit.backbone_shape(model))
    explicit = reduction(model, head, r, schedule, early_merges=early, shrink=importance_tome.SHRINK, score_layer=score_layer)
    with torch.no_grad():
        ours, theirs = run_guarded(model, x, auto, take={1}), run_guarded(model, x, explicit, take={1})
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1][1], theirs[1][1])
    assert auto.method.patch_tokens_per_block(auto, 16) == explicit.method.patch_tokens_per_block(explicit, 16)


def test_explicit_settings_keep_their_blocks_labels_and_need_no_patch_count():
    unknown = BackboneShape(depth=8, num_prefix=1, has_cls=True)  # a model that does not state its patch count
    for early, blocks in ((False, (2, 8)), (True, (0, 8))):
        for schedule in SCHEDULES:
            red = ReductionOptions(strategy="importance_tome", r=24, schedule=schedule, early_merges=early).resolve(unknown)
            assert (red.options.block_range, red.options.schedule, red.options.early_merges) == (blocks, schedule, early)
            assert red.method.block_merges(red) == merging.block_merges(red.options, 8)
    red = ReductionOptions(strategy="importance_tome", head=lambda F: F.norm(dim=-1), r=8, schedule="constant",
                           early_merges=False).resolve(DEMO)
    assert row_label(red) == ("importance_tome · lowest the imp-weighted first-order error of the pair (g = 1, head on block 1's "
                              "output, imp² shrunk 0.2 toward the image's mean), r per block (2, 8) · size-weighted, "
                              "proportional attention; merged tokens restored to their sources")  # the label of the pages' rows
    with pytest.raises(PullbackError, match="choose from r and the model's patch-token count"):
        ReductionOptions(strategy="importance_tome", r=8).resolve(unknown)
    given = ReductionOptions(strategy="importance_tome", r=8, block_range=(1, 8)).resolve(unknown)  # block 1: constant
    assert given.options.early_merges is False and given.method.block_merges(given) == [0] + [8] * 7
    assert "r per block (1, 8), constant schedule ·" in row_label(given)
    with pytest.raises(PullbackError, match="choose from r and the model's patch-token count"):  # block 0: chosen from r
        red = ReductionOptions(strategy="importance_tome", r=8, score_layer=0, block_range=(1, 8)).resolve(unknown)
        red.method.block_merges(red)
    given = ReductionOptions(strategy="importance_tome", r=20, score_layer=0, block_range=(1, 8)).resolve(DEMO)
    assert given.method.block_merges(given) == [0] + merging.merges_per_block(20, "decreasing", 7)
    assert ("r per block (1, 8), the constant schedule while ToMe's FLOP ratio at r is at most 1.5×, decreasing beyond ·"
            in row_label(given))


def test_the_token_count_reach_is_the_flop_counters_ratio_on_the_demo_model():
    """ToMe's FLOP ratio on the demo's CLS forward (torch's counter: patch embedding, blocks with
    their attention, CLS head) is within 3% of :func:`tome_reach`'s count of linear-layer tokens."""
    from pullback_ext import embedded
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.comparison.cost import count_flops
    from pullback_ext.demo.headline import flop_counter

    model = embedded.load()
    backbone = demo_backbone(model)
    image = torch.rand(1, 3, model.image_size, model.image_size)
    full, flops = count_flops(backbone.forwards("cls")[0], image), flop_counter(backbone, "cls", image)
    for r in (8, 16, 24):
        counted = full / flops(ReductionOptions(strategy="tome", r=r))
        assert importance_tome.tome_reach(r, "constant", DEMO) == pytest.approx(counted, rel=0.03)


def test_a_sweep_of_r_alone_gives_one_defaults_row():
    """``--sweep importance_tome:r=... --sweep importance_tome:schedule=auto --sweep
    importance_tome:early_merges=auto``: one row, labelled as the defaults, whose points run both
    block ranges (guarded up to the reach, ToMe-started beyond)."""
    from types import SimpleNamespace

    from pullback_ext.commands.evaluate_pareto import build_points, parse_sweeps
    from pullback_ext.comparison import pareto

    base = {"layers": (2,), "mode": "merge", "preset": "recommended"}
    given = parse_sweeps(["importance_tome:r=4,8,16,24", "importance_tome:schedule=auto", "importance_tome:early_merges=auto"])
    points = build_points(("importance_tome",), given, base, {"importance": lambda F: F.norm(dim=-1)}, None, (0.1,))
    backbone = SimpleNamespace(depth=8, num_prefix=1, has_cls=True, tasks=("cls",), num_patches=196)
    reductions = [pareto.resolve(p.options, backbone) for p in points]
    assert [p.knob for p in points] == [{"r": r, "schedule": "auto", "early_merges": "auto"} for r in (4, 8, 16, 24)]
    labels = {row_label(red) for red in reductions}
    assert len(labels) == 1 and labels.pop().startswith("importance_tome (defaults) · ")
    assert [red.options.block_range for red in reductions] == [(2, 8), (2, 8), (0, 8), (0, 8)]


def test_the_default_sweep_adds_a_defaults_row_beside_every_setting():
    """Without ``--sweep`` the page gets both: every ``r × schedule × early_merges`` point, and the
    defaults row swept over ``r`` alone (with each swept head); a ``--sweep`` of another field is the
    only sweep."""
    from types import SimpleNamespace

    from pullback_ext.commands.evaluate_pareto import build_points, parse_sweeps
    from pullback_ext.comparison import pareto

    base = {"layers": (2,), "mode": "merge", "preset": "recommended"}
    head = {"importance": lambda F: F.norm(dim=-1)}
    backbone = SimpleNamespace(depth=8, num_prefix=1, has_cls=True, tasks=("cls",), num_patches=196)

    def rows(given):
        points = build_points(("importance_tome",), parse_sweeps(given), base, head, None, (0.1,))
        labels = [row_label(pareto.resolve(p.options, backbone)) for p in points]
        defaults = [p.knob for p, label in zip(points, labels) if label.startswith("importance_tome (defaults) · ")]
        return points, defaults

    points, defaults = rows([])
    rs = (2, 4, 8, 12, 16, 20, 24, 28, 32)
    assert len(points) == 4 * len(rs) + 27 and defaults == [{"r": r} for r in (*range(2, 25), 28, 32, 40, 48)]
    _, defaults = rows(["importance_tome:r=4,8", "importance_tome:head=trained,none"])
    assert defaults == [{"r": r, "head": h} for r in (4, 8) for h in ("trained", "none")]
    points, defaults = rows(["importance_tome:schedule=constant"])
    assert defaults == [] and len(points) == 2 * len(rs)
