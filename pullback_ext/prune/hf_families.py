"""The Hugging Face ViT families the reducing block loop runs, each described once (:data:`FAMILIES`).

Every family's layers are the standard pre-norm ViT layers; what differs is where the layer loop
lives, how a layer takes an attention bias, where its projections are, and what the sequence
starts with:

- ``dpt``: ``DPTViTEncoder`` (DPT); its attention takes no mask (the bias goes through a
  re-implemented layer forward).
- ``dinov2``: ``Dinov2Encoder`` / ``Dinov2WithRegistersEncoder`` (also Depth Anything's backbone).
- ``vit``: ``ViTModel`` (also inside ``ViTForImageClassification``): transformers 5 runs the layers
  in ``ViTModel.forward`` itself, which :mod:`pullback_ext.prune.hf_vit` mirrors.
- ``clip``: the ``CLIPEncoder`` of a ``CLIPVisionModel`` (also inside
  ``CLIPVisionModelWithProjection`` and ``CLIPModel``); the pre-LayerNorm runs before it and the
  pooled output is the post-LayerNorm CLS token, both outside the loop.
- ``siglip``: the ``SiglipEncoder`` of a ``SiglipVisionModel``: no CLS token (the pooled output
  comes from an attention-pooling head on the full-length last hidden state).
- ``dinov3``: ``DINOv3ViTEncoder`` (``DINOv3ViTModel``, ``DINOv3ViTBackbone``): registers and
  rotary position embeddings passed to every layer (:mod:`pullback_ext.prune.rope`).

The families added here mirror transformers code checked against the versions in
:data:`CHECKED_TRANSFORMERS`; :func:`check_transformers` refuses other versions. :data:`MIRRORS`
records a hash of the upstream code the adapters mirror or rely on (a test compares it with the
installed source).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

from pullback_ext.errors import PullbackError

CHECKED_TRANSFORMERS = ("5.24", "6")  # [lowest, first excluded) versions the mirrors were checked against


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
    """The two residual branches of a layer, to run it in halves (:mod:`pullback_ext.prune.hf_split`):
    ``attention_out``, the modules (dotted paths from the layer) applied in turn to the attention's
    merged heads ``[B, K, H·d]`` (output projection, LayerScale); ``mlp_norm``, the norm before the
    MLP; ``mlp``, the modules applied in turn to its output (MLP, LayerScale). Dropout and drop
    path are identities at inference and left out."""

    attention_out: tuple
    mlp_norm: str
    mlp: tuple


@dataclass(frozen=True)
class Family:
    """One Hugging Face ViT family.

    ``loops``: class names of the module that runs the layer loop (the loop owner, whose forward is
    replaced); with ``parents`` it must be the ``encoder`` of a module of those classes (the text
    models of CLIP and SigLIP have the same encoder class); ``layers``: the loop owner's attribute
    that holds the layers. ``dense``: class names that mean the hidden states feed a dense neck (then
    ``mode="auto"`` prunes). ``takes_mask``: the layers take an additive ``attention_mask``.
    ``captures``: the loop owner's forward records hidden states itself (transformers'
    ``capture_outputs``), so the patched forward is wrapped the same way. ``rotary(q, k,
    position_embeddings)``: rotates queries and keys ``[B, H, K, d]`` (RoPE families).
    ``mirror(model, run_layers, *args, **kwargs)``: the mirrored forward of a loop owner that is the
    model itself. ``checked``: whether :func:`check_transformers` applies. ``branches``: the layer's
    residual branches, for the originals that reduce between attention and MLP.
    """

    name: str
    title: str
    loops: tuple
    attention: AttentionLayout
    branches: Branches
    parents: tuple = ()
    layers: str = "layer"
    has_cls: bool = True
    dense: tuple = ()
    takes_mask: bool = True
    captures: bool = False
    rotary: Optional[Callable] = None
    mirror: Optional[Callable] = None
    checked: bool = True


def _dinov3_rotary(q, k, position_embeddings):
    from transformers.models.dinov3_vit.modeling_dinov3_vit import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, *position_embeddings)


def _vit_mirror(model, run_layers, *args, **kwargs):
    from pullback_ext.prune.hf_vit import model_forward

    return model_forward(model, run_layers, *args, **kwargs)


_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
_CLIP_LAYOUT = AttentionLayout("layer_norm1", "self_attn", _PROJECTIONS, "head_dim", "scale")
_CLIP_BRANCHES = Branches(("self_attn.out_proj",), "layer_norm2", ("mlp",))
_SCALED_BRANCHES = Branches(("attention.o_proj", "layer_scale1"), "norm2", ("mlp", "layer_scale2"))  # LayerScale

FAMILIES = {
    family.name: family
    for family in (
        Family("dpt", "a Hugging Face DPT with a ViT encoder (DPTViTEncoder)", ("DPTViTEncoder",),
               AttentionLayout("layernorm_before", "attention.attention", ("query", "key", "value"),
                               "attention_head_size", "scaling"),
               Branches(("attention.output.dense",), "layernorm_after", ("intermediate", "output.dense")),
               dense=("DPTModel",), takes_mask=False, checked=False),
        Family("dinov2", "a Hugging Face DINOv2 model (Dinov2Encoder / Dinov2WithRegistersEncoder)",
               ("Dinov2Encoder", "Dinov2WithRegistersEncoder"),
               AttentionLayout("norm1", "attention", _PROJECTIONS, "head_dim", "scaling"), _SCALED_BRANCHES,
               dense=("Dinov2Backbone", "Dinov2WithRegistersBackbone"), captures=True, checked=False),
        Family("vit", "a Hugging Face ViTModel / ViTForImageClassification", ("ViTModel",),
               AttentionLayout("layernorm_before", "attention", _PROJECTIONS, "head_dim", "scaling"),
               Branches(("attention.o_proj",), "layernorm_after", ("mlp",)), layers="layers", captures=True, mirror=_vit_mirror),
        Family("clip", "a Hugging Face CLIP vision model (CLIPVisionModel / CLIPVisionModelWithProjection)",
               ("CLIPEncoder",), _CLIP_LAYOUT, _CLIP_BRANCHES, parents=("CLIPVisionModel",), layers="layers"),
        Family("siglip", "a Hugging Face SiglipVisionModel", ("SiglipEncoder",), _CLIP_LAYOUT, _CLIP_BRANCHES,
               parents=("SiglipVisionModel",), layers="layers", has_cls=False),
        Family("dinov3", "a Hugging Face DINOv3 ViT (DINOv3ViTModel / DINOv3ViTBackbone)", ("DINOv3ViTEncoder",),
               AttentionLayout("norm1", "attention", _PROJECTIONS, "head_dim", "scaling"), _SCALED_BRANCHES,
               dense=("DINOv3ViTBackbone",), captures=True, rotary=_dinov3_rotary),
    )
}

# The upstream code the adapters mirror or rely on, as of transformers 5.24.0: "module:qualified name"
# -> (sha256 of its inspect.getsource, what here depends on it). When a hash changes, re-read the new
# source against that code (and the versions in CHECKED_TRANSFORMERS), then record the new hash.
MIRRORS = {
    "transformers.models.vit.modeling_vit:ViTModel.forward": (
        "212d5a8f612d34b1cf6037a24a633b6d05535521e540c85b9a43b7edb4155aba", "hf_vit.model_forward (mirrored line by line)"),
    "transformers.models.dpt.modeling_dpt:DPTViTEncoder.forward": (
        "ac35e3e6f0a29c8fda1d900aefe81bddecdd85121814d180ca0ce93ca27816c1", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dpt.modeling_dpt:DPTViTLayer.forward": (
        "0936d66774596f7aed1c1b3dbfe415470d0fb4f12a0762d96a546e22b8137ff2", "hf_encoders.biased_layer_forward"),
    "transformers.models.dinov2.modeling_dinov2:Dinov2Encoder.forward": (
        "a0a46fc79ac37bb4d29cf5b9da6f695b60ff0c6342575e9a32b6a207d9891fbb", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov2_with_registers.modeling_dinov2_with_registers:Dinov2WithRegistersEncoder.forward": (
        "a0a46fc79ac37bb4d29cf5b9da6f695b60ff0c6342575e9a32b6a207d9891fbb", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.clip.modeling_clip:CLIPEncoder.forward": (
        "1004cb628fc6685f8316486c8fe5e84692ecf7add0fbbc6f91cb397ab768ca50", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.siglip.modeling_siglip:SiglipEncoder.forward": (
        "d91ba546ba6bcc0710927bffa70189e0c09563e897a682a969b8f8b8456f6963", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov3_vit.modeling_dinov3_vit:DINOv3ViTEncoder.forward": (
        "b982b7cb5ae25c8d31c51bbd98019bb70dade90b7d7ca9cae5cf825f71cf3d7c", "hf_encoders.encoder_forward (its layer loop)"),
    "transformers.models.dinov3_vit.modeling_dinov3_vit:apply_rotary_pos_emb": (
        "8403a7e3d9db2c5e111f7a7795108985120a7d66ce5f1500590ea0a0116cebd3",
        "rope.RotaryRows (prefix tokens = all tokens but one per table row)"),
}


def attention_module(layer, family: Family):
    """The self-attention module of ``layer``."""
    return operator.attrgetter(family.attention.attention)(layer)


def heads(layer, x, family: str, count: int):
    """``(attention module, normed input h [B, K, D], [q, k, v][:count] as [B, H, K, d])`` of a
    layer of ``family`` on its input ``x [B, K, D]`` (before any rotary embedding)."""
    layout = FAMILIES[family].attention
    attn = attention_module(layer, FAMILIES[family])
    h = getattr(layer, layout.norm)(x)
    b, k, _ = h.shape
    shape = (b, k, -1, getattr(attn, layout.head_size))
    return attn, h, [getattr(attn, name)(h).view(shape).transpose(1, 2) for name in layout.projections[:count]]


def check_transformers(family: Family) -> None:
    """Raise unless the installed transformers is one the mirror of ``family`` was checked against."""
    if not family.checked:
        return
    import transformers
    from packaging.version import Version

    low, high = CHECKED_TRANSFORMERS
    installed = Version(transformers.__version__)
    if not Version(low) <= installed < Version(high):
        raise PullbackError(f"token reduction for {family.title} mirrors transformers {low} up to (not including) "
                            f"{high}, whose layer loop it replaces; transformers {transformers.__version__} is installed "
                            f"(install transformers>={low},<{high})")
