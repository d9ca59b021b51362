"""benchmarks/heldout_photos.py: the held-out driver behind importance_tome's defaults."""

from __future__ import annotations

import json
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
