"""``pullback train dtem``: DTEM's per-block decoupled embeddings (Lee & Hong, NeurIPS 2024) for the
demo model, a timm VisionTransformer (``timm:NAME``, cls) or a Hugging Face folder (``hf:DIR``: a
ViT-family model, cls; DPT or Depth Anything, depth), the backbone frozen, through the authors'
relaxed merge (:mod:`pullback_ext.dtem_training`).

Writes OUT/model.safetensors + OUT/config.json (kind ``dtem``), the resume state, OUT/metrics.jsonl
and OUT/results.json (held-out distortion of the deployed DTEM and of ToMe at r/2 and r, on the
``--images`` after the training ones or on the first ``--eval-images``; the training time).
Deploy with ``patch.timm(model.backbone, strategy="dtem", head=OUT, r=16)`` (demo) or
``patch.auto(model, strategy="dtem", head=OUT, r=16)``. Runs under torchrun (DDP).
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``dtem`` group of ``pullback train`` (the model, images, --task, --out and the optimisation
    flags are shared; ``--task`` is ``cls`` or ``depth`` here, default cls)."""
    from pullback_ext.commands.arguments import positive_int

    group = parser.add_argument_group("dtem")
    group.add_argument("--r", type=positive_int, default=16, help="dtem: tokens merged softly in every block in training "
                                                                  "(the authors' --reduction 16)")
    group.add_argument("--k2", type=positive_int, default=3, help="dtem: candidate B tokens kept per A token in the soft grouping")
    group.add_argument("--tau1", type=float, default=0.1, help="dtem: temperature of the similarity scores")
    group.add_argument("--tau2", type=float, default=0.1, help="dtem: temperature of each round of the soft top-r")
    group.add_argument("--feat-dim", type=positive_int, default=None,
                       help="dtem: width of each block's embedding (default the authors': head width, twice it from width 1024)")


def _config(args: argparse.Namespace):
    from pullback_ext.dtem_training.relaxed import Relaxation
    from pullback_ext.dtem_training.training import DTEMConfig
    from pullback_ext.metric.training import TrainConfig

    train = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
                        warmup_steps=min(args.warmup, args.steps), seed=args.seed, checkpoint_every=args.checkpoint_every)
    return DTEMConfig(task=args.task or "cls", train=train, r=args.r, relax=Relaxation(args.k2, args.tau1, args.tau2),
                      feat_dim=args.feat_dim)


def image_sets(args: argparse.Namespace, spec, backbone):
    """``(training images, held-out images)`` ``[n, 3, H, W]`` prepared for ``backbone``."""
    from pullback_ext.commands.arguments import image_source
    from pullback_ext.sources.images import open_images

    source = image_source(args, spec)
    if args.eval_images is None:
        held = source.heldout(backbone.preprocess, args.heldout, after=args.num_images)
    else:
        held = open_images(args.eval_images, "--eval-images").heldout(backbone.preprocess, args.heldout)
    return source.training(backbone.preprocess, args.num_images), held


def _report(backbone, embedding, config, held, seconds: float, args: argparse.Namespace) -> None:
    from pathlib import Path

    from pullback_ext.dtem_training.training import heldout_report
    from pullback_ext.fileio import atomic_write_json

    embedding.eval()
    rows = heldout_report(backbone, {"dtem": {"strategy": "dtem", "head": embedding}, "tome": {"strategy": "tome"}}, config.task, held.load()["images"],
                          sorted({max(1, config.r // 2), config.r}))
    out = Path(args.out) / "results.json"
    atomic_write_json(out, {"task": config.task, "r": config.r, "steps": args.steps, "train_seconds": seconds,
                            "command": args.command_line, "heldout": rows})
    for row in rows:
        print(f"{row['strategy']} r = {row['r']}: {row['metric']} {row['value']:.4g} ({row['images']} held-out images)")
    print(f"trained in {seconds:.0f} s; wrote {out}")


def run(args: argparse.Namespace) -> int:
    from pullback_ext import distributed
    from pullback_ext.commands.arguments import model_spec, renamed_switch
    from pullback_ext.commands.train_config import training_folder
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.dtem_training.training import train

    config, spec, out = _config(args), model_spec(args), training_folder(args)
    backbone, model = load_backbone(spec, args.weights)
    train_set, held = image_sets(args, spec, backbone)
    source = {"model": str(spec), "images": dict(train_set.describe(), count=len(train_set))}
    info = distributed.init_from_env()
    try:
        began = time.perf_counter()
        embedding = train(model, train_set.load()["images"], config, out, resume=args.resume,
                          progress=not renamed_switch(args, "--no-progress", "--quiet"), backbone=backbone, extra=source)
        seconds = time.perf_counter() - began
    finally:
        distributed.shutdown(info)
    if info.is_main:
        _report(backbone, embedding, config, held, seconds, args)
    return 0
