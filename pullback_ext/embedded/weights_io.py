"""Reading and writing the demo model's weights and its segmentation head's (fp16 safetensors),
the digest that ties a head to the backbone weights it was trained on, and the model card."""

from __future__ import annotations

from pathlib import Path

import torch

from pullback_ext.errors import CheckpointError
from pullback_ext.fileio import atomic_write_bytes

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
WEIGHTS_FILE = WEIGHTS_DIR / "demo_vit.safetensors"
CARD_JSON = WEIGHTS_DIR / "model_card.json"
CARD_MD = WEIGHTS_DIR / "MODEL_CARD.md"
SEGMENTATION_FILE = WEIGHTS_DIR / "demo_segmentation.safetensors"


def weights_digest(model: torch.nn.Module) -> str:
    """A short digest of ``model``'s state dict (which weights a head was trained for)."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def save_weights(model: torch.nn.Module, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Save the model's state dict as fp16 safetensors (atomic); the same weights and metadata
    give the same bytes."""
    from safetensors.torch import save

    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    atomic_write_bytes(Path(path), _sorted_metadata(save(state, metadata=metadata)))


def _sorted_metadata(data: bytes) -> bytes:
    """safetensors bytes with the header's metadata in key order (safetensors writes it in hash
    order, which changes from one process to the next); tensors and offsets untouched."""
    import json

    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if len(header.get("__metadata__") or {}) < 2:
        return data
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + size:]


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of a readable safetensors file ({} when it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


def load_weights(model: torch.nn.Module, path: Path, what: str = "the demo model") -> None:
    """Load fp16 safetensors into ``model`` (kept in its own dtype); CheckpointError names the file
    and ``what`` it should have held."""
    from safetensors.torch import load

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights: file not found: {path} (expected the weights of {what})")
    try:
        state = load(path.read_bytes())
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
        raise CheckpointError(f"weights: {path} is not a readable safetensors file ({exc}); expected the weights of {what}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights: {path} does not fit {what} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"weights: {path}: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)} "
                f"for {what}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"weights: {path}: tensor {name} contains non-finite values")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()})
