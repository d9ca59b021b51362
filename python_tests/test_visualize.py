"""Pictures of the merges (``pullback_ext.visualize``, ``pullback visualize``): the painted groups are
the sources of a float64 loop reference of ToMe and the restore map of the same patched forward
(positions of one group have identical restored features, positions of two groups do not); pruned
positions are marked and hold their frozen features; r = 0 leaves every position its own group;
the importance map is the head's; a task's own forward draws its own output (a class map for
segmentation) and several reductions share one figure; the command writes a picture per image,
refuses an earlier results folder, and refuses a bad strategy, block or image source in one line."""

from __future__ import annotations

import json

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import per_block_merge_reference
from helpers.originals_reference import _merge_reference
from helpers.prune import images, norm_scorer, tiny_vit
from pullback_ext.cli import main
from pullback_ext.errors import PullbackError
from pullback_ext.prune import token_maps
from pullback_ext.visualize import GroupMaps, comparison_figure, group_counts, group_maps, group_overlay, merge_figure

DEPTH = 4


def _partition(ids: torch.Tensor) -> set:
    """The groups of a map ``[h, w]`` as a set of frozensets of flat patch positions (pruned left out)."""
    flat = ids.flatten().tolist()
    groups: dict = {}
    for position, owner in enumerate(flat):
        if owner != token_maps.PRUNED:
            groups.setdefault(owner, set()).add(position)
    return {frozenset(g) for g in groups.values()}


def _reference_sources(model, x: torch.Tensor, r: int) -> list:
    """ToMe's sources after every block of the loop reference, per image: ``[image][block]`` lists
    of the original tokens each current token holds (prefix included)."""
    seen: list = []

    def step(i, x_, keys, sizes, sources, p, r_):
        merged = _merge_reference(x_, keys, sizes, sources, p, r_)
        seen.append(merged[2])
        return merged

    per_block_merge_reference(model, x, [r] * DEPTH, step)
    return [seen[i * DEPTH:(i + 1) * DEPTH] for i in range(x.shape[0])]


def test_tome_groups_are_the_sources_of_the_loop_reference():
    model, x = tiny_vit(reg_tokens=1, depth=DEPTH).double(), images(2).double()
    maps = group_maps(model, x, blocks=(0, 2, 3), strategy="tome", r=3)
    p = model.num_prefix_tokens
    for image, per_block in enumerate(_reference_sources(model, x, 3)):
        for block in maps.blocks:
            expected = {frozenset(t - p for t in members if t >= p) for members in per_block[block]} - {frozenset()}
            assert _partition(maps.groups[block][image]) == expected, (image, block)
    assert maps.counts(0)[3]["tokens"] < 16 and maps.counts(0)[3]["merged_groups"] > 0


def test_one_group_holds_one_restored_feature_and_two_groups_two():
    """The restored full-length features of the patched model's own forward: equal within a group, different across."""
    model, x = tiny_vit(depth=DEPTH), images(2)
    maps = group_maps(model, x, blocks=(1, 3), strategy="tome", r=3)
    patch.timm(model, strategy="tome", r=3)
    try:
        features = model.forward_intermediates(x, indices=[1, 3], output_fmt="NLC", intermediates_only=True)
    finally:
        patch.unpatch(model)
    for block, restored in zip((1, 3), features):
        for image in range(x.shape[0]):
            ids, rows = maps.groups[block][image].flatten(), restored[image]
            same = ids[:, None] == ids[None, :]
            identical = (rows[:, None] == rows[None, :]).all(-1)
            assert torch.equal(same, identical), (block, image)


def test_pruned_positions_are_marked_and_hold_their_frozen_features():
    model, x = tiny_vit(depth=DEPTH), images(2)
    maps = group_maps(model, x, blocks=(0, 1, 2), strategy="norm", ratio=0.5, layers=(1,), mode="prune", llf=False)
    assert group_counts(maps.groups[0])["pruned"] == 0
    frozen = model.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True)[0]
    patch.timm(model, strategy="norm", ratio=0.5, layers=(1,), mode="prune", llf=False)
    try:
        restored = model.forward_intermediates(x, indices=[2], output_fmt="NLC", intermediates_only=True)[0]
    finally:
        patch.unpatch(model)
    for image in range(x.shape[0]):
        for block in (1, 2):
            counts = group_counts(maps.groups[block][image])
            assert counts == {"tokens": 8, "merged_groups": 0, "merged_positions": 0, "largest_group": 1, "pruned": 8}
        pruned = maps.groups[2][image].flatten() == token_maps.PRUNED
        assert torch.equal(pruned, maps.groups[1][image].flatten() == token_maps.PRUNED)
        assert torch.equal(restored[image][pruned], frozen[image][pruned])
        assert not torch.equal(restored[image][~pruned], frozen[image][~pruned])


@pytest.mark.parametrize("options", [dict(strategy="tome", r=0), dict(strategy="tome_score", ratio=0.0, layers=(1,))])
def test_nothing_removed_leaves_every_position_its_own_group(options):
    maps = group_maps(tiny_vit(depth=DEPTH), images(2), (0, 3), **options)
    for block in maps.blocks:
        for image in range(2):
            assert len(_partition(maps.groups[block][image])) == 16 and group_counts(maps.groups[block][image])["pruned"] == 0
            assert not group_overlay(maps.groups[block][image])[..., 3].any()  # nothing painted


def test_the_importance_map_is_the_heads_on_the_stage_input():
    model, x = tiny_vit(depth=DEPTH), images(2)
    maps = group_maps(model, x, (2,), strategy="importance", head=norm_scorer, ratio=0.25, layers=(2,), mode="merge")
    unreduced = model.forward_intermediates(x, indices=[1], output_fmt="NLC", intermediates_only=True)[0]
    torch.testing.assert_close(maps.importance, norm_scorer(unreduced).reshape(2, 4, 4))
    assert group_counts(maps.groups[2][0])["tokens"] == 12
    figure = merge_figure(maps, 1)
    assert len([ax for ax in figure.axes if ax.get_title()]) == 3  # input, groups, importance (a colorbar has no title)


def test_blocks_strategies_and_silent_loops_are_refused():
    model, x = tiny_vit(depth=DEPTH), images(1)
    with pytest.raises(PullbackError, match=r"block 4 is out of range; this 4-block model has blocks 0\.\.3"):
        group_maps(model, x, (1, 4), strategy="tome", r=2)
    with pytest.raises(PullbackError, match="strategy must be one of"):
        group_maps(model, x, (1,), strategy="no_such_method")
    with pytest.raises(PullbackError, match="does not take ratio"):
        group_maps(model, x, (1,), strategy="tome", r=2, ratio=0.5)


def test_a_loop_that_does_not_report_cannot_be_drawn(monkeypatch):
    from pullback_ext.prune import merged_tokens

    monkeypatch.setattr(merged_tokens, "report", lambda block, holders: None)
    with pytest.raises(PullbackError, match="does not report where its tokens go"):
        group_maps(tiny_vit(depth=DEPTH), images(1), (1,), strategy="tome", r=2)


def test_no_map_is_computed_without_a_recording():
    calls = []
    token_maps.report(0, lambda: calls.append(1))
    with token_maps.recording((1,)) as recorded:
        token_maps.report(0, lambda: calls.append(0))
        token_maps.report(1, lambda: torch.zeros(1, 3, dtype=torch.long))
    token_maps.report(1, lambda: calls.append(2))
    assert calls == [] and list(recorded.maps) == [1] and not token_maps._OPEN


# the command

DEMO = ["visualize", "--model", "demo", "--num-images", "2", "--strategy", "tome", "--r", "8", "--blocks", "2,5", "--quiet"]


def test_the_command_draws_every_image_and_refuses_an_earlier_folder(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*DEMO, "--out", str(out)]) == 0
    pictures = sorted(out.glob("image-*.png"))
    assert [p.name for p in pictures] == ["image-000.png", "image-001.png"] and all(p.stat().st_size > 1000 for p in pictures)
    record = json.loads((out / "groups.json").read_text())
    assert record["blocks"] == [2, 5] and record["grid"] == [14, 14] and record["options"]["r"] == 8
    for image in record["images"]:  # ToMe merges r = 8 in each block: 196 - 8 · (block + 1) tokens
        assert image["blocks"]["2"]["tokens"] == 196 - 24 and image["blocks"]["5"]["tokens"] == 196 - 48
        assert image["blocks"]["5"]["pruned"] == 0 and image["blocks"]["5"]["merged_groups"] > 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main([*DEMO, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err and str(out) in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main([*DEMO, "--num-images", "1", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["groups.json", "image-000.png"]  # the longer run's pictures are gone


@pytest.mark.parametrize("change,message", [
    (["--strategy", "no_such_method"], "strategy must be one of"),
    (["--blocks", "8"], "--blocks: layer 8 is out of range"),
    (["--images", "builtin:nope"], "no built-in image set"),
    (["--images", "/nonexistent/folder"], "/nonexistent/folder"),
    (["--option", "keep_rate"], "expected FIELD=VALUE"),
])
def test_a_bad_strategy_block_or_image_source_is_one_line(change, message, tmp_path, capsys):
    argv = list(DEMO)
    for flag, value in zip(change[::2], change[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and message in err, err
    assert err.startswith("pullback visualize: error:"), err
    assert not (tmp_path / "out" / "groups.json").exists()


def test_group_maps_is_a_record_of_what_is_drawn():
    assert {"groups", "grid", "blocks", "display", "importance", "outputs", "full_outputs"} <= set(GroupMaps.__dataclass_fields__)


def test_a_hugging_face_depth_model_prunes_by_default_and_draws_its_depth_maps():
    from helpers.prune import tiny_dpt

    maps = group_maps(tiny_dpt(), images(2), (1, 2), strategy="tome_score", ratio=0.5, layers=(1,))
    assert maps.options.mode == "prune" and all(group_counts(maps.groups[b][0])["pruned"] == 8 for b in (1, 2))
    assert set(maps.outputs) == set(maps.full_outputs) == {"depth"} and maps.outputs["depth"].shape == maps.full_outputs["depth"].shape
    assert not torch.equal(maps.outputs["depth"], maps.full_outputs["depth"])
    figure = merge_figure(maps, 0)
    assert len([ax for ax in figure.axes if ax.get_title()]) == 5  # input, two blocks, depth unreduced and reduced


def test_a_task_forward_draws_its_own_output_and_reductions_share_a_figure():
    """With ``task`` the forward is that task's alone: the demo's segmentation gives its class logits
    (drawn as the argmax map), its CLS task no picture, both the same groups; several reductions
    share one figure, a row each; a task the model lacks, a segmentation head on another model and
    no rows are refused."""
    from pullback_ext import embedded

    model = embedded.load()
    head = embedded.load_segmentation_head(model=model)
    x = embedded.heldout(1)["images"]
    segmented = group_maps(model, x, (3,), task="segmentation", segmentation_head=head, strategy="tome", r=16)
    assert set(segmented.outputs) == set(segmented.full_outputs) == {"segmentation"}
    assert segmented.outputs["segmentation"].shape[:2] == (1, head.num_classes)
    with torch.no_grad():
        torch.testing.assert_close(segmented.full_outputs["segmentation"], model.segment(x, head))
    cls = group_maps(model, x, (3,), task="cls", strategy="tome", r=16)
    assert cls.outputs == {} and cls.counts(0) == segmented.counts(0) and cls.counts(0)[3]["tokens"] == 196 - 4 * 16
    figure = comparison_figure([("ToMe, segmentation", segmented), ("ToMe, CLS", cls)], 0, "two rows")
    titles = [ax.get_title() for ax in figure.axes if ax.get_title()]
    assert titles[0] == "ToMe, segmentation" and "ToMe, CLS" in titles
    assert "segmentation, unreduced" in titles and "segmentation, reduced" in titles and len(titles) == 6
    with pytest.raises(PullbackError, match="task 'segmentation': demo supports cls, depth"):
        group_maps(model, x, (3,), task="segmentation", strategy="tome", r=16)
    with pytest.raises(PullbackError, match="segmentation_head: only the demo model takes one"):
        group_maps(tiny_vit(depth=DEPTH), images(1), (0,), segmentation_head=head, strategy="tome", r=1)
    with pytest.raises(PullbackError, match="rows: expected one or more"):
        comparison_figure([])
