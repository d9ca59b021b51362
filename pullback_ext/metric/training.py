"""The training loop shared by the SPN, the importance head and the VAE.

AdamW with linear warm-up and a cosine schedule, optional mixed precision, gradient clipping,
an optional exponential moving average of the weights, DDP when ``torch.distributed`` is
initialised (gloo on CPU), JSON-lines metrics, a progress bar, and atomic checkpoints with resume.

Every random choice is a function of (seed, step, image index) — the batch of a step comes from
a per-epoch permutation, sketches and VAE noise from per-image generators — so a run resumed from
a checkpoint at step s ends with the same weights as an uninterrupted one, and a run split over
ranks sees exactly the global batch a single process sees.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor, nn

from pullback_ext.fileio import atomic_write_text
from pullback_ext.metric import checkpoint
from pullback_ext.metric.targets import image_generator
from pullback_ext.errors import PullbackError

METRICS_FILE = "metrics.jsonl"


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    amp: bool = False
    seed: int = 0
    checkpoint_every: int = 100
    log_every: int = 10
    ema_decay: float = 0.0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every", "log_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PullbackError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise PullbackError(f"warmup_steps: expected an int >= 0, got {self.warmup_steps!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise PullbackError(f"lr: expected a positive finite float, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise PullbackError(f"min_lr_ratio: expected a float in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise PullbackError(f"ema_decay: expected a float in [0, 1) (0: no averaging), got {self.ema_decay!r}")


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio·lr``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def ema_update(averaged: nn.Module, model: nn.Module, step: int, decay: float) -> None:
    """averaged ← d·averaged + (1 − d)·model over the parameters, after optimizer step ``step``
    (0-based), with d = min(decay, (1 + step) / (10 + step)) so that early weights fade quickly."""
    d = min(decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for avg, p in zip(averaged.parameters(), model.parameters()):
            avg.mul_(d).add_(p.detach(), alpha=1.0 - d)


def batch_indices(step: int, num_samples: int, cfg: TrainConfig) -> Tensor:
    """Dataset indices of the global batch at ``step`` (a fresh permutation every epoch)."""
    per_epoch = num_samples // cfg.batch_size
    epoch, offset = divmod(step, per_epoch)
    perm = torch.randperm(num_samples, generator=image_generator(cfg.seed, 1, epoch))
    return perm[offset * cfg.batch_size : (offset + 1) * cfg.batch_size]


class Task(Protocol):
    """What the loop trains: ``kind`` ('spn', 'head', 'vae', or a kind of ``fit``'s ``classes``) and
    a loss on a batch."""

    kind: str

    def loss(self, model: nn.Module, batch: dict[str, Tensor], indices: Tensor, step: int) -> tuple[Tensor, dict[str, float]]:
        ...


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mean_over_ranks(values: dict[str, float], world: int) -> dict[str, float]:
    if world == 1 or not values:
        return values
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / world for k, v in zip(keys, t)}


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only the lines logged up to ``last_step`` completed steps (a resumed run redoes the rest)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", math.inf) <= last_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue
    atomic_write_text(path, "".join(f"{line}\n" for line in kept))


def _check_batch(data: dict[str, Tensor], cfg: TrainConfig, world: int) -> int:
    """The number of training samples, once the global batch fits them and the world size."""
    num = next(iter(data.values())).shape[0]
    if cfg.batch_size > num:
        raise PullbackError(f"batch_size: expected <= the number of training samples ({num}), got {cfg.batch_size}")
    if cfg.batch_size % world != 0:
        raise PullbackError(f"batch_size: expected a multiple of the world size {world}, got {cfg.batch_size}")
    return num


def _start(out: Path, rank: int, resume: bool, model: nn.Module, optimizer, averaged: Optional[nn.Module]) -> int:
    """The first step to run: 0, or the step of the checkpoint in ``out`` when resuming (its
    weights and optimizer state loaded); rank 0 drops metrics logged after it and stale temp files."""
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    start = 0
    if resume and (out / checkpoint.STATE_FILE).exists():
        start = int(checkpoint.load_training_state(out, model, optimizer, averaged)["step"])
    if rank == 0:
        _truncate_metrics(out / METRICS_FILE, start)
        for stale in out.glob(".*.tmp-*"):  # left by a run killed while writing
            stale.unlink()
    return start


def _optimizer_step(loss: Tensor, model: nn.Module, optimizer, scaler, grad_clip: float) -> float:
    """Backward, clip and step (through the gradient scaler when there is one); the gradient norm."""
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
    else:
        loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    return grad_norm


def fit(
    task: Task,
    model: nn.Module,
    data: dict[str, Tensor],
    cfg: TrainConfig,
    out_dir: str | os.PathLike,
    extra_config: Optional[dict[str, Any]] = None,
    resume: bool = False,
    progress: bool = True,
    on_step: Optional[Callable[[int], None]] = None,
    classes: Optional[dict[str, type]] = None,
) -> dict[str, float]:
    """Train ``model`` on ``data`` (tensors with a leading sample dim) for ``cfg.steps`` steps.

    Checkpoints every ``checkpoint_every`` steps and at the end into ``out_dir`` (model.safetensors,
    config.json, state.safetensors); with ``resume`` continues from the checkpoint found there.
    Under torchrun each rank computes the loss on its slice of the global batch. ``on_step(step)``
    runs after each completed step (progress hooks, tests). With ``ema_decay`` > 0 the checkpoints'
    model.safetensors hold the moving average of the weights (state.safetensors both), and ``model``
    ends with the averaged weights. ``classes``: the checkpoint kinds when ``task.kind`` is not a
    metric model's (:func:`~pullback_ext.metric.checkpoint.save_model`). Returns the last logged
    metrics.
    """
    from pullback_ext.progress import progress_bar

    rank, world = _world()
    out = Path(out_dir)
    num = _check_batch(data, cfg, world)
    param = next(model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    averaged = copy.deepcopy(model) if cfg.ema_decay > 0 else None
    start = _start(out, rank, resume, model, optimizer, averaged)
    trained = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    scaler = torch.amp.GradScaler("cuda") if cfg.amp and param.device.type == "cuda" else None
    amp_dtype = torch.float16 if param.device.type == "cuda" else torch.bfloat16
    config = {"train": asdict(cfg), **(extra_config or {})}
    logged: dict[str, float] = {}

    def save(step: int) -> None:
        if rank == 0:
            checkpoint.save_training_state(out, step, model, optimizer, averaged=averaged)
            checkpoint.save_model(out, task.kind, averaged if averaged is not None else model, dict(config, step=step), classes)
        _barrier(world)

    model.train()
    bar = progress_bar(range(start, cfg.steps), initial=start, total=cfg.steps, desc=f"train {task.kind}", unit="step",
                       enabled=progress and rank == 0)
    for step in bar:
        lr = learning_rate(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = batch_indices(step, num, cfg)[rank::world]
        batch = {k: (v[idx].to(param.device, param.dtype) if v.is_floating_point() else v[idx].to(param.device)) for k, v in data.items()}
        with torch.autocast(param.device.type, dtype=amp_dtype, enabled=cfg.amp):
            loss, metrics = task.loss(trained, batch, idx, step)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss became {float(loss)} at step {step}; lower --lr or check the targets")
        grad_norm = _optimizer_step(loss, model, optimizer, scaler, cfg.grad_clip)
        if averaged is not None:
            ema_update(averaged, model, step, cfg.ema_decay)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            logged = _mean_over_ranks({"loss": float(loss.detach()), **metrics}, world)
            logged.update(step=done, lr=lr, grad_norm=grad_norm)
            if rank == 0:
                with open(out / METRICS_FILE, "a") as fh:
                    fh.write(json.dumps(logged) + "\n")
                bar.set_postfix(loss=f"{logged['loss']:.4g}")
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            save(done)
        if on_step is not None:
            on_step(done)
    if averaged is not None:
        model.load_state_dict(averaged.state_dict())
    model.eval()
    return logged
