"""Build the backbone–decoder pairs the command line names, from local files only.

``timm:NAME`` — ``timm.create_model(NAME, pretrained=False)`` plus a local weights file;
``hf:DIR`` — a transformers model from a local folder holding ``config.json`` (and weights): a DPT or
Depth Anything depth model, or a DINOv2 model (CLS, tokens, pooled, linear probe);
``demo`` — the embedded demo model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from pullback_ext.errors import CheckpointError, PullbackError

DECODERS = ("cls", "tokens", "pooled", "embedding", "depth", "depth-multi", "linear:FILE")


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Tensors of a safetensors file or a torch checkpoint (a state dict, possibly under
    'state_dict' / 'model'); CheckpointError naming the file if it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--weights: file {str(path)!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any decoding failure of a user file is a user error
        raise CheckpointError(f"--weights: cannot read {str(path)!r} ({exc.__class__.__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if isinstance(state, Tensor):
        return {"weight": state}
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"--weights: {str(path)!r} does not hold a dict of tensors")
    return state


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Strictly load a weights file into ``model``; CheckpointError with the first mismatches."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)):
            if items:
                parts.append(f"{len(items)} {label} (e.g. {items[0]})")
        raise CheckpointError(f"--weights: {str(path)!r} does not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


@dataclass
class Setup:
    """A probe, the preprocessing its images need, and a description for the report."""

    probe: torch.nn.Module
    preprocess: Callable
    description: dict


def _linear_weights(spec: str, dim: int, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    path = spec.split(":", 1)[1]
    if not path:
        raise PullbackError("--decoder: expected linear:FILE with a weights file, got 'linear:'")
    state = read_state_dict(path)
    W = state.get("weight", state.get("W"))
    if W is None or W.dim() != 2 or W.shape[1] != dim:
        raise CheckpointError(
            f"--decoder: {path!r} must hold 'weight' of shape [C, {dim}] (D of the probe layer), got "
            + (str(tuple(W.shape)) if W is not None else f"keys {sorted(state)[:5]}")
        )
    bias = state.get("bias")
    if bias is not None and tuple(bias.shape) != (W.shape[0],):
        raise CheckpointError(f"--decoder: bias in {path!r} must have shape [{W.shape[0]}], got {tuple(bias.shape)}")
    return W.to(dtype), None if bias is None else bias.to(dtype)


def _check_decoder(decoder: str) -> None:
    if decoder not in DECODERS[:-1] and not decoder.startswith("linear:"):
        raise PullbackError(f"--decoder: expected one of {', '.join(DECODERS)}, got {decoder!r}")


def build_timm(
    name: str,
    weights: Optional[str],
    layer: int,
    decoder: str,
    output_size: Optional[int],
    img_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> Setup:
    import timm

    from pullback_ext.images import timm_preprocess
    from pullback_ext.probes import from_timm, linear_probe

    _check_decoder(decoder)
    if decoder in ("depth", "depth-multi", "embedding"):
        raise PullbackError(f"--decoder: timm models offer cls, tokens, pooled and linear:FILE, got {decoder!r}")
    try:
        kwargs = {"img_size": img_size} if img_size is not None else {}
        model = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as exc:
        raise PullbackError(f"--model: timm has no model {name!r} ({exc})") from exc
    if weights is not None:
        load_into(model, weights)
    model.eval().requires_grad_(False).to(dtype)
    if decoder.startswith("linear:"):
        base = from_timm(model, layer, "tokens")
        W, b = _linear_weights(decoder, base.dim, dtype)
        probe = linear_probe(W, base.num_tokens, b, base.features, layer, base.num_prefix_tokens)
        probe.grid_size = base.grid_size
    else:
        probe = from_timm(model, layer, decoder)
    return Setup(probe, timm_preprocess(model), {"model": f"timm:{name}", "weights": weights, "layer": layer, "decoder": decoder})


def build_hf(
    folder: str, weights: Optional[str], layer: int, decoder: str, output_size: Optional[int], dtype: torch.dtype = torch.float32
) -> Setup:
    from pullback_ext.images import hf_crop_preprocess, hf_preprocess
    from pullback_ext.probes import from_hf_dinov2, from_hf_dpt, linear_probe

    _check_decoder(decoder)
    model, weights = load_hf_model(folder, weights, {**HF_DEPTH_MODELS, **HF_CLS_MODELS})
    model.to(dtype)
    if type(model).__name__ in HF_CLS_MODELS.values():
        if decoder not in ("cls", "tokens", "pooled") and not decoder.startswith("linear:"):
            raise PullbackError(f"--decoder: DINOv2 models offer cls, tokens, pooled and linear:FILE, got {decoder!r}")
        preprocess = hf_crop_preprocess((model.config.image_size,) * 2, folder)
        if decoder.startswith("linear:"):
            base = from_hf_dinov2(model, layer, "tokens", image_size=preprocess.size)
            W, b = _linear_weights(decoder, base.dim, dtype)
            probe = linear_probe(W, base.num_tokens, b, base.features, layer, base.num_prefix_tokens)
            probe.grid_size = base.grid_size
        else:
            probe = from_hf_dinov2(model, layer, decoder, image_size=preprocess.size)
    else:
        if decoder not in ("depth", "depth-multi"):
            raise PullbackError(f"--decoder: hf depth models support depth and depth-multi, got {decoder!r}")
        probe = from_hf_dpt(model, layer, output_size=output_size, multi_layer=decoder == "depth-multi")
        preprocess = hf_preprocess(probe.image_size, folder)
    return Setup(probe, preprocess, {"model": f"hf:{folder}", "weights": weights, "layer": probe.layer, "decoder": decoder})


# transformers model types and the class built for each (by name: transformers is imported lazily).
HF_DEPTH_MODELS = {"dpt": "DPTForDepthEstimation", "depth_anything": "DepthAnythingForDepthEstimation"}
HF_CLS_MODELS = {"dinov2": "Dinov2Model", "dinov2_with_registers": "Dinov2WithRegistersModel"}


def load_hf_model(folder: str, weights: Optional[str], classes: dict) -> tuple[torch.nn.Module, Optional[str]]:
    """``(model, weights path)``: the model of a local transformers folder (its ``config.json``,
    of a model type in ``classes``) in float32, eval mode, without gradients.

    Weights: ``weights``, else the folder's ``model.safetensors`` / ``pytorch_model.bin``, else
    random. They go through transformers' own loading, which renames the keys of checkpoints
    saved in an older layout (DINOv2's ``attention.attention.query`` is ``attention.q_proj`` in
    current transformers), and must then fit exactly: a missing, unexpected or mis-shaped tensor
    is a CheckpointError.
    """
    import transformers

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise PullbackError(f"--model: hf:{folder} must be a local folder with a config.json")
    config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    if config.model_type not in classes:
        raise PullbackError(f"--model: hf model type must be one of {sorted(classes)}, got {config.model_type!r}")
    cls = getattr(transformers, classes[config.model_type])
    if weights is None:
        found = [p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()]
        weights = str(found[0]) if found else None
    if weights is None:
        model = cls(config)
    else:
        model, info = cls.from_pretrained(None, config=config, state_dict=read_state_dict(weights), dtype=torch.float32,
                                          output_loading_info=True)
        parts = [f"{len(keys)} {label} (e.g. {sorted(map(str, keys))[0]})"
                 for label, keys in (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"]),
                                     ("wrong shape", info["mismatched_keys"])) if keys]
        if parts:
            raise CheckpointError(f"--weights: {weights!r} does not fit the {classes[config.model_type]}: {'; '.join(parts)}")
    return model.eval().requires_grad_(False), weights


def build_demo(
    weights: Optional[str], layer: int, decoder: str, output_size: Optional[int], dtype: torch.dtype = torch.float32
) -> Setup:
    import pullback_ext.embedded
    from pullback_ext.embedded.probes import demo_probe
    from pullback_ext.images import unit_range_preprocess

    _check_decoder(decoder)
    model = pullback_ext.embedded.load(weights).to(dtype)
    if decoder.startswith("linear:"):
        from pullback_ext.probes import linear_probe

        base = demo_probe(model, layer, "cls")
        W, b = _linear_weights(decoder, base.dim, dtype)
        probe = linear_probe(W, base.num_tokens, b, base.features, layer, base.num_prefix_tokens)
    elif decoder == "depth":
        probe = demo_probe(model, layer, decoder, output_size)
    elif decoder in ("cls", "embedding"):
        probe = demo_probe(model, layer, decoder)
    else:
        raise PullbackError(f"--decoder: the demo model supports cls, embedding, depth and linear:FILE, got {decoder!r}")
    return Setup(probe, unit_range_preprocess(model.image_size), {"model": "demo", "weights": weights, "layer": layer, "decoder": decoder})


def build(
    model: str,
    weights: Optional[str],
    layer: int,
    decoder: str,
    output_size: Optional[int],
    img_size: Optional[int] = None,
    dtype: torch.dtype = torch.float32,
) -> Setup:
    """Dispatch on ``timm:NAME`` / ``hf:DIR`` / ``demo`` (``img_size`` overrides a timm model's
    input size); the model is converted to ``dtype``."""
    if img_size is not None and not model.startswith("timm:"):
        raise PullbackError(f"--img-size: only applies to timm models, got --model {model!r}")
    if model == "demo":
        return build_demo(weights, layer, decoder, output_size, dtype)
    kind, _, name = model.partition(":")
    if kind == "timm" and name:
        return build_timm(name, weights, layer, decoder, output_size, img_size, dtype)
    if kind == "hf" and name:
        return build_hf(name, weights, layer, decoder, output_size, dtype)
    raise PullbackError(f"--model: expected timm:NAME, hf:DIR or demo, got {model!r}")
