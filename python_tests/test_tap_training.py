"""TAP training: the frozen backbone stays bit-identical, a killed run resumes exactly, DDP equals one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.metric import Killed, kill_at
from pullback_ext.metric import checkpoint
from pullback_ext.metric.training import TrainConfig
from pullback_ext.tap.checkpoint import load_register
from pullback_ext.tap_training.training import TapConfig, train

ROOT = Path(__file__).resolve().parents[1]


def demo_and_images():
    from pullback_ext.embedded.model import DemoModel

    torch.manual_seed(0)
    return DemoModel().eval(), torch.rand(4, 3, 112, 112)


def settings(task: str = "cls", adapt: bool = False, steps: int = 3) -> TapConfig:
    return TapConfig(task, TrainConfig(steps=steps, batch_size=2, lr=1e-2, seed=3, checkpoint_every=1, log_every=1), adapt=adapt,
                     layers=(2, 4), rho_range=(0.4, 0.7))


@pytest.mark.parametrize("task, adapt", [("cls", False), ("depth", False), ("cls", True)])
def test_training_leaves_the_frozen_backbone_bit_identical(tmp_path, task, adapt):
    model, images = demo_and_images()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    register = train(model, images, settings(task, adapt, steps=2), tmp_path, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    trained = dict(register.named_parameters())
    moved = [k for k, v in trained.items() if k.startswith("lora_b")]
    assert (not adapt) == (not moved) and all(trained[k].abs().sum() > 0 for k in moved)  # TAP-J's adapters did train
    stored = checkpoint.read_config(tmp_path)
    assert stored["kind"] == "tap" and stored["tap"]["variant"] == ("TAP-J" if adapt else "TAP-F")


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    model, images = demo_and_images()
    full = train(model, images, settings(steps=4), tmp_path / "full", progress=False)
    with pytest.raises(Killed):
        train(model, images, settings(steps=4), tmp_path / "cut", progress=False, on_step=kill_at(3))
    resumed = train(model, images, settings(steps=4), tmp_path / "cut", resume=True, progress=False)
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


WORKER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from pullback_ext import distributed
    from test_tap_training import demo_and_images, settings
    from pullback_ext.tap_training.training import train
    info = distributed.init_from_env("gloo")
    try:
        model, images = demo_and_images()
        train(model.double(), images.double(), settings("depth", steps=2), sys.argv[1], progress=False)
    finally:
        distributed.shutdown(info)
    distributed.leave(0)
    """
)


@pytest.mark.distributed
def test_two_process_ddp_matches_single_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "python_tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, images = demo_and_images()
    single = train(model.double(), images.double(), settings("depth", steps=2), tmp_path / "single", progress=False)
    ddp = load_register(tmp_path / "ddp")
    for (name, a), (_, b) in zip(single.state_dict().items(), ddp.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-9), name
    losses = lambda d: [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-9)


def test_train_tap_command_reports_on_the_eval_images(tmp_path):
    """The held-out rows equal the distortion written out by hand (helpers.tap) on the --eval-images."""
    from helpers.tap import cls_distortion_x100
    from pullback_ext.cli import main
    from pullback_ext.sources.images import open_images
    from pullback_ext.sources.models import load_model, parse_model
    from pullback_ext.sources.preprocess import unit_range_preprocess

    out = tmp_path / "tap"
    assert main(["train", "tap", "--model", "demo", "--images", "builtin:scenes", "--eval-images", "builtin:photos", "--num-images", "2",
                 "--heldout", "2", "--steps", "1", "--batch-size", "2", "--quiet", "--out", str(out)]) == 0
    reported = json.loads((out / "results.json").read_text())["heldout"]
    model = load_model(parse_model("demo"), headless=True)[0]
    photos = open_images("builtin:photos", "--eval-images").heldout(unit_range_preprocess(model.image_size), 2).load()["images"]
    expected = [cls_distortion_x100(model, load_register(out), photos, row["rho"]) for row in reported]
    assert [row["value"] for row in reported] == pytest.approx(expected, rel=1e-5, abs=1e-5)  # float32 cosines
    assert all(value > 0 for rho, value in zip((row["rho"] for row in reported), expected) if rho < 1)  # tokens removed
