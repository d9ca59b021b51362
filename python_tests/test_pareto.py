"""Matched-cost comparison: the frontier and matched-speed-up reading against brute-force
oracles, the interleaved timing harness, the sweep grammar, and ``pullback evaluate --pareto``."""

from __future__ import annotations

import itertools
import json
import math
import random

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


def test_interleaved_timing_rotates_the_order_and_times_every_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    out = interleaved_wall_clock(fns, repeats=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")
    assert all(len(t["times_s"]) == 3 and t["median_s"] >= t["min_s"] >= 0 for t in out.values())
    with pytest.raises(PullbackError, match="repeats must be an int >= 1"):
        interleaved_wall_clock(fns, repeats=0)


def test_sweep_grammar():
    assert parse_sweeps(["tome:r=4,8", "evit:keep_rate=0.5", "importance:llf=off,full"]) == {
        "tome": {"r": (4, 8)}, "evit": {"keep_rate": (0.5,)}, "importance": {"llf": (False, "full")}}
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


def test_pareto_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "pareto"
    code = main(["evaluate", "--model", "demo", "--pareto", "--methods", "tome,random", "--sweep", "tome:r=2,16",
                 "--sweep", "tome:schedule=constant", "--ratios", "0.1,0.5", "--num-images", "3", "--seeds", "2",
                 "--time-batches", "1,2", "--time-repeats", "1", "--out", str(out), "--quiet",
                 "--results-page", str(tmp_path / "pages" / "pareto-test")])
    assert code == 0
    page = (tmp_path / "pages" / "pareto-test.md").read_text()
    assert "![error against speed-up](pareto-test.png)" in page and (tmp_path / "pages" / "pareto-test.png").stat().st_size > 0
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
    assert set(result["matched"]) == {"speedup_batch2", "speedup_batch1", "flop_ratio"}
    assert any("ToMe bipartite matching" in row for row in result["rows"])
    assert "| row | 1.1× | 1.25× | 1.5× | 2× | fastest reached |" in capsys.readouterr().out


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
