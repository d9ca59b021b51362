"""Reduction-aware layer loops for the Hugging Face ViT families of
:mod:`pullback_ext.families`: DPT, DINOv2 (with or without registers; also Depth
Anything's backbone), ViT, CLIP and SigLIP vision models, DINOv3 ViT (registers, RoPE).

Transformers records ``hidden_states`` (what a DPT or Depth Anything neck reads) with forward hooks
on every layer, so each layer must *return* full-length features: a patched layer runs on the
current (reduced) tokens and hands back the full sequence (pruned tokens frozen, merged tokens
unmerged); the loop goes on with the layer's output on the current tokens. Where the loop owner
itself installs those hooks (its forward is wrapped by transformers' ``capture_outputs``: DINOv2,
DINOv3, ViT), the patched forward is wrapped the same way; DPT, CLIP and SigLIP install them one
level up (``DPTModel``, ``CLIPVisionModel``, ``SiglipVisionModel``).

Attention bias (proportional attention after merges, masked LLF): the DINOv2, ViT, CLIP, SigLIP and
DINOv3 layers take an additive ``attention_mask`` (transformers' eager and SDPA attention add it to
the logits), so the bias is passed as that; DPT's attention takes no mask, so the patched layer
computes the same operations itself with the bias added to the logits (:func:`biased_layer_forward`).
DINOv3 layers get the rotary rows of their current tokens (:mod:`pullback_ext.prune.rope`).

The methods with a block loop of their own (``Method.own_loop``: ToMe, EViT, ASAP, …) run it on
the layers (:mod:`pullback_ext.prune.hf_split`); the layers are called once more afterwards with
their full-length outputs, which transformers' hooks then record.

TAP (``strategy="tap"``) runs with its task register in the sequence, after the prefix tokens: what
a layer returns (and transformers records) is the full-length sequence without it, while the loop
goes on with the layer's own output on the current tokens, register included. The register is a
prefix token to RoPE too: like CLS and the registers it gets no rotary row.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from functools import partial
from typing import Optional, Union

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError
from pullback_ext.families import HFFamily, check_transformers, detect, family as family_named
from pullback_ext.families.dpt import ADAPTER as DPT
from pullback_ext.prune import hf_split
from pullback_ext.prune.hf_vit import model_forward, refuse_attention_mask
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import Reduction
from pullback_ext.prune.rope import DeferredAttention, RotaryRows, still_cos_sin
from pullback_ext.prune.tokens import TokenState
from pullback_ext.tap.tokens import strip_register

_LAYER_ATTR = "_pullback_layer_state"
# Attention implementations that add a float attention_mask to the logits.
_MASKABLE_ATTENTION = ("eager", "sdpa")


@dataclass(frozen=True)
class Encoder:
    """A layer loop the pipeline can run: ``module`` owns the loop (its forward is replaced) and
    holds the layers (:attr:`layers`); ``family`` is its adapter
    (:class:`~pullback_ext.families.adapter.HFFamily`); ``num_prefix`` counts CLS and register tokens."""

    module: torch.nn.Module
    family: HFFamily
    num_prefix: int
    feeds_dense_neck: bool  # its hidden states feed a dense decoder (a transformers backbone, a DPT neck)
    has_cls: bool = True

    @property
    def layers(self) -> torch.nn.ModuleList:
        return getattr(self.module, self.family.layer_attr)


def find_encoder(model, families: Optional[tuple] = None) -> Encoder:
    """The layer loop of ``model`` in the first of ``families`` (names in
    :func:`pullback_ext.families.table`; None: every family), in detection order, it belongs to: a
    DPT, Depth Anything, DINOv2, ViT, CLIP or SigLIP vision, DINOv3 model, or a model built on one."""
    family = detect(model, families)
    if not isinstance(family, HFFamily):
        raise PullbackError(f"model: expected a Hugging Face model; {type(model).__name__} is {family.title}")
    return Encoder(family.loop_owner(model), family, family.num_prefix(model), has_cls=family.has_cls(model),
                   feeds_dense_neck=family.feeds_dense_neck(model))


def configured_patches(model) -> Optional[int]:
    """Patch tokens of a Hugging Face ``model`` at its configured ``image_size`` and ``patch_size``
    (of its ``backbone_config`` where it has one: DPT, Depth Anything); None where it does not say."""
    config = getattr(model.config, "backbone_config", None) or model.config
    size, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    pair = lambda v: tuple(v) if isinstance(v, (list, tuple)) else (v, v)  # noqa: E731
    if size is None or patch is None or not all(isinstance(v, int) and v > 0 for v in pair(size) + pair(patch)):
        return None
    (h, w), (ph, pw) = pair(size), pair(patch)
    return (h // ph) * (w // pw)


def attention_probs(layer, x: torch.Tensor, bias=None, family: str = "dpt", position_embeddings=None) -> torch.Tensor:
    """Head-averaged attention probabilities ``[B, K, K]`` of a layer of the family named ``family``
    on input ``x [B, K, D]`` (:meth:`~pullback_ext.families.adapter.HFFamily.attention_probs`)."""
    return family_named(family).attention_probs(layer, x, bias, position_embeddings)


def dinov2_attention_probs(layer, x: torch.Tensor, bias=None) -> torch.Tensor:
    """:func:`attention_probs` of a ``Dinov2Layer``."""
    return attention_probs(layer, x, bias, "dinov2")


def biased_layer_forward(layer, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``DPTViTLayer.forward`` on ``x [B, K, D]`` with ``bias`` (``[B, 1, 1|K, K]``) added to the
    attention logits of every head (inference: no dropout)."""
    attn, h, (q, key, v) = DPT.heads(layer, x, 3)
    b, k, _ = h.shape
    context = F.scaled_dot_product_attention(q, key, v, attn_mask=bias.to(q.dtype), scale=attn.scaling)
    x = layer.attention.output(context.transpose(1, 2).reshape(b, k, attn.all_head_size), h) + x
    return layer.output(layer.intermediate(layer.layernorm_after(x)), x)


def masked_layer_forward(layer, x: torch.Tensor, bias: Optional[torch.Tensor], family: Union[str, HFFamily] = "dinov2",
                         **extra):
    """The layer's own forward on ``x [B, K, D]`` with ``bias`` (``[B, 1, 1|K, K]`` or None) as its
    additive ``attention_mask`` (the families whose layers take one; ``family``: its adapter or
    name); ``extra``: further layer arguments (DINOv3's ``position_embeddings``)."""
    if bias is not None:
        adapter = family_named(family) if isinstance(family, str) else family
        implementation = adapter.attention_module(layer).config._attn_implementation
        if implementation not in _MASKABLE_ATTENTION:
            raise PullbackError(f"attention implementation {implementation!r} takes no additive attention mask, which "
                                f"proportional attention and masked LLF need; load the model with "
                                f"attn_implementation='sdpa' or 'eager', or pass prop_attn=False and llf='full' or False")
        bias = bias.to(x.dtype)
    return type(layer).forward(layer, x, attention_mask=bias, **extra)


def dinov2_biased_forward(layer, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``Dinov2Layer.forward`` on ``x [B, K, D]`` with ``bias`` (``[B, 1, 1|K, K]``) as its additive
    attention mask."""
    return masked_layer_forward(layer, x, bias, "dinov2")


def _current_forward(holder: dict, family: HFFamily, layer, state, bias) -> torch.Tensor:
    """The layer's own computation on the current tokens ``state.x [B, K, D]`` (with ``bias`` and,
    RoPE families, the rotary rows of the current tokens); returns ``[B, K, D]``."""
    x, extra = state.x, {}
    if family.rotary:
        extra["position_embeddings"] = _rotary_rows(holder, state)
        holder["deferred"].fill(layer, x, bias, extra["position_embeddings"])
    if family.takes_mask:
        return masked_layer_forward(layer, x, bias, family, **extra)
    return type(layer).forward(layer, x) if bias is None else biased_layer_forward(layer, x, bias)


def _rotary_rows(holder: dict, state) -> tuple:
    """The rotary ``(cos, sin)`` rows of the current tokens of ``state`` (RoPE families)."""
    return holder["rows"].select(state, holder["rotary"])


def _layer_forward(holder: dict, family: HFFamily):
    """A layer forward that runs on the loop's current tokens (with its bias and rotary rows) and
    returns full-length features; while the originals' outputs are replayed (see
    :func:`_run_original`) it returns the layer's recorded full-length output; outside a patched
    loop it is the layer's own forward."""

    def forward(layer, x: torch.Tensor, *args, **kwargs):
        if "replay" in holder:
            return holder["replay"][layer]
        state, bias = holder.get("state"), holder.get("bias")
        if state is None:
            return type(layer).forward(layer, x, *args, **kwargs)
        # the first layer is handed the unreduced input (see :func:`_unreduced_input`); it runs on state.x
        out = _current_forward(holder, family, layer, state, bias)
        holder["current"] = out  # what the loop goes on with (see :func:`encoder_forward`)
        full = state.full(out) if state.reduced else out
        return full if holder.get("register") is None else strip_register(full, holder["register"])

    return forward


def _unreduced_input(holder: dict):
    """A forward pre-hook for the first layer: transformers records its input as ``hidden_states[0]``,
    which stays the full-length embedding (without TAP's register) when a stage reduces the input of
    layer 0."""

    def hook(layer, args):
        return (holder["input"],) + tuple(args[1:]) if holder.get("state") is not None else None

    return hook


def _attention_reader(encoder: Encoder, holder: dict, position_embeddings):
    """The ``attention_probs(layer, x, bias)`` the block loop calls; for RoPE families the rotary
    tables go into ``holder`` and the attention is computed when the layer runs (TAP's register is
    one more prefix token)."""
    family = encoder.family
    if not family.rotary:
        return lambda layer, x, bias: family.attention_probs(layer, x, bias)
    if position_embeddings is None:
        raise PullbackError(f"position_embeddings: {family.title} layers need the rotary (cos, sin) tables; got None")
    prefix = encoder.num_prefix + int(holder.get("register") is not None)
    holder["rows"], holder["rotary"] = RotaryRows(prefix, still_cos_sin), tuple(position_embeddings)
    holder["deferred"] = DeferredAttention(lambda layer, x, bias, rows: family.attention_probs(layer, x, bias, rows))
    return holder["deferred"].request


def encoder_forward(encoder: Encoder, reduction: Reduction, holder: dict, hidden_states: torch.Tensor,
                    attention_mask=None, position_embeddings=None):
    """The layer loop with token reduction on ``hidden_states [B, N, D]`` (``position_embeddings``:
    the rotary tables of the full sequence, RoPE families); every layer output is full-length.
    Returns ``BaseModelOutput`` with ``last_hidden_state [B, N, D]``."""
    from transformers.modeling_outputs import BaseModelOutput

    refuse_attention_mask(attention_mask)

    def call_layer(layer, state: TokenState, bias) -> torch.Tensor:
        holder["state"], holder["bias"] = state, bias
        layer(state.x)  # returns the full-length sequence (recorded by transformers' hooks)
        return holder.pop("current")

    try:
        holder["input"] = hidden_states
        holder["register"] = encoder.num_prefix if reduction.method.needs.extra_token else None
        probs = _attention_reader(encoder, holder, position_embeddings)
        if reduction.method.own_loop:
            final = _run_original(encoder, reduction, holder, hidden_states, probs)
        else:
            final, _ = run_blocks(reduction, hidden_states, encoder.layers, call_layer, probs)
    finally:
        holder.clear()
    return BaseModelOutput(last_hidden_state=final)


def _run_original(encoder: Encoder, reduction: Reduction, holder: dict, hidden_states: torch.Tensor, probs):
    """An original method's own loop (:func:`pullback_ext.prune.hf_split.run`) on ``hidden_states
    [B, N, D]``, its layers run directly on the current tokens; then every layer is called once more
    to hand transformers' hooks its full-length output (the layers the originals split never run
    as modules). Returns the final features ``[B, N, D]``."""
    family = encoder.family

    def call_layer(layer, state, bias) -> torch.Tensor:
        return _current_forward(holder, family, layer, state, bias)

    rows = partial(_rotary_rows, holder) if family.rotary else None
    final, outputs = hf_split.run(family, reduction, hidden_states, encoder.layers, call_layer, probs, rows)
    holder["replay"] = dict(zip(encoder.layers, outputs))
    x = hidden_states
    for layer in encoder.layers:
        x = layer(x)
    return final


def _owner_forward(encoder: Encoder, reduction: Reduction, holder: dict):
    """The patched forward of the loop owner, taking the arguments of its own forward."""
    if encoder.family.mirrored:
        def run_layers(hidden_states: torch.Tensor) -> torch.Tensor:
            return encoder_forward(encoder, reduction, holder, hidden_states).last_hidden_state

        return lambda module, *args, **kwargs: model_forward(module, run_layers, *args, **kwargs)
    signature = inspect.signature(type(encoder.module).forward)
    first = list(signature.parameters)[1]  # after self: the hidden states (or inputs_embeds)

    def forward(module, *args, **kwargs):
        arguments = signature.bind(module, *args, **kwargs).arguments
        return encoder_forward(encoder, reduction, holder, arguments[first], arguments.get("attention_mask"),
                               arguments.get("position_embeddings"))

    return forward


def install(encoder: Encoder, reduction: Reduction) -> None:
    """Patch the loop owner and its layers in place."""
    family = encoder.family
    check_transformers(family)
    holder: dict = {}
    for layer in encoder.layers:
        layer.forward = types.MethodType(_layer_forward(holder, family), layer)
        setattr(layer, _LAYER_ATTR, None)
    setattr(encoder.layers[0], _LAYER_ATTR, encoder.layers[0].register_forward_pre_hook(_unreduced_input(holder)))
    forward = _owner_forward(encoder, reduction, holder)
    if family.captures:
        from transformers.utils.generic import merge_with_config_defaults
        from transformers.utils.output_capturing import capture_outputs

        forward = merge_with_config_defaults(capture_outputs(tie_last_hidden_states=False)(forward))
    encoder.module.forward = types.MethodType(forward, encoder.module)


def restore(module) -> None:
    """Undo :func:`install` on a loop owner."""
    for layer in module.modules():
        if hasattr(layer, _LAYER_ATTR):
            hook = getattr(layer, _LAYER_ATTR)  # the first layer's pre-hook, None for the others
            if hook is not None:
                hook.remove()
            del layer.forward
            delattr(layer, _LAYER_ATTR)
    del module.forward
