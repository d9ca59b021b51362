"""Training TAP: TAP-F (register and read-out, backbone frozen) and TAP-J (the same, with LoRA
adapters on every block's attention and MLP), on the demo model, a timm VisionTransformer or a
Hugging Face model of the families of :mod:`pullback_ext.families` (through the
evaluation's :class:`~pullback_ext.comparison.backbones.Backbone`: its ``reduced`` forward with the
training loop in place of the deployed one).

Objective: the pruned model's distortion against the unpruned (original, frozen) model's outputs
at a keep rate ρ drawn per step (uniform in ``rho_range``, a function of (seed, step), so resume
and DDP see the same ρ): CLS ``1 − cos(e_pruned, e_full)`` of the embedding (the backbone's
``embedding`` output), depth the SILog of ``log d_pruned − log d_full``. The forward is :func:`pullback_ext.tap_training.relaxed.run_relaxed`; the
loop, checkpoints (kind ``tap``), resume, DDP and progress bar are
:func:`pullback_ext.metric.training.fit`'s. The targets are computed once, before training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from pullback_ext.comparison.backbones import Backbone
from pullback_ext.errors import PullbackError
from pullback_ext.families import TimmFamily, detect
from pullback_ext.metric.targets import image_generator
from pullback_ext.metric.training import TrainConfig
from pullback_ext.prune import timm_vit
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions
from pullback_ext.tap.register import TASKS, TaskRegister, lora_shapes
from pullback_ext.prune.methods.tap import TAP
from pullback_ext.tap_training.relaxed import run_relaxed
from pullback_ext.tap.tokens import batch_shares


def default_layers(task: str, depth: int) -> tuple[int, int]:
    """Eligible block inputs ``(1, depth)`` for CLS (up to the input of the last block), ``(1, depth − 1)``
    for dense tasks (the last block is Last-Layer Fusion's); block 0's input is left alone so that
    the register has seen the image once."""
    return (1, depth) if task == "cls" else (1, depth - 1)


def sample_rho(seed: int, step: int, rho_range: tuple[float, float]) -> float:
    """The keep rate of ``step``: uniform in ``rho_range``, a function of ``(seed, step)`` only."""
    u = float(torch.rand((), generator=image_generator(seed, 3, step), dtype=torch.float64))
    return rho_range[0] + u * (rho_range[1] - rho_range[0])


def distortion(task: str, pruned: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Per-image distortion ``[B]``: CLS ``1 − cos`` of embeddings ``[B, E]``; depth SILog of depths ``[B, H, W]``."""
    if task == "cls":
        return 1 - F.cosine_similarity(pruned, full, dim=-1)
    g = (pruned.clamp_min(1e-6).log() - full.clamp_min(1e-6).log()).flatten(1)
    return (g.pow(2).mean(1) - g.mean(1).pow(2)).clamp_min(1e-12).sqrt()


class DemoRunner:
    """The demo model's pruned forward for training: embed, :func:`run_relaxed`, decode ``task``."""

    def __init__(self, model, task: str):
        self.model, self.task = model, task

    def __call__(self, register: TaskRegister, images: torch.Tensor, rho: float) -> torch.Tensor:
        m = self.model
        take = set(m.hook_layers) if self.task == "depth" else set()
        final, hooked = run_relaxed(register, m.embed(images), m.backbone.blocks, timm_vit.call_block,
                                    int(m.backbone.num_prefix_tokens), rho, take=take, share_mean=_share_mean)
        return decode(m, self.task, final, hooked)


class BackboneRunner:
    """Another backbone's pruned forward for training: its ``reduced`` forward on a TAP reduction
    whose method runs the training loop (:class:`RelaxedTAP`); the output of ``task`` (``embedding``
    or ``depth``)."""

    def __init__(self, backbone: Backbone, task: str):
        self.backbone, self.key = backbone, "embedding" if task == "cls" else "depth"
        self.shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls)

    def __call__(self, register: TaskRegister, images: torch.Tensor, rho: float) -> torch.Tensor:
        reduction = ReductionOptions(strategy=TAP.name, head=register, ratio=1.0 - rho).resolve(self.shape)
        reduction = dataclasses.replace(reduction, method=RELAXED_TAP)
        return self.backbone.reduced(reduction, images)[self.key]


class RelaxedTAP(TAP):
    """TAP's training forward (:func:`~pullback_ext.tap_training.relaxed.run_relaxed`, the shares of
    a batch averaged over DDP ranks) in place of the deployed loop."""

    def run(self, reduction, x: torch.Tensor, loop, take=()):
        rho = 1.0 - reduction.options.ratio
        return run_relaxed(reduction.strategy, x, loop.blocks, loop.call_block, reduction.backbone.num_prefix, rho, take,
                           _share_mean)


RELAXED_TAP = RelaxedTAP()


def decode(model, task: str, final: torch.Tensor, hooked: dict) -> torch.Tensor:
    """The demo's ``embedding [B, E]`` (cls) or ``depth [B, H, W]`` from full-length block outputs."""
    norm = model.backbone.norm
    if task == "cls":
        return model.cls_head(norm(final)[:, 0])[0]
    return model.depth_head([norm(hooked[i]) for i in model.hook_layers], model.image_size)


def _share_mean(shares: torch.Tensor) -> list[float]:
    """The batch-mean shares, averaged over DDP ranks too (equal slices: the global batch's mean)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return batch_shares(shares)
    mean = shares.detach().mean(dim=0).to(torch.float64)
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).tolist()


@dataclass
class TapTask:
    """The :class:`~pullback_ext.metric.training.Task` of TAP: distortion at the step's ρ."""

    runner: DemoRunner | BackboneRunner
    task: str
    seed: int
    rho_range: tuple
    kind: str = field(default="tap", init=False)

    def loss(self, model, batch: dict, indices, step: int):
        rho = sample_rho(self.seed, step, self.rho_range)
        d = distortion(self.task, model(self.runner, batch["images"], rho), batch["target"])
        return d.mean(), {"rho": rho}


@dataclass(frozen=True)
class TapConfig:
    """One TAP training run: ``task`` cls | depth, ``adapt`` (TAP-J: LoRA of ``lora_rank``),
    eligible ``layers`` (None: :func:`default_layers`), ``rho_range`` of the sampled keep rates,
    ``key_dim`` of the read-out, ``train`` (batch, steps, lr, seed, checkpoints)."""

    task: str
    train: TrainConfig
    adapt: bool = False
    layers: Optional[tuple] = None
    rho_range: tuple = (0.3, 0.9)
    key_dim: int = 32
    lora_rank: int = 4

    def __post_init__(self):
        if self.task not in TASKS:
            raise PullbackError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        low, high = self.rho_range
        if not 0.0 < low <= high < 1.0:
            raise PullbackError(f"rho_range must be (low, high) with 0 < low <= high < 1; got {self.rho_range}")


def layer_layout(model, backbone: Backbone) -> tuple:
    """``(blocks, layout)``: the block list of ``model`` (the demo model, a timm VisionTransformer or
    a Hugging Face model; ``backbone`` its view) and the name of its family
    (:func:`pullback_ext.families.detect`), whose ``lora_targets`` TAP-J adapts."""
    if backbone.name == "demo":
        return model.backbone.blocks, "timm_vit"
    family = detect(model)
    if isinstance(family, TimmFamily):
        timm_vit.check_strategy(model, TAP.name)  # an Eva (RoPE) is refused
    return family.layers(model), family.name


def build_register(model, backbone: Backbone, config: TapConfig) -> TaskRegister:
    """A fresh register for ``model`` (seen as ``backbone``), in its dtype (seeded by ``config.train.seed``)."""
    blocks, layout = layer_layout(model, backbone)
    torch.manual_seed(config.train.seed)
    layers = config.layers or default_layers(config.task, backbone.depth)
    lora = lora_shapes(blocks, layout) if config.adapt else None
    register = TaskRegister(backbone.features_dim, layers, config.task, config.key_dim, lora, config.lora_rank)
    return register.to(next(model.parameters()).dtype)


@torch.no_grad()
def targets(backbone: Backbone, task: str, images: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """The unpruned original model's outputs on ``images``: embeddings or depths."""
    outs = [backbone.full(images[s:s + batch]) for s in range(0, len(images), batch)]
    return torch.cat([o["embedding" if task == "cls" else "depth"] for o in outs])


def train(model, images: torch.Tensor, config: TapConfig, out: Path, resume: bool = False, progress: bool = True,
          on_step=None, backbone: Optional[Backbone] = None) -> TaskRegister:
    """Train a register for the frozen ``model`` on ``images [n, 3, H, W]``; checkpoints in ``out``
    (``on_step(step)``: as in :func:`~pullback_ext.metric.training.fit`). ``backbone``: the
    model's view, which must serve ``config.task`` (None: ``model`` is the demo model). The demo
    model runs :class:`DemoRunner`, any other :class:`BackboneRunner`."""
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.metric.training import fit
    from pullback_ext.tap.checkpoint import model_classes

    backbone = demo_backbone(model) if backbone is None else backbone
    if config.task not in backbone.tasks:
        raise PullbackError(f"--task: {backbone.name} serves {', '.join(backbone.tasks)}; got {config.task!r}")
    model.eval().requires_grad_(False)
    register = build_register(model, backbone, config)
    data = {"images": images, "target": targets(backbone, config.task, images)}
    runner = DemoRunner(model, config.task) if backbone.name == "demo" else BackboneRunner(backbone, config.task)
    task = TapTask(runner, config.task, config.train.seed, tuple(config.rho_range))
    extra = {"tap": {"variant": "TAP-J" if config.adapt else "TAP-F", **{k: v for k, v in asdict(config).items() if k != "train"}}}
    fit(task, register, data, config.train, out, extra_config=extra, resume=resume, progress=progress, on_step=on_step,
        classes=model_classes())
    return register
