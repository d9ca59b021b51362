"""Probe maps of Hugging Face DINOv2 models (random weights): wiring against the model's own
forward, JVPs through SDPA attention against a dense reverse-mode Jacobian, the command line."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.diagnose import dense_jacobian, images
from helpers.images import random_image_folder
from pullback_ext.cli import main
from pullback_ext.linalg import JacobianOperator
from pullback_ext.probes import from_hf_dinov2


def tiny_dinov2(registers: int = 0, attn: str = "sdpa", classifier: bool = False):
    import transformers

    options = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32,
                   patch_size=8, initializer_range=0.3, attn_implementation=attn)
    prefix = "Dinov2WithRegisters" if registers else "Dinov2"
    config = getattr(transformers, f"{prefix}Config")(**options, **({"num_register_tokens": registers} if registers else {}))
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForImageClassification" if classifier else f"{prefix}Model")(config)
    return model.double().eval()


@pytest.mark.parametrize("registers", [0, 4])
def test_probe_reproduces_the_model_outputs(registers):
    model = tiny_dinov2(registers)
    x = images(2, 32).double()
    with torch.no_grad():
        out = model(pixel_values=x)
    for layer in (0, 2):
        cls = from_hf_dinov2(model, layer, "cls")
        assert (cls.num_tokens, cls.dim, cls.num_prefix_tokens, cls.grid_size) == (17 + registers, 32, 1 + registers, (4, 4))
        features = cls.features(x)
        assert features.context == {} and cls.context_keys == ()
        F = features.F
        torch.testing.assert_close(cls(F), out.pooler_output, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(from_hf_dinov2(model, layer, "tokens")(F), out.last_hidden_state.flatten(1))
        torch.testing.assert_close(from_hf_dinov2(model, layer, "pooled")(F),
                                   out.last_hidden_state[:, 1 + registers:].mean(1))


def test_jvps_through_sdpa_attention_match_the_dense_jacobian():
    model = tiny_dinov2(attn="sdpa")
    probe = from_hf_dinov2(model, 0, "cls")
    F = probe.features(images(1, 32).double()).F[0]
    op = JacobianOperator(probe, F, chunk_size=4)
    J = dense_jacobian(probe, F)
    V = torch.randn(J.shape[1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(op.jvp(V), J @ V, rtol=1e-9, atol=1e-9)
    eager = from_hf_dinov2(tiny_dinov2(attn="eager"), 0, "cls")  # same weights, the other attention path
    torch.testing.assert_close(dense_jacobian(eager, F), J, rtol=1e-9, atol=1e-9)


def test_classifier_wrapper_and_bad_arguments():
    classifier = tiny_dinov2(classifier=True)
    probe = from_hf_dinov2(classifier, 1)
    assert probe.model is classifier.dinov2
    with pytest.raises(ValueError, match=r"layer: expected an int in \[0, 2\]"):
        from_hf_dinov2(classifier, 3)
    with pytest.raises(ValueError, match="output: expected one of cls, tokens, pooled"):
        from_hf_dinov2(classifier, 0, "logits")
    with pytest.raises(ValueError, match=r"images: expected spatial size \(32, 32\)"):
        probe.features(torch.zeros(1, 3, 24, 24, dtype=torch.float64))
    with pytest.raises(TypeError, match="model: expected transformers' Dinov2Model"):
        from_hf_dinov2(torch.nn.Linear(2, 2), 0)


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return random_image_folder(tmp_path_factory.mktemp("images"), 6, 40)


def test_diagnose_train_and_evaluate_a_dinov2_folder(image_dir, tmp_path, capsys):
    folder = tmp_path / "dinov2"
    tiny_dinov2().float().save_pretrained(folder)
    model = ["--model", f"hf:{folder}"]
    assert main(["diagnose", *model, "--layer", "1", "--task", "cls", "--images", str(image_dir), "--num-images", "2",
                 "--rank", "3", "--power", "1", "--probes", "6", "--slq-steps", "4", "--out", str(tmp_path / "diag")]) == 0
    first = json.loads((tmp_path / "diag" / "diagnosis.json").read_text())["images"][0]
    assert (first["N"], first["D"], first["M"]) == (17, 32, 32)
    assert main(["train", "head", *model, "--layer", "0", "--task", "cls", "--images", str(image_dir), "--num-images",
                 "4", "--heldout", "2", "--steps", "4", "--batch-size", "2", "--hidden", "16", "--heads", "2", "--warmup",
                 "1", "--rank", "3", "--power", "1", "--no-progress", "--out", str(tmp_path / "head")]) == 0
    assert main(["evaluate", *model, "--head", str(tmp_path / "head"), "--images", str(image_dir), "--num-images", "2",
                 "--seeds", "2", "--ratios", "0.25", "--layers", "1", "--strategies", "importance,tome_score",
                 "--no-timing", "--quiet", "--out", str(tmp_path / "eval")]) == 0
    cells = json.loads((tmp_path / "eval" / "results.json").read_text())["tables"]["merge"]
    assert cells["importance"]["0.25"]["cosine_x100"]["mean"] >= 0.0 and "tome_score" in cells
    capsys.readouterr()
    assert main(["diagnose", *model, "--layer", "1", "--task", "depth", "--images", str(image_dir),
                 "--out", str(tmp_path / "x")]) == 2
    assert "DINOv2 models offer cls, tokens, pooled and linear:FILE" in capsys.readouterr().err


def test_a_cropping_image_processor_sets_the_input_size(image_dir, tmp_path):
    from pullback_ext.sources.preprocess import hf_crop_preprocess

    folder = tmp_path / "dinov2"
    tiny_dinov2().float().save_pretrained(folder)
    assert hf_crop_preprocess((32, 32), folder).size == (32, 32)  # no processor config: the model's own size
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "do_center_crop": True, "crop_size": {"height": 24, "width": 24}, "size": {"shortest_edge": 28},
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))
    preprocess = hf_crop_preprocess((32, 32), folder)
    assert (preprocess.size, preprocess.resize, preprocess.mean) == ((24, 24), 28, (0.485, 0.456, 0.406))
    assert main(["diagnose", "--model", f"hf:{folder}", "--layer", "1", "--task", "pooled", "--images", str(image_dir),
                 "--num-images", "1", "--rank", "3", "--power", "1", "--probes", "6", "--slq-steps", "4",
                 "--out", str(tmp_path / "diag")]) == 0
    first = json.loads((tmp_path / "diag" / "diagnosis.json").read_text())["images"][0]
    assert (first["N"], first["M"]) == (10, 32)  # 3 × 3 patches of the 24 px crop, plus CLS
