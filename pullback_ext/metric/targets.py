"""Supervision targets per image: the probe's top-r right singular subspace, its energies, imp*.

Two modes (docs/formulas.md §3):
- ``randnla``: randomized SVD with ``power`` rounds from a Gaussian sketch (pullback_ext.linalg);
- ``exact``: the dense Jacobian from min(M, P) products and a full SVD — the "ceiling" for small
  probes.
Targets can be computed on the fly (a fresh sketch every step) or once and cached to disk as
safetensors shards (``TargetCache``) for reuse across epochs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import Tensor

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.fileio import atomic_write_json
from pullback_ext.metric.checkpoint import atomic_save_tensors
from pullback_ext.probes.features import Features, as_features, image_map

EXACT_MAX_SIDE = 4096


@dataclass(frozen=True)
class TargetConfig:
    """How targets are computed. ``rank`` is the SPN rank r; ``block_norm_probes`` Rademacher
    probes estimate the plain block norms ‖J_{:,t}‖_F when M > 512 (exact below)."""

    mode: str = "randnla"
    rank: int = 20
    power: int = 1
    oversample: int = 10
    seed: int = 0
    keep_basis: bool = True
    block_norms: bool = False
    block_norm_probes: int = 64

    def __post_init__(self) -> None:
        if self.mode not in ("randnla", "exact"):
            raise PullbackError(f"mode: expected 'randnla' or 'exact', got {self.mode!r}")
        for name in ("rank", "power", "oversample", "block_norm_probes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name in ("rank", "block_norm_probes") else 0):
                raise PullbackError(f"{name}: expected a {'positive' if name in ('rank', 'block_norm_probes') else 'non-negative'} int, got {value!r}")


def _dense_jacobian_transposed(op) -> Tensor:
    """Jᵀ[P,M] from products against the standard basis of the smaller side."""
    M, P = op.shape
    if min(M, P) > EXACT_MAX_SIDE:
        raise PullbackError(f"mode: 'exact' needs min(M, P) <= {EXACT_MAX_SIDE}, got M={M}, P={P}; use 'randnla'")
    from pullback_ext.linalg import jacobian_transposed

    return jacobian_transposed(op)


def _modes(op, config: TargetConfig, generator: torch.Generator, JT: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(V[P,m], sigma[m or m+1]): m = min(r, M, P) supervised modes, plus σ_{m+1} when it exists
    (needed to tell whether mode m is near-degenerate). Exact mode uses Jᵀ[P,M] when given."""
    from pullback_ext.linalg import randomized_svd

    M, P = op.shape
    m = min(config.rank, M, P)
    wanted = min(m + 1, M, P)
    if config.mode == "exact":
        A, S, _ = torch.linalg.svd((_dense_jacobian_transposed(op) if JT is None else JT).double(), full_matrices=False)
        return A[:, :m].to(op.dtype), S[:wanted].to(op.dtype)
    result = randomized_svd(op, wanted, oversample=config.oversample, power=config.power, generator=generator)
    return result.V[:, :m], result.sigma


def importance_from_modes(V: Tensor, sigma: Tensor, num_tokens: int) -> Tensor:
    """imp*(t) = sqrt(Σ_j σ_j² ‖v_j^(t)‖²) over the modes given: V[P,m], sigma[>=m] -> [N]."""
    from pullback_ext import ops

    m = V.shape[1]
    return ops.token_importance(V.unsqueeze(0).contiguous(), sigma[:m].pow(2).unsqueeze(0).to(V.dtype), num_tokens)[0]


def block_norms(op, num_tokens: int, probes: int, generator: torch.Generator, JT: Optional[Tensor] = None) -> Tensor:
    """Plain block norms ‖J_{:,t}‖_F: [N]. Exact from Jᵀ[P,M] when given or when M <= 512, else
    E_z ‖(Jᵀz)^(t)‖² (Rademacher z)."""
    from pullback_ext.linalg.trace import EXACT_TRACE_MAX, rademacher

    M, P = op.shape
    if JT is not None or M <= EXACT_TRACE_MAX:
        from pullback_ext.linalg import jacobian_transposed

        JT = jacobian_transposed(op) if JT is None else JT
        return JT.double().pow(2).reshape(num_tokens, -1).sum(1).sqrt().to(op.dtype)
    Z = rademacher(M, probes, generator, op.dtype, op.device)
    est = op.vjp(Z).double().pow(2).view(num_tokens, -1, probes).sum(1).mean(1)
    return est.sqrt().to(op.dtype)


def image_generator(seed: int, *stream: Any) -> torch.Generator:
    """A generator whose state depends only on (seed, *stream) (JSON-able ids): reproducible
    across processes and resumed runs."""
    digest = hashlib.sha256(json.dumps([seed, *stream]).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def compute_targets(
    probe: Callable[[Tensor], Tensor],
    F: Union[Tensor, Features],
    config: TargetConfig,
    stream: Iterable[Any] | None = None,
    chunk_size: Optional[int] = 32,
) -> dict[str, Tensor]:
    """Targets for a batch F[B,N,D]: importance[B,N] (imp*), and with ``keep_basis`` V[B,P,m],
    sigma[B,m'] (m' = m or m+1); with ``block_norms`` block_norm[B,N].

    Image b uses the sketch generator ``image_generator(config.seed, stream[b])`` (default: b).
    ``F`` is ``probe.features(images)`` (``Features``: a probe that reads per-image context, e.g.
    a depth decoder reading frozen earlier layers, is bound to image b's) or a bare tensor for a
    probe whose ψ depends on F alone.
    """
    from pullback_ext.linalg import JacobianOperator

    if not isinstance(F, Features) and (not isinstance(F, Tensor) or F.dim() != 3):
        raise PullbackError(f"F: expected Features or a tensor [B,N,D], got {tuple(F.shape) if isinstance(F, Tensor) else type(F).__name__}")
    features = as_features(F)
    keys = list(range(len(features))) if stream is None else list(stream)
    if len(keys) != len(features):
        raise PullbackError(f"stream: expected {len(features)} ids (one per image), got {len(keys)}")
    out: dict[str, list[Tensor]] = {}
    N = features.F.shape[1]
    for b, key in enumerate(keys):
        op = JacobianOperator(image_map(probe, features, b), features.F[b], chunk_size=chunk_size)
        gen = image_generator(config.seed, key)
        JT = _dense_jacobian_transposed(op) if config.mode == "exact" and config.block_norms else None
        V, sigma = _modes(op, config, gen, JT)
        out.setdefault("importance", []).append(importance_from_modes(V, sigma, N))
        if config.keep_basis:
            out.setdefault("V", []).append(V)
            out.setdefault("sigma", []).append(sigma)
        if config.block_norms:
            out.setdefault("block_norm", []).append(block_norms(op, N, config.block_norm_probes, gen, JT))
    return {k: torch.stack(v).contiguous() for k, v in out.items()}


class TargetCache:
    """Features and their targets stored as safetensors shards plus ``manifest.json``.

    The manifest records the target config and a caller-supplied ``source`` description (the exact
    probe definition and image set); ``build`` reuses complete shards written for the same
    (config, source) and recomputes the rest, so an interrupted build resumes.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    @property
    def manifest_path(self) -> Path:
        return self.directory / "manifest.json"

    def _key(self, config: TargetConfig, source: dict) -> str:
        return hashlib.sha256(json.dumps([asdict(config), source], sort_keys=True).encode()).hexdigest()[:16]

    def build(
        self,
        probe: Callable[[Tensor], Tensor],
        features: Callable[[int, int], Tensor],
        num_images: int,
        config: TargetConfig,
        source: dict,
        shard_size: int = 64,
        progress: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> Optional[dict[str, Tensor]]:
        """Compute (or reuse) targets for images 0..num_images-1 and return them all (see ``load``).

        ``features(start, stop)`` returns the ``Features`` (or a bare F[stop-start,N,D]) of those
        images; their F is cached next to the targets. With
        ``world_size`` > 1 each rank computes the shards i with i % world_size == rank and
        returns None; once every rank is done, rank 0 calls ``write_manifest`` and all ``load``.
        """
        from safetensors import safe_open
        from pullback_ext.progress import progress_bar

        self.directory.mkdir(parents=True, exist_ok=True)
        key = self._key(config, source)
        mine = [s for i, s in enumerate(self._shards(key, num_images, shard_size)) if i % world_size == rank]
        for shard in progress_bar(mine, desc="targets", unit="shard", enabled=progress):
            path = self.directory / shard["file"]
            if not path.exists():
                F = features(shard["start"], shard["stop"])
                tensors = compute_targets(probe, F, config, stream=range(shard["start"], shard["stop"]))
                tensors["features"] = as_features(F).F.detach()
                atomic_save_tensors(tensors, path, {"key": key})
            else:
                with safe_open(str(path), "pt") as fh:
                    if fh.metadata().get("key") != key:
                        raise CheckpointError(f"{path}: target shard written for another configuration; delete it")
        if world_size > 1:
            return None
        self.write_manifest(num_images, config, source, shard_size)
        return self.load(config, source)

    def _shards(self, key: str, num_images: int, shard_size: int) -> list[dict]:
        return [
            {"file": f"targets-{key}-{start:07d}-{min(start + shard_size, num_images):07d}.safetensors", "start": start, "stop": min(start + shard_size, num_images)}
            for start in range(0, num_images, shard_size)
        ]

    def write_manifest(self, num_images: int, config: TargetConfig, source: dict, shard_size: int = 64) -> None:
        key = self._key(config, source)
        shards = self._shards(key, num_images, shard_size)
        missing = [s["file"] for s in shards if not (self.directory / s["file"]).exists()]
        if missing:
            raise CheckpointError(f"{self.directory}: target shards missing: {missing[:3]}")
        manifest = {"key": key, "config": asdict(config), "source": source, "num_images": num_images, "shards": shards}
        atomic_write_json(self.manifest_path, manifest)

    def load(self, config: TargetConfig | None = None, source: dict | None = None) -> dict[str, Tensor]:
        """All cached tensors concatenated over images; checks the manifest matches when given."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not self.manifest_path.exists():
            raise CheckpointError(f"{self.manifest_path}: no target cache here (missing manifest)")
        try:
            manifest = json.loads(self.manifest_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.manifest_path}: unreadable manifest ({exc})") from exc
        if config is not None and manifest.get("key") != self._key(config, source or {}):
            raise CheckpointError(f"{self.manifest_path}: cache built for another configuration {manifest.get('config')}")
        parts: dict[str, list[Tensor]] = {}
        for shard in manifest["shards"]:
            path = self.directory / shard["file"]
            try:
                tensors = load_file(str(path))
            except (OSError, SafetensorError) as exc:
                raise CheckpointError(f"{path}: missing or corrupt target shard ({exc})") from exc
            for k, v in tensors.items():
                parts.setdefault(k, []).append(v)
        return {k: torch.cat(v) for k, v in parts.items()}
