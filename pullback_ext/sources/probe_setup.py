"""A model and a decoder name -> the probe map the diagnostics and the learned metric work on.

Decoders: ``cls``, ``tokens``, ``pooled`` (timm, the Hugging Face families of
:mod:`pullback_ext.families` with a probe read-out), ``embedding`` (demo), ``depth``
(demo, DPT / Depth Anything), ``depth-multi`` (DPT / Depth Anything, all hooked layers) and
``linear:FILE`` (a linear token probe ``weight [C, D]``, optional ``bias [C]``, on any model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.sources.models import ModelSpec, load_model
from pullback_ext.sources.preprocess import Preprocess, hf_crop_preprocess, hf_preprocess, timm_preprocess, unit_range_preprocess
from pullback_ext.sources.weights import read_state_dict

DECODERS = ("cls", "tokens", "pooled", "embedding", "depth", "depth-multi", "segmentation", "linear:FILE")


@dataclass
class ProbeSetup:
    """A probe, the preprocessing its images need, and a description for the report."""

    probe: torch.nn.Module
    preprocess: Preprocess
    description: dict


def _linear_weights(spec: str, dim: int, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    path = spec.split(":", 1)[1]
    if not path:
        raise PullbackError("--task: expected linear:FILE with a weights file, got 'linear:'")
    state = read_state_dict(path, flag="--task")
    W = state.get("weight", state.get("W"))
    if W is None or W.dim() != 2 or W.shape[1] != dim:
        raise CheckpointError(
            f"--task: {path!r} must hold 'weight' of shape [C, {dim}] (D of the probe layer), got "
            + (str(tuple(W.shape)) if W is not None else f"keys {sorted(state)[:5]}")
        )
    bias = state.get("bias")
    if bias is not None and tuple(bias.shape) != (W.shape[0],):
        raise CheckpointError(f"--task: bias in {path!r} must have shape [{W.shape[0]}], got {tuple(bias.shape)}")
    return W.to(dtype), None if bias is None else bias.to(dtype)


def _linear_probe(base, decoder: str, layer: int, dtype: torch.dtype, keep_grid: bool = True):
    """The ``linear:FILE`` decoder on the token features of ``base`` (a probe of the same layer)."""
    from pullback_ext.probes import linear_probe

    W, b = _linear_weights(decoder, base.dim, dtype)
    probe = linear_probe(W, base.num_tokens, b, base.features, layer, base.num_prefix_tokens)
    if keep_grid:
        probe.grid_size = base.grid_size
    return probe


# what each kind of model offers besides linear:FILE, and the error naming it (a Hugging Face CLS model: see _offered)
OFFERED = {
    "timm": (("cls", "tokens", "pooled"), "timm models offer cls, tokens, pooled and linear:FILE"),
    "hf-depth": (("depth", "depth-multi"), "hf depth models support depth and depth-multi"),
    "demo": (("cls", "embedding", "depth", "segmentation"), "the demo model supports cls, logits, depth, segmentation and linear:FILE"),
}


def _offered(kind) -> tuple:
    """``(decoders, message)`` of ``kind``: a key of :data:`OFFERED` or a Hugging Face family adapter."""
    if isinstance(kind, str):
        return OFFERED[kind]
    if kind.depth:
        return OFFERED["hf-depth"]
    return ("cls", "tokens", "pooled"), f"{kind.short_title} models offer cls, tokens, pooled and linear:FILE"


def _check_decoder(decoder: str, kind=None) -> None:
    """``decoder`` is a known name and (given the ``kind`` of model: a key of :data:`OFFERED` or a
    Hugging Face family adapter) one it offers."""
    linear = decoder.startswith("linear:")
    if decoder not in DECODERS[:-1] and not linear:
        raise PullbackError(f"--task: expected one of cls, logits (demo), tokens, pooled, depth, depth-multi, segmentation (demo), "
                            f"linear:FILE; got {decoder!r}")
    if kind is not None:
        offered, message = _offered(kind)
        if decoder not in offered and not (linear and not getattr(kind, "depth", False)):
            raise PullbackError(f"--task: {message}, got {decoder!r}")


def _timm_probe(model, layer: int, decoder: str, dtype: torch.dtype):
    from pullback_ext.probes import from_timm

    if decoder.startswith("linear:"):
        return _linear_probe(from_timm(model, layer, "tokens"), decoder, layer, dtype), timm_preprocess(model)
    return from_timm(model, layer, decoder), timm_preprocess(model)


def _hf_probe(model, folder: str, layer: int, decoder: str, output_size: Optional[int], dtype: torch.dtype):
    from pullback_ext.families import detect
    from pullback_ext.probes import from_hf_dpt, from_hf_vision

    family = detect(model)
    _check_decoder(decoder, family)
    if family.depth:
        probe = from_hf_dpt(model, layer, output_size=output_size, multi_layer=decoder == "depth-multi")
        return probe, hf_preprocess(probe.image_size, folder)
    preprocess = hf_crop_preprocess((model.config.image_size,) * 2, folder)
    if decoder.startswith("linear:"):
        base = from_hf_vision(model, layer, "tokens", image_size=preprocess.size)
        return _linear_probe(base, decoder, layer, dtype), preprocess
    return from_hf_vision(model, layer, decoder, image_size=preprocess.size), preprocess


def _demo_probe(model, layer: int, decoder: str, output_size: Optional[int], dtype: torch.dtype):
    from pullback_ext.embedded.probes import DENSE, demo_probe

    preprocess = unit_range_preprocess(model.image_size)
    if decoder.startswith("linear:"):
        return _linear_probe(demo_probe(model, layer, "cls"), decoder, layer, dtype, keep_grid=False), preprocess
    return demo_probe(model, layer, decoder, output_size if decoder in DENSE else None), preprocess


def build_probe_setup(
    spec: ModelSpec,
    weights: Optional[str],
    layer: int,
    decoder: str,
    output_size: Optional[int],
    img_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
    random_weights: bool = False,
) -> ProbeSetup:
    """The probe of ``spec`` at block ``layer`` with ``decoder`` (``img_size`` builds a timm model
    for that input size; ``output_size`` resizes dense outputs); the model is converted to ``dtype``.
    ``random_weights`` lets an hf:DIR folder without weights keep its random initialisation. The
    description records ``random_weights``: whether the model runs at a random initialisation
    (timm or hf without weights)."""
    _check_decoder(decoder, None if spec.kind == "hf" else spec.kind)  # hf: once the model type is known
    model, weights = load_model(spec, weights, img_size, random_weights=random_weights)
    model.to(dtype)
    if spec.kind == "timm":
        probe, preprocess = _timm_probe(model, layer, decoder, dtype)
    elif spec.kind == "hf":
        probe, preprocess = _hf_probe(model, spec.name, layer, decoder, output_size, dtype)
        layer = probe.layer  # depth-multi reads several layers; the probe names its own
    else:
        probe, preprocess = _demo_probe(model, layer, decoder, output_size, dtype)
    return ProbeSetup(probe, preprocess, {"model": str(spec), "weights": weights, "layer": layer, "decoder": decoder,
                                          "random_weights": weights is None and spec.kind != "demo"})
