"""Matched-cost comparison: the frontier and matched-speed-up reading against brute-force
oracles, the interleaved timing harness, the sweep grammar, and ``pullback evaluate --pareto``."""

from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.commands.evaluate_pareto import build_points, method_grid, parse_sweeps
from pullback_ext.comparison.cost import interleaved_wall_clock
from pullback_ext.comparison.pareto import error_summary, frontier, matched_error
from pullback_ext.errors import PullbackError


def _dominated(i, xs, ys):
    return any(xs[j] >= xs[i] and ys[j] <= ys[i] and (xs[j] > xs[i] or ys[j] < ys[i]) for j in range(len(xs)))


@pytest.mark.parametrize("seed", range(20))
def test_frontier_is_exactly_the_non_dominated_points(seed):
    rng = random.Random(seed)
    xs = [rng.choice([1.0, 1.2, 1.5, 2.0]) if seed % 2 else rng.uniform(1, 3) for _ in range(12)]
    ys = [rng.choice([0.0, 0.1, 1.0]) if seed % 3 == 0 else rng.uniform(0, 5) for _ in range(12)]
    front = frontier(xs, ys)
    expected = {i for i in range(len(xs)) if not _dominated(i, xs, ys)}
    # duplicates of one (x, y) point: one representative is kept
    assert {(xs[i], ys[i]) for i in front} == {(xs[i], ys[i]) for i in expected}
    assert [xs[i] for i in front] == sorted(xs[i] for i in front)


def test_matched_error_interpolates_log_linearly_on_the_frontier():
    xs, ys = [1.2, 1.5, 2.0, 1.4], [0.01, 0.1, 1.0, 0.5]  # (1.4, 0.5) is dominated by (1.5, 0.1)
    assert matched_error(xs, ys, 1.35) == {"value": pytest.approx(math.sqrt(0.01 * 0.1)), "bound": False}
    assert matched_error(xs, ys, 1.5) == {"value": pytest.approx(0.1), "bound": False}
    assert matched_error(xs, ys, 1.1) == {"value": 0.01, "bound": True}  # slower than any setting: an upper bound
    assert matched_error(xs, ys, 2.5) is None
    assert matched_error([1.0, 2.0], [0.0, 1.0], 1.5)["value"] == pytest.approx(0.5)  # a zero error: linear


def test_error_summary():
    s = error_summary(torch.tensor([0.0, 1.0, 2.0, 3.0, 10.0]))
    assert (s["mean"], s["median"], s["worst"], s["worst_image"]) == (3.2, 2.0, 10.0, 4)
    assert s["p95"] == pytest.approx(float(torch.quantile(torch.tensor([0.0, 1, 2, 3, 10], dtype=torch.float64), 0.95)))


def test_interleaved_timing_rotates_the_order_and_times_every_round(monkeypatch):
    """On a scripted clock each call takes a known time: the warm-up round is dropped, every timed
    call is recorded in order, and the median and minimum are those of the scripted times."""
    import pullback_ext.comparison.cost as cost

    now = [0.0]
    monkeypatch.setattr(cost.time, "perf_counter", lambda: now[0])
    durations = {"a": [9.0, 3.0, 1.0, 2.0], "b": [9.0, 5.0, 4.0, 6.0], "c": [9.0, 0.5, 0.25, 8.0]}  # warm-up first
    calls = []

    def call(name):
        now[0] += durations[name][sum(c == name for c in calls)]
        calls.append(name)

    fns = {name: (lambda name=name: call(name)) for name in "abc"}
    out = interleaved_wall_clock(fns, repeats=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")
    assert {name: t["times_s"] for name, t in out.items()} == {"a": [3.0, 1.0, 2.0], "b": [5.0, 4.0, 6.0], "c": [0.5, 0.25, 8.0]}
    assert {name: (t["median_s"], t["min_s"], t["repeats"]) for name, t in out.items()} == {
        "a": (2.0, 1.0, 3), "b": (5.0, 4.0, 3), "c": (0.5, 0.25, 3)}
    with pytest.raises(PullbackError, match="repeats must be an int >= 1"):
        interleaved_wall_clock(fns, repeats=0)


def test_sweep_grammar():
    assert parse_sweeps(["tome:r=4,8", "evit:keep_rate=0.5", "importance:llf=off,full"]) == {
        "tome": {"r": (4, 8)}, "evit": {"keep_rate": (0.5,)}, "importance": {"llf": (False, "full")}}
    assert parse_sweeps(["importance_tome:early_merges=False,TRUE,auto"]) == {"importance_tome": {"early_merges": (False, True, "auto")}}
    for bad, match in (("tome-r=4", "expected METHOD:FIELD"), ("tome:rr=4", "'rr' is not a reduction option"),
                       ("tome:r=", "expected METHOD:FIELD")):
        with pytest.raises(PullbackError, match=match):
            parse_sweeps([bad])


def test_grids_give_both_of_our_rules_and_the_authors_knobs():
    assert method_grid("importance", "merge", (0.1, 0.2), {}) == {"ratio": (0.1, 0.2), "selection": ("bound", "lowest")}
    assert method_grid("importance", "prune", (0.1,), {}) == {"ratio": (0.1,), "llf": ("masked", "full")}
    assert set(method_grid("tome", "merge", (0.1,), {})) == {"r", "schedule"}
    assert method_grid("tome", "merge", (0.1,), {"tome": {"r": (3,)}})["r"] == (3,)
    base = {"layers": (2,), "mode": "merge", "preset": "recommended"}
    points = build_points(("tome", "norm"), parse_sweeps(["tome:r=2,4", "tome:schedule=constant"]), base, {}, None, (0.1, 0.3))
    assert [p.knob for p in points] == [{"r": 2, "schedule": "constant"}, {"r": 4, "schedule": "constant"}, {"ratio": 0.1}, {"ratio": 0.3}]
    assert points[0].options.strategy == "tome" and points[2].options.layers == (2,)
    with pytest.raises(PullbackError, match="needs --head"):
        build_points(("importance",), {}, base, {}, None, (0.1,))
    with pytest.raises(PullbackError, match="--sweep evit: keep_rate must be"):
        build_points(("evit",), {"evit": {"keep_rate": (1.5,)}}, base, {}, None, (0.1,))
    with pytest.raises(PullbackError, match="which --methods does not include"):
        build_points(("tome",), {"evit": {"keep_rate": (0.5,)}}, base, {}, None, (0.1,))


def test_a_method_with_an_optional_head_sweeps_it_into_two_rows():
    from pullback_ext.prune.methods.base import BackboneShape
    from pullback_ext.prune.row_rules import row_label

    base = {"layers": (2,), "mode": "merge", "preset": "recommended"}
    head = lambda F: F.norm(dim=-1)  # noqa: E731  (any callable F [B, K, D] -> [B, K])
    given = parse_sweeps(["importance_tome:head=trained,none", "importance_tome:r=4", "importance_tome:schedule=constant",
                          "importance_tome:early_merges=off"])
    points = build_points(("importance_tome",), given, base, {"importance": head}, None, (0.1,))
    assert [(p.knob["head"], p.options.head) for p in points] == [("trained", head), ("none", None)]
    labels = {row_label(p.options.resolve(BackboneShape(depth=8, num_prefix=1, has_cls=True))) for p in points}
    assert len(labels) == 2  # one row each: a frontier never mixes the headed and the head-free method
    without = build_points(("importance_tome",), parse_sweeps(["importance_tome:head=none", "importance_tome:r=4"]),
                           base, {}, None, (0.1,))
    assert {p.options.head for p in without} == {None}
    for sweep, scorers, match in ((["importance_tome:head=trained"], {}, "head=trained needs --head"),
                                  (["tome:head=none"], {}, "only a method that runs without one")):
        with pytest.raises(PullbackError, match=match):
            build_points((sweep[0].split(":")[0],), parse_sweeps(sweep), base, scorers, None, (0.1,))
    with pytest.raises(PullbackError, match="head takes trained or none"):
        parse_sweeps(["importance_tome:head=big"])


@pytest.fixture
def clean_checkout(monkeypatch):
    """Stamps as from a checkout without local changes (the page refusal is tested on its own)."""
    import pullback_ext.results_pages as rp

    monkeypatch.setattr(rp, "git_commit", lambda repo=rp.REPO: "0" * 40)


def test_pareto_command_end_to_end(tmp_path, capsys, clean_checkout):
    out = tmp_path / "pareto"
    code = main(["evaluate", "--model", "demo", "--pareto", "--methods", "tome,random", "--sweep", "tome:r=2,16",
                 "--sweep", "tome:schedule=constant", "--ratios", "0.1,0.5", "--num-images", "3", "--seeds", "2",
                 "--time-batches", "1,2", "--out", str(out), "--quiet",
                 "--results-page", str(tmp_path / "pages" / "pareto-test")])
    assert code == 0
    page = (tmp_path / "pages" / "pareto-test.md").read_text()
    assert "![error against speed-up](pareto-test.png)" in page and (tmp_path / "pages" / "pareto-test.png").stat().st_size > 0
    assert "torch's flop counter" in page and "local changes" not in page
    assert page.index("at matched FLOP ratio") < page.index("at matched measured speed-up at batch 2")
    assert re.search(r"\| \d+\.\d\d× \[\d+\.\d\d, \d+\.\d\d\] \|", page)  # every measured speed-up with its interval
    assert json.loads((tmp_path / "pages" / "pareto-test.json").read_text())["stamp"]["command"].startswith("pullback evaluate")
    result = json.loads((out / "pareto.json").read_text())
    assert (out / "pareto.md").exists() and (out / "pareto.png").stat().st_size > 0
    assert result["num_images"] == 6 and result["command"].startswith("pullback evaluate --model demo --pareto")
    tome = [p for p in result["points"] if p["options"]["strategy"] == "tome"]
    assert [p["knob"]["r"] for p in tome] == [2, 16]
    assert tome[1]["cost"]["flop_ratio"] > tome[0]["cost"]["flop_ratio"] > 1.0
    assert tome[1]["eta"] > tome[0]["eta"] > 0
    for p in result["points"]:
        assert len(p["per_image"]) == 6 and p["error"]["worst"] == max(p["per_image"])
        assert p["error"]["worst_image_name"]
        assert set(p["cost"]) >= {"gflops_per_image", "batch1", "batch2", "speedup_batch1", "speedup_batch2", "flop_ratio"}
        low, high = p["cost"]["speedup_batch2_ci90"]
        assert low <= p["cost"]["speedup_batch2"] <= high and len(p["cost"]["batch2"]["times_s"]) == 7
    assert list(result["matched"]) == ["flop_ratio", "speedup_batch2", "speedup_batch1"] and result["repeats"] == 7
    assert all("within_noise" in cell for cells in result["matched"]["speedup_batch2"]["mean"].values()
               for cell in cells.values() if cell is not None)
    assert any("ToMe bipartite matching" in row for row in result["rows"])
    assert "| row | 1.1× | 1.25× | 1.5× | 2× | 3× | fastest reached |" in capsys.readouterr().out


def test_a_page_needs_seven_timing_rounds_and_a_clean_checkout(tmp_path, capsys, monkeypatch):
    import pullback_ext.results_pages as rp

    base = ["evaluate", "--model", "demo", "--pareto", "--methods", "random", "--ratios", "0.5", "--num-images", "2",
            "--seeds", "1", "--out", str(tmp_path / "o"), "--quiet", "--results-page", str(tmp_path / "p" / "page")]
    monkeypatch.setattr(rp, "git_commit", lambda repo=rp.REPO: "0" * 40)
    assert main(base + ["--time-repeats", "3"]) == 2
    assert "--time-repeats 3: a --pareto results page gives every speed-up a bootstrap interval" in capsys.readouterr().err
    monkeypatch.setattr(rp, "git_commit", lambda repo=rp.REPO: "0" * 40 + " +local changes")
    assert main(base + ["--no-timing"]) == 2
    assert "the checkout has local changes" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(base + ["--no-timing", "--allow-dirty"]) == 0
    page = (tmp_path / "p" / "page.md").read_text()
    assert rp.DIRTY_NOTE in page and "measured speed-up" not in page


def test_sweep_without_pareto_is_refused(tmp_path, capsys):
    assert main(["evaluate", "--model", "demo", "--sweep", "tome:r=2", "--out", str(tmp_path)]) == 2
    assert "--methods, --sweep and --device need --pareto" in capsys.readouterr().err


def test_device_is_checked():
    from pullback_ext.commands.evaluate_pareto import device

    assert device("cpu") == torch.device("cpu")
    with pytest.raises(PullbackError, match="expected cpu, cuda or cuda:N"):
        device("tpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(PullbackError, match="no CUDA device is available"):
            device("cuda")


def test_unpruned_reference_is_in_every_timing_round():
    # every point's speed-up uses the unpruned median of the same interleaved run
    seen = []
    fns = {"unpruned": lambda: seen.append("u")} | {i: (lambda i=i: seen.append(i)) for i in range(3)}
    interleaved_wall_clock(fns, repeats=2, warmup=0)
    rounds = [seen[k:k + 4] for k in range(0, len(seen), 4)]
    assert all(sorted(map(str, r)) == ["0", "1", "2", "u"] for r in rounds)
    assert list(itertools.chain(*rounds)) == seen


def test_paper_preset_in_evaluate_chooses_full_llf(tmp_path):
    out = tmp_path / "paper"
    assert main(["evaluate", "--model", "demo", "--task", "depth", "--preset", "paper", "--strategies", "random", "--ratios", "0.2",
                 "--num-images", "2", "--seeds", "1", "--no-timing", "--out", str(out), "--quiet"]) == 0
    assert set(json.loads((out / "results.json").read_text())["tables"]) == {"llf_full"}


def test_cls_flop_ratio_counts_the_backbone_and_the_cls_head_only():
    # by hand: timm's own forward of a copy of the demo backbone, patched with the original ToMe, then
    # the CLS head; the depth decoder is not part of the CLS task's forward
    import copy

    from pullback_ext import patch
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.comparison.cost import count_flops
    from pullback_ext.embedded import load_segmentation_head
    from pullback_ext.comparison.pareto import Point, measure_cost, resolve
    from pullback_ext.prune.reduction_options import ReductionOptions
    from pullback_ext.sources.models import ModelSpec

    backbone, model = load_backbone(ModelSpec("demo"))
    x = torch.rand(2, 3, 112, 112, generator=torch.Generator().manual_seed(0))
    scaled = (x[:1] - 0.5) / 0.25  # the demo's pixel normalisation (element-wise: no FLOPs)

    def cls_forward(vit):
        return lambda images: model.cls_head(vit.forward_features(images)[:, 0])

    options = ReductionOptions(strategy="tome", r=24, schedule="decreasing")
    tome = patch.timm(copy.deepcopy(model.backbone), options)
    by_hand = count_flops(cls_forward(model.backbone), scaled) / count_flops(cls_forward(tome), scaled)
    cost = measure_cost(backbone, x, [Point(options=options)], "cls", batches=(), progress=False)
    assert cost["points"][0]["flop_ratio"] == pytest.approx(by_hand, rel=1e-12)
    assert by_hand > 3.0  # with the depth decoder counted as well it read 2.07
    full, reduced = backbone.forwards("cls")
    r = resolve(options, backbone)
    assert torch.equal(reduced(r, x)["embedding"], backbone.reduced(r, x)["embedding"])  # the errors do not move
    assert torch.equal(full(x)["embedding"], backbone.full(x)["embedding"])
    depth_full, _ = backbone.forwards("depth")
    assert count_flops(depth_full, x[:1]) > count_flops(full, x[:1])  # the depth task counts its decoder
    with pytest.raises(PullbackError, match="supports cls, depth$"):  # the segmentation head comes with --task segmentation
        backbone.forwards("segmentation")
    segmented, _ = load_backbone(ModelSpec("demo"), task="segmentation")
    assert segmented.tasks == ("cls", "depth", "segmentation")
    segmentation_full, _ = segmented.forwards("segmentation")
    head = load_segmentation_head(model=model)
    assert count_flops(segmentation_full, x[:1]) == count_flops(lambda images: model.segment(images, head), x[:1])


def test_speedup_interval_against_a_numpy_bootstrap_and_by_hand():
    import numpy as np

    from pullback_ext.comparison.cost import speedup_interval

    base, point = [1.0, 1.1, 0.9, 1.3, 1.0, 1.2, 1.05], [0.8, 0.7, 0.75, 0.9, 0.85, 0.8, 0.6]
    ratios = np.array(base) / np.array(point)
    draws = np.random.default_rng(3).integers(0, 7, size=(500, 7))
    low, high = np.percentile(np.median(ratios[draws], axis=1), [5, 95])
    assert speedup_interval(base, point, resamples=500, seed=3) == {
        "median": pytest.approx(float(np.median(ratios))), "low": pytest.approx(low), "high": pytest.approx(high), "rounds": 7}
    # two rounds of ratios 1 and 3: a draw's median is 1, 2 or 3 (odds 1:2:1), so the 5th and 95th percentiles are 1 and 3
    assert speedup_interval([1.0, 3.0], [1.0, 1.0]) == {"median": 2.0, "low": 1.0, "high": 3.0, "rounds": 2}
    assert speedup_interval([2.0] * 7, [1.0] * 7) == {"median": 2.0, "low": 2.0, "high": 2.0, "rounds": 7}
    for bad, match in ((([1.0], [1.0, 2.0]), "equal-length"), (([1.0], [0.0]), "positive"), (([], []), "equal-length")):
        with pytest.raises(PullbackError, match=match):
            speedup_interval(*bad)


def _timed_point(row, speedup, low, high, error):
    return {"row": row, "cost": {"speedup_batch4": speedup, "speedup_batch4_ci90": [low, high]},
            "error": {stat: error for stat in ("mean", "median", "p95", "worst")}}


def test_within_noise_is_an_overlap_of_the_rows_error_bands():
    from pullback_ext.comparison.pareto import error_band, mark_noise

    points = [_timed_point("a", 1.0, 0.9, 1.1, 0.01), _timed_point("a", 1.5, 1.4, 1.6, 0.1),
              _timed_point("b", 1.0, 0.95, 1.05, 1.0), _timed_point("b", 1.5, 1.45, 1.55, 10.0),
              _timed_point("c", 1.0, 0.9, 1.1, 0.02), _timed_point("c", 1.5, 1.4, 1.6, 0.2),
              _timed_point("d", 1.3, 1.1, 1.4, 5.0)]
    # a at 1.25×: optimistic (points at 1.1 and 1.6) 0.01·10^0.3, pessimistic (0.9 and 1.4) 0.01·10^0.7
    assert error_band([p for p in points if p["row"] == "a"], "speedup_batch4", "mean", 1.25) == (
        pytest.approx(0.01 * 10 ** 0.3), pytest.approx(0.01 * 10 ** 0.7))
    # d: optimistic reading at its slowest point (a bound), pessimistic never that fast
    assert error_band([p for p in points if p["row"] == "d"], "speedup_batch4", "mean", 1.25) == (5.0, math.inf)
    assert error_band([p for p in points if p["row"] == "d"], "speedup_batch4", "mean", 1.45) is None
    rows, targets = ["a", "b", "c", "d"], [1.25, 1.45]
    matched = {stat: {row: {f"{t:g}": matched_error([p["cost"]["speedup_batch4"] for p in points if p["row"] == row],
                                                    [p["error"][stat] for p in points if p["row"] == row], t) for t in targets}
                      for row in rows} for stat in ("mean", "median", "p95", "worst")}
    mark_noise(matched, points, rows, "speedup_batch4", targets)
    at = {row: matched["mean"][row]["1.25"] for row in rows}
    # a [0.020, 0.050] and c [0.040, 0.100] overlap; b [2.5, 4.0] overlaps d [5, ∞) of neither: b is settled
    assert (at["a"]["within_noise"], at["c"]["within_noise"], at["b"]["within_noise"]) == (True, True, False)
    assert at["d"]["within_noise"] is False and at["d"]["band"] == [5.0, math.inf]
    assert matched["mean"]["d"]["1.45"] is None  # not reached: no mark
    # at 1.45× a's pessimistic reading (fastest point at 1.4) does not get there: its band [0.05, ∞) overlaps b's [6.3, 10]
    assert matched["mean"]["a"]["1.45"]["band"] == [pytest.approx(0.01 * 10 ** 0.7), math.inf]
    assert matched["mean"]["b"]["1.45"]["within_noise"] and matched["mean"]["b"]["1.45"]["band"] == [
        pytest.approx(10 ** 0.8), pytest.approx(10.0)]
    from pullback_ext.comparison.pareto_report import _cell, speedup_text

    assert _cell(at["a"]) == "≈ 0.032" and _cell(at["b"]) == "3.162" and _cell({"value": 5.0, "bound": True}) == "≤ 5.000"
    assert speedup_text(points[0]["cost"], "speedup_batch4") == "1.00× [0.90, 1.10]"


def test_a_method_trained_by_its_own_command_gets_its_rows_from_trained(tmp_path, capsys):
    """``--trained dtem=DIR`` gives DTEM's rows the module of that folder: its errors equal the
    reduced model's with that module, computed here; without it, or with a bad value, one clear line."""
    from pullback_ext.comparison import quality
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.metric import checkpoint
    from pullback_ext.prune.methods import dtem
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
    from pullback_ext.sources.images import open_images
    from pullback_ext.sources.models import load_model, parse_model

    model = load_model(parse_model("demo"), headless=True)[0]
    torch.manual_seed(3)
    checkpoint.save_model(tmp_path / "dtem", "dtem", dtem.embedding_for(model.backbone), classes=dtem.CHECKPOINT_KINDS)
    base = ["evaluate", "--model", "demo", "--pareto", "--methods", "tome,dtem", "--num-images", "2",
            *[f for m in ("tome", "dtem") for f in ("--sweep", f"{m}:r=8", "--sweep", f"{m}:schedule=constant")], "--seeds", "1", "--no-timing", "--quiet", "--out", str(tmp_path / "out")]
    assert main(base + ["--trained", f"dtem={tmp_path / 'dtem'}"]) == 0
    points = json.loads((tmp_path / "out" / "pareto.json").read_text())["points"]
    got = {p["row"].split(" · ")[0]: p["error"]["mean"] for p in points}
    backbone = demo_backbone(model)
    full, reduced = backbone.forwards("cls")
    images = open_images("builtin:scenes", "--images").seed_sets(backbone.preprocess, 2, 1)[0].load()["images"]
    shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=True)
    with torch.no_grad():
        want = reduced(ReductionOptions(strategy="dtem", head=tmp_path / "dtem", r=8).resolve(shape), images)["embedding"]
        want = float(quality.cosine_x100(want, full(images)["embedding"]).mean())
    assert got["dtem"] == pytest.approx(want, rel=1e-6, abs=1e-12) and got["dtem"] != got["tome"]
    for flags, message in [([], "'dtem' needs --trained dtem=DIR (a folder of pullback train dtem)"),
                           (["--trained", "tome=x"], "--trained: expected METHOD=DIR with METHOD one of dtem"),
                           (["--trained", f"dtem={tmp_path / 'missing'}"], "missing")]:
        assert main(base + flags + ["--overwrite"]) == 2, flags  # --out holds the run above
        assert message in capsys.readouterr().err, flags


def test_the_standings_name_our_best_row_against_the_best_other_and_every_target_where_ours_trails():
    from pullback_ext.comparison.pareto_report import standings

    def cell(value):
        return None if value is None else {"value": value, "bound": False}

    rows = {"importance_tome · guarded": ("importance_tome", {"mean": (1.0, 4.0), "p95": (2.0, None)}),
            "importance_tome (defaults) · guarded": ("importance_tome", {"mean": (0.5, 8.0), "p95": (3.0, None)}),
            "tome · bipartite": ("tome", {"mean": (2.0, 3.0), "p95": (4.0, 6.0)}),
            "dtem · learned": ("dtem", {"mean": (1.5, 2.0), "p95": (None, None)})}
    result = {"rows": list(rows), "targets": [1.1, 2.0],
              "points": [{"row": row, "options": {"strategy": strategy}} for row, (strategy, _) in rows.items()],
              "matched": {"flop_ratio": {stat: {row: {t: cell(errors[stat][i]) for i, t in enumerate(("1.1", "2"))}
                                                for row, (_, errors) in rows.items()} for stat in ("mean", "p95")}}}
    text = standings(result)
    # 1.1× mean: ours 0.5 (the defaults row) against dtem's 1.5 -> 3×; p95: ours 2 against tome's 4 -> 2×
    assert "| 1.1× | mean | 0.500 (importance_tome (defaults)) | 1.500 (dtem) | ours leads, 3× |" in text
    assert "| 1.1× | p95 | 2.000 (importance_tome) | 4.000 (tome) | ours leads, 2× |" in text
    # 2× mean: ours 4 against dtem's 2 -> trails 2×; p95: no row of ours reaches 2×
    assert "| 2× | mean | 4.000 (importance_tome) | 2.000 (dtem) | **ours trails**, 2× |" in text
    assert "| 2× | p95 | – | 6.000 (tome) | only others reach it |" in text
    assert "Ours trails at 2× mean (behind dtem); 2× p95 (not reached by ours)." in text
    assert standings({**result, "rows": [r for r in rows if r.startswith("tome")]}) == ""


def _varied_images() -> torch.Tensor:
    """``[4, 3, 112, 112]`` of different content for the demo model: a smooth ramp (most 2 × 2
    windows alike), uniform noise, patch-sized blocks of random colour, and half ramp half noise."""
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 1, 112)
    smooth = torch.stack([ramp[None, :].expand(112, 112), ramp[:, None].expand(112, 112), 0.5 * torch.ones(112, 112)])
    noise = torch.rand(3, 112, 112, generator=g)
    blocks = torch.rand(3, 14, 14, generator=g).repeat_interleave(8, dim=1).repeat_interleave(8, dim=2)
    half = torch.cat([smooth[:, :56], torch.rand(3, 56, 112, generator=g)], dim=1)
    return torch.stack([smooth, noise, blocks, half])


def _spied_segmentation_backbone():
    """The demo backbone with its segmentation head, recording ``(strategy, batch)`` of every
    reduced forward (those of the errors and those of the cost)."""
    import dataclasses

    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.sources.models import ModelSpec

    backbone, _ = load_backbone(ModelSpec("demo"), task="segmentation")
    calls = []

    def recorded(fn):
        def reduced(reduction, images):
            calls.append((reduction.options.strategy, images.shape[0]))
            return fn(reduction, images)
        return reduced

    full, reduced = backbone.forwards("segmentation")
    spied = dataclasses.replace(backbone, reduced=recorded(backbone.reduced),
                                task_forward=lambda task: (full, recorded(reduced)))
    return backbone, spied, calls


def test_a_batch_dependent_method_is_measured_one_image_at_a_time():
    """ALGM's counts are the batch's smallest: each image's reported error is that of the image
    reduced alone (not in its batch of 4), its FLOP ratio the unpruned count over the mean of the
    images' counts each alone (not the first image's), and its time at batch 3 is three forwards
    at batch 1; the page's cost note says so."""
    from pullback_ext.comparison.cost import count_flops
    from pullback_ext.comparison.evaluation import output_errors
    from pullback_ext.comparison.pareto import Point, image_errors, measure_cost, resolve, summarise
    from pullback_ext.comparison.pareto_report import cost_note
    from pullback_ext.prune.methods import get
    from pullback_ext.prune.reduction_options import ReductionOptions

    assert get("algm").batch_dependent and get("tap").batch_dependent and not get("tome").batch_dependent
    backbone, spied, calls = _spied_segmentation_backbone()
    images = _varied_images()
    points = [Point(options=ReductionOptions(strategy="algm", local_threshold=t)) for t in (0.9, 0.8)]
    measured = image_errors(spied, images, points, "segmentation", batch_size=16, progress=False)
    cost = measure_cost(spied, images, points, "segmentation", batches=(3,), repeats=1, progress=False)
    assert calls == [("algm", 1)] * (2 * 4 + 2 * 4 + 2 * 2 * 3)  # errors, FLOPs, timing (warm-up and one round)
    full, reduced = backbone.forwards("segmentation")
    with torch.no_grad():
        unpruned = backbone.full(images)
        for point, errors, entry in zip(points, measured, cost["points"]):
            r = resolve(point.options, backbone)
            alone = torch.cat([output_errors("segmentation", backbone.reduced(r, x[None]), backbone.full(x[None]))
                               ["pixel_kl_x100"] for x in images])
            pooled = output_errors("segmentation", backbone.reduced(r, images), unpruned)["pixel_kl_x100"]
            torch.testing.assert_close(errors["pixel_kl_x100"], alone, rtol=1e-4, atol=1e-6)
            assert not torch.allclose(pooled, alone, rtol=1e-2, atol=1e-4)  # in a batch, an image gets another reduction
            each = [count_flops(lambda x: reduced(r, x), x[None]) for x in images]
            assert len(set(each)) > 1  # the images' counts differ: the first one's alone is not their mean
            assert entry["flop_ratio"] == pytest.approx(count_flops(full, images[:1]) / (sum(each) / len(each)), rel=1e-12)
            assert entry["gflops_per_image"] == pytest.approx(sum(each) / len(each) / 1e9, rel=1e-12)
    result = summarise(points, ["algm"] * 2, [e["pixel_kl_x100"] for e in measured], cost, [None, None])
    assert [p["one_image_at_a_time"] for p in result["points"]] == [True, True]
    assert "ALGM: an image's token counts depend on the other images of its batch" in cost_note(result)
    assert "same b images reduced one after another" in cost_note(result)


def test_a_method_whose_counts_do_not_depend_on_the_batch_is_measured_as_before():
    """ToMe: errors from one forward of the whole batch, FLOPs on the first image, time on the batch."""
    from pullback_ext.comparison.cost import count_flops
    from pullback_ext.comparison.evaluation import output_errors
    from pullback_ext.comparison.pareto import Point, image_errors, measure_cost, resolve, summarise
    from pullback_ext.comparison.pareto_report import cost_note
    from pullback_ext.prune.reduction_options import ReductionOptions

    backbone, spied, calls = _spied_segmentation_backbone()
    images = _varied_images()
    point = Point(options=ReductionOptions(strategy="tome", r=8, schedule="constant"))
    measured = image_errors(spied, images, [point], "segmentation", batch_size=16, progress=False)
    cost = measure_cost(spied, images, [point], "segmentation", batches=(3,), repeats=1, progress=False)
    assert calls == [("tome", 4), ("tome", 1), ("tome", 3), ("tome", 3)]
    full, reduced = backbone.forwards("segmentation")
    r = resolve(point.options, backbone)
    with torch.no_grad():
        want = output_errors("segmentation", backbone.reduced(r, images), backbone.full(images))["pixel_kl_x100"]
    assert torch.equal(measured[0]["pixel_kl_x100"], want)
    assert cost["points"][0]["flop_ratio"] == count_flops(full, images[:1]) / count_flops(lambda x: reduced(r, x), images[:1])
    result = summarise([point], ["tome"], [measured[0]["pixel_kl_x100"]], cost, [None])
    assert result["points"][0]["one_image_at_a_time"] is False and "one image at a time" not in cost_note(result)
