"""pullback_ext.patch.auto: each supported family gets its own patch (the same options as calling
that patch directly), anything else a clear error listing the families; unpatch undoes all."""

from __future__ import annotations

import inspect

import pytest
import torch

import pullback_ext.patch as patch
from helpers.diagnose import tiny_depth_anything
from helpers.prune import images, tiny_dinov2, tiny_dpt, tiny_eva, tiny_hf, tiny_vit
from pullback_ext.errors import PullbackError


def timm_features(model, x):
    return model.forward_features(x.to(next(model.parameters()).dtype))


def hf_output(name: str):
    return lambda model, x: model(pixel_values=x)[name]


# name: (build, the patch auto must choose, what to compare, mode "auto" resolves to)
MODELS = {
    "timm_vit": (lambda: tiny_vit(reg_tokens=1), patch.timm, timm_features, "merge"),
    "timm_eva": (lambda: tiny_eva(img_size=28), patch.timm, timm_features, "merge"),
    "dpt": (tiny_dpt, patch.hf_dpt, hf_output("predicted_depth"), "prune"),
    "depth_anything": (lambda: tiny_depth_anything(dtype=torch.float32).requires_grad_(False), patch.hf_dinov2,
                       hf_output("predicted_depth"), "prune"),
    "dinov2_registers": (lambda: tiny_dinov2(registers=2), patch.hf_dinov2, hf_output("pooler_output"), "merge"),
    "vit": (lambda: tiny_hf("vit_cls"), patch.hf_vit, hf_output("logits"), "merge"),
    "clip": (lambda: tiny_hf("clip_projection"), patch.hf_clip, hf_output("image_embeds"), "merge"),
    "siglip": (lambda: tiny_hf("siglip"), patch.hf_siglip, hf_output("pooler_output"), "merge"),
    "dinov3": (lambda: tiny_hf("dinov3_backbone"), patch.hf_dinov3, lambda model, x: model(pixel_values=x).feature_maps[-1],
               "prune"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_applies_the_patch_of_each_family(name):
    build, direct, output, mode = MODELS[name]
    model = build()
    size = 28 if name == "timm_eva" else 32
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
    ref = output(model, x)
    patch.auto(model, ratio=0.0, layers=(1,), strategy="norm")
    assert torch.equal(output(model, x), ref) and patch.config(model).mode == mode
    patch.auto(model, ratio=0.5, layers=(1,), strategy="norm", prop_attn=False)
    reduced, chosen = output(model, x), patch.config(model)
    assert not torch.allclose(reduced, ref, atol=1e-5)
    patch.unpatch(model)
    assert torch.equal(output(model, x), ref) and patch.config(model) is None
    direct(model, ratio=0.5, layers=(1,), strategy="norm", prop_attn=False)
    assert patch.config(model) == chosen and torch.equal(output(model, x), reduced)
    patch.unpatch(model)
    assert not any("forward" in vars(m) or "forward_features" in vars(m) for m in model.modules())


def test_a_clip_model_patches_its_vision_encoder_only():
    from transformers import CLIPConfig, CLIPModel

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=dict(small, vocab_size=50), vision_config=dict(small, image_size=32, patch_size=8),
                                 projection_dim=16)).eval().requires_grad_(False)
    x = images(2)
    ref = model.get_image_features(pixel_values=x)
    patch.auto(model, ratio=0.5, layers=(1,), strategy="norm")
    assert not any("forward" in vars(m) for m in model.text_model.modules())
    assert not torch.allclose(model.get_image_features(pixel_values=x).pooler_output, ref.pooler_output, atol=1e-5)
    patch.unpatch(model)
    assert torch.equal(model.get_image_features(pixel_values=x).pooler_output, ref.pooler_output)


def test_anything_else_is_refused_with_the_list_of_families():
    with pytest.raises(PullbackError, match=r"patch.auto: Linear is none of the supported families: a timm "
                                            r"VisionTransformer or Eva; .*DPT.*DINOv2.*ViTModel.*CLIP.*Siglip.*DINOv3"):
        patch.auto(torch.nn.Linear(2, 2), strategy="norm")


def test_the_new_entry_points_show_every_option_in_their_signature():
    for fn in (patch.auto, patch.hf_vit, patch.hf_clip, patch.hf_siglip, patch.hf_dinov3):
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(patch.timm).parameters)
