"""Reduction-aware encoder for Hugging Face DPT (ViT backbone).

Transformers records ``hidden_states`` (what the DPT neck reads) with forward hooks on every
``DPTViTLayer``, so each layer must *return* full-length features: a patched layer runs on the
current (reduced) tokens and hands back the full sequence (pruned tokens frozen, merged tokens
unmerged); the encoder gathers the current tokens again before the next layer.

Transformers' DPT attention takes no additive mask, so when the pipeline needs one (proportional
attention after merges, masked LLF) the patched layer computes the same operations itself with the
bias added to the attention logits (:func:`biased_layer_forward`).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.pipeline import ReductionConfig, run_blocks
from pullback_ext.prune.tokens import TokenState, internal_indices

_LAYER_ATTR = "_pullback_layer_state"


def find_encoder(model):
    """The ``DPTViTEncoder`` of a DPT model (``DPTForDepthEstimation``, ``DPTModel``)."""
    for module in model.modules() if hasattr(model, "modules") else ():
        if type(module).__name__ == "DPTViTEncoder":
            return module
    raise PullbackError(f"model must be a Hugging Face DPT with a ViT encoder (DPTViTEncoder); got {type(model).__name__}")


def attention_probs(layer, x: torch.Tensor, bias=None) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of a ``DPTViTLayer`` on input ``x``
    (``bias``: additive logit mask or None)."""
    attn = layer.attention.attention
    h = layer.layernorm_before(x)
    b, k, _ = h.shape
    shape = (b, k, attn.num_attention_heads, attn.attention_head_size)
    q = attn.query(h).view(shape).transpose(1, 2)
    key = attn.key(h).view(shape).transpose(1, 2)
    logits = (q @ key.transpose(-2, -1)) * attn.scaling
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


def _layer_forward(holder: dict):
    def forward(layer, x: torch.Tensor, *args, **kwargs):
        bias = holder.get("bias")
        out = type(layer).forward(layer, x, *args, **kwargs) if bias is None else biased_layer_forward(layer, x, bias)
        state = holder.get("state")
        return state.full(out) if state is not None and state.reduced else out

    return forward


def encoder_forward(encoder, cfg: ReductionConfig, holder: dict, hidden_states: torch.Tensor, **kwargs):
    """``DPTViTEncoder.forward`` with token reduction; every layer output is full-length."""
    from transformers.modeling_outputs import BaseModelOutput

    def call_layer(layer, state: TokenState, bias) -> torch.Tensor:
        holder["state"], holder["bias"] = state, bias
        out = layer(state.x)
        if not state.reduced:
            return out
        with internal_indices():
            return ops.gather_tokens(out, state.positions)

    try:
        final, _ = run_blocks(cfg, hidden_states, encoder.layer, call_layer, attention_probs)
    finally:
        holder["state"] = holder["bias"] = None
    return BaseModelOutput(last_hidden_state=final)


def install(encoder, cfg: ReductionConfig) -> None:
    """Patch ``encoder`` (a ``DPTViTEncoder``) and its layers in place."""
    holder: dict = {}
    for layer in encoder.layer:
        layer.forward = types.MethodType(_layer_forward(holder), layer)
        setattr(layer, _LAYER_ATTR, True)

    def forward(module, hidden_states: torch.Tensor, **kwargs):
        return encoder_forward(module, cfg, holder, hidden_states, **kwargs)

    encoder.forward = types.MethodType(forward, encoder)


def restore(encoder) -> None:
    """Undo :func:`install`."""
    for layer in encoder.layer:
        if getattr(layer, _LAYER_ATTR, False):
            del layer.forward
            delattr(layer, _LAYER_ATTR)
    del encoder.forward
