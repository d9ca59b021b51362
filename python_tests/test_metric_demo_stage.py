"""The importance-head stage of ``pullback demo`` on the demo architecture (tiny settings), and
the heads the package ships for it."""

import json
from dataclasses import asdict, replace

import pytest
import torch

from pullback_ext.demo import importance_stage
from pullback_ext.demo.importance_stage import SETTINGS, HeadSettings, run_demo_stage


def test_stage_trains_then_reuses_its_checkpoint(tmp_path, monkeypatch):
    from pullback_ext.demo.pipeline import demo_inputs
    from pullback_ext.embedded import heldout
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.metric.checkpoint import load_model

    torch.manual_seed(0)
    model = DemoModel().eval().requires_grad_(False)  # random weights: no shipped head fits them
    inputs = replace(demo_inputs(tmp_path, quick=True), model=model, scenes=heldout(2, 0))
    settings = {"cls": HeadSettings("embedding", None, "exact", train_images=4, steps=3, batch_size=2)}
    output = run_demo_stage(inputs, progress=False, settings=settings)
    first = output.report["cls"]
    assert first["origin"] == "trained" and first["parameters"] > 0 and first["spearman"]["count"] == 2
    assert -1 <= first["spearman"]["mean"] <= 1
    (trained,) = output.heads
    assert (trained.task, trained.layer) == ("cls", 2) and not trained.head.training
    F = torch.randn(1, 197, 192)
    saved, _ = load_model(tmp_path / "importance_head" / "cls", kind="head")
    torch.testing.assert_close(trained.head(F), saved(F), rtol=0, atol=0)  # the head handed on is the one written
    config = json.loads((tmp_path / "importance_head" / "cls" / "config.json").read_text())
    assert config["probe"] == {"model": "demo", "layer": 1, "decoder": "embedding"} and config["step"] == 3
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "importance_head" / "cls" / "targets").glob("*.safetensors")}
    assert shards
    monkeypatch.setattr("pullback_ext.metric.tasks.HeadTask.loss", lambda *a, **k: pytest.fail("the head was retrained"))
    second = run_demo_stage(inputs, progress=False, settings=settings).report["cls"]
    assert second["spearman"]["per_image"] == first["spearman"]["per_image"]
    assert shards == {p: p.stat().st_mtime_ns for p in (tmp_path / "importance_head" / "cls" / "targets").glob("*.safetensors")}


def test_the_shipped_heads_fit_the_shipped_model_and_reproduce_their_recorded_rho(tmp_path, monkeypatch):
    """The demo loads the shipped heads (trained by ``python -m pullback_ext.demo.ship_heads``)
    instead of training: each fits the stage's settings and the shipped weights, and its held-out
    ρ, recomputed here on the first two held-out scenes, is the one recorded when it was made."""
    from pullback_ext.demo.pipeline import demo_inputs

    inputs = demo_inputs(tmp_path, quick=False)
    model, scenes = inputs.model, inputs.scenes["images"][:2]
    record = json.loads((importance_stage.SHIPPED_DIR / importance_stage.RECORD).read_text())
    assert set(record) == set(SETTINGS)
    monkeypatch.setattr("pullback_ext.metric.tasks.HeadTask.loss", lambda *a, **k: pytest.fail("a head was trained"))
    for task, settings in SETTINGS.items():
        assert record[task]["settings"] == asdict(settings) and record[task]["command"].startswith("python -m pullback_ext.demo.ship_heads")
        head = importance_stage.shipped_head(model, task, settings)
        assert head is not None, f"the shipped {task} head does not fit the shipped model"
        rho = importance_stage.heldout_rho(model, head, settings, scenes)
        assert rho["per_image"] == pytest.approx(record[task]["heldout_spearman_per_image"][:2], abs=0.02)
    assert record["cls"]["heldout_spearman"] > 0.8  # the CLS head ranks the tokens as imp* does
    assert importance_stage.shipped_head(model, "cls", replace(SETTINGS["cls"], steps=1)) is None  # other settings: trained
