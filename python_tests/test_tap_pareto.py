"""TAP rows in ``pullback evaluate --pareto``: one labelled row per checkpoint swept over ρ, the η
values of the exact budget, FLOPs falling with η, TAP-J run on its adapted backbone, and the
unpruned (ρ = 1) drop reported beside the pruned rows."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from pullback_ext.cli import build_parser, main
from pullback_ext.commands.evaluate_pareto import TAP_RHOS, tap_points
from pullback_ext.errors import PullbackError
from pullback_ext.metric.training import TrainConfig
from pullback_ext.prune import row_rules
from pullback_ext.comparison import pareto
from pullback_ext.comparison.backbones import demo_backbone
from pullback_ext.tap_training.training import TapConfig, train

N = 196  # the demo model's patch tokens


def demo():
    """The demo model with its shipped weights, as ``--model demo`` loads it."""
    from pullback_ext.sources.models import load_model, parse_model

    return load_model(parse_model("demo"), headless=True)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few steps of TAP-F cls, TAP-J cls and TAP-F depth on the demo model: ``{name: folder}``."""
    model, root = demo(), tmp_path_factory.mktemp("taps")
    images = torch.rand(4, 3, model.image_size, model.image_size, generator=torch.Generator().manual_seed(1))
    folders = {}
    for name, task, adapt in (("tapf", "cls", False), ("tapj", "cls", True), ("tapd", "depth", False)):
        config = TapConfig(task, TrainConfig(steps=2, batch_size=2, lr=1e-2, seed=3, checkpoint_every=2, log_every=1), adapt=adapt)
        train(model, images, config, root / name, progress=False)
        folders[name] = root / name
    return folders


def scenes(count: int) -> torch.Tensor:
    """The images ``evaluate --images builtin:scenes --num-images count --seeds 1`` runs on."""
    from pullback_ext.sources.images import open_images
    from pullback_ext.sources.preprocess import unit_range_preprocess

    return open_images("builtin:scenes", "--images").seed_sets(unit_range_preprocess(112), count, 1)[0].load()["images"]


def pareto_run(tmp_path, *flags) -> dict:
    out = tmp_path / "pareto"
    code = main(["evaluate", "--model", "demo", "--images", "builtin:scenes", "--pareto", "--methods", "random", "--ratios", "0.5",
                 "--num-images", "3", "--seeds", "1", "--no-timing", "--quiet", "--out", str(out), *flags])
    assert code == 0
    return json.loads((out / "pareto.json").read_text())


def mean_error(model, register, images, rho: float) -> float:
    """The mean 100·(1 − cos) written out by hand (helpers.tap), not the code the command calls."""
    from helpers.tap import cls_distortion_x100

    return cls_distortion_x100(model, register, images, rho)


def test_each_checkpoint_gets_a_labelled_row_over_rho_and_its_unpruned_drop(tmp_path, trained):
    from pullback_ext.tap.checkpoint import load_register

    result = pareto_run(tmp_path, "--tap", f"{trained['tapf']},{trained['tapj']}")
    rows = {"TAP-F [tapf]": [], "TAP-J (LoRA rank 4) [tapj]": []}
    for name in rows:
        pruned = [r for r in result["rows"] if r.startswith(name) and "lowest task-register score" in r]
        alone = [r for r in result["rows"] if r.startswith(name) and "nothing removed (ρ = 1)" in r]
        assert len(pruned) == 1 and len(alone) == 1 and "removed tokens dropped" in pruned[0]
        rows[name] = [p for p in result["points"] if p["row"] == pruned[0]] + [p for p in result["points"] if p["row"] == alone[0]]
    unpruned_gflops = result["unpruned_cost"]["gflops_per_image"]
    for points in rows.values():
        assert [p["knob"]["rho"] for p in points] == [*TAP_RHOS, 1.0]
        for p in points:  # η of the exact budget: floor(ρN + 0.5) patch tokens kept
            assert p["eta"] == pytest.approx(1 - math.floor(p["knob"]["rho"] * N + 0.5) / N, abs=1e-12)
            assert p["options"]["strategy"] == "tap" and p["options"]["ratio"] == pytest.approx(1 - p["knob"]["rho"])
        gflops = [p["cost"]["gflops_per_image"] for p in points]  # ρ = 0.9 .. 0.3, then 1
        assert all(a > b for a, b in zip(gflops[:-1], gflops[1:-1])) and gflops[-1] > gflops[0]  # fewer FLOPs as η grows
        assert gflops[-1] > unpruned_gflops  # ρ = 1: the register is one token more than the unpruned model
    model, images = demo(), scenes(3)
    tapj = load_register(trained["tapj"])
    unpruned_j, half_j = rows["TAP-J (LoRA rank 4) [tapj]"][-1], rows["TAP-J (LoRA rank 4) [tapj]"][TAP_RHOS.index(0.5)]
    assert unpruned_j["error"]["mean"] == pytest.approx(mean_error(model, tapj, images, 1.0), rel=1e-4, abs=1e-5)
    assert half_j["error"]["mean"] == pytest.approx(mean_error(model, tapj, images, 0.5), rel=1e-4, abs=1e-5)
    frozen = copy.deepcopy(tapj)
    for b in frozen.lora_b.values():
        b.data.zero_()
    assert unpruned_j["error"]["mean"] > 0 and abs(half_j["error"]["mean"] - mean_error(model, frozen, images, 0.5)) > 1e-6
    assert any("random" in r for r in result["rows"])  # beside the other methods


def test_depth_register_row_and_a_swept_rho(tmp_path, trained):
    result = pareto_run(tmp_path, "--task", "depth", "--tap", str(trained["tapd"]), "--sweep", "tap:ratio=0.25,0.6")
    tap = [p for p in result["points"] if p["options"]["strategy"] == "tap"]
    assert [p["knob"]["rho"] for p in tap] == [0.75, 0.4, 1.0]
    assert "masked LLF" in tap[0]["row"] and tap[0]["row"].startswith("TAP-F [tapd] · lowest task-register score")
    assert tap[1]["eta"] == pytest.approx(1 - math.floor(0.4 * N + 0.5) / N)
    assert tap[1]["cost"]["gflops_per_image"] < tap[0]["cost"]["gflops_per_image"] < tap[2]["cost"]["gflops_per_image"]
    assert all(p["error"]["mean"] > 0 for p in tap)


def test_describe_names_tap_by_its_variant_and_rules(trained):
    from pullback_ext.prune.reduction_options import ReductionOptions
    from pullback_ext.tap.checkpoint import load_register

    backbone = demo_backbone(demo())
    for name, method in (("tapf", "TAP-F"), ("tapj", "TAP-J (LoRA rank 4)")):
        register = load_register(trained[name])
        described = row_rules.describe(pareto.resolve(ReductionOptions(strategy="tap", head=register, ratio=0.5), backbone))
        assert described == {"method": method, "selection": "lowest task-register score; exact budget, split over block inputs "
                             "1–7 by the register's read-out (per batch)", "averaging": "pruned, removed tokens dropped"}
        point = tap_points([(name, register)], (0.5,))[0]
        assert point.row == row_rules.row_label(pareto.resolve(point.options, backbone)).replace(method, f"{method} [{name}]", 1)


def test_tap_flag_parses_and_bad_uses_are_refused(tmp_path, trained, capsys):
    args = build_parser().parse_args(["evaluate", "--model", "demo", "--pareto", "--tap", "a,b", "--out", "x"])
    assert args.tap == "a,b"
    assert build_parser().parse_args(["evaluate", "--model", "demo", "--out", "x"]).tap is None
    base = ["evaluate", "--model", "demo", "--num-images", "2", "--seeds", "1", "--no-timing", "--quiet", "--out", str(tmp_path / "o")]
    cases = [(["--tap", str(trained["tapf"])], "--tap needs --pareto"),
             (["--pareto", "--task", "depth", "--tap", str(trained["tapf"])], "serves task 'cls', but --task is 'depth'"),
             (["--pareto", "--methods", "tap"], "give their folders with --tap"),
             (["--pareto", "--methods", "random", "--sweep", "tap:ratio=0.5"], "needs --tap DIR"),
             (["--pareto", "--methods", "random", "--tap", str(trained["tapf"]), "--sweep", "tap:r=2"], "only ratio"),
             (["--pareto", "--methods", "random", "--tap", str(tmp_path / "missing")], "missing")]
    for flags, message in cases:
        assert main(base + flags) == 2, flags
        assert message in capsys.readouterr().err, flags
    from pullback_ext.commands.evaluate_pareto import load_taps

    with pytest.raises(PullbackError, match="--tap: expected TAP checkpoint folders"):
        load_taps(" , ", demo_backbone(demo()), demo(), "cls")
    import shutil

    twins = [shutil.copytree(trained["tapf"], tmp_path / side / "tapf") for side in ("a", "b")]
    model = demo()
    assert [name for name, _ in load_taps(f"{twins[0]},{twins[1]}", demo_backbone(model), model, "cls")] == [str(t) for t in twins]
    assert [name for name, _ in load_taps(f"{twins[0]},{trained['tapj']}", demo_backbone(model), model, "cls")] == ["tapf", "tapj"]
