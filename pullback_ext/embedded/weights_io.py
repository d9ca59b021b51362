"""Reading and writing the demo model's weights (fp16 safetensors) and its model card."""

from __future__ import annotations

from pathlib import Path

import torch

from pullback_ext.errors import CheckpointError
from pullback_ext.fileio import atomic_write_bytes

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_FILE = WEIGHTS_DIR / "demo_vit.safetensors"
CARD_JSON = WEIGHTS_DIR / "model_card.json"
CARD_MD = WEIGHTS_DIR / "MODEL_CARD.md"


def save_weights(model: torch.nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save the model's state dict as fp16 safetensors (atomic)."""
    from safetensors.torch import save

    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    atomic_write_bytes(Path(path), save(state, metadata=metadata))


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Load fp16 safetensors into ``model`` (kept in its own dtype); CheckpointError names the file."""
    from safetensors.torch import load

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights: file not found: {path}")
    try:
        state = load(path.read_bytes())
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
        raise CheckpointError(f"weights: {path} is not a readable safetensors file ({exc})") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights: {path} does not fit the demo model (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"weights: {path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"weights: {path}: tensor {name} contains non-finite values")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
