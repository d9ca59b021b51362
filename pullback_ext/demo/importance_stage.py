"""The importance-head stage of ``pullback demo``: per-token importance heads of the demo model,
one for the CLS embedding and one for the depth map, both reading the output of block 1.

Block 1's output is the input of the CLS soft-merge stage the pruning stage runs at (the ViT-B
layer 4 scaled to the demo's 8 blocks) and the layer ``importance_tome`` scores at. Targets imp*
come from the demo probe's Jacobian (CLS: exact, 128 VJPs per image; depth: randomised, rank 20,
on a 16×16 depth map) on 96 (CLS) and 32 (depth) rendered training scenes; an ImportanceHead is trained on them.

Training is the expensive part of the demo and is deterministic, so the heads trained with
:data:`SETTINGS` on the shipped demo model are shipped too (``embedded/weights/heads/``, fp16,
with a record of the settings and the command, :mod:`pullback_ext.demo.ship_heads`, that
reproduces them). The stage loads them when they fit the model and settings, trains otherwise
(other ``--weights``), and always measures each head's held-out Spearman ρ against freshly
computed imp* on the demo's held-out scenes; the pruning stage receives the heads.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pullback_ext.demo.stages import DemoInputs, StageResult, TrainedHead
from pullback_ext.progress import info_line

NAME = "importance_head"
LAYER = 1
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "embedded" / "weights" / "heads"
RECORD = "heads.json"


@dataclass(frozen=True)
class HeadSettings:
    """One head: its probe (``decoder``, ``output_size`` of a depth map), how its targets are
    computed (``targets``: exact or randnla, ``rank``), and its training."""

    decoder: str
    output_size: int | None
    targets: str
    train_images: int
    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    w_rank: float = 0.5
    rank: int = 20
    mlp_hidden: int = 64  # per-token MLPs in the encoder (pullback train head, 256 scenes: held-out ρ 0.916, 0.888 without)


SETTINGS = {"cls": HeadSettings("embedding", None, "exact", train_images=96, steps=600),
            "depth": HeadSettings("depth", 16, "randnla", train_images=32, steps=400)}
EVAL_IMAGES = {True: 2, False: 6}  # held-out scenes the stage measures ρ on (quick / full)
PLAN = {quick: f"load the shipped CLS and depth importance heads (trained here if they do not fit the weights), "
               f"held-out Spearman ρ against imp* on {n} scenes" for quick, n in EVAL_IMAGES.items()}
EXPECTED_S = {True: 12, False: 30}


def weights_digest(model: torch.nn.Module) -> str:
    """A short digest of ``model``'s state dict (which weights a head was trained for)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _probe(model, settings: HeadSettings):
    from pullback_ext.embedded.probes import demo_probe

    return demo_probe(model, LAYER, settings.decoder, output_size=settings.output_size)


def _target_config(settings: HeadSettings):
    from pullback_ext.metric.targets import TargetConfig

    return TargetConfig(mode=settings.targets, rank=settings.rank, keep_basis=False)


def train_head(model, inputs: DemoInputs, settings: HeadSettings, stage_dir: Path, progress: bool = True):
    """Train a head with ``settings`` on ``model`` (targets cached under ``stage_dir/targets``,
    checkpoints in ``stage_dir``; a second run reuses both)."""
    from pullback_ext.metric.head import ImportanceHead
    from pullback_ext.metric.probe_spec import features
    from pullback_ext.metric.targets import TargetCache
    from pullback_ext.metric.tasks import HeadTask
    from pullback_ext.metric.training import TrainConfig, fit

    probe = _probe(model, settings)
    scenes = inputs.images.training(inputs.preprocess, settings.train_images)
    source = {"model": "demo", "weights": weights_digest(model), "layer": LAYER, "decoder": settings.decoder,
              "output_size": settings.output_size, "images": scenes.describe()}
    train = TargetCache(stage_dir / "targets").build(probe, lambda a, b: features(probe, scenes, a, b), settings.train_images,
                                                     _target_config(settings), source, shard_size=32, progress=progress)
    torch.manual_seed(0)
    head = ImportanceHead(probe.dim, mlp_hidden=settings.mlp_hidden)
    head.set_score_offset(train["importance"])
    cfg = TrainConfig(steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr, warmup_steps=settings.steps // 20,
                      checkpoint_every=max(settings.steps // 4, 1), log_every=10)
    fit(HeadTask(w_rank=settings.w_rank), head, train, cfg, stage_dir,
        extra_config={"probe": {"model": "demo", "layer": LAYER, "decoder": settings.decoder}, "stage": asdict(settings)},
        resume=True, progress=progress)
    return head.eval().requires_grad_(False)


def shipped_head(model, task: str, settings: HeadSettings, folder: Path = SHIPPED_DIR):
    """The shipped ``task`` head when it was trained with ``settings`` for these very ``model``
    weights, else None."""
    from pullback_ext.embedded.weights_io import load_weights
    from pullback_ext.metric.head import ImportanceHead

    record_path = Path(folder) / RECORD
    if not record_path.is_file():
        return None
    record = json.loads(record_path.read_text()).get(task)
    if record is None or record["settings"] != asdict(settings) or record["model_weights"] != weights_digest(model):
        return None
    head = ImportanceHead(model.backbone.embed_dim, mlp_hidden=settings.mlp_hidden)
    load_weights(head, Path(folder) / record["file"])
    return head.eval().requires_grad_(False)


def heldout_rho(model, head, settings: HeadSettings, images: torch.Tensor) -> dict:
    """Per-image Spearman ρ of ``head`` against imp* of its probe (``settings``) on ``images [n, 3, H, W]``."""
    from pullback_ext.metric.targets import compute_targets
    from pullback_ext.metric.tasks import evaluate_head

    probe = _probe(model, settings)
    F = probe.features(images)
    imp = compute_targets(probe, F, _target_config(settings), stream=[("heldout", i) for i in range(len(F))])["importance"]
    return evaluate_head(head, F.F, imp)


def run_demo_stage(inputs: DemoInputs, progress: bool = True, settings: dict | None = None) -> StageResult:
    """Load (or train) the CLS and depth heads (``settings``: {task: HeadSettings}, default
    :data:`SETTINGS`) and measure their held-out Spearman ρ against imp* on the first
    :data:`EVAL_IMAGES` of ``inputs.scenes["images"]``. The result carries the heads for the
    pruning stage; a head trained here is written to ``out_dir/importance_head/TASK/``."""
    from pullback_ext.metric.head import parameter_count

    report, heads = {}, []
    images = inputs.scenes["images"][: EVAL_IMAGES[inputs.quick]]
    for task, chosen in (settings or SETTINGS).items():
        started = time.time()
        head = shipped_head(inputs.model, task, chosen)
        origin = "shipped" if head is not None else "trained"
        if head is None:
            info_line(f"[importance_head] {task}: no shipped head fits these weights and settings; training one "
                      f"({chosen.train_images} scenes, {chosen.steps} steps)")
            head = train_head(inputs.model, inputs, chosen, Path(inputs.out_dir) / NAME / task, progress)
        rho = heldout_rho(inputs.model, head, chosen, images)
        print(f"[importance_head] {task} head ({origin}, {parameter_count(head):,} parameters): held-out Spearman rho = "
              f"{rho['mean']:.3f} ± {rho['std']:.3f} over {rho['count']} images", flush=True)
        report[task] = {"origin": origin, "layer": LAYER, "settings": asdict(chosen), "parameters": parameter_count(head),
                        "spearman": rho, "seconds": time.time() - started}
        # a probe at block LAYER scores the tokens entering stage LAYER + 1
        heads.append(TrainedHead(task, head, LAYER + 1))
    return StageResult(report, heads=tuple(heads))
