"""Token merging / pruning for frozen ViTs, switched on and off in place.

    import pullback_ext.patch as patch
    patch.auto(model, head=head, ratio=0.3)             # any family below, recognised
    patch.timm(model, head=head, ratio=0.3, layers=(4,), mode="merge", strategy="importance")
    patch.hf_dinov2(dinov2, head=head, ratio=0.3)       # Hugging Face DINOv2 (CLS: merge)
    patch.hf_dpt(depth_model, head=head, ratio=0.5)     # Hugging Face DPT / Depth Anything (prune)
    patch.hf_clip(clip_vision, strategy="tome_score")   # also hf_vit, hf_siglip, hf_dinov3
    options = patch.ReductionOptions(strategy="tome_score", ratio=0.5, layers=(4, 8))
    patch.timm(model, options, mode="prune")            # options object, keywords override fields
    patch.timm(model, strategy="tome", r=16, schedule="decreasing")   # ToMe as its authors run it
    patch.timm(model, strategy="evit", keep_rate=0.7)                  # EViT as its authors run it
    patch.timm(model, strategy="pitome", r=16)                         # PiToMe as its authors define it
    patch.timm(model, strategy="expedite", cluster_grid=(8, 8))        # Expedite (clusters, reconstructs)
    patch.timm(model, strategy="asap", ratio=0.5, layers=(4,), rings=4)  # ASAP, reconstructed
    patch.timm(model, strategy="tap", head="out/tap", ratio=0.5)       # TAP task register (docs/tap.md; hf_* too)
    patch.config(model)             # the options in use, every "auto" chosen
    patch.unpatch(model)            # the original forward again

Which family runs which method follows from each method's needs (a class token, blocks split
between attention and MLP, tokens with a rotary position, an extra prefix token) and each family's
traits; the table below is generated from the method registry (:mod:`pullback_ext.prune.methods`)
and the family adapters (:mod:`pullback_ext.families`). A method a model cannot run is refused when
patching with a :class:`~pullback_ext.errors.PullbackError` that gives the reason and what the
model runs.

{support_table}
Proportional attention and masked LLF reach each family's attention as an additive mask: timm's
``attn_mask``; the ``attention_mask`` of the Hugging Face layers (eager or SDPA attention), except
DPT, whose layer is re-run with the bias added to its logits. RoPE families (Eva, DINOv3) give every
current token the rotary position of its own original place: a merged token keeps its
destination's, a pruned token re-inserted by LLF its own, EViT's fused token none (it is not
rotated); Expedite's cluster tokens have no position, so the RoPE families refuse it. A strategy a
model cannot take is refused when patching with a :class:`~pullback_ext.errors.PullbackError`
(without a CLS token: "needs a class token").

``mode="merge"`` (CLS decoders): the ``ratio`` fraction of patch tokens with the lowest keep scores
merge into their nearest remaining token (pullback distance with ``spn=``, cosine otherwise).
``mode="prune"`` (dense decoders): they are removed, their features frozen and re-inserted wherever
features are read; with ``llf`` the last block runs on the full sequence (Last-Layer Fusion; no
effect in merge mode). ``llf=True`` is the ``"masked"`` fusion: the re-inserted tokens attend to
every token but the kept tokens do not attend to them, so the kept tokens' outputs are exactly
those without LLF and only the stale re-inserted features are updated; ``llf="full"`` lets every
token attend to every token (Token Cropr's fusion, meant for a backbone trained with it).
``layers`` are 0-based block indices whose *input* is reduced; several layers form a multi-stage
schedule (``ratio`` is then the total fraction, split evenly, or one fraction per layer) — see
:func:`pullback_ext.prune.schedules.scale_layers` to map ViT-B schedules to other depths. CLS and register tokens are never merged or pruned.
The gather, merge and re-insert steps run through the ``pullback_ext.ops`` kernels. Every patched
forward but ``strategy="random"`` (its generator) compiles whole (``torch.compile(..., fullgraph=True)``)
and reads no tensor value on the host: every shape follows from the ratio, never from the values.

Besides the single-stage criteria, the methods of the registry
(:func:`pullback_ext.prune.methods.all_methods`, one module per family in
:mod:`pullback_ext.prune.methods`: the methods as their authors define them, and the library's own
such as the every-block merge ``importance_tome``) take their own options (ToMe's ``r``,
``schedule``, ``block_range``; EViT's ``keep_rate``; …), in place of ``ratio`` / ``layers`` /
``mode`` or besides them; each module documents them, and :func:`pullback_ext.prune.eta.eta` gives
the η a setting produces.

Every option is a field of :class:`~pullback_ext.prune.reduction_options.ReductionOptions`, which
documents and validates them once. Each patch function is ``fn(model, options=None, /, **overrides)``
and builds one ``ReductionOptions`` from both, so the option list is written in one place; the
functions' ``__signature__`` lists every option (every method's own included) as a keyword with
its default, which ``help()``, IPython and editors that read runtime signatures show.
"""

from __future__ import annotations

import inspect
import types
from typing import Optional

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods import check_supported, support_table
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions, keyword_parameters, with_overrides

__doc__ = __doc__.replace("{support_table}", support_table())
_ATTR = "_pullback_reduction"


def _is_patched(model) -> bool:
    return getattr(model, _ATTR, None) is not None


def _option_keywords(fn):
    """Show every option (:func:`~pullback_ext.prune.reduction_options.keyword_parameters`) as a
    keyword of ``fn(model, options=None, /, **overrides)``."""
    signature = inspect.signature(fn)
    fn.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:2] + keyword_parameters())
    return fn


@_option_keywords
def timm(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a timm ``VisionTransformer`` or ``Eva`` in place (re-patching replaces the previous plan).

    ``options`` and the keywords (which replace its fields) are those of :class:`ReductionOptions`;
    ``mode="auto"`` merges. An ``Eva`` (EVA-02, RoPE ViTs) gives each current token the rotary
    position of its original place (a merged token its destination's), and takes the single-stage
    strategies and the originals but Expedite and TAP. Returns the model.
    """
    from pullback_ext.prune import timm_vit

    timm_vit.check_model(model)
    if _is_patched(model):
        unpatch(model)
    options = with_overrides(options, **overrides)
    timm_vit.check_strategy(model, options.strategy)
    if options.prop_attn == "folded":
        from pullback_ext.prune.folded_attention import check_foldable

        check_foldable(model.blocks)
    reduction = options.resolve(timm_vit.backbone_shape(model))
    reduction.method.check_blocks(reduction, model.blocks, model.embed_dim)
    model.forward_features = types.MethodType(_with_reduction(timm_vit.forward_features, reduction), model)
    model.forward_intermediates = types.MethodType(_with_reduction(timm_vit.forward_intermediates, reduction), model)
    setattr(model, _ATTR, ("timm", reduction))
    return model


@_option_keywords
def hf_dpt(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a Hugging Face ``DPTForDepthEstimation`` / ``DPTModel`` (ViT backbone) or a
    ``DepthAnythingForDepthEstimation`` (DINOv2 backbone) in place.

    Same options as :func:`timm`; ``mode="auto"`` prunes. The encoder's hidden states (what the
    neck reads) are full-length. Returns the model.
    """
    return _patch_hf(model, ("dpt", "depth_anything", "dinov2"), options, overrides, dense_neck=True)


@_option_keywords
def hf_dinov2(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a Hugging Face DINOv2 model in place: ``Dinov2Model``, ``Dinov2ForImageClassification``,
    ``Dinov2Backbone``, their ``Dinov2WithRegisters`` versions (register tokens are never merged or
    pruned), or a model built on one (``DepthAnythingForDepthEstimation``).

    Same options as :func:`timm`; ``mode="auto"`` prunes when the encoder is a backbone whose hidden
    states feed a dense neck (Depth Anything, ``Dinov2Backbone``) and merges otherwise. Proportional
    attention and masked LLF pass their bias as the layers' additive attention mask, which needs
    ``attn_implementation`` "sdpa" (transformers' default) or "eager". Returns the model.
    """
    return _patch_hf(model, ("depth_anything", "dinov2"), options, overrides)


@_option_keywords
def hf_vit(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a Hugging Face ``ViTModel`` (or a model built on one: ``ViTForImageClassification``) in place.

    Transformers 5 runs the layers in ``ViTModel.forward`` itself; the patched forward mirrors it
    (:mod:`pullback_ext.prune.hf_vit`) for the transformers versions it was checked against, and
    refuses others. Same options as :func:`timm`; ``mode="auto"`` merges; hidden states are
    full-length; the bias of proportional attention and masked LLF is the layers' additive attention
    mask ("sdpa" or "eager" attention). Returns the model.
    """
    return _patch_hf(model, ("vit",), options, overrides)


@_option_keywords
def hf_clip(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch the vision encoder of a Hugging Face ``CLIPVisionModel`` / ``CLIPVisionModelWithProjection``
    (or ``CLIPModel``) in place.

    The pre-LayerNorm before the encoder and the pooled output (the post-LayerNorm CLS token, which
    is never merged or pruned) are unchanged. Same options and attention bias as :func:`hf_vit`;
    ``mode="auto"`` merges. Returns the model.
    """
    return _patch_hf(model, ("clip",), options, overrides)


@_option_keywords
def hf_siglip(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch the encoder of a Hugging Face ``SiglipVisionModel`` (or ``SiglipModel``) in place.

    SigLIP has no CLS token: every token is a patch token, merge mode needs no CLS (its
    attention-pooling head reads the full-length last hidden state, a merged token at every position
    it absorbed), and the strategies that read the CLS token (``evit_score``, ``cls_sim``) are
    refused when patching ("needs a class token"). Same options and attention bias as
    :func:`hf_vit`; ``mode="auto"`` merges. Returns the model.
    """
    return _patch_hf(model, ("siglip",), options, overrides)


@_option_keywords
def hf_dinov3(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a Hugging Face ``DINOv3ViTModel`` / ``DINOv3ViTBackbone`` in place (register tokens are
    never merged or pruned).

    Every layer gets the rotary position embeddings of its current tokens: a merged token keeps its
    destination's position, a pruned token re-inserted by LLF its own. Same options and attention
    bias as :func:`hf_vit`; ``mode="auto"`` prunes for ``DINOv3ViTBackbone`` and merges otherwise.
    Returns the model.
    """
    return _patch_hf(model, ("dinov3",), options, overrides)


@_option_keywords
def auto(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch ``model`` in place with the patch of its family: :func:`timm` for a timm
    ``VisionTransformer`` or ``Eva``, else the Hugging Face family found in it (as :func:`hf_dpt`,
    :func:`hf_dinov2`, :func:`hf_vit`, :func:`hf_clip`, :func:`hf_siglip`, :func:`hf_dinov3`; a
    Depth Anything model as :func:`hf_dinov2`): the family of :func:`pullback_ext.families.detect`.
    Same options as :func:`timm`. Returns the model.
    """
    from pullback_ext.families import TimmFamily, detect

    family = detect(model, who="patch.auto")
    if isinstance(family, TimmFamily):
        return timm(model, options, **overrides)
    return _patch_hf(model, (family.name,), options, overrides)


def _patch_hf(model, families: tuple, options: Optional[ReductionOptions], overrides: dict, dense_neck: Optional[bool] = None):
    """The one path of the ``hf_*`` patches: patch the layer loop of ``model`` in the first of the
    Hugging Face ``families`` (names of :func:`pullback_ext.families.table`) it belongs to; a
    transformers version the families' code was not checked against is refused first (its models
    may be laid out otherwise). ``dense_neck``: whether the hidden states feed a dense neck (None:
    as the family finds). Returns the model."""
    from pullback_ext.families import check_transformers, family
    from pullback_ext.prune.methods.base import Traits
    from pullback_ext.prune.hf_encoders import configured_patches, find_encoder, install

    for name in families:
        check_transformers(family(name))
    encoder = find_encoder(model, families)
    if _is_patched(encoder.module):
        unpatch(model)
    dense = encoder.feeds_dense_neck if dense_neck is None else dense_neck
    shape = BackboneShape(depth=len(encoder.layers), num_prefix=encoder.num_prefix, has_cls=encoder.has_cls, dense_neck=dense,
                          num_patch=configured_patches(model))
    options = with_overrides(options, **overrides)
    check_supported(options.strategy, Traits.of(encoder.family), encoder.family.title)  # before resolve: the family's own reason
    reduction = options.resolve(shape)
    if reduction.options.prop_attn == "folded":
        raise PullbackError("prop_attn='folded' needs timm's standard Block and Attention (patch.timm); "
                            "Hugging Face layers take prop_attn=True")
    reduction.method.check_blocks(reduction, encoder.layers, encoder.module.config.hidden_size)
    install(encoder, reduction)
    setattr(encoder.module, _ATTR, ("hf", reduction))
    return model


def _with_reduction(fn, reduction):
    """``fn(module, reduction, ...)`` as a method of ``module`` (a named function: torch.compile
    traces it like any method)."""

    def method(module, *args, **kwargs):
        return fn(module, reduction, *args, **kwargs)

    method.__name__ = method.__qualname__ = fn.__name__
    method.__doc__ = fn.__doc__
    return method


def unpatch(model):
    """Undo any patch of this module (:func:`auto`, :func:`timm`, the ``hf_*`` patches); a no-op on an
    unpatched model. Returns the model."""
    if _is_patched(model) and getattr(model, _ATTR)[0] == "timm":
        del model.forward_features
        del model.forward_intermediates
        delattr(model, _ATTR)
        return model
    for module in model.modules() if hasattr(model, "modules") else ():
        if _is_patched(module) and getattr(module, _ATTR)[0] == "hf":
            from pullback_ext.prune.hf_encoders import restore

            restore(module)
            delattr(module, _ATTR)
    return model


def config(model) -> Optional[ReductionOptions]:
    """The options in use on a patched model (every ``auto`` chosen for it), or None."""
    for module in model.modules():
        if _is_patched(module):
            return getattr(module, _ATTR)[1].options
    return None
