"""Reduction-aware encoders for Hugging Face ViT-family models: DPT (ViT backbone) and DINOv2
(with or without registers; also as the backbone of Depth Anything).

Transformers records ``hidden_states`` (what a DPT or Depth Anything neck reads) with forward hooks
on every encoder layer, so each layer must *return* full-length features: a patched layer runs on
the current (reduced) tokens and hands back the full sequence (pruned tokens frozen, merged tokens
unmerged); the encoder gathers the current tokens again before the next layer. Where the encoder
itself installs those hooks (DINOv2's forward is wrapped by transformers' ``capture_outputs``), the
patched forward is wrapped the same way; DPT installs them one level up, in ``DPTModel``.

Attention bias (proportional attention after merges, masked LLF): DINOv2 layers take an additive
``attention_mask`` (transformers' eager and SDPA attention add it to the logits), so the bias is
passed as that; DPT's attention takes no mask, so the patched layer computes the same operations
itself with the bias added to the logits (:func:`biased_layer_forward`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.pipeline import ReductionConfig, run_blocks
from pullback_ext.prune.tokens import TokenState

_LAYER_ATTR = "_pullback_layer_state"
_DPT_ENCODERS = ("DPTViTEncoder",)
_DINOV2_ENCODERS = ("Dinov2Encoder", "Dinov2WithRegistersEncoder")
# Attention implementations that add a float attention_mask to the logits.
_MASKABLE_ATTENTION = ("eager", "sdpa")


@dataclass(frozen=True)
class Encoder:
    """An encoder the pipeline can run: ``module.layer`` is its block list; ``family`` is ``"dpt"``
    or ``"dinov2"``; ``num_prefix`` counts CLS and register tokens."""

    module: torch.nn.Module
    family: str
    num_prefix: int
    feeds_dense_neck: bool  # its hidden states feed a dense decoder (a transformers backbone)


def _first(model, names: tuple):
    modules = model.modules() if hasattr(model, "modules") else ()
    return next((m for m in modules if type(m).__name__ in names), None)


def find_encoder(model, families: tuple = ("dpt", "dinov2")) -> Encoder:
    """The encoder of a DPT (``DPTForDepthEstimation``, ``DPTModel``) or DINOv2 model
    (``Dinov2Model``, ``Dinov2ForImageClassification``, ``Dinov2Backbone``, their ``WithRegisters``
    versions, ``DepthAnythingForDepthEstimation``)."""
    dpt = _first(model, _DPT_ENCODERS) if "dpt" in families else None
    if dpt is not None:
        return Encoder(dpt, "dpt", 1, feeds_dense_neck=True)
    dinov2 = _first(model, _DINOV2_ENCODERS) if "dinov2" in families else None
    if dinov2 is not None:
        registers = int(getattr(dinov2.config, "num_register_tokens", 0) or 0)
        dense = _first(model, ("Dinov2Backbone", "Dinov2WithRegistersBackbone")) is not None
        return Encoder(dinov2, "dinov2", 1 + registers, feeds_dense_neck=dense)
    wanted = {"dpt": "a Hugging Face DPT with a ViT encoder (DPTViTEncoder)",
              "dinov2": "a Hugging Face DINOv2 model (Dinov2Encoder / Dinov2WithRegistersEncoder)"}
    raise PullbackError(f"model must be {' or '.join(wanted[f] for f in families)}; got {type(model).__name__}")


def attention_probs(layer, x: torch.Tensor, bias=None) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of a ``DPTViTLayer`` on input ``x``
    (``bias``: additive logit mask or None)."""
    attn = layer.attention.attention
    h = layer.layernorm_before(x)
    b, k, _ = h.shape
    shape = (b, k, attn.num_attention_heads, attn.attention_head_size)
    q = attn.query(h).view(shape).transpose(1, 2)
    key = attn.key(h).view(shape).transpose(1, 2)
    return _mean_probs(q, key, attn.scaling, bias)


def dinov2_attention_probs(layer, x: torch.Tensor, bias=None) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of a ``Dinov2Layer`` (or its
    ``WithRegisters`` twin) on input ``x``."""
    attn = layer.attention
    h = layer.norm1(x)
    b, k, _ = h.shape
    shape = (b, k, attn.num_attention_heads, attn.head_dim)
    q = attn.q_proj(h).view(shape).transpose(1, 2)
    key = attn.k_proj(h).view(shape).transpose(1, 2)
    return _mean_probs(q, key, attn.scaling, bias)


def _mean_probs(q: torch.Tensor, key: torch.Tensor, scaling: float, bias) -> torch.Tensor:
    logits = (q @ key.transpose(-2, -1)) * scaling
    if bias is not None:
        logits = logits + bias
    return logits.softmax(dim=-1).mean(dim=1)


def biased_layer_forward(layer, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``DPTViTLayer.forward`` on ``x [B, K, D]`` with ``bias`` (``[B, 1, 1|K, K]``) added to the
    attention logits of every head (inference: no dropout)."""
    attn = layer.attention.attention
    h = layer.layernorm_before(x)
    b, k, _ = h.shape
    shape = (b, k, attn.num_attention_heads, attn.attention_head_size)
    q, key, v = (proj(h).view(shape).transpose(1, 2) for proj in (attn.query, attn.key, attn.value))
    context = F.scaled_dot_product_attention(q, key, v, attn_mask=bias.to(q.dtype), scale=attn.scaling)
    x = layer.attention.output(context.transpose(1, 2).reshape(b, k, attn.all_head_size), h) + x
    return layer.output(layer.intermediate(layer.layernorm_after(x)), x)


def dinov2_biased_forward(layer, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``Dinov2Layer.forward`` on ``x [B, K, D]`` with ``bias`` (``[B, 1, 1|K, K]``) as its additive
    attention mask."""
    implementation = layer.attention.config._attn_implementation
    if implementation not in _MASKABLE_ATTENTION:
        raise PullbackError(f"attention implementation {implementation!r} takes no additive attention mask, which "
                            f"proportional attention and masked LLF need; load the model with "
                            f"attn_implementation='sdpa' or 'eager', or pass prop_attn=False and llf='full' or False")
    return type(layer).forward(layer, x, bias.to(x.dtype))


def _layer_forward(holder: dict, family: str):
    biased = dinov2_biased_forward if family == "dinov2" else biased_layer_forward

    def forward(layer, x: torch.Tensor, *args, **kwargs):
        state, bias = holder.get("state"), holder.get("bias")
        out = type(layer).forward(layer, x, *args, **kwargs) if bias is None else biased(layer, x, bias)
        return state.full(out) if state is not None and state.reduced else out

    return forward


def encoder_forward(encoder: Encoder, cfg: ReductionConfig, holder: dict, hidden_states: torch.Tensor,
                    attention_mask=None, **kwargs):
    """The encoder's forward with token reduction; every layer output is full-length."""
    from transformers.modeling_outputs import BaseModelOutput

    if attention_mask is not None:
        raise PullbackError(f"attention_mask: a token-reducing encoder takes none (its token set changes between "
                            f"layers); got a tensor of shape {list(attention_mask.shape)}")

    def call_layer(layer, state: TokenState, bias) -> torch.Tensor:
        holder["state"], holder["bias"] = state, bias
        out = layer(state.x)
        if not state.reduced:
            return out
        return ops.gather_tokens(out, state.positions, check_values=False)

    probs = dinov2_attention_probs if encoder.family == "dinov2" else attention_probs
    try:
        final, _ = run_blocks(cfg, hidden_states, encoder.module.layer, call_layer, probs)
    finally:
        holder["state"] = holder["bias"] = None
    return BaseModelOutput(last_hidden_state=final)


def install(encoder: Encoder, cfg: ReductionConfig) -> None:
    """Patch the encoder and its layers in place."""
    holder: dict = {}
    for layer in encoder.module.layer:
        layer.forward = types.MethodType(_layer_forward(holder, encoder.family), layer)
        setattr(layer, _LAYER_ATTR, True)

    def forward(module, hidden_states: torch.Tensor, attention_mask=None, **kwargs):
        return encoder_forward(encoder, cfg, holder, hidden_states, attention_mask, **kwargs)

    if encoder.family == "dinov2":
        from transformers.utils.output_capturing import capture_outputs

        forward = capture_outputs(tie_last_hidden_states=False)(forward)
    encoder.module.forward = types.MethodType(forward, encoder.module)


def restore(module) -> None:
    """Undo :func:`install` on an encoder module."""
    for layer in module.layer:
        if getattr(layer, _LAYER_ATTR, False):
            del layer.forward
            delattr(layer, _LAYER_ATTR)
    del module.forward
