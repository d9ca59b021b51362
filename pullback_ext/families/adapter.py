"""What a family adapter holds: :class:`TimmFamily` (timm models, recognised by class) and
:class:`HFFamily` (Hugging Face models, recognised by the module that runs their layer loop).

Every adapter answers the same questions, which the patches, probes, model sources and TAP
training ask instead of testing classes themselves:

- ``name``, ``title`` (in messages), ``priority`` (lower: tried first by
  :func:`~pullback_ext.families.detect`), ``listing`` (how it reads in the list of
  supported families; empty: covered by another's);
- ``matches(model)``, ``layers(model)`` (the block list), ``num_prefix(model)`` (CLS and register
  tokens), ``feeds_dense_neck(model)``;
- ``lora_targets``: the linears of one block TAP-J adapts (a name a block lacks is skipped);
- the traits that decide which reduction methods it runs: ``has_cls(model)``, ``rotary`` (the
  blocks rotate queries and keys by each token's position), ``splittable`` (its blocks can be run
  in an attention half and an MLP half), ``takes_extra_token`` (one more prefix token, a task
  register, can join the sequence: False where the rotary rows are laid out for the model's own
  prefix only).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class AttentionLayout:
    """Where a layer keeps its pre-attention norm, its self-attention (dotted path from the layer),
    the query/key/value projections and head width of that attention, and its logit scale."""

    norm: str
    attention: str
    projections: tuple
    head_size: str
    scaling: str


@dataclass(frozen=True)
class Branches:
    """The two residual branches of a layer, to run it in halves: ``attention_out``, the modules
    (dotted paths from the layer) applied in turn to the attention's merged heads ``[B, K, H·d]``
    (output projection, LayerScale); ``mlp_norm``, the norm before the MLP; ``mlp``, the modules
    applied in turn to its output (MLP, LayerScale). Dropout and drop path are identities at
    inference and left out."""

    attention_out: tuple
    mlp_norm: str
    mlp: tuple


@dataclass(frozen=True)
class ProbeReadout:
    """Where a family's probe reads its parts. ``bases``: class names of the base model (the one with
    the embeddings and the layer loop); ``wrapper``: the attribute a model built on it (a classifier,
    a model with a projection) holds it under; ``layers``: dotted path of the layers from the base;
    ``norm``: the base's norm on all tokens after the loop (None: none); ``pool``: the base's map of
    the last hidden state ``[B, N, D]`` to ``pooler_output`` ``[B, D]`` (None: its normed CLS row),
    ``head`` the base's attribute it needs; ``projection``: the wrapper's attribute projecting the
    pooled output (None: none); ``pooler``: the image embedding is the base's ``pooler_output``
    (False: the CLS row of its ``last_hidden_state``); ``rotary``: the layers read the base's
    ``rope_embeddings``."""

    bases: tuple
    wrapper: Optional[str]
    layers: str
    norm: Optional[str]
    pool: Optional[Callable] = None
    head: Optional[str] = None
    projection: Optional[str] = None
    pooler: bool = True
    rotary: bool = False


def first_module(model, names: tuple) -> Optional[torch.nn.Module]:
    """The first module of ``model`` (itself included) whose class name is in ``names``, or None."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return next((m for m in modules if type(m).__name__ in names), None)


@dataclass(frozen=True)
class TimmFamily:
    """A timm family: ``classes()`` returns the timm classes a model of which (or of a subclass)
    belongs to it (imported when asked: an ImportError means timm is not installed);
    ``rotary_table(model)``: the rotary table its blocks
    read (None: none); ``block_rotary``: the blocks take it as ``block(x, rope=...)``."""

    name: str
    title: str
    classes: Callable
    lora_targets: tuple
    priority: int = 0
    listing: Optional[str] = None
    rotary: bool = False
    takes_extra_token: bool = True
    rotary_table: Optional[Callable] = None
    splittable: bool = True

    def matches(self, model) -> bool:
        try:
            classes = self.classes()
        except ImportError:
            return False
        return isinstance(model, classes)

    def layers(self, model) -> torch.nn.ModuleList:
        return model.blocks

    def num_prefix(self, model) -> int:
        return int(model.num_prefix_tokens)

    def has_cls(self, model) -> bool:
        return getattr(model, "cls_token", None) is not None

    def feeds_dense_neck(self, model) -> bool:
        return False


@dataclass(frozen=True)
class HFFamily:
    """A Hugging Face family.

    ``loops``: class names of the module that runs the layer loop (the loop owner, whose forward a
    patch replaces); with ``parents`` it must be the ``encoder`` of a module of those classes (the
    text models of CLIP and SigLIP have the same encoder class); with ``anchors`` the model must
    hold a module of those classes (a family whose layers are another's: Depth Anything's DINOv2);
    ``layer_attr``: the loop owner's attribute that holds the layers. ``loads``: transformers model
    type -> the classes a model source builds for it (the config's listed architecture, else the
    first); ``depth``: those are depth models. ``dense``: class names that mean the hidden states
    feed a dense neck. ``takes_mask``: the layers take an additive ``attention_mask``.
    ``captures``: the loop owner's forward records hidden states itself (transformers'
    ``capture_outputs``). ``rotate(q, k, position_embeddings)``: rotates queries and keys ``[B, H,
    K, d]`` (RoPE families). ``mirrored``: the loop owner is the model itself, whose forward a patch
    mirrors. ``checked``: the transformers version range applies. ``probe``: its probe read-out
    (None: no CLS-model probe). ``short_title``: its name in the probes' messages.
    """

    name: str
    title: str
    loops: tuple
    attention: AttentionLayout
    branches: Branches
    lora_targets: tuple
    loads: dict = field(default_factory=dict)
    priority: int = 100
    listing: Optional[str] = None
    short_title: str = ""
    parents: tuple = ()
    anchors: tuple = ()
    layer_attr: str = "layer"
    cls_token: bool = True
    dense: tuple = ()
    depth: bool = False
    takes_mask: bool = True
    captures: bool = False
    rotate: Optional[Callable] = None
    mirrored: bool = False
    checked: bool = True
    probe: Optional[ProbeReadout] = None
    splittable: bool = True
    takes_extra_token: bool = True

    @property
    def rotary(self) -> bool:
        return self.rotate is not None

    def has_cls(self, model=None) -> bool:
        """Whether the sequence starts with a class token (the same for every model of the family)."""
        return self.cls_token

    def loop_owner(self, model) -> Optional[torch.nn.Module]:
        """The module of ``model`` that runs this family's layer loop, or None."""
        if self.anchors and first_module(model, self.anchors) is None:
            return None
        if not self.parents:
            return first_module(model, self.loops)
        encoder = getattr(first_module(model, self.parents), "encoder", None)
        return encoder if type(encoder).__name__ in self.loops else None

    def matches(self, model) -> bool:
        return self.loop_owner(model) is not None

    def layers(self, model) -> torch.nn.ModuleList:
        return getattr(self.loop_owner(model), self.layer_attr)

    def num_prefix(self, model) -> int:
        registers = int(getattr(self.loop_owner(model).config, "num_register_tokens", 0) or 0)
        return int(self.cls_token) + registers

    def feeds_dense_neck(self, model) -> bool:
        return first_module(model, self.dense) is not None

    def attention_module(self, layer) -> torch.nn.Module:
        """The self-attention module of ``layer``."""
        return operator.attrgetter(self.attention.attention)(layer)

    def heads(self, layer, x: torch.Tensor, count: int):
        """``(attention module, normed input h [B, K, D], [q, k, v][:count] as [B, H, K, d])`` of
        ``layer`` on its input ``x [B, K, D]`` (before any rotary embedding)."""
        layout = self.attention
        attn = self.attention_module(layer)
        h = getattr(layer, layout.norm)(x)
        b, k, _ = h.shape
        shape = (b, k, -1, getattr(attn, layout.head_size))
        return attn, h, [getattr(attn, name)(h).view(shape).transpose(1, 2) for name in layout.projections[:count]]

    def attention_probs(self, layer, x: torch.Tensor, bias=None, position_embeddings=None) -> torch.Tensor:
        """Head-averaged attention probabilities ``[B, K, K]`` of ``layer`` on input ``x [B, K, D]``
        (``bias``: additive logit mask or None; ``position_embeddings``: the rotary ``(cos, sin)``
        rows of the current patch tokens, RoPE families only)."""
        attn, _, (q, key) = self.heads(layer, x, 2)
        if self.rotate is not None:
            q, key = self.rotate(q, key, position_embeddings)
        logits = (q @ key.transpose(-2, -1)) * getattr(attn, self.attention.scaling)
        if bias is not None:
            logits = logits + bias
        return logits.softmax(dim=-1).mean(dim=1)
