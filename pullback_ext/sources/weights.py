"""Reading local weights files: a safetensors file or a torch checkpoint, strictly loaded."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from pullback_ext.errors import CheckpointError


def read_state_dict(path: str | Path, flag: str = "--weights") -> dict[str, Tensor]:
    """Tensors of a safetensors file or a torch checkpoint (a state dict, possibly under
    'state_dict' / 'model'); CheckpointError naming ``flag`` and the file if it is missing or
    unreadable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{flag}: file {str(path)!r} does not exist")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any decoding failure of a user file is a user error
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        raise CheckpointError(f"{flag}: cannot read {str(path)!r} ({exc.__class__.__name__}: {first_line})") from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if isinstance(state, Tensor):
        return {"weight": state}
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{flag}: {str(path)!r} does not hold a dict of tensors")
    return state


def load_into(model: torch.nn.Module, path: str | Path) -> None:
    """Strictly load a weights file into ``model``; CheckpointError with the first mismatches."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape]
    parts = [f"{len(items)} {label} (e.g. {items[0]})"
             for label, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if items]
    if parts:
        raise CheckpointError(f"--weights: {str(path)!r} does not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)
