"""Checkpoints of the learned metric models: safetensors weights + JSON config, written atomically.

A model checkpoint is a directory with ``model.safetensors`` (self-contained: its metadata holds
the format tag, the model kind and the full JSON config) and ``config.json`` (the same config,
readable, plus the weights' SHA-256). The training state for resuming (optimizer moments, step)
is ``state.safetensors`` next to them. Every file is written to a temporary name in the same
folder and moved into place with ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.fileio import atomic_path, atomic_write_text

FORMAT = "pullback_ext.metric/1"
MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
STATE_FILE = "state.safetensors"


def model_classes() -> dict[str, type]:
    """{kind: model class} of the metric models ('spn', 'head', 'vae'). A package above that stores
    its own models in this format passes its larger table as ``classes`` to :func:`save_model` and
    :func:`load_model` (TAP adds 'tap': ``pullback_ext.tap.checkpoint``)."""
    from pullback_ext.metric.head import ImportanceHead
    from pullback_ext.metric.spn import SPN
    from pullback_ext.metric.vae import FeatureVAE

    return {"spn": SPN, "head": ImportanceHead, "vae": FeatureVAE}


def atomic_save_tensors(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file via a temporary name in the same folder and ``os.replace``."""
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _read_tensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file not found")
    try:
        with safe_open(str(path), "pt", device="cpu") as fh:
            metadata = dict(fh.metadata() or {})
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a pullback_ext metric checkpoint (format {metadata.get('format')!r}, expected {FORMAT!r})")
    return tensors, metadata


def save_model(directory: str | os.PathLike, kind: str, model: nn.Module, extra: dict[str, Any] | None = None,
               classes: dict[str, type] | None = None) -> Path:
    """Write ``model`` (with a ``config()`` method) of ``kind``, a key of ``classes`` (default
    :func:`model_classes`: 'spn', 'head', 'vae'), to ``directory``.

    ``extra`` (the probe definition, training settings, results) is stored in the config.
    """
    classes = model_classes() if classes is None else classes
    if kind not in classes:
        raise PullbackError(f"kind: expected one of {sorted(classes)}, got {kind!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT, "kind": kind, "model": model.config(), **(extra or {})}
    text = json.dumps(config, sort_keys=True)
    weights = directory / MODEL_FILE
    atomic_save_tensors(dict(model.state_dict()), weights, {"format": FORMAT, "kind": kind, "config": text})
    readable = dict(config, weights_sha256=_sha256(weights))
    atomic_write_text(directory / CONFIG_FILE, json.dumps(readable, indent=2, sort_keys=True) + "\n")
    return directory


def read_config(path: str | os.PathLike) -> dict:
    """The config stored in a checkpoint (directory or its model.safetensors)."""
    return _load(path)[1]


def _load(path: str | os.PathLike) -> tuple[dict[str, Tensor], dict]:
    path = Path(path)
    weights = path / MODEL_FILE if path.is_dir() else path
    tensors, metadata = _read_tensors(weights)
    try:
        config = json.loads(metadata["config"])
    except (KeyError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{weights}: checkpoint metadata has no readable config ({exc})") from exc
    _check_readable_config(weights, config)
    return tensors, config


def _check_readable_config(weights: Path, config: dict) -> None:
    """``config.json`` next to ``weights`` must say what their metadata says: the model is built
    from the metadata, so an edited config.json would otherwise be ignored without a word."""
    readable = weights.parent / CONFIG_FILE
    if not readable.is_file():
        return  # the weights file is self-contained
    try:
        stated = json.loads(readable.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{readable}: not valid JSON ({exc})") from None
    if isinstance(stated, dict):
        stated = {k: v for k, v in stated.items() if k != "weights_sha256"}
    if stated != config:
        raise CheckpointError(f"{readable}: disagrees with the config stored in {weights.name} ({_difference(stated, config)}); "
                              "the model is built from the stored one: restore config.json, or retrain to change the model")


def _difference(stated: Any, stored: Any, where: str = "") -> str:
    """Where two JSON values first differ, e.g. ``probe.layer: 5 in config.json, 1 stored``."""
    if isinstance(stated, dict) and isinstance(stored, dict):
        missing = object()
        for key in sorted(set(stated) | set(stored)):
            a, b = stated.get(key, missing), stored.get(key, missing)
            if a != b:
                return _difference(None if a is missing else a, None if b is missing else b, f"{where}.{key}" if where else key)
    return f"{where or 'the config'}: {stated!r} in config.json, {stored!r} stored"


def load_model(path: str | os.PathLike, kind: str | None = None, dtype: torch.dtype | None = None,
               classes: dict[str, type] | None = None) -> tuple[nn.Module, dict]:
    """Rebuild the model stored at ``path`` (directory or file) -> (model in eval mode, config).
    ``classes``: {kind: model class} of the kinds to build (default :func:`model_classes`).

    Raises CheckpointError when the file is missing or corrupt, holds another kind of model than
    ``kind`` or one ``classes`` does not hold, or its tensors do not fit the configured architecture.
    """
    tensors, config = _load(path)
    classes = model_classes() if classes is None else classes
    stored = config.get("kind")
    if kind is not None and stored != kind:
        raise CheckpointError(f"{path}: expected a {kind!r} checkpoint, got a {stored!r} checkpoint")
    if stored not in classes:
        raise CheckpointError(f"{path}: unknown model kind {stored!r} (expected one of {sorted(classes)})")
    try:
        model = classes[stored](**config["model"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: model config {config.get('model')} does not build a {stored} ({exc})") from exc
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [k for k in expected if k in tensors and tensors[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        detail = "; ".join(
            part
            for part in (
                f"missing {missing[:3]}" if missing else "",
                f"unexpected {unexpected[:3]}" if unexpected else "",
                ", ".join(f"{k}: expected {tuple(expected[k].shape)}, got {tuple(tensors[k].shape)}" for k in wrong[:3]),
            )
            if part
        )
        raise CheckpointError(f"{path}: weights do not fit the configured {stored} ({detail})")
    stored_dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    model.to(stored_dtype)
    model.load_state_dict(tensors)
    layer = config.get("probe", {}).get("layer") if stored == "head" else None
    if isinstance(layer, int) and not isinstance(layer, bool):
        model.probe_layer = layer  # the block it scores by default (importance_tome's score_layer)
    if dtype is not None:
        model.to(dtype)
    return model.eval(), config


def save_training_state(
    directory: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None,
    averaged: nn.Module | None = None,
) -> None:
    """Everything a resumed run needs in one file: weights, optimizer moments, step, and the
    moving average of the weights when one is kept."""
    state = optimizer.state_dict()
    tensors: dict[str, Tensor] = {f"model/{k}": v for k, v in model.state_dict().items()}
    if averaged is not None:
        tensors.update({f"ema/{k}": v for k, v in averaged.state_dict().items()})
    scalars: dict[str, dict] = {}
    for pid, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"optim/{pid}/{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    meta = {"step": step, "param_groups": state["param_groups"], "scalars": scalars, **(extra or {})}
    atomic_save_tensors(tensors, Path(directory) / STATE_FILE, {"format": FORMAT, "state": json.dumps(meta)})


def load_training_state(
    directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, averaged: nn.Module | None = None
) -> dict:
    """Restore model and optimizer (and the weight average into ``averaged``) from
    ``state.safetensors``; returns the metadata (with ``step``)."""
    path = Path(directory) / STATE_FILE
    tensors, metadata = _read_tensors(path)
    try:
        meta = json.loads(metadata["state"])
        weights = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        model.load_state_dict(weights)
        if averaged is not None:
            ema = {k[len("ema/"):]: v for k, v in tensors.items() if k.startswith("ema/")}
            if not ema:
                raise KeyError("no weight average (ema/*) in a run resumed with ema_decay > 0")
            averaged.load_state_dict(ema)
        state: dict[int, dict] = {}
        for key, value in tensors.items():
            if key.startswith("optim/"):
                pid, name = key[len("optim/"):].split("/", 1)
                state.setdefault(int(pid), {})[name] = value
        for pid, entries in meta["scalars"].items():
            state.setdefault(int(pid), {}).update(entries)
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (KeyError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: training state does not fit this model/optimizer ({exc})") from exc
    return meta
