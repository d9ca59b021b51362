"""TAP on the Hugging Face families: the exact budget, the one-token-longer sequence, full-length
hidden states without the register, a hand-written reference loop (RoPE rows and no CLS included),
TAP-J's adapters on the families' own linears, re-patching at another ratio, unpatching, refusals."""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import images, tiny_dinov2, tiny_hf
from pullback_ext.errors import PullbackError
from pullback_ext.families import detect
from pullback_ext.tap.budget import keep_count, largest_remainder
from pullback_ext.tap.register import TaskRegister, lora_shapes

PREFIX = {"vit": 1, "siglip": 0, "dinov3": 3, "dinov2": 1}  # dinov3: CLS + 2 registers
N = 16  # 32 px, patch 8


def model_of(family: str):
    return tiny_dinov2() if family == "dinov2" else tiny_hf(family)


def register_for(task: str, layers: tuple, lora=None, seed: int = 1) -> TaskRegister:
    torch.manual_seed(seed)
    register = TaskRegister(32, layers, task, key_dim=8, lora=lora)
    with torch.no_grad():  # uneven, image-dependent shares: every layer's count is exercised
        register.shares.weight.normal_(0.0, 2.0)
        register.shares.bias.normal_(0.0, 1.0)
        for b in register.lora_b.values():
            b.normal_(0.0, 0.2)
    return register.eval()


def entering_lengths(model, x) -> tuple[list[int], object]:
    """Sequence length each layer computes on (what its pre-attention norm is given), and the model
    output with hidden states."""
    family = detect(model)
    norms = [getattr(layer, family.attention.norm) for layer in family.layers(model)]
    lengths: list[int] = []
    hooks = [norm.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1])) for norm in norms]
    try:
        out = model(pixel_values=x, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    return lengths, out


@pytest.mark.parametrize("family", ["vit", "dinov2"])
@pytest.mark.parametrize("rho", [0.5, 0.37, 0.81, 0.13])
def test_budget_is_exact_and_hidden_states_are_full_length_without_the_register(family, rho):
    model, x = model_of(family), images(3)
    base, ref = entering_lengths(model, x)
    patch.auto(model, strategy="tap", head=register_for("cls", (1, 4)), ratio=1.0 - rho)
    lengths, out = entering_lengths(model, x)
    assert lengths[0] == base[0] + 1  # only the task register is added
    assert lengths[3] - PREFIX[family] - 1 == keep_count(rho, N)  # exactly floor(ρN + 0.5), every image
    assert all(a >= b for a, b in zip(lengths, lengths[1:]))
    assert [h.shape for h in out.hidden_states] == [h.shape for h in ref.hidden_states]
    assert torch.equal(out.hidden_states[0], ref.hidden_states[0])  # the embedding, no register in it
    assert out.last_hidden_state.shape == ref.last_hidden_state.shape


def parts(model, family: str, x: torch.Tensor):
    """``(input of layer 0, layers, call(layer, y [1, K, D], kept patch indices), final norm)``."""
    pe = model.rope_embeddings(x) if family == "dinov3" else None

    def call(layer, y, kept):
        return layer(y, None) if pe is None else layer(y, position_embeddings=(pe[0][kept], pe[1][kept]))

    if family == "vit":
        return model.embeddings(x), model.layers, call, model.layernorm
    if family == "siglip":
        return model.embeddings(x), model.encoder.layers, call, model.post_layernorm
    if family == "dinov2":
        return model.embeddings(x), model.encoder.layer, call, model.layernorm
    return model.embeddings(x), model.model.layer, call, model.norm


def tap_reference(model, family: str, x: torch.Tensor, register: TaskRegister, rho: float):
    """Hand-written TAP (CLS register): the register after the prefix, at each eligible layer the
    batch-mean shares split what is left by the largest remainder and each image drops its
    lowest-scoring patch tokens; every layer runs image by image on its kept tokens (RoPE: their own
    rows, none for the prefix and the register). Returns ``(hidden states [B, N, D] after each layer,
    last hidden state)``, removed tokens frozen at the layer that removed them."""
    h0, layers, call, final = parts(model, family, x)
    p, b = PREFIX[family], x.shape[0]
    y = torch.cat([h0[:, :p], register.register.expand(b, 1, -1), h0[:, p:]], dim=1)
    kept = [list(range(N)) for _ in range(b)]
    patches = h0[:, p:].clone()
    remaining, hidden = N - keep_count(rho, N), []
    for i, layer in enumerate(layers):
        stage = register.stage(i)
        if stage is not None:
            read = register.read(stage, y[:, p], y[:, p + 1:], rho)
            count = largest_remainder(remaining, read.shares.mean(0).tolist())[0] if remaining else 0
            remaining -= count
            rows = []
            for j in range(b):
                gone = set(read.scores[j].argsort()[:count].tolist())
                stay = [t for t in range(len(kept[j])) if t not in gone]
                kept[j] = [kept[j][t] for t in stay]
                rows.append(y[j, list(range(p + 1)) + [p + 1 + t for t in stay]])
            y = torch.stack(rows)
        y = torch.cat([call(layer, y[j:j + 1], kept[j]) for j in range(b)])
        for j in range(b):
            patches[j, kept[j]] = y[j, p + 1:]
        hidden.append(torch.cat([y[:, :p], patches], dim=1))
    return hidden, final(hidden[-1])


@pytest.mark.parametrize("family", ["vit", "siglip", "dinov3", "dinov2"])
def test_patched_model_equals_a_hand_written_reference(family):
    model, x = model_of(family), images(2)
    register = register_for("cls", (1, 4))
    with torch.no_grad():
        hidden, last = tap_reference(model, family, x, register, 0.45)
    patch.auto(model, strategy="tap", head=register, ratio=0.55)
    out = model(pixel_values=x, output_hidden_states=True)
    torch.testing.assert_close(out.last_hidden_state, last, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(out.hidden_states[1:4], hidden):  # the last one is normed by some families
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_depth_register_on_a_dense_backbone_runs_the_last_layer_on_all_tokens():
    from transformers import Dinov2Backbone, Dinov2Config

    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64, image_size=32,
                          patch_size=8, initializer_range=0.3, out_indices=[2, 4])
    model = Dinov2Backbone(config).eval().requires_grad_(False)
    x = images(2)
    base, ref = entering_lengths(model, x)
    patch.hf_dinov2(model, strategy="tap", head=register_for("depth", (1, 3)), ratio=0.6)
    lengths, out = entering_lengths(model, x)
    assert lengths[0] == lengths[3] == base[0] + 1  # masked Last-Layer Fusion: every token again in the last layer
    assert lengths[2] - 2 == keep_count(0.4, N)
    assert [f.shape for f in out.feature_maps] == [f.shape for f in ref.feature_maps]
    assert [h.shape for h in out.hidden_states] == [h.shape for h in ref.hidden_states]


def test_tap_j_adapts_the_familys_linears_and_equals_merged_weights():
    """TAP-J on the HF ViT's own linears equals TAP-F's register on a copy of the model whose
    weights have the adapters merged in."""
    import copy

    model, x = tiny_hf("vit"), images(2)
    adapted = register_for("cls", (1, 4), lora=lora_shapes(model.layers, "vit"))
    assert {k.split(".", 1)[1] for k in adapted.lora_shapes} == {"attention.q_proj", "attention.k_proj", "attention.v_proj",
                                                                 "attention.o_proj", "mlp.fc1", "mlp.fc2"}
    plain = TaskRegister(32, (1, 4), "cls", key_dim=8).eval()  # the same register, without the adapters
    plain.load_state_dict({k: v for k, v in adapted.state_dict().items() if not k.startswith("lora_")})
    merged = copy.deepcopy(model)
    scale = adapted.lora_alpha / adapted.lora_rank
    with torch.no_grad():
        for name in adapted.lora_shapes:
            index, target = name.split(".", 1)
            key = name.replace(".", "-")
            merged.layers[int(index)].get_parameter(f"{target}.weight").add_(scale * adapted.lora_b[key] @ adapted.lora_a[key])
    weights = [p.clone() for p in model.parameters()]
    for rho in (0.5, 1.0):
        patch.hf_vit(model, strategy="tap", head=adapted, ratio=1.0 - rho)
        patch.hf_vit(merged, strategy="tap", head=plain, ratio=1.0 - rho)
        torch.testing.assert_close(model(pixel_values=x).last_hidden_state, merged(pixel_values=x).last_hidden_state,
                                   rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))  # the model's own weights untouched


def test_another_ratio_at_re_patch_and_unpatch_restores_the_model():
    model, x = tiny_hf("vit"), images(2)
    ref = model(pixel_values=x, output_hidden_states=True)
    register = register_for("cls", (1, 4))
    first = patch.hf_vit(model, strategy="tap", head=register, ratio=0.3)(pixel_values=x).last_hidden_state
    second = patch.hf_vit(model, strategy="tap", head=register, ratio=0.6)(pixel_values=x).last_hidden_state
    lengths, _ = entering_lengths(model, x)
    assert lengths[3] - 2 == keep_count(0.4, N) and not torch.allclose(first, second)
    assert torch.equal(patch.hf_vit(tiny_hf("vit"), strategy="tap", head=register, ratio=0.6)(pixel_values=x).last_hidden_state,
                       second)  # as if patched once at that ratio
    patch.unpatch(model)
    out = model(pixel_values=x, output_hidden_states=True)
    assert torch.equal(out.last_hidden_state, ref.last_hidden_state)
    assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, ref.hidden_states))
    assert patch.config(model) is None and not any("forward" in vars(m) for m in model.modules())


def test_a_register_that_does_not_fit_the_model_is_refused():
    from timm.models.vision_transformer import VisionTransformer

    model = tiny_hf("vit")
    with pytest.raises(PullbackError, match="16-wide but this model's tokens are 32-wide"):
        patch.hf_vit(model, strategy="tap", head=TaskRegister(16, (1, 4), "cls"), ratio=0.5)
    with pytest.raises(PullbackError, match="do not fit this 4-block model"):
        patch.hf_vit(model, strategy="tap", head=TaskRegister(32, (1, 6), "cls"), ratio=0.5)
    timm_model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=4, num_heads=2, num_classes=0)
    timm_trained = TaskRegister(32, (1, 4), "cls", lora=lora_shapes(timm_model.blocks))
    with pytest.raises(PullbackError, match="adapts attn.qkv .* layer layout it was trained on"):
        patch.hf_vit(model, strategy="tap", head=timm_trained, ratio=0.5)
    with pytest.raises(PullbackError, match="adapts attention.q_proj"):
        patch.timm(timm_model, strategy="tap", head=TaskRegister(32, (1, 4), "cls", lora=lora_shapes(model.layers, "vit")), ratio=0.5)
    assert patch.config(model) is None


@pytest.mark.parametrize("adapt", ["none", "lora"])
def test_train_tap_on_a_hugging_face_folder_then_deploy_with_patch_auto(tmp_path, adapt):
    """``pullback train tap --model hf:DIR`` trains through the HF patch's layer loop (its training
    forward), checkpoints, and the checkpoint deploys on the loaded model with ``patch.auto``."""
    import json

    from helpers.images import random_image_folder
    from pullback_ext.cli import main
    from pullback_ext.sources.models import ModelSpec, load_model
    from pullback_ext.tap.checkpoint import load_register

    folder = tmp_path / "vit"
    tiny_hf("vit", "sdpa").save_pretrained(folder)
    image_dir = random_image_folder(tmp_path / "images", 6, 40)
    out = tmp_path / "tap"
    assert main(["train", "tap", "--model", f"hf:{folder}", "--images", str(image_dir), "--task", "cls", "--adapt", adapt,
                 "--num-images", "4", "--heldout", "2", "--steps", "2", "--batch-size", "2", "--lr", "1e-2",
                 "--warmup", "1", "--threads", "1", "--quiet", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [row["rho"] for row in results["heldout"]] == [0.3, 0.5, 0.7, 1.0]
    trained = load_register(out)
    assert trained.layers == (1, 4) and trained.adapted == (adapt == "lora")
    assert all(k.split(".", 1)[1].startswith(("attention.", "mlp.")) for k in trained.lora_shapes)  # the HF ViT's own linears
    assert trained.shares.weight.abs().sum() > 0  # trained: it starts at zero
    assert all(b.abs().sum() > 0 for b in trained.lora_b.values())  # TAP-J's adapters too (they start at zero)
    model, _ = load_model(ModelSpec("hf", str(folder)), None, headless=True)
    x = images(2)
    ref = model(pixel_values=x).last_hidden_state
    patch.auto(model, strategy="tap", head=str(out), ratio=0.5)
    lengths, out_ = entering_lengths(model, x)
    assert lengths[0] == 18 and lengths[3] - 2 == keep_count(0.5, N) and out_.last_hidden_state.shape == ref.shape
    patch.unpatch(model)
    assert torch.equal(model(pixel_values=x).last_hidden_state, ref)


@pytest.mark.parametrize("kind", ["vit", "dpt"])
def test_training_forward_through_the_hf_loop_equals_the_deployed_one(kind):
    """The training runner (the relaxed loop inside the HF patch: removed tokens masked, their
    frozen features in the hidden states a DPT neck reads) gives the deployed model's output."""
    from helpers.prune import tiny_dpt
    from pullback_ext.comparison.backbones import hf_backbone
    from pullback_ext.tap_training.evaluation import pruned_outputs
    from pullback_ext.tap_training.training import BackboneRunner

    model = tiny_dpt().double() if kind == "dpt" else tiny_hf("vit", "sdpa").double()
    task = "depth" if kind == "dpt" else "cls"
    register = register_for(task, (1, 3) if task == "depth" else (1, 4)).double()
    backbone, x = hf_backbone(model), images(3).double()
    deployed = pruned_outputs(backbone, register, x, 0.45)
    trained = BackboneRunner(backbone, task)(register, x, 0.45)
    torch.testing.assert_close(trained, deployed, rtol=1e-5, atol=1e-7)  # the bias's ε-leak, through DPT's head
    assert not torch.allclose(deployed, backbone.full(x)["depth" if task == "depth" else "embedding"], atol=1e-4)
