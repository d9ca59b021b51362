"""The evaluation pipeline and ``pullback evaluate`` on small models with random weights."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from helpers.images import random_image_folder
from pullback_ext.cli import main
from pullback_ext.comparison.backbones import demo_backbone
from pullback_ext.comparison.evaluation import Plan, markdown_table, run_cost, run_quality


def _demo_model():
    from pullback_ext.embedded.model import DemoModel

    torch.manual_seed(0)
    return DemoModel().eval().requires_grad_(False)


def _scenes(n, seed):
    from pullback_ext.embedded.scenes import render

    data = render(n, seed)
    return {"images": data["images"], "labels": data["labels"]}


@pytest.fixture(scope="module")
def demo():
    return demo_backbone(_demo_model())


def test_demo_backbone_reduced_output_equals_the_model_at_zero_ratio(demo):
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions

    x = _scenes(2, 0)["images"]
    shape = BackboneShape(depth=demo.depth, num_prefix=demo.num_prefix, has_cls=True)
    cfg = ReductionOptions(ratio=0.0, layers=(2,), mode="prune", strategy="norm").resolve(shape)
    full, reduced = demo.full(x), demo.reduced(cfg, x)
    assert all(torch.equal(full[k], reduced[k]) for k in ("embedding", "depth", "logits"))


def test_depth_table_with_and_without_llf(demo):
    sets = [_scenes(4, s) for s in range(2)]
    plan = Plan(task="depth", strategies=("importance", "tome_score", "random"), ratios=(0.0, 0.5), layers=(2, 4), mode="prune",
                llf=(True, False), scorers={"importance": lambda F: F.norm(dim=-1)}, batch_size=4)
    result = run_quality(demo, sets, plan, progress=False)
    for key in ("llf", "no_llf"):
        table = result["tables"][key]
        for strategy in plan.strategies:
            zero = table[strategy]["0"]
            assert zero["silog_x100"]["mean"] == 0.0 and zero["cosine_x100"]["mean"] == 0.0
            half = table[strategy]["0.5"]["silog_x100"]
            assert half["mean"] > 0 and len(half["per_seed"]) == 2
            assert table[strategy]["0.5"]["knn_top1"]["mean"] <= 1.0
    w = result["wilcoxon"]["llf"]["0.5"]
    assert w["baseline"] in ("tome_score", "random") and (w["p_value"] is None or 0 <= w["p_value"] <= 1)
    md = markdown_table(result, "llf")
    assert "| importance |" in md and "η=0.5" in md
    json.dumps(result)


def test_rows_name_their_rules_and_show_both_of_ours_side_by_side(demo):
    sets = [_scenes(3, 0)]
    scorers = {"importance": lambda F: F.norm(dim=-1)}
    merge = Plan(task="cls", strategies=("importance", "tome_score"), ratios=(0.25,), layers=(2,), mode="merge",
                 scorers=scorers, batch_size=3)
    result = run_quality(demo, sets, merge, progress=False)
    rules = result["rules"]["merge"]
    assert list(result["tables"]["merge"]) == ["importance", "importance (paper preset)", "tome_score"]
    assert rules["importance"]["selection"] == "bound imp·drift" and rules["importance"]["averaging"].startswith("size-weighted")
    assert rules["importance (paper preset)"]["selection"] == "lowest importance"
    assert rules["importance (paper preset)"]["averaging"].startswith("importance-weighted")
    assert rules["tome_score"]["selection"] == "lowest tome_score"
    ours, paper = (result["tables"]["merge"][k]["0.25"]["cosine_x100"]["mean"] for k in rules if k.startswith("importance"))
    assert ours != paper  # the two rows really ran different rules
    md = markdown_table(result, "merge")
    assert "| importance (paper preset) | lowest importance | importance-weighted" in md
    cost = run_cost(demo, sets[0]["images"], merge, batches=(1,), repeats=1, strategies=("importance",), progress=False)
    assert set(cost) >= {"importance", "importance (paper preset)"} and "tome_score" not in cost

    fixed = Plan(task="cls", strategies=("importance",), ratios=(0.25,), layers=(2,), mode="merge", scorers=scorers, selection="lowest")
    assert [r.key for r in fixed.rows(demo)] == ["importance"]  # an explicit selection is one row
    prune = Plan(task="depth", strategies=("importance",), ratios=(0.25,), layers=(2,), mode="prune", llf=(True,), scorers=scorers)
    assert [r.key for r in prune.rows(demo)] == ["importance"]  # in prune mode with the LLF given, the presets agree


def test_cost_counts_fewer_flops_when_pruning(demo):
    plan = Plan(task="cls", strategies=("norm",), ratios=(0.5,), layers=(2,), mode="merge")
    cost = run_cost(demo, _scenes(2, 0)["images"], plan, batches=(1, 2), repeats=1, progress=False)
    assert cost["norm"]["0.5"]["flop_ratio"] > 1.2
    assert cost["unpruned"]["batch2"]["median_s"] > 0


def test_cli_end_to_end_on_a_timm_model(tmp_path):
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for cls in ("a", "b"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(4):
            arr = (torch.rand(24, 24, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(arr).save(tmp_path / "img" / cls / f"{i}.png")
    out = tmp_path / "out"
    with pytest.warns(FutureWarning, match="write --model timm:vit_tiny_patch16_224"):  # the bare name still works
        code = main(["evaluate", "--model", "vit_tiny_patch16_224", "--images", str(tmp_path / "img"), "--num-images", "4",
                     "--seeds", "2", "--ratios", "0,0.3", "--stages", "4,8", "--strategies", "tome_score,norm",
                     "--time-batches", "1,2", "--time-repeats", "1", "--out", str(out), "--quiet", "--batch-size", "4"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert result["layers"] == [4, 8] and result["seeds"] == 2
    assert result["tables"]["merge"]["tome_score"]["0"]["cosine_x100"]["mean"] == 0.0
    assert result["cost"]["norm"]["0.3"]["flop_ratio"] > 1.0
    assert 0.0 <= result["tables"]["merge"]["tome_score"]["0.3"]["knn_top1"]["mean"] <= 1.0  # class subfolders give labels
    assert (out / "quality.png").stat().st_size > 0 and (out / "table.md").read_text().startswith("**cosine_x100**")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return random_image_folder(tmp_path_factory.mktemp("images"), 4, 24)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--ratios", "0.2,1.5"], "ratio must lie in"),
        (["--ratios", "a"], "--ratios must be comma-separated numbers"),
        (["--stages", "11"], "schedule layers must lie in"),
        (["--layers", "12"], "--layers: layer 12 is out of range; valid layers are 0..11"),
        (["--layers", "3,3"], "--layers: layer 3 is named twice"),
        (["--layers", "4", "--stages", "4"], "--layers: conflicts with --stages"),
        (["--stages", "12", "--absolute-layers"], "layers must lie in [0, 11]"),
        (["--stages", "11", "--absolute-layers", "--task", "cls", "--mode", "prune"], "layers must lie in [0, 10]"),
        (["--strategies", "importance"], "needs --head"),
        (["--strategies", "bogus"], "unknown strategy"),
        (["--task", "depth"], "--task depth needs a model with that decoder"),
        (["--head", "/nonexistent/ckpt"], "checkpoint file not found"),
        (["--num-images", "0"], "--num-images must be at least 1"),
        (["--seeds", "3"], "cannot fill 3 seeds"),
    ],
)
def test_cli_rejects_bad_options(image_dir, tmp_path, capsys, argv, match):
    base = ["evaluate", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_dir), "--out", str(tmp_path / "o"), "--quiet",
            "--num-images", "2", "--seeds", "2"]
    assert main(base + argv) == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o" / "results.json").exists()


def test_cli_rejects_a_corrupt_head_checkpoint(image_dir, tmp_path, capsys):
    bad = tmp_path / "head"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    assert main(["evaluate", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_dir), "--head", str(bad),
                 "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "corrupt or unreadable" in capsys.readouterr().err


def test_demo_stage_uses_the_trained_head_at_its_layer(tmp_path, monkeypatch):
    from dataclasses import replace

    from pullback_ext.demo import headline, pruning_stage
    from pullback_ext.demo.pipeline import demo_inputs
    from pullback_ext.demo.stages import TrainedHead
    from pullback_ext.metric.head import ImportanceHead

    monkeypatch.setitem(pruning_stage.QUICK, "images", 4)
    monkeypatch.setitem(pruning_stage.QUICK, "merge_ratios", (0.5,))
    monkeypatch.setitem(pruning_stage.QUICK, "prune_ratios", (0.5,))
    monkeypatch.setitem(headline.SETTINGS, True, {"batch": 2, "repeats": 1})
    torch.manual_seed(0)
    head = ImportanceHead(192, hidden=16, heads=2).eval().requires_grad_(False)
    inputs = replace(demo_inputs(tmp_path, quick=True), model=_demo_model(), segmentation_head=None,  # none fits these weights
                     heads=(TrainedHead("cls", head, 4),))
    result = pruning_stage.run_demo_stage(inputs, progress=False).report
    assert result["heads"] == {"cls": 4}
    assert result["cls"]["layers"] == [4] and "importance" in result["cls"]["strategies"]
    assert "importance" not in result["depth"]["strategies"]
    assert [(row["method"], row["ours"]) for row in result["cls"]["headline"]["rows"]] == [("tome", False), ("importance_tome", True)]
    assert result["cls"]["headline"]["rows"][1]["speedup"]["low"] <= result["cls"]["headline"]["rows"][1]["speedup"]["high"]
    # no depth head: ours without one (as with one), no paper pipeline
    assert [row["row"] for row in result["depth"]["headline"]["rows"]] == ["tome", "importance_tome (no head)"]
    assert "Measured winner" in (tmp_path / "pruning" / "cls" / "table.md").read_text()
    for task in ("cls", "depth"):
        for name in ("results.json", "quality.png", "merges.png"):
            assert (tmp_path / "pruning" / task / name).is_file()
    assert "segmentation" not in result and not (tmp_path / "pruning" / "segmentation").exists()  # no segmentation head
    assert result["subspace"]["results"]["subspace"][-1]["energy"] == pytest.approx(1.0)


def test_cli_rejects_a_head_of_the_wrong_width(image_dir, tmp_path, capsys):
    from pullback_ext.metric.checkpoint import save_model
    from pullback_ext.metric.head import ImportanceHead

    save_model(tmp_path / "head", "head", ImportanceHead(16, hidden=8, heads=2))
    assert main(["evaluate", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_dir), "--head", str(tmp_path / "head"),
                 "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "expects features of width 16, the backbone has 192" in capsys.readouterr().err


def test_cli_subspace_interventions_with_a_probe_file(image_dir, tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(2, 192, generator=torch.Generator().manual_seed(0))
    save_file({"weight": w, "bias": torch.zeros(2)}, str(tmp_path / "probe.safetensors"))
    code = main(["subprobe", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_dir), "--num-images", "2",
                 "--probe", str(tmp_path / "probe.safetensors"), "--layer", "3", "--k", "1,2", "--out", str(tmp_path / "o")])
    assert code == 0
    result = json.loads((tmp_path / "o" / "subspace.json").read_text())
    assert result["rank"] == 2 and result["layer"] == 3
    top = {r["k"]: r for r in result["results"]["subspace"]}
    assert top[2]["output_change"] < 1e-6 and top[2]["energy"] == pytest.approx(1.0)
    save_file({"weight": torch.randn(2, 5)}, str(tmp_path / "bad.safetensors"))
    assert main(["subprobe", "--model", "timm:vit_tiny_patch16_224", "--images", str(image_dir), "--probe",
                 str(tmp_path / "bad.safetensors"), "--out", str(tmp_path / "o2")]) == 2


def _save_hf(model, folder):
    model.save_pretrained(str(folder))
    return f"hf:{folder}"


def test_cli_end_to_end_on_hugging_face_dinov2_and_depth_anything(image_dir, tmp_path):
    from helpers.diagnose import tiny_depth_anything
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    dinov2 = Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                      image_size=32, patch_size=8, initializer_range=0.3))
    common = ["--images", str(image_dir), "--num-images", "2", "--seeds", "2", "--ratios", "0,0.25", "--stages", "1",
              "--absolute-layers", "--strategies", "tome_score,norm", "--no-timing", "--quiet"]
    assert main(["evaluate", "--model", _save_hf(dinov2, tmp_path / "dinov2"), "--out", str(tmp_path / "cls")] + common) == 0
    cls = json.loads((tmp_path / "cls" / "results.json").read_text())
    assert cls["model"] == "Dinov2Model" and cls["mode"] == "merge"
    assert cls["tables"]["merge"]["tome_score"]["0"]["cosine_x100"]["mean"] == 0.0
    assert cls["tables"]["merge"]["norm"]["0.25"]["cosine_x100"]["mean"] > 0.0

    da = tiny_depth_anything(dtype=torch.float32)
    da.config.depth_estimation_type, da.config.max_depth = "metric", 10  # a sigmoid head: depth > 0, as SILog needs
    depth = _save_hf(type(da)(da.config), tmp_path / "da")
    assert main(["evaluate", "--model", depth, "--task", "depth", "--out", str(tmp_path / "depth")] + common) == 0
    dense = json.loads((tmp_path / "depth" / "results.json").read_text())
    assert dense["model"] == "DepthAnythingForDepthEstimation" and dense["mode"] == "prune"
    table = next(iter(dense["tables"].values()))
    assert table["tome_score"]["0"]["silog_x100"]["mean"] == 0.0 and table["tome_score"]["0.25"]["silog_x100"]["mean"] > 0.0


def test_cli_rejects_an_unsupported_hugging_face_model(image_dir, tmp_path, capsys):
    from transformers import DeiTConfig, DeiTModel

    deit = _save_hf(DeiTModel(DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                         image_size=32, patch_size=8)), tmp_path / "deit")
    assert main(["evaluate", "--model", deit, "--images", str(image_dir), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "hf model type must be one of" in capsys.readouterr().err
    assert main(["evaluate", "--model", f"hf:{tmp_path / 'nothing'}", "--images", str(image_dir), "--out",
                 str(tmp_path / "o"), "--quiet"]) == 2
    assert "must be a local folder with a config.json" in capsys.readouterr().err


def test_hugging_face_weights_must_fit_exactly(image_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import Dinov2Config, Dinov2Model

    model = _save_hf(Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                              intermediate_size=64, image_size=32, patch_size=8)), tmp_path / "m")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))  # the layout save_pretrained writes
    assert any(".attention.attention.query." in key for key in state)  # older than the module names: renamed on load
    state.pop("embeddings.cls_token")
    save_file(state, str(tmp_path / "partial.safetensors"))
    assert main(["evaluate", "--model", model, "--weights", str(tmp_path / "partial.safetensors"), "--images",
                 str(image_dir), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "does not fit the Dinov2Model: 1 missing (e.g. embeddings.cls_token)" in capsys.readouterr().err


def test_cli_demo_model_on_builtin_scenes_and_the_deprecated_demo_flag(tmp_path):
    common = ["--num-images", "2", "--seeds", "1", "--ratios", "0.5", "--stages", "4", "--strategies", "tome_score",
              "--no-timing", "--quiet"]
    assert main(["evaluate", "--model", "demo", "--images", "builtin:scenes", "--out", str(tmp_path / "new")] + common) == 0
    with pytest.warns(FutureWarning, match="write --model demo --images builtin:scenes"):
        assert main(["evaluate", "--demo", "--out", str(tmp_path / "old")] + common) == 0
    new, old = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("new", "old"))
    assert new["model"] == old["model"] == "demo"
    assert new["tables"] == old["tables"] and new["tables"]["merge"]["tome_score"]["0.5"]["cosine_x100"]["mean"] > 0


def test_cli_model_and_images_errors(image_dir, tmp_path, capsys):
    out = ["--out", str(tmp_path / "o"), "--quiet"]
    cases = [
        (["--images", str(image_dir)], "--model: required (demo | timm:NAME | hf:DIR)"),
        (["--model", "resnet:50", "--images", str(image_dir)], "--model: expected demo | timm:NAME | hf:DIR, got 'resnet:50'"),
        (["--model", "timm:vit_tiny_patch16_224"], "--images: required with --model timm:vit_tiny_patch16_224"),
        (["--model", "demo", "--images", str(tmp_path / "missing")], f"--images: folder '{tmp_path / 'missing'}' does not exist"),
        (["--model", "demo", "--images", "builtin:nothing"], "expected a folder or one of builtin:scenes"),
        (["--demo", "--model", "timm:vit_tiny_patch16_224"], "--demo: conflicts with --model"),
    ]
    for argv, message in cases:
        with pytest.warns(FutureWarning) if "--demo" in argv else contextlib.nullcontext():
            assert main(["evaluate", *argv, *out]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert message in err[-1] and err[-1].startswith("pullback evaluate: error:"), (argv, err)


def test_cli_publishes_a_stamped_results_page(tmp_path, monkeypatch):
    import pullback_ext.results_pages as rp

    monkeypatch.setattr(rp, "git_commit", lambda repo=rp.REPO: "0" * 40)  # as from a clean checkout
    page = tmp_path / "pages" / "demo-eval"
    assert main(["evaluate", "--model", "demo", "--images", "builtin:scenes", "--num-images", "2", "--seeds", "1",
                 "--ratios", "0.5", "--layers", "2", "--strategies", "tome_score", "--time-batches", "1", "--time-repeats", "1",
                 "--quiet", "--out", str(tmp_path / "o"), "--results-page", str(page)]) == 0
    text = (tmp_path / "pages" / "demo-eval.md").read_text()
    assert "**FLOP ratio**" in text and "torch's flop counter" in text and "| tome_score | " in text
    published = json.loads((tmp_path / "pages" / "demo-eval.json").read_text())
    assert published["stamp"]["command"].startswith("pullback evaluate --model demo --images builtin:scenes")
    assert "tome_score" in text and published["tables"] == json.loads((tmp_path / "o" / "results.json").read_text())["tables"]


def test_layers_are_blocks_of_the_model_and_stages_is_the_deprecated_scaled_spelling():
    import argparse

    from pullback_ext.commands.evaluate_plan import reduction_layers

    def ns(**kw):
        return argparse.Namespace(**{"layers": None, "stages": None, "absolute_layers": False, "head": None, **kw})

    assert reduction_layers(ns(layers="2,5"), 8) == (2, 5)
    assert reduction_layers(ns(), 8) == (2,) and reduction_layers(ns(), 12) == (4,)  # block depth/3
    with pytest.warns(FutureWarning, match="write --layers 2,5 "):
        assert reduction_layers(ns(stages="4,8"), 8) == (2, 5)  # ViT-B numbering, scaled to 8 blocks
    with pytest.warns(FutureWarning, match="write --layers 4,8 "):
        assert reduction_layers(ns(stages="4,8", absolute_layers=True), 12) == (4, 8)
