"""``pullback train tap``: a TAP task register (TAP-F, or TAP-J with ``--adapt lora``) for the demo
model, a timm VisionTransformer (``timm:NAME``, cls) or a Hugging Face folder (``hf:DIR``: a ViT-family
model, cls; DPT or Depth Anything, depth).

Writes OUT/model.safetensors + OUT/config.json (kind ``tap``), the resume state, OUT/metrics.jsonl
and OUT/results.json (held-out distortion of the deployed model at several keep rates, on the
``--images`` after the training ones or on the first ``--eval-images``; the training time; TAP-J:
also the adapted model's unpruned distortion). Deploy with
``patch.timm(model.backbone, strategy="tap", head=OUT, ratio=0.5)`` (demo) or ``patch.auto(model,
strategy="tap", head=OUT, ratio=0.5)``. Runs under torchrun (DDP).
"""

from __future__ import annotations

import argparse
import time

RHOS = (0.3, 0.5, 0.7, 1.0)  # keep rates of the held-out evaluation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``tap`` group of ``pullback train`` (the model, images, --task, --out and the optimisation flags are
    shared; ``--task`` is ``cls`` or ``depth`` here, the task the register serves, default cls)."""
    group = parser.add_argument_group("tap")
    group.add_argument("--adapt", default="none", choices=["none", "lora"],
                       help="tap: none (TAP-F, backbone frozen) or lora (TAP-J: LoRA on every block's attention and MLP)")
    group.add_argument("--lora-rank", type=int, default=4, help="tap: rank of the TAP-J adapters")
    group.add_argument("--tap-layers", default=None, metavar="START:STOP",
                       help="tap: eligible block inputs START..STOP-1 (default 1:depth for cls, 1:depth-1 for depth)")
    group.add_argument("--rho-range", default="0.3:0.9", metavar="LOW:HIGH", help="tap: keep rates ρ sampled in training")


def _pair(text: str, flag: str, kind):
    from pullback_ext.errors import PullbackError

    try:
        low, high = (kind(v) for v in text.split(":"))
    except ValueError:
        raise PullbackError(f"{flag}: expected two numbers as A:B, got {text!r}") from None
    return low, high


def run(args: argparse.Namespace) -> int:
    from pullback_ext import distributed
    from pullback_ext.commands.arguments import image_source, model_spec, renamed_switch
    from pullback_ext.commands.train_config import training_folder
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.errors import PullbackError
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.metric.training import TrainConfig
    from pullback_ext.sources.images import open_images
    from pullback_ext.tap_training.evaluation import heldout_report
    from pullback_ext.tap_training.training import TapConfig, train

    spec = model_spec(args)
    args.task = args.task or "cls"
    if args.task not in ("cls", "depth"):
        raise PullbackError(f"--task: a TAP register serves cls or depth; got {args.task!r}")
    out = training_folder(args)
    backbone, model = load_backbone(spec, args.weights)
    if args.task not in backbone.tasks:
        raise PullbackError(f"--task: {spec} serves {' or '.join(backbone.tasks)}; got {args.task!r}")
    source = image_source(args, spec)
    train_set = source.training(backbone.preprocess, args.num_images)
    held = source.heldout(backbone.preprocess, args.heldout, after=args.num_images) if args.eval_images is None else \
        open_images(args.eval_images, "--eval-images").heldout(backbone.preprocess, args.heldout)
    config = TapConfig(task=args.task, adapt=args.adapt == "lora", lora_rank=args.lora_rank,
                       layers=None if args.tap_layers is None else _pair(args.tap_layers, "--tap-layers", int),
                       rho_range=_pair(args.rho_range, "--rho-range", float),
                       train=TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                                         warmup_steps=min(args.warmup, args.steps), seed=args.seed,
                                         checkpoint_every=args.checkpoint_every))
    info = distributed.init_from_env()
    try:
        start = time.perf_counter()
        register = train(model, train_set.load()["images"], config, out, resume=args.resume,
                         progress=not renamed_switch(args, "--no-progress", "--quiet"), backbone=backbone)
        seconds = time.perf_counter() - start
    finally:
        distributed.shutdown(info)
    if info.is_main:
        report = heldout_report(backbone, register, held.load()["images"], RHOS)
        results = {"variant": "TAP-J" if config.adapt else "TAP-F", "task": args.task, "steps": args.steps,
                   "train_seconds": seconds, "command": args.command_line, "heldout": report}
        atomic_write_json(out / "results.json", results)
        for row in report:
            print(f"ρ = {row['rho']:.2f}: {row['metric']} {row['value']:.4f} ({row['images']} held-out images)")
        print(f"trained in {seconds:.0f} s; wrote {out / 'results.json'}")
    return 0
