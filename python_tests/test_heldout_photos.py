"""benchmarks/heldout_photos.py: the held-out driver behind importance_tome's defaults."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import heldout_photos  # noqa: E402


def test_it_writes_every_point_of_every_row_and_the_head_scores_its_own_block(tmp_path, capsys):
    from pullback_ext.metric import checkpoint
    from pullback_ext.metric.head import ImportanceHead

    torch.manual_seed(0)
    head = tmp_path / "head"
    checkpoint.save_model(head, "head", ImportanceHead(192, hidden=32, heads=1), extra={"probe": {"layer": 0}})
    out = tmp_path / "heldout.json"
    assert heldout_photos.main(["--methods", "tome", "--head", str(head), "--first", "300", "--count", "2",
                                "--targets", "1.1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["crops"] == [300, 301] and result["metric"] == "cosine_x100" and "machine" in result
    rows = result["rows"]
    tome = [label for label in rows if label.startswith("tome")]
    ours = [label for label in rows if label.startswith("head: importance_tome")]
    assert len(tome) == 1 and len(rows[tome[0]]) == 18  # r 1..24 x both schedules
    assert ours and all("head on block 0's output" in label for label in ours)
    assert any("(defaults)" in label for label in ours)
    assert all(p["head"] == "head" for label in ours for p in rows[label])  # what a --rule row is read per
    assert all(p["flop_ratio"] >= 1.0 and p["error"]["worst"] >= p["error"]["mean"] for r in rows.values() for p in r)
    printed = capsys.readouterr().out
    assert "| row | 1.1× | 2× | fastest |" in printed and printed.count("\n| ") >= len(rows)


def test_a_sweep_replaces_a_field_of_the_grid_of_the_rows_it_names(tmp_path):
    out = tmp_path / "heldout.json"
    assert heldout_photos.main(["--methods", "tome,importance_tome", "--sweep", "tome:r=4,8", "--sweep",
                                "importance_tome:guard=2", "--first", "300", "--count", "2", "--targets", "1.1",
                                "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    tome = [label for label in rows if label.startswith("tome")]
    assert len(tome) == 1 and sorted(p["knob"]["r"] for p in rows[tome[0]]) == [4, 4, 8, 8]  # x both schedules
    ours = [p for label, points in rows.items() if label.startswith("importance_tome") for p in points]
    assert ours and all(p["knob"]["guard"] == 2 for p in ours)  # a swept field leaves out the defaults row


def test_head_methods_give_each_heads_rows_of_the_methods_named(tmp_path, capsys):
    import pytest

    from pullback_ext.metric import checkpoint
    from pullback_ext.metric.head import ImportanceHead

    torch.manual_seed(0)
    head = tmp_path / "head"
    checkpoint.save_model(head, "head", ImportanceHead(192, hidden=32, heads=1), extra={"probe": {"layer": 1}})
    out = tmp_path / "heldout.json"
    assert heldout_photos.main(["--task", "depth", "--methods", "tome", "--sweep", "tome:r=8", "--head", str(head),
                                "--head-methods", "importance_cluster", "--sweep", "importance_cluster:keep_rate=0.9,0.6",
                                "--first", "300", "--count", "2", "--targets", "1.1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    ours = sorted(label for label in rows if label.startswith("head: "))
    assert len(ours) == 2 and all("importance_cluster" in label and "head on block 1's output" in label for label in ours)
    assert "at blocks 2, 3, 4, 5, 6," in ours[0] and "at blocks 2, 4, 5," in ours[1]  # inner (after the score), ATC's
    assert all(sorted(p["knob"]["keep_rate"] for p in rows[label]) == [0.6, 0.9] for label in ours)
    for wrong in ("atc", "importance_tome,tome", ""):
        with pytest.raises(SystemExit):
            heldout_photos.parse(["--head-methods", wrong, "--out", "x.json"])
        assert "--head-methods: expected a comma list of importance_tome, importance_cluster" in capsys.readouterr().err


def test_two_heads_of_one_folder_name_keep_their_rows_apart(tmp_path):
    from pullback_ext.metric import checkpoint
    from pullback_ext.metric.head import ImportanceHead

    for seed in (0, 1):
        torch.manual_seed(seed)
        checkpoint.save_model(tmp_path / f"seed{seed}" / "head", "head", ImportanceHead(192, hidden=32, heads=1),
                              extra={"probe": {"layer": 0}})
    out = tmp_path / "heldout.json"
    assert heldout_photos.main(["--methods", "tome", "--sweep", "tome:r=8", "--head", str(tmp_path / "seed0" / "head"),
                                "--head", str(tmp_path / "seed1" / "head"), "--sweep", "importance_tome:r=8",
                                "--first", "300", "--count", "1", "--targets", "1.1", "--out", str(out)]) == 0
    heads = {p["head"] for points in json.loads(out.read_text())["rows"].values() for p in points if p.get("head")}
    assert heads == {str(tmp_path / "seed0" / "head"), str(tmp_path / "seed1" / "head")}


def _point(r, schedule, early, flop_ratio, error, head="head"):
    return {"knob": {"r": r, "schedule": schedule, "early_merges": early}, "flop_ratio": flop_ratio, "head": head,
            "error": {"mean": error, "p95": 2 * error, "worst": 4 * error}}


def test_a_rule_row_takes_at_each_r_the_setting_its_reach_picks_and_the_criterion_is_over_tomes(tmp_path, capsys):
    # On the demo ToMe reaches 1.46x at r = 15, 1.51x at 16, 1.73x at 20 and 2.01x at 24
    # (docs/importance_tome_findings.md §5d), so the rule (1.5, 2; decreasing, decreasing) takes
    # the guarded constant point at 15, the guarded decreasing ones at 16 and 20, and the early one at 24.
    settings = [("constant", False), ("constant", True), ("decreasing", False), ("decreasing", True)]
    ours = [_point(r, s, e, 1.0 + r / 20 + 0.01 * i, 0.1 * (i + 1) * r) for r in (15, 16, 20, 24) for i, (s, e) in enumerate(settings)]
    tome = [{"knob": {"r": r}, "flop_ratio": 1.0 + r / 20, "error": {"mean": 1.0, "p95": 2.0, "worst": 4.0}} for r in (2, 30)]
    source = tmp_path / "points.json"
    source.write_text(json.dumps({"task": "cls", "crops": [0, 9], "rows": {"tome (ToMe)": tome, "head: settings": ours}}))
    out = tmp_path / "rules.json"
    assert heldout_photos.main(["--from", str(source), "--rule", "1.5,2,decreasing,decreasing", "--rule", "1.5,1.5,constant,constant",
                                "--criterion-targets", "1.8", "--targets", "1.8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    chosen = rows["head: rule (1.5, 2; decreasing, decreasing)"]
    assert [(p["knob"]["r"], p["knob"]["schedule"], p["knob"]["early_merges"]) for p in chosen] == [
        (15, "constant", False), (16, "decreasing", False), (20, "decreasing", False), (24, "decreasing", True)]
    old = rows["head: rule (1.5, 1.5; constant, constant)"]
    assert [(p["knob"]["schedule"], p["knob"]["early_merges"]) for p in old] == [("constant", False)] + [("constant", True)] * 3
    printed = capsys.readouterr().out
    # ToMe's errors are 1 / 2 / 4 everywhere and ours y / 2y / 4y, so the criterion is our matched mean:
    # at 1.8x, between the rule's points at r = 15 (1.75x, 0.1 * 15) and r = 16 (1.82x, 0.3 * 16), log-linearly
    x0, y0, x1, y1 = 1.75, 1.5, 1.82, 4.8
    expected = math.exp(math.log(y0) + (1.8 - x0) / (x1 - x0) * (math.log(y1) - math.log(y0)))
    assert f"| head: rule (1.5, 2; decreasing, decreasing) | {expected:.3g} |" in printed


def test_a_bad_rule_or_source_is_refused_naming_the_argument(tmp_path, capsys):
    import pytest

    from pullback_ext.errors import PullbackError

    for rule in ("2,1.5,constant,constant", "1.5,2,linear,constant", "1.5,2,constant"):
        with pytest.raises(SystemExit):
            heldout_photos.parse(["--rule", rule, "--out", "x.json"])
        assert "--rule takes GUARDED,EARLY,BETWEEN,BEYOND" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(PullbackError, match="--from"):
        heldout_photos.main(["--from", str(broken), "--out", str(tmp_path / "x.json")])
    broken.write_text(json.dumps({"task": "cls", "crops": [0, 1], "rows": {"tome": []}}))
    with pytest.raises(PullbackError, match="--rule: no importance_tome points"):
        heldout_photos.main(["--from", str(broken), "--rule", "1.5,2,constant,constant", "--out", str(tmp_path / "x.json")])
    broken.write_text(json.dumps({"rows": {}}))
    with pytest.raises(PullbackError, match=r"--from: .* \(expected the keys task, rows and crops\)"):
        heldout_photos.main(["--from", str(broken), "--out", str(tmp_path / "x.json")])
