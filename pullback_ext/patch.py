"""Token merging / pruning for frozen ViTs, switched on and off in place.

    import pullback_ext.patch as patch
    patch.timm(model, head=head, ratio=0.3, layers=(4,), mode="merge", strategy="importance")
    patch.hf_dinov2(dinov2, head=head, ratio=0.3)       # Hugging Face DINOv2 (CLS: merge)
    patch.hf_dpt(depth_model, head=head, ratio=0.5)     # Hugging Face DPT / Depth Anything (prune)
    options = patch.ReductionOptions(strategy="tome_score", ratio=0.5, layers=(4, 8))
    patch.timm(model, options, mode="prune")            # options object, keywords override fields
    patch.timm(model, strategy="tome", r=16, schedule="decreasing")   # ToMe as its authors run it
    patch.timm(model, strategy="evit", keep_rate=0.7)                  # EViT as its authors run it
    patch.config(model)             # the options in use, every "auto" chosen
    patch.unpatch(model)            # the original forward again

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
The gather, merge and re-insert steps run through the ``pullback_ext.ops`` kernels.

``strategy="tome"`` and ``"evit"`` are the original methods (timm only for now): they reduce inside
the blocks, between attention and MLP — ToMe ``r`` tokens in every block of ``block_range``
(:mod:`pullback_ext.prune.tome`), EViT at three blocks keeping ``keep_rate`` of the patch tokens
(:mod:`pullback_ext.prune.evit`) — and take their own options instead of ``ratio`` / ``layers`` /
``mode``; the single-stage criteria of the paper's controlled comparison are ``tome_score`` and
``evit_score``. :func:`pullback_ext.prune.eta.eta` gives the η a setting produces.

Every option is a field of :class:`~pullback_ext.prune.reduction_options.ReductionOptions`, which
documents and validates them once. Each patch function is ``fn(model, options=None, /, **overrides)``
and builds one ``ReductionOptions`` from both, so the option list is written in one place; the
functions' ``__signature__`` lists every field as a keyword with its default, which ``help()``,
IPython and editors that read runtime signatures show (explicit keyword lists would repeat the
13 options in every function, and let their defaults drift apart).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Optional

from pullback_ext.errors import PullbackError
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions, with_overrides
from pullback_ext.prune.strategies import ORIGINALS

_ATTR = "_pullback_reduction"


def _is_patched(model) -> bool:
    return getattr(model, _ATTR, None) is not None


def _option_keywords(fn):
    """Show every :class:`ReductionOptions` field as a keyword of ``fn(model, options=None, /, **overrides)``."""
    signature = inspect.signature(fn)
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in dataclasses.fields(ReductionOptions)]
    fn.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:2] + keywords)
    return fn


@_option_keywords
def timm(model, options: Optional[ReductionOptions] = None, /, **overrides):
    """Patch a timm ``VisionTransformer`` in place (re-patching replaces the previous plan).

    ``options`` and the keywords (which replace its fields) are those of :class:`ReductionOptions`;
    ``mode="auto"`` merges. Returns the model.
    """
    from pullback_ext.prune import timm_vit

    timm_vit.check_model(model)
    if _is_patched(model):
        unpatch(model)
    reduction = with_overrides(options, **overrides).resolve(timm_vit.backbone_shape(model))
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
    from pullback_ext.prune.hf_encoders import find_encoder

    return _patch_hf(model, find_encoder(model), options, overrides, dense_neck=True)


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
    from pullback_ext.prune.hf_encoders import find_encoder

    encoder = find_encoder(model, families=("dinov2",))
    return _patch_hf(model, encoder, options, overrides, dense_neck=encoder.feeds_dense_neck)


def _patch_hf(model, encoder, options: Optional[ReductionOptions], overrides: dict, dense_neck: bool):
    from pullback_ext.prune.hf_encoders import install

    if _is_patched(encoder.module):
        unpatch(model)
    shape = BackboneShape(depth=len(encoder.module.layer), num_prefix=encoder.num_prefix, has_cls=True, dense_neck=dense_neck)
    reduction = with_overrides(options, **overrides).resolve(shape)
    if reduction.options.strategy in ORIGINALS:
        raise PullbackError(f"strategy {reduction.options.strategy!r} (the original method) is available for timm ViTs "
                            f"(patch.timm) only; Hugging Face models take the single-stage '{reduction.options.strategy}_score'")
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
    """Undo :func:`timm` / :func:`hf_dpt` / :func:`hf_dinov2`; a no-op on an unpatched model. Returns the model."""
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
