"""``--task segmentation``: the per-pixel KL and argmax-mIoU errors and the label mIoU against
hand-computed values, the one task table the commands read, and ``pullback evaluate`` (plain and
``--pareto``) on the demo with its segmentation head."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.errors import PullbackError


def _kl_by_hand(reduced: torch.Tensor, full: torch.Tensor) -> list[float]:
    """100 · mean over pixels of Σ_c p_c (log p_c − log q_c), one pixel and one class at a time."""
    out = []
    for b in range(full.shape[0]):
        total, count = 0.0, 0
        for i in range(full.shape[2]):
            for j in range(full.shape[3]):
                zp = [float(v) for v in full[b, :, i, j]]
                zq = [float(v) for v in reduced[b, :, i, j]]
                lp = [z - math.log(sum(math.exp(y) for y in zp)) for z in zp]
                lq = [z - math.log(sum(math.exp(y) for y in zq)) for z in zq]
                total += sum(math.exp(a) * (a - c) for a, c in zip(lp, lq))
                count += 1
        out.append(100.0 * total / count)
    return out


def _miou_by_hand(pred: np.ndarray, target: np.ndarray, num_classes: int) -> float:
    """Mean over classes present in either map of |pred = c ∧ target = c| / |pred = c ∨ target = c|."""
    ious = []
    for c in range(num_classes):
        union = np.logical_or(pred == c, target == c).sum()
        if union:
            ious.append(np.logical_and(pred == c, target == c).sum() / union)
    return float(np.mean(ious))


def test_segmentation_errors_and_label_miou_against_hand_loops():
    from pullback_ext.comparison.evaluation import label_miou, output_errors

    g = torch.Generator().manual_seed(0)
    full = {"segmentation": torch.randn(2, 4, 3, 5, generator=g), "embedding": torch.randn(2, 6, generator=g)}
    reduced = {"segmentation": full["segmentation"] + 0.7 * torch.randn(2, 4, 3, 5, generator=g),
               "embedding": torch.randn(2, 6, generator=g)}
    errors = output_errors("segmentation", reduced, full)
    assert list(errors) == ["pixel_kl_x100", "miou_gap_x100", "cosine_x100"]
    assert errors["pixel_kl_x100"].tolist() == pytest.approx(_kl_by_hand(reduced["segmentation"], full["segmentation"]), rel=1e-9)
    pred, ref = reduced["segmentation"].argmax(1).numpy(), full["segmentation"].argmax(1).numpy()
    gaps = [100.0 * (1.0 - _miou_by_hand(pred[b], ref[b], 4)) for b in range(2)]
    assert errors["miou_gap_x100"].tolist() == pytest.approx(gaps, rel=1e-12)
    assert 0 < min(gaps)  # the noise moves some argmax pixels
    classes = torch.randint(0, 4, (2, 3, 5), generator=g, dtype=torch.uint8)
    # the label mIoU: one confusion matrix over both images, not a mean of per-image values
    assert label_miou("segmentation", reduced, {"classes": classes}) == pytest.approx(_miou_by_hand(pred, classes.numpy(), 4))
    assert label_miou("segmentation", reduced, {}) is None and label_miou("depth", reduced, {"classes": classes}) is None
    assert output_errors("segmentation", full, full)["pixel_kl_x100"].tolist() == [0.0, 0.0]


def test_one_task_table_feeds_the_metrics_the_modes_and_the_options():
    from pullback_ext.commands.evaluate import add_arguments
    from pullback_ext.comparison.cost import FLOP_ACCOUNTING
    from pullback_ext.comparison.evaluation import ERRORS, METRICS, PRIMARY
    from pullback_ext.comparison.tasks import TASKS, get, resolve_mode

    assert list(METRICS) == list(PRIMARY) == list(TASKS) == ["cls", "depth", "segmentation"]
    assert PRIMARY == {"cls": "cosine_x100", "depth": "silog_x100", "segmentation": "pixel_kl_x100"}
    assert METRICS["segmentation"] == ("pixel_kl_x100", "miou_gap_x100", "cosine_x100")
    assert all(metric in ERRORS for metrics in METRICS.values() for metric in metrics)
    assert [resolve_mode("auto", t) for t in TASKS] == ["merge", "prune", "prune"]
    assert resolve_mode("merge", "segmentation") == "merge"
    assert "segmentation: the segmentation head" in FLOP_ACCOUNTING
    with pytest.raises(PullbackError, match="choose from cls, depth, segmentation"):
        get("panoptic")
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    task = next(a for a in parser._actions if a.dest == "task")
    assert tuple(task.choices) == tuple(TASKS)


def _seg_model():
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.embedded import load_segmentation_head
    from pullback_ext.sources.models import ModelSpec

    backbone, model = load_backbone(ModelSpec("demo"), task="segmentation")
    return backbone, model, load_segmentation_head(model=model)


def test_evaluate_segmentation_on_scenes(tmp_path, capsys):
    from pullback_ext.sources.scenes import SceneSource

    out = tmp_path / "out"
    argv = ["evaluate", "--model", "demo", "--task", "segmentation", "--strategies", "random", "--ratios", "0.3",
            "--num-images", "3", "--seeds", "2", "--no-timing", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["mode"] == "prune" and result["task"] == "segmentation"
    cell = result["tables"]["llf"]["random"]["0.3"]
    assert {"pixel_kl_x100", "miou_gap_x100", "cosine_x100", "label_miou", "knn_top1"} <= set(cell)
    assert cell["pixel_kl_x100"]["mean"] > 0 and len(cell["label_miou"]["per_seed"]) == 2
    # the unpruned model's label mIoU, recomputed: the model and its head on the same scenes
    backbone, model, head = _seg_model()
    by_seed = []
    for data in (s.load() for s in SceneSource().seed_sets(backbone.preprocess, 3, 2)):
        with torch.no_grad():
            pred = model.segment(data["images"], head).argmax(1).numpy()
        by_seed.append(_miou_by_hand(pred, data["classes"].numpy(), 11))
    assert result["label_miou_unpruned"] == pytest.approx(sum(by_seed) / 2, rel=1e-12)
    table = (out / "table.md").read_text()
    assert "**pixel_kl_x100**" in table and "**miou_gap_x100**" in table and "**label_miou**" in table


def test_evaluate_pareto_segmentation_on_scenes(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["evaluate", "--model", "demo", "--task", "segmentation", "--pareto", "--methods", "random,tome",
                 "--sweep", "tome:r=4", "--sweep", "tome:schedule=constant", "--ratios", "0.2,0.5", "--num-images", "3",
                 "--seeds", "1", "--no-timing", "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "pareto.json").read_text())
    assert result["metric"] == "pixel_kl_x100" and result["other_metrics"] == ["miou_gap_x100", "cosine_x100"]
    assert result["mode"] == "prune" and len(result["points"]) == 3
    assert "segmentation: the segmentation head" in result["flops"]
    for p in result["points"]:
        assert p["error"]["mean"] >= 0 and 0 <= p["other_errors"]["miou_gap_x100"]["mean"] <= 100
        assert 0 < p["label_miou"] <= 1 and p["other_errors"]["miou_gap_x100"]["worst_image_name"].startswith("heldout-scene-0-")
    assert 0 < result["label_miou_unpruned"] <= 1
    page = (out / "pareto.md").read_text()
    assert "pixel_kl_x100 at matched" in page and "miou_gap_x100 mean" in page and "label mIoU" in page
    # the FLOPs of the segmentation task: the backbone and its head, the other decoders not counted
    from pullback_ext.comparison.cost import count_flops

    _, model, head = _seg_model()
    x = torch.rand(1, 3, 112, 112)
    assert result["unpruned_cost"]["gflops_per_image"] == pytest.approx(count_flops(lambda i: model.segment(i, head), x) / 1e9)


def test_evaluate_pareto_segmentation_on_photos_has_no_label_miou(tmp_path, capsys):
    pytest.importorskip("skimage")
    out = tmp_path / "out"
    assert main(["evaluate", "--model", "demo", "--task", "segmentation", "--pareto", "--methods", "random", "--ratios", "0.3",
                 "--images", "builtin:photos", "--num-images", "2", "--seeds", "1", "--no-timing", "--out", str(out), "--quiet"]) == 0
    result = json.loads((out / "pareto.json").read_text())
    assert "label_miou_unpruned" not in result and "label_miou" not in result["points"][0]
    assert result["points"][0]["other_errors"]["miou_gap_x100"]["mean"] >= 0


@pytest.mark.parametrize("case", ["other_weights", "other_weights_pareto"])
def test_segmentation_bad_input_is_one_line(tmp_path, capsys, random_demo_model, case):
    from pullback_ext.embedded.weights_io import save_weights

    other = tmp_path / "other.safetensors"
    save_weights(random_demo_model(1), other)
    extra, names = {
        # the shipped head refuses a backbone it was not trained on
        "other_weights": (["--weights", str(other)], ["segmentation head was trained for demo weights"]),
        "other_weights_pareto": (["--weights", str(other), "--pareto", "--methods", "random"], ["segmentation head"]),
    }[case]
    argv = ["evaluate", "--model", "demo", "--task", "segmentation", "--num-images", "2", "--seeds", "1", "--no-timing",
            "--out", str(tmp_path / "out"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, err


@pytest.mark.parametrize("pareto", [False, True])
def test_segmentation_needs_the_demo(image_folder, tmp_path, capsys, pareto):
    argv = ["evaluate", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_folder()),
            "--task", "segmentation", "--num-images", "2", "--seeds", "1", "--no-timing", "--out", str(tmp_path / "out")]
    assert main(argv + (["--pareto", "--methods", "random"] if pareto else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--task segmentation needs a model with that decoder" in err and "supports cls" in err, err


def test_segmentation_probe_is_the_pooled_logits_map_of_the_head():
    from pullback_ext.embedded import heldout, load, load_segmentation_head
    from pullback_ext.embedded.probes import demo_probe

    model = load()
    head = load_segmentation_head(model=model)
    images = heldout(2, seed=3)["images"]
    with torch.no_grad():
        logits = model.segment(images, head)  # [2, 11, 112, 112]
    # by hand: the mean of each class's 28×28 blocks, class-major then row-major
    pooled = torch.tensor([[float(logits[b, c, 28 * i:28 * i + 28, 28 * j:28 * j + 28].double().mean())
                            for c in range(11) for i in range(4) for j in range(4)] for b in range(2)], dtype=torch.float64)
    for layer in (0, 4):  # block 1 is hooked: layer 0 reads it from F, layer 4 holds blocks 1 and 3 frozen
        probe = demo_probe(model, layer, "segmentation", output_size=4)
        assert probe.output_dim == 11 * 16
        features = probe.features(images)
        with torch.no_grad():
            y = probe.bind(features.context).outputs(features.F)
        assert y.shape == (2, 176)
        torch.testing.assert_close(y.double(), pooled, rtol=1e-4, atol=1e-4)
    with pytest.raises(PullbackError, match="segmentation_head: only read by decoder='segmentation'"):
        demo_probe(model, 2, "depth", segmentation_head=head)


def test_diagnose_segmentation(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["diagnose", "--model", "demo", "--layer", "2", "--task", "segmentation", "--output-size", "2", "--num-images", "1",
                 "--rank", "2", "--probes", "4", "--slq-steps", "0", "--out", str(out), "--quiet"]) == 0
    data = json.loads((out / "diagnosis.json").read_text())
    assert data["settings"]["decoder"] == "segmentation" and data["images"][0]["M"] == 11 * 4
    assert data["regime"] in ("i", "ii", "iii", "iv") and data["regime_name"]
    assert main(["diagnose", "--model", "timm:vit_tiny_patch16_224", "--images", "builtin:scenes", "--layer", "2",
                 "--task", "segmentation", "--num-images", "1", "--out", str(tmp_path / "timm")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "timm models offer cls, tokens, pooled" in err, err


def test_oracle_scores_the_segmentation_logits(tmp_path):
    from pullback_ext.commands.evaluate_plan import load_scorers

    backbone, model, _ = _seg_model()
    scorers, _ = load_scorers(None, None, model, backbone, (2,), "segmentation", True)
    probe = scorers["oracle"].probe
    assert probe.decoder == "segmentation" and probe.layer == 1 and probe.output_dim == 11 * 16 * 16


def test_train_head_on_the_segmentation_logits(tmp_path):
    out = tmp_path / "head"
    assert main(["train", "head", "--model", "demo", "--task", "segmentation", "--layer", "1", "--output-size", "2",
                 "--num-images", "2", "--heldout", "1", "--steps", "2", "--batch-size", "2", "--rank", "2", "--mlp-hidden", "8",
                 "--hidden", "8", "--heads", "2", "--out", str(out), "--quiet"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["probe"]["decoder"] == "segmentation" and config["probe"]["layer"] == 1
    # the head scores the segmentation task's reduction
    run = tmp_path / "run"
    assert main(["evaluate", "--model", "demo", "--task", "segmentation", "--head", str(out), "--strategies", "importance",
                 "--layers", "2", "--ratios", "0.3", "--num-images", "2", "--seeds", "1", "--no-timing", "--out", str(run),
                 "--quiet"]) == 0
    assert json.loads((run / "results.json").read_text())["tables"]["llf"]["importance"]["0.3"]["pixel_kl_x100"]["mean"] > 0
