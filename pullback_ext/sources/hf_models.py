"""Hugging Face transformers models from a local folder (``hf:DIR``)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.families import table
from pullback_ext.sources.weights import read_state_dict

def model_types() -> dict:
    """transformers model type -> the classes built for it (by name: transformers is imported
    lazily), as the families of :mod:`pullback_ext.families` load them: the one of the config's
    ``architectures`` when it is listed, else the first."""
    return {kind: classes for family in table().values() for kind, classes in getattr(family, "loads", {}).items()}


def model_class_name(config) -> str:
    """The class :func:`load_hf_model` builds for ``config`` (of a model type in :func:`model_types`)."""
    offered = model_types()[config.model_type]
    listed = [name for name in (getattr(config, "architectures", None) or ()) if name in offered]
    return listed[0] if listed else offered[0]


def load_hf_model(folder: str, weights: Optional[str], random_weights: bool = False) -> tuple[torch.nn.Module, Optional[str]]:
    """``(model, weights path)``: the model of a local transformers folder (its ``config.json``,
    of a model type in :func:`model_types`) in float32, eval mode, without gradients.

    Weights: ``weights``, else the folder's ``model.safetensors`` / ``pytorch_model.bin``; a folder
    without weights (an unfinished download) is refused unless ``random_weights``, which keeps the
    random initialisation (weights path None). They go through transformers' own loading, which renames the keys of checkpoints
    saved in an older layout (DINOv2's ``attention.attention.query`` is ``attention.q_proj`` in
    current transformers), and must then fit exactly: a missing, unexpected or mis-shaped tensor
    is a CheckpointError.
    """
    import transformers

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise PullbackError(f"--model: hf:{folder} must be a local folder with a config.json")
    config = _read_config(path)
    if config.model_type not in model_types():
        raise PullbackError(f"--model: hf model type must be one of {sorted(model_types())}, got {config.model_type!r}")
    name = model_class_name(config)
    cls = getattr(transformers, name)
    if weights is None:
        found = [p for p in (path / "model.safetensors", path / "pytorch_model.bin") if p.is_file()]
        weights = str(found[0]) if found else None
    if weights is None:
        if not random_weights:
            raise PullbackError(f"--model: hf:{folder} has a config.json but no weights (model.safetensors or pytorch_model.bin; "
                                "an unfinished download?); pass --weights FILE, or --random-weights where a command offers it "
                                "to measure the random initialisation")
        model = cls(config)
    else:
        with _quiet_loading():
            model, info = cls.from_pretrained(None, config=config, state_dict=read_state_dict(weights), dtype=torch.float32,
                                              output_loading_info=True)
        parts = [f"{len(keys)} {label} (e.g. {sorted(map(str, keys))[0]})"
                 for label, keys in (("missing", info["missing_keys"]), ("unexpected", info["unexpected_keys"]),
                                     ("wrong shape", info["mismatched_keys"])) if keys]
        if parts:
            raise CheckpointError(f"--weights: {weights!r} does not fit the {name}: {'; '.join(parts)}")
    return model.eval().requires_grad_(False), weights


@contextlib.contextmanager
def _quiet_loading():
    """Without transformers' progress bar for the (local, sub-second) weight loading, so that the
    console keeps to the command's own lines."""
    from transformers.utils import logging

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for an unreadable or ill-typed config.json (invalid JSON is an
    OSError; a field of the wrong type a TypeError / ValueError, or huggingface_hub's strict
    dataclass validation error)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: no strict validation
        return OSError, TypeError, ValueError
    return OSError, TypeError, ValueError, StrictDataclassError


def _read_config(path: Path):
    """The transformers config of ``path/config.json``; a file that does not parse or has a field
    of the wrong type is a CheckpointError naming it and the first line of transformers' reason."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except _config_errors() as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise CheckpointError(f"--model: {path / 'config.json'} is not a usable transformers config: {reason}") from None
