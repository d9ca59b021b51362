"""``pullback train finetune``: an importance head (``--init-head``, from ``pullback train head``)
fine-tuned through importance_tome's relaxed merging on the task's own distortion, the backbone
frozen (:mod:`pullback_ext.dtem_training.finetune`; docs/prune.md).

Writes OUT/model.safetensors + OUT/config.json (an importance head checkpoint, kind ``head``, its
start's records kept and a ``finetune`` record added: ``--head OUT`` takes it), the loop's
checkpoints and resume state in OUT/training, and OUT/results.json (held-out distortion of
importance_tome with the start head and with the fine-tuned one, and of ToMe, at a few ``r``, on
the ``--images`` after the training ones or on the first ``--eval-images``; the training time).
Runs under torchrun (DDP).
"""

from __future__ import annotations

import argparse
import time

REPORT_R = (8, 16, 24)  # the r of the held-out report (ToMe's constant schedule reaches ~1.3x / 1.8x / 2.6x on the demo)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``finetune`` group of ``pullback train`` (model, images, --task, --out and the optimisation
    flags are shared; ``--task`` is ``cls`` or ``depth``, default cls)."""
    from pullback_ext.dtem_training.finetune import BUDGETS

    group = parser.add_argument_group("finetune")
    group.add_argument("--init-head", default=None, metavar="DIR",
                       help="finetune: the importance head checkpoint to start from (pullback train head)")
    group.add_argument("--budgets", default=",".join(map(str, BUDGETS)), metavar="R1,R2,...",
                       help="finetune: ToMe's r of each step in turn (importance_tome's defaults at that r)")


def _config(args: argparse.Namespace):
    from pullback_ext.commands.arguments import comma_ints
    from pullback_ext.dtem_training.finetune import FinetuneConfig
    from pullback_ext.metric.training import TrainConfig

    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        warmup_steps=min(args.warmup, args.steps), seed=args.seed, checkpoint_every=args.checkpoint_every)
    return FinetuneConfig(task=args.task or "cls", train=train, budgets=comma_ints(args.budgets, "--budgets"))


def _report(backbone, start, tuned, score_layer: int, config, held, seconds: float, args: argparse.Namespace) -> None:
    from pathlib import Path

    from pullback_ext.dtem_training.training import heldout_report
    from pullback_ext.fileio import atomic_write_json

    ours = {"strategy": "importance_tome", "score_layer": score_layer}
    rows = heldout_report(backbone, {"importance_tome (start head)": ours | {"head": start},
                                     "importance_tome (fine-tuned)": ours | {"head": tuned}, "tome": {"strategy": "tome"}},
                          config.task, held.load()["images"], REPORT_R)
    out = Path(args.out) / "results.json"
    atomic_write_json(out, {"task": config.task, "budgets": list(config.budgets), "steps": args.steps,
                            "train_seconds": seconds, "command": args.command_line, "heldout": rows})
    for row in rows:
        print(f"{row['strategy']} r = {row['r']}: {row['metric']} {row['value']:.4g} ({row['images']} held-out images)")
    print(f"trained in {seconds:.0f} s; wrote {out}")


def run(args: argparse.Namespace) -> int:
    from pullback_ext import distributed
    from pullback_ext.commands.arguments import model_spec, renamed_switch
    from pullback_ext.commands.train_config import training_folder
    from pullback_ext.commands.train_dtem import image_sets
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.dtem_training.finetune import finetune, score_layer_of
    from pullback_ext.errors import PullbackError
    from pullback_ext.metric.checkpoint import read_config
    from pullback_ext.commands.evaluate_plan import load_metric

    if args.init_head is None:
        raise PullbackError("--init-head: train finetune starts from an importance head checkpoint (pullback train head); give its folder")
    config, spec, out = _config(args), model_spec(args), training_folder(args)
    backbone, model = load_backbone(spec, args.weights)
    start = load_metric(args.init_head, backbone.features_dim)[0]
    train_set, held = image_sets(args, spec, backbone)
    source = {"model": str(spec), "init_head": str(args.init_head), "images": dict(train_set.describe(), count=len(train_set))}
    info = distributed.init_from_env()
    try:
        began = time.perf_counter()
        start_config = read_config(args.init_head)
        tuned = finetune(model, start, start_config, train_set.load()["images"], config, out,
                         resume=args.resume, progress=not renamed_switch(args, "--no-progress", "--quiet"), backbone=backbone,
                         extra=source)
        seconds = time.perf_counter() - began
    finally:
        distributed.shutdown(info)
    if info.is_main:
        _report(backbone, start, tuned, score_layer_of(start_config), config, held, seconds, args)
    return 0
