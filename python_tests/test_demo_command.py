"""``pullback demo``: stage handling and the quick run end to end."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.demo import pipeline
from pullback_ext.demo.stages import StageResult, TrainedHead


def _walk_numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_numbers(v)
    elif isinstance(value, float):
        yield value


def _stage(name, run):
    return SimpleNamespace(NAME=name, run_demo_stage=run)


def test_the_stages_are_the_demo_modules_in_order():
    from pullback_ext.demo import diagnostic_stage, importance_stage, pruning_stage

    assert pipeline.STAGES == (diagnostic_stage, importance_stage, pruning_stage)
    assert [stage.NAME for stage in pipeline.STAGES] == ["diagnostic", "importance_head", "pruning"]


def test_heads_pass_from_stage_to_stage_as_values(tmp_path, monkeypatch):
    head = torch.nn.Identity()
    seen = []

    def trains(inputs):
        assert inputs.heads == () and inputs.scenes["images"].shape[0] == 4 and inputs.images.spec == "builtin:scenes"
        return StageResult({"trained": True}, heads=(TrainedHead("cls", head, 2),))

    def uses(inputs):
        seen.append(inputs.heads)
        return StageResult({"used": [h.layer for h in inputs.heads]})

    monkeypatch.setattr(pipeline, "STAGES", (_stage("first", trains), _stage("second", uses)))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    assert seen == [(TrainedHead("cls", head, 2),)]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["first"]["result"] == {"trained": True}
    assert results["stages"]["second"]["result"] == {"used": [2]} and results["stages"]["second"]["status"] == "ok"
    assert results["scenes"] == {"source": "builtin:scenes", "seed": 0, "num_images": 4}
    assert 0 <= results["model"]["this_run"]["top1"] <= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # nothing read or left through the folder


def test_failing_stage_is_recorded_and_exit_code_is_1(tmp_path, monkeypatch):
    def run_demo_stage(inputs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "STAGES", (_stage("bad", run_demo_stage), _stage("after", run_demo_stage)))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["bad"]["status"] == "failed" and "boom" in results["stages"]["bad"]["error"]
    assert results["stages"]["after"]["status"] == "failed"  # later stages still run


def test_jsonable_handles_tensors_and_non_finite_values():
    out = pipeline.jsonable({"a": torch.tensor([1.0, float("nan")]), 3: (float("inf"), torch.tensor(2))})
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
        assert stage["status"] == "ok"
    assert results["stages"]["pruning"]["result"]["heads"] == {"cls": 2}  # the importance stage's head, by value
