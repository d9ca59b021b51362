"""The importance-head stage of ``pullback demo``: learn imp* of the demo CLS embedding probe.

The probe reads the output of block 1, the input of the CLS soft-merge stage that the pruning
stage runs at (the ViT-B layer 4 scaled to the demo's 8 blocks), and ends at the 128-d CLS
embedding whose cosine the pruning stage reports. Targets imp* come from the exact Jacobian (128
VJPs per image) of rendered training scenes and are cached; an ImportanceHead is trained on them
(or loaded when the stage already ran with the same settings) and evaluated by per-image Spearman ρ
on the held-out scenes the demo passes in; the pruning stage receives the trained head.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pullback_ext.demo.stages import DemoInputs, StageResult, TrainedHead
from pullback_ext.progress import info_line

NAME = "importance_head"
LAYER = 1
DECODER = "embedding"


@dataclass(frozen=True)
class StageSettings:
    train_images: int
    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    w_rank: float = 0.5
    rank: int = 20
    mlp_hidden: int = 64  # per-token MLPs in the encoder (pullback train head, 256 scenes: held-out ρ 0.916, 0.888 without)

    @classmethod
    def for_run(cls, quick: bool) -> "StageSettings":
        return cls(train_images=16, steps=150, batch_size=8) if quick else cls(train_images=96, steps=600)


def _weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def run_demo_stage(inputs: DemoInputs, progress: bool = True, settings: StageSettings | None = None) -> StageResult:
    """Train (or load) the head for the demo model's CLS probe; held-out Spearman ρ against imp*
    on ``inputs.scenes["images"]``. The result carries the head for the pruning stage.

    Writes ``out_dir/importance_head/`` (checkpoint, metrics.jsonl, target cache); a second run
    with the same settings and weights reuses them.
    """
    from pullback_ext.embedded.probes import demo_probe
    from pullback_ext.metric.head import ImportanceHead, parameter_count
    from pullback_ext.metric.probe_spec import features
    from pullback_ext.metric.targets import TargetCache, TargetConfig, compute_targets
    from pullback_ext.metric.tasks import HeadTask, evaluate_head
    from pullback_ext.metric.training import TrainConfig, fit

    started = time.time()
    model = inputs.model
    settings = settings or StageSettings.for_run(inputs.quick)
    stage_dir = Path(inputs.out_dir) / "importance_head"
    probe = demo_probe(model, LAYER, DECODER)
    targets = TargetConfig(mode="exact", rank=settings.rank, keep_basis=False)
    scenes_train = inputs.images.training(inputs.preprocess, settings.train_images)
    source = {"model": "demo", "weights": _weights_digest(model), "layer": LAYER, "decoder": DECODER, "images": scenes_train.describe()}
    train = TargetCache(stage_dir / "targets").build(
        probe, lambda a, b: features(probe, scenes_train, a, b), settings.train_images, targets, source, shard_size=32, progress=progress
    )
    target_seconds = time.time() - started

    torch.manual_seed(0)
    head = ImportanceHead(probe.dim, mlp_hidden=settings.mlp_hidden)
    head.set_score_offset(train["importance"])
    count = parameter_count(head)
    info_line(f"[importance_head] ImportanceHead(dim={probe.dim}, mlp_hidden={settings.mlp_hidden}): {count:,} parameters")
    cfg = TrainConfig(steps=settings.steps, batch_size=settings.batch_size, lr=settings.lr, warmup_steps=settings.steps // 20,
                      checkpoint_every=max(settings.steps // 4, 1), log_every=10)
    probe_def = {"model": "demo", "layer": LAYER, "decoder": DECODER}
    fit(HeadTask(w_rank=settings.w_rank), head, train, cfg, stage_dir,
        extra_config={"probe": probe_def, "targets": asdict(targets), "stage": asdict(settings)}, resume=True, progress=progress)

    F_held = probe.features(inputs.scenes["images"])
    imp_held = compute_targets(probe, F_held, targets, stream=[("heldout", i) for i in range(len(F_held))])["importance"]
    result = evaluate_head(head, F_held.F, imp_held)
    print(f"[importance_head] held-out Spearman rho = {result['mean']:.3f} ± {result['std']:.3f} over {result['count']} images", flush=True)
    report = {
        "probe": probe_def,
        "parameters": count,
        "train_images": settings.train_images,
        "steps": settings.steps,
        "w_rank": settings.w_rank,
        "spearman": result,
        "target_seconds": target_seconds,
        "seconds": time.time() - started,
        "checkpoint": str(stage_dir),
    }
    # the CLS embedding probe at block LAYER scores the tokens entering stage LAYER + 1
    return StageResult(report, heads=(TrainedHead("cls", head.eval().requires_grad_(False), LAYER + 1),))
