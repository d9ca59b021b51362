"""Probe maps of the Hugging Face ViT, CLIP, SigLIP and DINOv3 vision models and of timm Eva models
(random weights): the probe reproduces the model's own outputs, its JVPs match a dense reverse-mode
Jacobian, bad arguments are refused, and ``pullback diagnose`` / ``train head`` / ``evaluate`` take
``--model hf:DIR`` folders of each family and ``--model timm:NAME`` Eva models."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.images import random_image_folder
from helpers.prune import tiny_eva, tiny_hf
from pullback_ext.cli import main
from pullback_ext.errors import PullbackError
from pullback_ext.linalg import JacobianOperator
from pullback_ext.probes import from_hf_vision, from_timm
from pullback_ext.probes.hf_vision import embedding

KINDS = ["vit", "vit_cls", "clip", "clip_projection", "siglip", "dinov3"]
PREFIX = {"siglip": 0, "dinov3": 3}  # the others: CLS only; dinov3: CLS + 2 registers
EVAS = [("eva02_tiny_patch14_224", 56), ("vit_small_patch16_rope_mixed_224", 64)]


def model_of(kind: str, **extra):
    return tiny_hf(kind, "sdpa", **extra).double()


def pixels(n: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def last_hidden_state(model, x: torch.Tensor) -> torch.Tensor:
    base = getattr(model, "vit", None) or getattr(model, "vision_model", None) or model
    return base(pixel_values=x).last_hidden_state


@pytest.mark.parametrize("kind", KINDS)
def test_probe_reproduces_the_model_outputs(kind):
    model = model_of(kind)
    x = pixels()
    prefix = PREFIX.get(kind, 1)
    with torch.no_grad():
        expected, tokens = embedding(model, x), last_hidden_state(model, x)
        for layer in (0, 2):
            probe = from_hf_vision(model, layer, "cls")
            assert (probe.num_tokens, probe.dim, probe.num_prefix_tokens, probe.grid_size) == (16 + prefix, 32, prefix, (4, 4))
            F = probe.features(x).F
            torch.testing.assert_close(probe(F), expected, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(from_hf_vision(model, layer, "tokens")(F), tokens.flatten(1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(from_hf_vision(model, layer, "pooled")(F), tokens[:, prefix:].mean(1))
    if kind == "clip_projection":  # the projected embedding, not the pooled output
        torch.testing.assert_close(expected, model(pixel_values=x).image_embeds, rtol=0, atol=0)
        assert expected.shape[1] == model.config.projection_dim and probe.output_dim == model.config.projection_dim
    if kind == "vit_cls":  # what the classifier reads
        torch.testing.assert_close(model.classifier(expected), model(pixel_values=x).logits, rtol=1e-12, atol=1e-12)


def relative_jacobian_check(probe, F: torch.Tensor) -> None:
    """JVPs of the matrix-free operator against the dense reverse-mode Jacobian of ``probe`` at F[N,D]."""
    J = torch.autograd.functional.jacobian(lambda f: probe(f.unsqueeze(0)).reshape(-1), F).reshape(probe.output_dim, -1)
    assert J.abs().max() > 1e-3  # the layers after ℓ are not numerically flat
    V = torch.randn(J.shape[1], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(JacobianOperator(probe, F, chunk_size=2).jvp(V), J @ V, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["vit", "clip_projection", "siglip", "dinov3"])
def test_jvps_match_the_dense_jacobian(kind):
    probe = from_hf_vision(model_of(kind), 2, "cls")
    relative_jacobian_check(probe, probe.features(pixels(1)).F[0])


@pytest.mark.parametrize("name,size", EVAS)
def test_eva_probe_reproduces_the_model_and_its_jvps_match_the_dense_jacobian(name, size):
    model = tiny_eva(name, size)
    x = pixels(2, size)
    with torch.no_grad():
        features = model.forward_features(x)
        for output, expected in (("cls", features[:, 0]), ("pooled", model.forward_head(features, pre_logits=True)),
                                 ("tokens", features.flatten(1))):
            probe = from_timm(model, 1, output)
            assert probe.eva and probe.rotary is not None
            torch.testing.assert_close(probe(probe.features(x).F), expected, rtol=1e-12, atol=1e-12)
    probe = from_timm(model, 2, "cls")
    relative_jacobian_check(probe, probe.features(x[:1]).F[0])


def test_bad_arguments_are_refused():
    with pytest.raises(PullbackError, match="'cls' of a SiglipVisionModel is its attention-pooling head's output"):
        from_hf_vision(model_of("siglip", vision_use_head=False), 1, "cls")
    assert from_hf_vision(model_of("siglip", vision_use_head=False), 1, "pooled").output_dim == 32
    with pytest.raises(PullbackError, match="SiglipVisionModel has no pooled output"):
        embedding(model_of("siglip", vision_use_head=False), pixels(1))
    with pytest.raises(PullbackError, match=r"layer: expected an int in \[0, 3\]"):
        from_hf_vision(model_of("clip"), 4)
    with pytest.raises(PullbackError, match="output: expected one of cls, tokens, pooled"):
        from_hf_vision(model_of("dinov3"), 0, "logits")
    with pytest.raises(TypeError, match="model: expected transformers' Dinov2Model, .*ViTModel, .*CLIPVisionModel"):
        from_hf_vision(torch.nn.Linear(2, 2), 0)
    with pytest.raises(PullbackError, match=r"images: expected spatial size \(32, 32\)"):
        from_hf_vision(model_of("vit"), 0).features(pixels(1, 24))


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    return random_image_folder(tmp_path_factory.mktemp("images"), 6, 64)


def saved(kind: str, folder):
    tiny_hf(kind, "sdpa", **({"projection_dim": 24} if kind == "clip_projection" else {})).save_pretrained(folder)
    return f"hf:{folder}"


def diagnose(model: str, image_dir, out, *extra) -> dict:
    assert main(["diagnose", "--model", model, "--layer", "1", "--task", "cls", "--images", str(image_dir),
                 "--num-images", "2", "--rank", "3", "--power", "1", "--probes", "6", "--slq-steps", "4", *extra,
                 "--out", str(out)]) == 0
    return json.loads((out / "diagnosis.json").read_text())["images"][0]


@pytest.mark.parametrize("kind", ["vit_cls", "clip_projection", "siglip", "dinov3"])
def test_diagnose_a_folder_of_each_family(kind, image_dir, tmp_path):
    first = diagnose(saved(kind, tmp_path / kind), image_dir, tmp_path / "diag")
    M = 24 if kind == "clip_projection" else 32  # the projected embedding
    assert (first["N"], first["D"], first["M"]) == (16 + PREFIX.get(kind, 1), 32, M)


def test_diagnose_a_timm_eva(image_dir, tmp_path):
    first = diagnose("timm:eva02_tiny_patch14_224", image_dir, tmp_path / "diag", "--img-size", "56")
    assert (first["N"], first["D"], first["M"]) == (17, 192, 192)


def train_and_evaluate(model: str, image_dir, tmp_path, *train_extra) -> dict:
    """``train head`` at layer 0 then ``evaluate`` with that head: the merge table."""
    assert main(["train", "head", "--model", model, "--layer", "0", "--task", "cls", "--images", str(image_dir),
                 "--num-images", "4", "--heldout", "2", "--steps", "3", "--batch-size", "2", "--hidden", "16", "--heads", "2",
                 "--warmup", "1", "--rank", "3", "--power", "1", "--no-progress", *train_extra,
                 "--out", str(tmp_path / "head")]) == 0
    assert main(["evaluate", "--model", model, "--head", str(tmp_path / "head"), "--images", str(image_dir), "--num-images",
                 "2", "--seeds", "1", "--ratios", "0.25", "--stages", "1", "--absolute-layers", "--strategies",
                 "importance,norm", "--no-timing", "--quiet", "--out", str(tmp_path / "eval")]) == 0
    return json.loads((tmp_path / "eval" / "results.json").read_text())["tables"]["merge"]


@pytest.mark.parametrize("kind", ["vit_cls", "clip_projection", "siglip", "dinov3"])
def test_train_a_head_and_evaluate_on_a_folder(kind, image_dir, tmp_path):
    cells = train_and_evaluate(saved(kind, tmp_path / kind), image_dir, tmp_path)
    assert set(cells) >= {"importance", "norm"} and cells["norm"]["0.25"]["cosine_x100"]["mean"] > 0.0


def test_train_a_head_and_evaluate_on_a_timm_eva(image_dir, tmp_path):
    cells = train_and_evaluate("timm:eva02_tiny_patch14_224", image_dir, tmp_path, "--img-size", "56")
    assert set(cells) >= {"importance", "norm"} and cells["norm"]["0.25"]["cosine_x100"]["mean"] > 0.0
