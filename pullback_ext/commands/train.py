"""``pullback train spn|head|vae``: learn the task metric of a backbone–decoder pair.

Writes OUT/model.safetensors + OUT/config.json (with the exact probe definition), the resume state,
OUT/metrics.jsonl, OUT/results.json (held-out figures) and OUT/training.png; ``train head
--stages`` writes one such folder per stage and OUT/schedule.json (``train_schedule``). Runs under
``torchrun --nproc_per_node=N -m pullback_ext train ...`` (DDP, gloo on CPU): target shards are
split over ranks and every rank trains on its slice of the global batch.
"""

from __future__ import annotations

import argparse


def add_probe_arguments(parser: argparse.ArgumentParser) -> None:
    """The model, images and probe definition (shared with ``pullback eval-head``)."""
    from pullback_ext.commands.arguments import BUILTIN_HELP, add_source_arguments, add_task_argument, positive_int

    add_source_arguments(parser, 256, "training images",
                         images_help=f"a folder of images (training images first, then held-out) or a built-in set: {BUILTIN_HELP}",
                         img_size=True)
    parser.add_argument("--layer", type=int, default=None, help="probe layer ℓ (0-based block index; F is its output)")
    add_task_argument(parser, "; train tap, dtem, finetune: cls or depth, the task the register, embeddings or fine-tuned head serve (default cls)")
    parser.add_argument("--output-size", type=positive_int, default=None, help="resize dense outputs to S×S (M = S²)")
    parser.add_argument("--vae", default=None, metavar="DIR", help="take the probe at the latent of this trained feature VAE")
    parser.add_argument("--heldout", type=positive_int, default=32, help="held-out images for the final evaluation")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--seed", type=int, default=0, help="seeds training, sketches, and the weights of a model built without --weights")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument, add_renamed, positive_int

    parser.add_argument("kind", choices=["spn", "head", "vae", "tap", "dtem", "finetune"],
                        help="what to train (tap: a TAP task register, docs/tap.md; dtem: DTEM's decoupled embeddings, docs/prune.md; "
                             "finetune: an importance head (--init-head) fine-tuned through importance_tome's relaxed merging, docs/prune.md)")
    add_probe_arguments(parser)
    parser.add_argument("--stages", default=None, metavar="L1,L2,...",
                        help="head: one head per stage of a schedule instead of --layer: the stage at layer ℓ (0-based block, "
                             ">= 1) gets a head on the output of block ℓ-1, in OUT/stage-ℓ, and OUT/schedule.json names them")
    parser.add_argument("--eval-images", metavar="PATH|builtin:NAME", default=None,
                        help="take the --heldout images from this source (its first ones) instead of the --images after the "
                             "training ones, e.g. train on builtin:scenes and evaluate on builtin:photos")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (checkpoint, metrics, results)")
    targets = parser.add_argument_group("targets (spn, head)")
    targets.add_argument("--rank", type=positive_int, default=20, help="rank r of the SPN / of imp*")
    targets.add_argument("--targets", default="randnla", choices=["randnla", "exact"], help="randomized SVD or the exact-SVD ceiling")
    targets.add_argument("--power", type=int, default=1, help="power rounds q of the randomized SVD")
    targets.add_argument("--oversample", type=int, default=10)
    targets.add_argument("--on-the-fly", action="store_true", help="spn: fresh sketch every step instead of cached targets")
    targets.add_argument("--cache", default=None, metavar="DIR", help="target cache folder (default OUT/targets)")
    targets.add_argument("--target", default="imp", help="head: imp (imp*), block-norm (ablation) or spn:DIR (distil imp_θ of a trained SPN)")
    targets.add_argument("--w-rank", type=float, default=0.5, help="head: weight of the ranking loss")
    targets.add_argument("--w-order", type=float, default=0.0,
                         help="spn: weight of an extra term tying column j of U to mode j (default 0: L_sub + L_en only)")
    model = parser.add_argument_group("model")
    model.add_argument("--hidden", type=positive_int, default=None,
                       help="width of the token encoder (spn, vae: default 256; head: default sized to the backbone, the largest "
                            "of H = 32, 64, ... with H/32 heads and MLP H within 1.5%% of the backbone's FLOPs)")
    model.add_argument("--heads", type=positive_int, default=None,
                       help="attention heads (spn: default 4; head: H/32 when sized, else 4)")
    model.add_argument("--mlp-hidden", type=int, default=None,
                       help="head: width of a per-token MLP in each encoder block (0: none; default H when sized, else 0)")
    model.add_argument("--eps", type=float, default=1e-3, help="spn: isotropic floor ε")
    model.add_argument("--latent-dim", type=positive_int, default=32, help="vae: latent channels per token")
    model.add_argument("--beta", type=float, default=1e-3, help="vae: KL weight")
    model.add_argument("--diagnose-images", type=int, default=2,
                       help="vae: held-out images diagnosed at the features and at the latent afterwards (0: skip)")
    from pullback_ext.commands import train_dtem, train_finetune, train_tap

    train_tap.add_arguments(parser)
    train_dtem.add_arguments(parser)
    train_finetune.add_arguments(parser)
    train = parser.add_argument_group("optimisation")
    train.add_argument("--steps", type=positive_int, default=1000)
    train.add_argument("--batch-size", type=positive_int, default=16, help="global batch (split over torchrun ranks)")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--weight-decay", type=float, default=0.01)
    train.add_argument("--warmup", type=int, default=50, help="linear warm-up steps before the cosine decay")
    train.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                       help="keep an exponential moving average of the weights with this decay (e.g. 0.999) and save it as the model (0: off)")
    train.add_argument("--amp", action="store_true", help="mixed precision (bfloat16 on CPU, float16 on CUDA)")
    train.add_argument("--checkpoint-every", type=positive_int, default=100)
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in OUT")
    add_overwrite_argument(train)
    add_renamed(train, "--no-progress", "--quiet", action="store_true")


def _check(args: argparse.Namespace) -> None:
    from pullback_ext.errors import PullbackError

    for name in ("power", "oversample", "warmup", "mlp_hidden"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise PullbackError(f"--{name.replace('_', '-')}: expected an int >= 0, got {getattr(args, name)}")
    if not args.lr > 0:
        raise PullbackError(f"--lr: expected > 0, got {args.lr}")
    if not args.eps >= 0:
        raise PullbackError(f"--eps: expected >= 0, got {args.eps}")
    if args.target not in ("imp", "block-norm") and not args.target.startswith("spn:"):
        raise PullbackError(f"--target: expected imp, block-norm or spn:DIR, got {args.target!r}")
    if args.on_the_fly and args.kind != "spn":
        raise PullbackError("--on-the-fly: only for spn (the head and VAE train on cached data)")


def run(args: argparse.Namespace) -> int:
    from pullback_ext import distributed
    from pullback_ext.commands.train_config import print_results, run_config, training_folder
    from pullback_ext.metric.training_run import TrainingRun

    if args.kind == "tap":
        from pullback_ext.commands import train_tap

        return train_tap.run(args)
    if args.kind in ("dtem", "finetune"):
        from pullback_ext.commands import train_dtem, train_finetune

        return (train_dtem if args.kind == "dtem" else train_finetune).run(args)
    _check(args)
    if args.stages is not None:
        from pullback_ext.commands import train_schedule

        return train_schedule.run(args)
    out = training_folder(args)
    config = run_config(args)
    info = distributed.init_from_env()
    try:
        results = TrainingRun(config, info).run()
    finally:
        distributed.shutdown(info)
    if info.is_main:
        print_results(args.kind, results, out)
    return 0
