"""The importance-head stage of ``pullback demo`` on the demo architecture (tiny settings)."""

import json

import pytest
import torch

from pullback_ext.demo.importance_stage import StageSettings, run_demo_stage


def test_stage_trains_then_reuses_its_checkpoint(tmp_path, monkeypatch):
    from dataclasses import replace

    from pullback_ext.demo.pipeline import demo_inputs
    from pullback_ext.embedded import heldout
    from pullback_ext.embedded.model import DemoModel

    torch.manual_seed(0)
    model = DemoModel().eval().requires_grad_(False)
    inputs = replace(demo_inputs(tmp_path, quick=True), model=model, scenes=heldout(2, 0))
    settings = StageSettings(train_images=4, steps=3, batch_size=2)
    output = run_demo_stage(inputs, progress=False, settings=settings)
    first = output.report
    assert first["parameters"] > 0 and first["spearman"]["count"] == 2
    assert -1 <= first["spearman"]["mean"] <= 1
    (trained,) = output.heads
    assert (trained.task, trained.layer) == ("cls", 2) and not trained.head.training
    F = torch.randn(1, 197, 192)
    from pullback_ext.metric.checkpoint import load_model

    saved, _ = load_model(tmp_path / "importance_head", kind="head")
    torch.testing.assert_close(trained.head(F), saved(F), rtol=0, atol=0)  # the head handed on is the one written
    config = json.loads((tmp_path / "importance_head" / "config.json").read_text())
    assert config["probe"] == {"model": "demo", "layer": 1, "decoder": "embedding"} and config["step"] == 3
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "importance_head" / "targets").glob("*.safetensors")}
    assert shards
    monkeypatch.setattr("pullback_ext.metric.tasks.HeadTask.loss", lambda *a, **k: pytest.fail("the head was retrained"))
    second = run_demo_stage(inputs, progress=False, settings=settings).report
    assert second["spearman"]["per_image"] == first["spearman"]["per_image"]
    assert shards == {p: p.stat().st_mtime_ns for p in (tmp_path / "importance_head" / "targets").glob("*.safetensors")}
