"""``pullback study``: the sweep engine (units, resume, layer lists) and the three kinds against
the single-layer commands they sweep (diagnose, subprobe, evaluate) and the subspace closed form."""

from __future__ import annotations

import json

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.errors import PullbackError
from pullback_ext.studies.engine import UnitStore, run_sweep
from pullback_ext.studies.layers import parse_layers
from pullback_ext.studies.subspace_study import power_ks, probe_curves


# ---- layers -------------------------------------------------------------------------------------

def test_layer_lists():
    assert parse_layers("all", 0, 3) == (0, 1, 2, 3)
    assert parse_layers("3, 1", 0, 7) == (1, 3)


@pytest.mark.parametrize("text, why", [("8", "out of range"), ("-1", "out of range"), ("", "empty"), ("1,1", "twice"),
                                       ("a", "integers")])
def test_bad_layer_lists_name_the_valid_range(text, why):
    with pytest.raises(PullbackError, match=f"{why}.*valid layers are 0..7"):
        parse_layers(text, 0, 7)


@pytest.mark.parametrize("layers", ["8", "", "2,2"])
def test_bad_layers_on_the_command_line_is_one_line_and_exit_2(layers, tmp_path, capsys):
    argv = ["study", "subspace", "--model", "demo", "--layers", layers, "--num-images", "2", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--layers" in err and "0..7" in err, err


# ---- engine -------------------------------------------------------------------------------------

class Counting:
    """A measurement that records every (layer, items) call and can fail after some layer."""

    def __init__(self, fail_after=None):
        self.calls, self.fail_after = [], fail_after

    def measure(self, layer, items):
        if self.fail_after is not None and layer > self.fail_after:
            raise RuntimeError("killed")
        self.calls.append(layer)
        return [layer * 10 + i for i in items]

    @staticmethod
    def finish(layer, records):
        return {"layer": layer, "records": records}


def test_a_killed_sweep_resumes_without_recomputing_finished_layers(tmp_path):
    store = UnitStore(tmp_path, "toy", {"a": 1})
    first = Counting(fail_after=2)
    with pytest.raises(RuntimeError, match="killed"):
        run_sweep(store, [0, 1, 2, 3, 4], [0, 1, 2], first.measure, first.finish, progress=False)
    assert first.calls == [0, 1, 2]
    assert [p.name for p in store.existing()] == ["layer-00.json", "layer-01.json", "layer-02.json"]
    with pytest.raises(PullbackError, match="--resume"):
        run_sweep(store, [0, 1, 2, 3, 4], [0, 1, 2], first.measure, first.finish, progress=False)
    second = Counting()
    units = run_sweep(store, [0, 1, 2, 3, 4], [0, 1, 2], second.measure, second.finish, resume=True, progress=False)
    assert second.calls == [3, 4]
    assert units == {layer: {"layer": layer, "records": [layer * 10 + i for i in range(3)]} for layer in range(5)}
    assert not list(tmp_path.glob("layers/.*tmp*"))  # atomic writes leave no temporary files


def test_resume_refuses_units_of_other_settings(tmp_path):
    toy = Counting()
    run_sweep(UnitStore(tmp_path, "toy", {"a": 1}), [0], [0], toy.measure, toy.finish, progress=False)
    with pytest.raises(PullbackError, match=r"settings differing in \['a'\]"):
        run_sweep(UnitStore(tmp_path, "toy", {"a": 2}), [0, 1], [0], toy.measure, toy.finish, resume=True, progress=False)


# ---- subspace closed form -----------------------------------------------------------------------

def _white(n: int, d: int, seed: int) -> torch.Tensor:
    """n × d features, centred, with sample covariance exactly I (x = sqrt(n)·Q of a centred QR)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    q = torch.linalg.qr(x - x.mean(0)).Q
    return q * n ** 0.5


@pytest.mark.parametrize("with_targets", [False, True])
def test_subspace_curve_of_a_linear_probe_on_white_features_is_its_closed_form(with_targets):
    """For centred white features the quality of a projector P is ‖W P‖²_F / ‖W‖²_F: on the top-k
    subspace Σ_{j≤k} σ_j² / Σ σ_j², on its complement one minus that."""
    import numpy as np

    d, c, images, tokens = 12, 5, 4, 50
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(c, d, generator=g, dtype=torch.float64) * torch.tensor([4.0, 2.0, 1.0, 0.5, 0.1])[:, None]
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    x = _white(images * tokens, d, 2)
    targets = (x @ weight.T + bias).reshape(images, tokens, c) if with_targets else None
    out = probe_curves(x.reshape(images, tokens, d), weight, bias, targets)
    sigma = np.linalg.svd(weight.numpy(), compute_uv=False)
    share = np.cumsum(sigma**2) / np.sum(sigma**2)
    assert out["ks"] == [1, 2, 4, 5] and out["rank"] == 5
    expected = share[[k - 1 for k in out["ks"]]]
    np.testing.assert_allclose(out["curves"]["subspace"], expected, atol=1e-10)
    np.testing.assert_allclose(out["curves"]["complement"], 1 - expected, atol=1e-10)
    np.testing.assert_allclose(out["curves"]["random"], [r["energy"] for r in out["interventions"]["random"]], atol=1e-10)
    assert out["quality"] == pytest.approx(1.0)
    assert out["k95"] == next(k for k, q in zip(out["ks"], expected) if q >= 0.95)


def test_power_ks():
    assert power_ks(1) == (1,) and power_ks(4) == (1, 2, 4) and power_ks(6) == (1, 2, 4, 6)


# ---- the sweeps equal the single-layer commands -------------------------------------------------

def _run(argv):
    assert main([str(a) for a in argv]) == 0


def test_study_diagnose_equals_diagnose_at_each_layer(tmp_path):
    common = ["--model", "demo", "--num-images", "2", "--output-size", "4", "--probes", "4", "--slq-steps", "0"]
    _run(["study", "diagnose", *common, "--layers", "1,4", "--decoders", "cls,depth", "--out", tmp_path / "study", "--quiet"])
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    for layer in (1, 4):
        for decoder in ("cls", "depth"):
            _run(["diagnose", *common, "--layer", layer, "--decoder", decoder, "--out", tmp_path / f"d{layer}{decoder}"])
            single = json.loads((tmp_path / f"d{layer}{decoder}" / "diagnosis.json").read_text())
            swept = study["units"][str(layer)][decoder]
            assert swept["regime"] == single["regime"]
            for name, value in single["aggregate"].items():
                assert f"{swept['aggregate'][name]['mean']:.3f}" == f"{value['mean']:.3f}", (layer, decoder, name)


def test_study_subspace_equals_subprobe_at_each_layer(tmp_path):
    _run(["study", "subspace", "--model", "demo", "--num-images", "3", "--layers", "2,5", "--out", tmp_path / "study", "--quiet"])
    study = json.loads((tmp_path / "study" / "study.json").read_text())["models"]["demo"]
    for layer in (2, 5):
        _run(["subprobe", "--model", "demo", "--probe", "fit", "--num-images", "3", "--layer", layer, "--k", "1,2,4",
              "--out", tmp_path / f"p{layer}"])
        single = json.loads((tmp_path / f"p{layer}" / "subspace.json").read_text())["results"]
        swept = study["units"][str(layer)]["interventions"]
        for kind, rows in single.items():
            for a, b in zip(rows, swept[kind]):
                assert a["k"] == b["k"] and f"{a['rmse']:.4f}" == f"{b['rmse']:.4f}"
                assert f"{a['output_change']:.4f}" == f"{b['output_change']:.4f}"


def test_class_probe_targets_are_each_patchs_class_fractions():
    from pullback_ext.studies.subspace import class_probe_targets

    classes = torch.randint(0, 5, (2, 6, 9), generator=torch.Generator().manual_seed(0))[:, :6, :6]
    targets = class_probe_targets(classes, 3, 5)
    assert targets.shape == (2, 9, 5) and targets.dtype == torch.float64
    for b in range(2):
        for i in range(3):
            for j in range(3):
                patch = classes[b, 2 * i:2 * i + 2, 2 * j:2 * j + 2].flatten().tolist()
                assert targets[b, 3 * i + j].tolist() == [patch.count(c) / 4 for c in range(5)]
    with pytest.raises(PullbackError, match="multiples of the 4-patch grid"):
        class_probe_targets(classes, 4, 5)


def test_study_subspace_fits_a_segmentation_probe_beside_the_depth_probe(tmp_path):
    """The depth probe's sweep is unchanged beside it; the segmentation probe's quality equals R²
    recomputed in numpy: its own ridge fit of patch class fractions on the 128 rendered training
    scenes, judged on the study's scenes."""
    import argparse

    import numpy as np

    from pullback_ext.commands.arguments import image_source
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.embedded.scenes import render
    from pullback_ext.sources.models import ModelSpec

    common = ["study", "subspace", "--model", "demo", "--num-images", "3", "--layers", "2", "--quiet"]
    _run([*common, "--fitted-probes", "depth,segmentation", "--out", tmp_path / "both"])
    _run([*common, "--out", tmp_path / "depth"])
    both, depth = (json.loads((tmp_path / run / "study.json").read_text())["models"] for run in ("both", "depth"))
    assert list(both) == ["demo", "demo (segmentation probe)"] and both["demo"]["units"] == depth["demo"]["units"]
    seg = both["demo (segmentation probe)"]
    unit = seg["units"]["2"]
    assert seg["quality_name"] == "R² vs class fractions" and seg["probe"] == "segmentation"
    assert unit["rank"] <= 10 and unit["ks"] == list(power_ks(unit["rank"]))  # 11 fractions summing to one

    def fractions(classes):  # [n, 112, 112] -> [n, 196, 11]: 8×8-pixel patches, row-major
        c = classes.numpy().astype(np.int64).reshape(-1, 14, 8, 14, 8).transpose(0, 1, 3, 2, 4).reshape(-1, 196, 64)
        return np.stack([(c == k).mean(axis=2) for k in range(11)], axis=2)

    backbone, _ = load_backbone(ModelSpec("demo"))
    train = render(128, seed=12345, classes=True)
    test = image_source(argparse.Namespace(images=None, num_images=3), ModelSpec("demo")).heldout(backbone.preprocess, 3, partial=True).load()
    with torch.no_grad():
        x, x_test = (backbone.block_tokens(images, 2).double().numpy().reshape(-1, backbone.features_dim) for images in (train["images"], test["images"]))
    y, y_test = fractions(train["classes"]).reshape(-1, 11), fractions(test["classes"]).reshape(-1, 11)
    xc, yc = x - x.mean(0), y - y.mean(0)
    gram = xc.T @ xc
    w = np.linalg.solve(gram + 1e-3 * np.diag(gram).mean() * np.eye(len(gram)), xc.T @ yc)
    predicted = (x_test - x.mean(0)) @ w + y.mean(0)
    r2 = 1 - np.square(predicted - y_test).mean() / np.square(y_test - y_test.mean(0)).mean()
    assert unit["quality"] == pytest.approx(r2, rel=1e-4) and r2 > 0


@pytest.mark.parametrize("extra, why", [(["--fitted-probes", "normals"], "--fitted-probes: expected a comma list of depth, segmentation"),
                                        (["--fitted-probes", "segmentation", "--probe-targets", "t.npy"],
                                         "--fitted-probes: .*give one of the two")])
def test_study_subspace_refuses_bad_probes_in_one_line(extra, why, tmp_path, capsys):
    import re

    assert main(["study", "subspace", "--model", "demo", "--layers", "0", "--num-images", "2", *extra, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(why, err), err


def test_study_criteria_equals_evaluate_at_each_layer(tmp_path):
    criteria = "random,norm,evit_score"
    _run(["study", "criteria", "--model", "demo", "--num-images", "4", "--layers", "0,3", "--criteria", criteria, "--tasks", "depth",
          "--alphas", "0,1", "--batch-size", "2", "--out", tmp_path / "study", "--quiet"])
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    for layer in (0, 3):
        _run(["evaluate", "--model", "demo", "--num-images", "4", "--task", "depth", "--layers", layer + 1,
              "--ratios", "0.3", "--strategies", criteria, "--seeds", "1", "--batch-size", "2", "--no-timing", "--quiet",
              "--out", tmp_path / f"e{layer}"])
        single = json.loads((tmp_path / f"e{layer}" / "results.json").read_text())["tables"]["llf"]
        unit = study["units"][str(layer)]
        for c in criteria.split(","):
            for metric in ("silog_x100", "cosine_x100"):
                assert f"{unit['tasks']['depth'][c][metric]['mean']:.3f}" == f"{single[c]['0.3'][metric]['mean']:.3f}"
            # α = 1 re-inserts the frozen copy: the prune path itself
            assert unit["recovery"]["depth"][c]["1"]["silog_x100"]["images"] == unit["tasks"]["depth"][c]["silog_x100"]["images"]
    assert set(study["summary"]["recovery"]["depth"]["criteria"]["norm"]["mean"]) == {"0", "1"}


def _kl_by_hand(reduced: torch.Tensor, full: torch.Tensor) -> list[float]:
    """100 · mean over pixels of Σ_c p_c (log p_c − log q_c) of logits [B, C, H, W], in Python floats."""
    import math

    out = []
    for b in range(full.shape[0]):
        p_logits, q_logits = full[b].double().flatten(1).T.tolist(), reduced[b].double().flatten(1).T.tolist()
        total = 0.0
        for zp, zq in zip(p_logits, q_logits):
            lp = [z - math.log(sum(math.exp(y) for y in zp)) for z in zp]
            lq = [z - math.log(sum(math.exp(y) for y in zq)) for z in zq]
            total += sum(math.exp(a) * (a - c) for a, c in zip(lp, lq))
        out.append(100.0 * total / len(p_logits))
    return out


def test_study_criteria_over_segmentation_equals_evaluate_and_a_hand_kl(tmp_path):
    """The segmentation cells are evaluate's at that stage; the depth cells those of a depth-only
    study (the two dense tasks read one prune forward); α = 1 is the prune path; the per-pixel KL
    equals a float64 loop over the model's own unreduced logits and the reduced ones."""
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.embedded import load_segmentation_head
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
    from pullback_ext.sources.models import ModelSpec
    from pullback_ext.sources.scenes import SceneSource

    common = ["study", "criteria", "--model", "demo", "--num-images", "2", "--layers", "0", "--criteria", "random,norm",
              "--alphas", "0,1", "--batch-size", "2", "--quiet"]
    _run([*common, "--tasks", "cls,depth,segmentation", "--out", tmp_path / "three"])
    _run([*common, "--tasks", "depth", "--out", tmp_path / "depth"])
    three, depth = (json.loads((tmp_path / run / "study.json").read_text()) for run in ("three", "depth"))
    assert three["tasks"] == ["cls", "depth", "segmentation"] and set(three["summary"]["recovery"]) == {"depth", "segmentation"}
    unit = three["units"]["0"]
    _run(["evaluate", "--model", "demo", "--num-images", "2", "--task", "segmentation", "--layers", "1", "--ratios", "0.3",
          "--strategies", "random,norm", "--seeds", "1", "--batch-size", "2", "--no-timing", "--quiet", "--out", tmp_path / "e"])
    single = json.loads((tmp_path / "e" / "results.json").read_text())["tables"]["llf"]
    for c in ("random", "norm"):
        for metric in ("pixel_kl_x100", "miou_gap_x100", "cosine_x100"):
            assert f"{unit['tasks']['segmentation'][c][metric]['mean']:.4f}" == f"{single[c]['0.3'][metric]['mean']:.4f}"
        assert unit["tasks"]["depth"][c] == depth["units"]["0"]["tasks"]["depth"][c]
        assert unit["recovery"]["segmentation"][c]["1"] == unit["tasks"]["segmentation"][c]
        assert unit["tasks"]["segmentation"][c]["pixel_kl_x100"]["mean"] > 0
    backbone, model = load_backbone(ModelSpec("demo"), task="segmentation")
    images = SceneSource().seed_sets(backbone.preprocess, 2, 1)[0].load()["images"]
    options = ReductionOptions(ratio=0.3, layers=(1,), mode="prune", strategy="norm", llf=True)
    reduction = options.resolve(BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls))
    with torch.no_grad():
        full = model.segment(images, load_segmentation_head(model=model))
        reduced = backbone.reduced(reduction, images)["segmentation"]
    assert unit["tasks"]["segmentation"]["norm"]["pixel_kl_x100"]["images"] == pytest.approx(_kl_by_hand(reduced, full), rel=1e-6)


@pytest.mark.parametrize("tasks, model, why", [("cls,panoptic", "demo", "unknown task 'panoptic'.*choose from cls, depth, segmentation"),
                                               (",", "demo", "no task named"),
                                               ("segmentation", "demo:random", "'segmentation' needs a model with that decoder; "
                                                                               "demo:random supports cls, depth")])
def test_study_criteria_refuses_a_task_it_cannot_run_in_one_line(tasks, model, why, tmp_path, capsys):
    import re

    argv = ["study", "criteria", "--model", model, "--tasks", tasks, "--layers", "0", "--num-images", "2", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.count("--tasks") == 1 and re.search(why, err), err


def _units(errors: dict, alphas: dict) -> dict:
    """Study units from ``{task: {criterion: [error per layer]}}`` and ``{task: {criterion: {α: error}}}``."""
    from pullback_ext.comparison.evaluation import PRIMARY

    layers = len(next(iter(next(iter(errors.values())).values())))
    return {str(layer): {"stage": layer + 1,
                         "tasks": {t: {c: {PRIMARY[t]: {"mean": row[layer]}} for c, row in by_c.items()} for t, by_c in errors.items()},
                         "recovery": {t: {c: {a: {PRIMARY[t]: {"mean": v}} for a, v in by_a.items()} for c, by_a in by_c.items()}
                                      for t, by_c in alphas.items()}}
            for layer in range(layers)}


def test_criteria_summary_reads_seed_003s_findings_off_the_errors():
    """Rankings, per-layer τ and the three findings on errors whose answers are known by construction."""
    from scipy.stats import kendalltau

    from pullback_ext.studies.criteria_study import summary
    from pullback_ext.studies.pages import render

    criteria = ["random", "evit_score", "norm", "cls_sim"]
    errors = {"cls": {"random": [1, 1, 1, 1], "evit_score": [9, 5, 1, 1], "norm": [2, 2, 2, 2], "cls_sim": [3, 3, 3, 3]},
              "depth": {"random": [1, 1, 1, 1], "evit_score": [2, 2, 2, 2], "norm": [3, 3, 3, 3], "cls_sim": [4, 4, 4, 4]},
              "segmentation": {"random": [4, 4, 4, 4], "evit_score": [3, 3, 3, 3], "norm": [2, 2, 2, 2], "cls_sim": [1, 1, 1, 1]}}
    alphas = {"depth": {c: {"0": 2.0, "1": 1.0} for c in criteria},
              "segmentation": {c: {"0": 1.0, "1": 2.0} if c != "norm" else {"0": 3.0, "1": 2.0} for c in criteria}}
    s = summary(_units(errors, alphas), ["cls", "depth", "segmentation"], criteria)
    assert s["tasks"]["segmentation"]["ranking"] == ["cls_sim", "norm", "evit_score", "random"]
    pairs = {tuple(p["tasks"]): p for p in s["kendall_tau"]}
    assert list(pairs) == [("cls", "depth"), ("cls", "segmentation"), ("depth", "segmentation")]
    assert pairs["depth", "segmentation"]["tau"] == pytest.approx(-1.0) and not pairs["depth", "segmentation"]["agree"]
    means_cls = [sum(errors["cls"][c]) / 4 for c in criteria]
    assert pairs["cls", "depth"]["tau"] == pytest.approx(kendalltau(means_cls, [1, 2, 3, 4]).statistic)
    assert pairs["cls", "depth"]["per_layer"][0] == pytest.approx(kendalltau([1, 9, 2, 3], [1, 2, 3, 4]).statistic)
    assert pairs["cls", "depth"]["best"] == ["random", "random"]
    found = s["seed_003"]
    assert {tuple(r["tasks"]): r["differ"] for r in found["rankings"]}[("depth", "segmentation")] is True
    # evit_score is 9x random for cls at block 0, 5x at block 1, 1x later; 2x and 0.75x on the dense tasks
    attention = found["attention"]
    assert attention["criteria"] == ["evit_score"] and attention["early_layers"] == [0, 1]
    assert attention["ratio_to_random"]["cls"]["evit_score"]["early"] == pytest.approx(7.0)
    assert attention["ratio_to_random"]["cls"]["evit_score"]["later"] == pytest.approx(1.0)
    assert attention["cls_most_sensitive_early"] == {"evit_score": True}
    assert found["endpoints"]["opposite"] == ["random", "evit_score", "cls_sim"]
    assert found["endpoints"]["preferred"]["norm"] == {"depth": "1", "segmentation": "1"}
    page = render({"kind": "criteria", "criteria": criteria, "settings": {"ratio": 0.3}, "summary": s})
    assert "depth and segmentation differ (τ = -1" in page and "evit_score: holds" in page
    assert "under 3 of 4 criteria (random, evit_score, cls_sim)" in page and "**segmentation recovery endpoints**" in page
    assert "(there is no detection here; the other dense task is depth): cls and segmentation differ" in page
    two = summary(_units({t: errors[t] for t in ("cls", "depth")}, {"depth": alphas["depth"]}), ["cls", "depth"], criteria)
    page = render({"kind": "criteria", "criteria": criteria, "settings": {"ratio": 0.3}, "summary": two})
    assert "differently* (this run has neither task; its pairs of tasks instead): cls and depth differ (τ = 0.333" in page
    assert "opposite recovery endpoints" not in page  # one dense task: nothing to compare


# ---- demo:random, the untrained control --------------------------------------------------------

def test_random_demo_is_the_seeded_untrained_architecture():
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.sources.models import parse_model
    from pullback_ext.studies.models import parse_study_model, random_demo

    first, again, other = (random_demo(s).state_dict() for s in (0, 0, 1))
    trained = load_backbone(parse_model("demo"))[1].state_dict()
    assert isinstance(random_demo(0), DemoModel) and first.keys() == trained.keys()
    name = next(k for k in first if k.endswith("qkv.weight"))
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])
    assert not torch.equal(first[name], trained[name])
    assert str(parse_study_model("demo:random")) == "demo:random"


def test_demo_random_takes_no_weights(tmp_path, capsys):
    from pullback_ext.studies.models import load_study_backbone, parse_study_model

    with pytest.raises(PullbackError, match="--weights: demo:random"):
        load_study_backbone(parse_study_model("demo:random"), "w.safetensors", 0)
    argv = ["study", "diagnose", "--model", "demo:random", "--weights", "w.safetensors", "--out", str(tmp_path / "d")]
    assert main(argv) == 2
    assert "--weights: demo:random" in capsys.readouterr().err


def test_study_diagnose_on_demo_random_equals_diagnose_with_the_initialisation_as_weights(tmp_path):
    from pullback_ext.studies.models import random_demo, random_demo_weights

    common = ["--num-images", "2", "--output-size", "4", "--probes", "4", "--slq-steps", "0", "--seed", "3"]
    _run(["study", "diagnose", "--model", "demo:random", *common, "--layers", "2", "--decoders", "depth", "--out",
          tmp_path / "study", "--quiet"])
    weights = random_demo_weights(3, tmp_path / "init")
    from safetensors.torch import load_file

    assert all(torch.equal(v, load_file(weights)[k]) for k, v in random_demo(3).state_dict().items())
    _run(["diagnose", "--model", "demo", "--weights", weights, *common, "--layer", "2", "--decoder", "depth", "--out", tmp_path / "single"])
    swept = json.loads((tmp_path / "study" / "study.json").read_text())
    single = json.loads((tmp_path / "single" / "diagnosis.json").read_text())
    assert swept["model"] == "demo:random"
    for name, value in single["aggregate"].items():
        assert f"{swept['units']['2']['depth']['aggregate'][name]['mean']:.3f}" == f"{value['mean']:.3f}", name


def test_study_criteria_on_demo_random_measures_the_untrained_model(tmp_path):
    common = ["study", "criteria", "--num-images", "2", "--layers", "0", "--criteria", "random,norm", "--tasks", "depth",
              "--alphas", "0,1", "--quiet"]
    _run([*common, "--model", "demo:random", "--out", tmp_path / "random"])
    _run([*common, "--model", "demo", "--out", tmp_path / "demo"])
    untrained, trained = (json.loads((tmp_path / run / "study.json").read_text()) for run in ("random", "demo"))
    assert untrained["model"] == "demo:random" and set(untrained["summary"]["recovery"]["depth"]["criteria"]) == {"random", "norm"}
    cells = [study["units"]["0"]["tasks"]["depth"]["norm"]["silog_x100"]["mean"] for study in (untrained, trained)]
    assert all(c > 0 for c in cells) and cells[0] != pytest.approx(cells[1])


def test_the_published_diagnose_json_keeps_every_per_image_figure_but_not_the_per_token_arrays():
    from pullback_ext.studies.pages import PER_TOKEN, published

    image = {"index": 0, "kappa_cap": 0.5, "cv": 1.0, "token_energy": [1.0] * 5, "importance": [0.1] * 5}
    result = {"kind": "diagnose", "units": {"0": {"cls": {"aggregate": {}, "images": [image]}}}}
    page = published(result)
    kept = page["units"]["0"]["cls"]["images"][0]
    assert kept == {"index": 0, "kappa_cap": 0.5, "cv": 1.0} and not set(PER_TOKEN) & set(kept)
    assert result["units"]["0"]["cls"]["images"][0] is image and "token_energy" in image  # the command's copy is untouched
    assert published({"kind": "subspace", "x": 1}) == {"kind": "subspace", "x": 1}


def test_study_diagnose_runs_on_a_hugging_face_folder(tmp_path):
    """`--model hf:DIR` (a transformers Depth Anything folder): the sweep equals diagnose at each layer."""
    from helpers.diagnose import tiny_depth_anything
    from helpers.images import random_image_folder

    folder, images = tmp_path / "da", random_image_folder(tmp_path / "images", 2, 32)
    tiny_depth_anything(dtype=torch.float32).save_pretrained(folder)
    common = ["--model", f"hf:{folder}", "--images", str(images), "--num-images", "2", "--output-size", "4",
              "--probes", "4", "--slq-steps", "0"]
    _run(["study", "diagnose", *common, "--layers", "0,2", "--decoders", "depth", "--out", tmp_path / "study", "--quiet"])
    study = json.loads((tmp_path / "study" / "study.json").read_text())
    assert sorted(study["units"]) == ["0", "2"]
    for layer in ("0", "2"):
        _run(["diagnose", *common, "--layer", layer, "--task", "depth", "--out", tmp_path / f"d{layer}"])
        single = json.loads((tmp_path / f"d{layer}" / "diagnosis.json").read_text())
        swept = study["units"][layer]["depth"]
        assert f"{swept['aggregate']['kappa_cap']['mean']:.6f}" == f"{single['aggregate']['kappa_cap']['mean']:.6f}"


def test_study_criteria_recovery_endpoints_on_a_hugging_face_depth_folder_equal_evaluate_with_recovery(tmp_path):
    """The α cells of a Depth Anything folder are `pullback evaluate --recovery α` at that layer."""
    from helpers.diagnose import tiny_depth_anything
    from helpers.images import random_image_folder

    folder, images = tmp_path / "da", random_image_folder(tmp_path / "images", 2, 32)
    da = tiny_depth_anything(dtype=torch.float32)
    da.config.depth_estimation_type, da.config.max_depth = "metric", 10  # a sigmoid head: depth > 0, as SILog needs
    type(da)(da.config).save_pretrained(folder)
    common = ["--model", f"hf:{folder}", "--images", str(images), "--num-images", "2", "--batch-size", "2", "--quiet"]
    _run(["study", "criteria", *common, "--layers", "1", "--criteria", "norm", "--tasks", "depth", "--alphas", "0,1",
          "--out", tmp_path / "study"])
    unit = json.loads((tmp_path / "study" / "study.json").read_text())["units"]["1"]
    assert unit["recovery"]["depth"]["norm"]["1"]["silog_x100"]["images"] == unit["tasks"]["depth"]["norm"]["silog_x100"]["images"]
    _run(["evaluate", *common, "--task", "depth", "--layers", "2", "--ratios", "0.3", "--strategies", "norm", "--seeds", "1",
          "--recovery", "0", "--no-timing", "--out", tmp_path / "e"])
    single = json.loads((tmp_path / "e" / "results.json").read_text())["tables"]["llf"]["norm"]["0.3"]["silog_x100"]["mean"]
    swept = unit["recovery"]["depth"]["norm"]["0"]["silog_x100"]["mean"]
    assert f"{swept:.4f}" == f"{single:.4f}" and swept != pytest.approx(unit["tasks"]["depth"]["norm"]["silog_x100"]["mean"])


def test_study_diagnose_off_a_terminal_writes_plain_progress_lines_and_no_internal_warning(tmp_path):
    """Into a pipe (as into a log file): one plain line per tenth, no tqdm redraws; no warning the
    user did not cause (r above M on one of several decoders is a note under the table, torch's own
    FutureWarning about scripting its forward-AD decompositions stays inside the library)."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONWARNINGS="default")
    argv = [sys.executable, "-m", "pullback_ext", "study", "diagnose", "--model", "demo", "--layers", "2", "--decoders", "cls",
            "--num-images", "1", "--probes", "4", "--slq-steps", "0", "--out", str(tmp_path / "study")]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr and "Warning" not in done.stderr, done.stderr
    for line in done.stderr.splitlines():  # one layer, one decoder, one image: one diagnosis
        assert re.fullmatch(r"study diagnose: \d+/1 diagnosis \(\d+%\) [\d.]+ s( \[layer=2 \(1/1\), decoder=cls, "
                            r"image=1/1, passes=\d+\])?", line), line
    assert len(done.stderr.splitlines()) == 2  # the start and the end of a one-layer sweep
    assert "- cls: r = 20 exceeds M = 9, so r = 9 (every direction) is used" in done.stdout
