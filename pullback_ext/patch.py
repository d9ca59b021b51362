"""Token merging / pruning for frozen ViTs, switched on and off in place.

    import pullback_ext.patch as patch
    patch.timm(model, head=head, ratio=0.3, layers=(4,), mode="merge", strategy="importance")
    patch.hf_dinov2(dinov2, head=head, ratio=0.3)       # Hugging Face DINOv2 (CLS: merge)
    patch.hf_dpt(depth_model, head=head, ratio=0.5)     # Hugging Face DPT / Depth Anything (prune)
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
"""

from __future__ import annotations

import types
from typing import Callable, Optional

from pullback_ext.errors import PullbackError

_ATTR = "_pullback_reduction"


def _is_patched(model) -> bool:
    return getattr(model, _ATTR, None) is not None


def timm(
    model,
    head=None,
    ratio=0.3,
    layers=(4,),
    mode: str = "merge",
    strategy: str = "importance",
    llf=True,
    *,
    spn: Optional[Callable] = None,
    matching: str = "auto",
    eps: Optional[float] = None,
    prop_attn="auto",
    weights: str = "auto",
    selection: str = "auto",
    seed: Optional[int] = 0,
):
    """Patch a timm ``VisionTransformer`` in place (re-patching replaces the previous plan).

    ``head``: importance head ``F [B, K, D] -> [B, K]`` (or an SPN) for ``importance``, or a
    callable giving imp* for ``oracle``; a sequence gives one per stage of ``layers``. ``llf``:
    ``True`` (= ``"masked"``), ``"full"`` or ``False`` (see the module docstring). ``spn``: returns
    ``(U [B, K*D, r], lam [B, r])`` for the pullback matching of merge mode. ``prop_attn``: add ``log(size)`` to attention logits after
    merges (``auto``: on in merge mode). ``weights``: ``auto``/``size``/``importance`` for merged
    averages. ``selection``: ``auto``/``lowest``/``bound``, which tokens a scorer strategy merges
    away (see :func:`pullback_ext.prune.pipeline.make_config`). ``seed``: for ``random``.
    Returns the model.
    """
    from pullback_ext.prune import timm_vit
    from pullback_ext.prune.pipeline import make_config

    needed = ("patch_embed", "_pos_embed", "blocks", "norm", "num_prefix_tokens", "forward_features")
    missing = [a for a in needed if not hasattr(model, a)]
    if missing:
        raise PullbackError(f"model must be a timm VisionTransformer; {type(model).__name__} lacks {', '.join(missing)}")
    if _is_patched(model):
        unpatch(model)
    cfg = make_config(
        depth=len(model.blocks), num_prefix=int(model.num_prefix_tokens), has_cls=getattr(model, "cls_token", None) is not None,
        head=head, ratio=ratio, layers=layers, mode=mode, strategy=strategy, llf=llf, spn=spn, matching=matching,
        eps=eps, prop_attn=prop_attn, weights=weights, selection=selection, seed=seed,
    )
    model.forward_features = types.MethodType(_with_config(timm_vit.forward_features, cfg), model)
    model.forward_intermediates = types.MethodType(_with_config(timm_vit.forward_intermediates, cfg), model)
    setattr(model, _ATTR, ("timm", cfg))
    return model


def hf_dpt(
    model,
    head=None,
    ratio=0.3,
    layers=(4,),
    mode: str = "prune",
    strategy: str = "importance",
    llf=True,
    *,
    spn: Optional[Callable] = None,
    matching: str = "auto",
    eps: Optional[float] = None,
    prop_attn="auto",
    weights: str = "auto",
    selection: str = "auto",
    seed: Optional[int] = 0,
):
    """Patch a Hugging Face ``DPTForDepthEstimation`` / ``DPTModel`` (ViT backbone) or a
    ``DepthAnythingForDepthEstimation`` (DINOv2 backbone) in place.

    Same options as :func:`timm`; the encoder's hidden states (what the neck reads) are
    full-length. Returns the model.
    """
    from pullback_ext.prune.hf_encoders import find_encoder

    return _patch_hf(model, find_encoder(model), head=head, ratio=ratio, layers=layers, mode=mode, strategy=strategy,
                     llf=llf, spn=spn, matching=matching, eps=eps, prop_attn=prop_attn, weights=weights,
                     selection=selection, seed=seed)


def hf_dinov2(
    model,
    head=None,
    ratio=0.3,
    layers=(4,),
    mode: str = "auto",
    strategy: str = "importance",
    llf=True,
    *,
    spn: Optional[Callable] = None,
    matching: str = "auto",
    eps: Optional[float] = None,
    prop_attn="auto",
    weights: str = "auto",
    selection: str = "auto",
    seed: Optional[int] = 0,
):
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
    if mode == "auto":
        mode = "prune" if encoder.feeds_dense_neck else "merge"
    return _patch_hf(model, encoder, head=head, ratio=ratio, layers=layers, mode=mode, strategy=strategy, llf=llf,
                     spn=spn, matching=matching, eps=eps, prop_attn=prop_attn, weights=weights, selection=selection,
                     seed=seed)


def _patch_hf(model, encoder, **options):
    from pullback_ext.prune.hf_encoders import install
    from pullback_ext.prune.pipeline import make_config

    if _is_patched(encoder.module):
        unpatch(model)
    cfg = make_config(depth=len(encoder.module.layer), num_prefix=encoder.num_prefix, has_cls=True, **options)
    install(encoder, cfg)
    setattr(encoder.module, _ATTR, ("hf", cfg))
    return model


def _with_config(fn, cfg):
    """``fn(module, cfg, ...)`` as a method of ``module`` (a named function: torch.compile
    traces it like any method)."""

    def method(module, *args, **kwargs):
        return fn(module, cfg, *args, **kwargs)

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


def config(model):
    """The active reduction plan of a patched model, or None."""
    for module in model.modules():
        if _is_patched(module):
            return getattr(module, _ATTR)[1]
    return None
