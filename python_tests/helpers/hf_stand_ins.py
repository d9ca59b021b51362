"""Tiny Hugging Face models of each family with random weights, and the timm blocks that carry the
same weights (the stand-ins the references of the original methods run on), shared by the tests of
the per-block methods on the Hugging Face families."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

import pullback_ext.patch as patch
from helpers.prune import tiny_dinov2, tiny_dpt, tiny_hf

PATCHES = {"dpt": patch.hf_dpt, "dinov2": patch.hf_dinov2, "vit": patch.hf_vit, "clip": patch.hf_clip,
           "siglip": patch.hf_siglip, "dinov3": patch.hf_dinov3}
PREFIX = {"dpt": 1, "dinov2": 3, "vit": 1, "clip": 1, "siglip": 0, "dinov3": 3}  # dinov2, dinov3: CLS + 2 registers
SPLIT_FAMILIES = ["dpt", "dinov2", "vit", "clip", "siglip"]


def tiny(family: str):
    """A 4-layer model of ``family`` in float64 (DINOv2 with 2 registers and LayerScale), SDPA attention
    where the family has a choice (transformers' eager attention takes the softmax in float32)."""
    model = tiny_dpt() if family == "dpt" else tiny_dinov2("sdpa", 2) if family == "dinov2" else tiny_hf(family, "sdpa")
    if family == "dinov2":
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.layer_scale1.lambda1.normal_(0.0, 0.5)
                layer.layer_scale2.lambda1.normal_(0.0, 0.5)
    return model.double()


def layers_of(model, family: str):
    return {"dpt": lambda: model.dpt.encoder.layer, "dinov2": lambda: model.encoder.layer, "vit": lambda: model.layers,
            "dinov3": lambda: model.model.layer}.get(family, lambda: model.encoder.layers)()


# (q, k, v, output projection, norm1, norm2, fc1, fc2, activation, LayerScale 1, 2) of each family's layer
WEIGHTS = {
    "dpt": ("attention.attention.query", "attention.attention.key", "attention.attention.value", "attention.output.dense",
            "layernorm_before", "layernorm_after", "intermediate.dense", "output.dense", "intermediate.intermediate_act_fn",
            None, None),
    "dinov2": ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "norm1", "norm2", "mlp.fc1",
               "mlp.fc2", "mlp.activation_fn", "layer_scale1", "layer_scale2"),
    "vit": ("attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "layernorm_before",
            "layernorm_after", "mlp.fc1", "mlp.fc2", "mlp.activation_fn", None, None),
    "clip": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "layer_norm1",
             "layer_norm2", "mlp.fc1", "mlp.fc2", "mlp.activation_fn", None, None),
}
WEIGHTS["siglip"] = WEIGHTS["clip"]


def timm_block(layer, family: str):
    """A timm ``Block`` with the weights of a Hugging Face layer (the converter of the references)."""
    from operator import attrgetter

    from timm.models.vision_transformer import Block

    q, k, v, proj, norm1, norm2, fc1, fc2, act, ls1, ls2 = (attrgetter(p)(layer) if p else None for p in WEIGHTS[family])
    block = Block(32, 2, mlp_ratio=2.0, qkv_bias=True, init_values=1.0 if ls1 is not None else None)
    block = block.double().eval().requires_grad_(False)
    with torch.no_grad():
        block.attn.qkv.weight.copy_(torch.cat([q.weight, k.weight, v.weight]))
        block.attn.qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        if ls1 is not None:
            block.ls1.gamma.copy_(ls1.lambda1)
            block.ls2.gamma.copy_(ls2.lambda1)
    block.attn.proj, block.norm1, block.norm2 = copy.deepcopy(proj), copy.deepcopy(norm1), copy.deepcopy(norm2)
    block.mlp.fc1, block.mlp.fc2, block.mlp.act = copy.deepcopy(fc1), copy.deepcopy(fc2), copy.deepcopy(act)
    return block


def timm_stand_in(model, family: str):
    """What the timm references read of a model (``blocks``, ``num_prefix_tokens``, the embedding
    steps, ``norm``), with the layers of ``model`` as timm blocks and the embedding steps identities:
    the references then start from the layer-0 input they are given instead of images."""
    identity = torch.nn.Identity()
    return SimpleNamespace(blocks=torch.nn.ModuleList(timm_block(layer, family) for layer in layers_of(model, family)),
                           num_prefix_tokens=PREFIX[family], norm=identity, norm_pre=identity, patch_drop=identity,
                           _pos_embed=identity, patch_embed=identity)


def hidden_states(model, x: torch.Tensor) -> tuple:
    return model(pixel_values=x, output_hidden_states=True).hidden_states
