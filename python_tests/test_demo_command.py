"""``pullback demo``: stage handling and the quick run end to end."""

import json
import math

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.commands import demo as demo_command


def _walk_numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_numbers(v)
    elif isinstance(value, float):
        yield value


def test_missing_stage_is_skipped_and_results_stay_valid(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo_command, "STAGES", (("future", "pullback_ext.no_such_module"),
                                                ("also_future", "pullback_ext.embedded.scenes")))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["future"]["status"] == "skipped"
    assert "no_such_module" in results["stages"]["future"]["reason"]
    assert results["stages"]["also_future"] == {"status": "skipped", "reason": "pullback_ext.embedded.scenes has no run_demo_stage"}
    assert 0 <= results["model"]["this_run"]["top1"] <= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # no temp files left
    assert "skipped" in capsys.readouterr().out


def test_failing_stage_is_recorded_and_exit_code_is_1(tmp_path, monkeypatch):
    def run_demo_stage(model, scenes, out_dir, quick):
        raise RuntimeError("boom")

    monkeypatch.setattr(demo_command, "_stage_function", lambda name: (run_demo_stage, ""))
    monkeypatch.setattr(demo_command, "STAGES", (("bad", "any.module"), ("after", "any.module")))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["bad"]["status"] == "failed" and "boom" in results["stages"]["bad"]["error"]
    assert results["stages"]["after"]["status"] == "failed"  # later stages still run


def test_jsonable_handles_tensors_and_non_finite_values():
    out = demo_command._jsonable({"a": torch.tensor([1.0, float("nan")]), 3: (float("inf"), torch.tensor(2))})
    assert out == {"a": [1.0, None], "3": [None, 2]}


def test_out_must_be_a_folder(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["demo", "--quick", "--out", str(target)]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_demo_end_to_end(tmp_path):
    from pullback_ext.demo.diagnostic_stage import PROBE_LAYERS

    code = main(["demo", "--quick", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, results["stages"]
    assert all(math.isfinite(x) for x in _walk_numbers(results))
    diagnostic = results["stages"]["diagnostic"]
    assert diagnostic["status"] == "ok"
    rows = diagnostic["result"]["table"]
    assert {(r["decoder"], r["layer"]) for r in rows} == {(d, l) for d in ("embedding", "depth") for l in PROBE_LAYERS}
    for row in rows:
        assert 0 <= row["kappa_cap"] <= 1 + 1e-6 and row["cv"] >= 0
        assert row["regime"] in {"i", "ii", "iii", "iv", "v"}
        assert 1 <= row["r_eff_trunc"] <= 20
    for name in diagnostic["result"]["plots"]:
        assert (tmp_path / name).stat().st_size > 1000
    for stage in results["stages"].values():
        assert stage["status"] in {"ok", "skipped"}
