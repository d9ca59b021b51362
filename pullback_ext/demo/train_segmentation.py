"""Train the demo model's segmentation head on rendered scenes, the backbone frozen.

    python -m pullback_ext.demo.train_segmentation [--steps 2400] [--batch-size 16] [--train-images 4096] [--cache-dir DIR]

Classes (11): ground, wall, and the nine object classes of the image labels (type × colour
family), each pixel labelled by the surface the renderer's camera ray hits first
(``render(..., classes=True)``). The training scenes are the demo's training scenes (the same
seeds as ``python -m pullback_ext.demo.train``), rendered once with their class maps; each step
draws a batch with random horizontal flips, computes the frozen backbone's hooked features under
``no_grad`` (bf16 autocast) and trains only the :class:`~pullback_ext.embedded.model.SegmentationHead`
on them: class-weighted cross-entropy (weights ∝ frequency^-power, from the training maps),
AdamW with warm-up and cosine decay. Seeded: the same command on the same thread count
reproduces the weights. At the end the head is evaluated on held-out scenes *after* the fp16
round trip of the shipped file (pixel accuracy, mIoU, per-class IoU), and the weights, the
``segmentation`` section of ``model_card.json`` and ``MODEL_CARD.md`` are written (atomically)
to ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

WEIGHTS_NAME = "demo_segmentation.safetensors"


def parse_args(argv=None) -> argparse.Namespace:
    from pullback_ext.embedded.weights_io import WEIGHTS_DIR

    p = argparse.ArgumentParser(prog="python -m pullback_ext.demo.train_segmentation", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2400, help="optimiser steps (default 2400)")
    p.add_argument("--batch-size", type=int, default=16, help="images per step (default 16)")
    p.add_argument("--train-images", type=int, default=4096, help="rendered training scenes (default 4096)")
    p.add_argument("--eval-images", type=int, default=512, help="held-out scenes for the record (default 512)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (default 100)")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--class-power", type=float, default=0.5,
                   help="class weights ∝ pixel frequency^-power (0: plain cross-entropy; default 0.5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-bf16", action="store_true", help="run backbone and head in float32 instead of bf16 autocast")
    p.add_argument("--weights", type=Path, default=None, help="the demo model's weights (default: the shipped file)")
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="output folder (default: the package's weights/)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="keep the rendered training set in this folder and reuse it on the next run")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "train_images", "eval_images", "threads", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.class_power < 0:
        p.error(f"--class-power: expected a non-negative number, got {args.class_power}")
    return args


def reproduce_command(args: argparse.Namespace) -> str:
    """The training command with every setting that affects the weights spelled out."""
    from pullback_ext.demo.train import command_flags

    flags = command_flags(args, [f"--class-power {args.class_power:g}"])
    if args.weights is not None:
        flags.append(f"--weights {Path(args.weights).name}")
    return "python -m pullback_ext.demo.train_segmentation " + " ".join(flags)


def class_weights(classes, num_classes: int, power: float):
    """Cross-entropy weights ``w_c ∝ f_c^-power`` from the training maps' class frequencies
    ``f_c``, scaled so that the average weight per pixel is 1 (absent classes: weight 0)."""
    import torch

    freq = torch.bincount(classes.flatten().long(), minlength=num_classes).double()
    freq = freq / freq.sum()
    weights = torch.where(freq > 0, freq.clamp_min(1e-12) ** -power, torch.zeros_like(freq))
    return (weights / (weights * freq).sum()).float()


def hooked_maps(model, images, bf16: bool):
    """The frozen backbone's hooked token maps (through the final norm), float32, no graph."""
    import torch

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hooked: dict = {}
        model.run_blocks(model.embed(images), 0, max(model.hook_layers) + 1, hooked)
        return [m.float() for m in model.hook_maps(hooked)]


def train_head(model, head, data: dict, args: argparse.Namespace, started: float) -> None:
    """AdamW (no weight decay on biases) on random flipped batches: class-weighted cross-entropy
    of the head's logits on the frozen backbone's features."""
    import torch
    import torch.nn.functional as Fn

    from pullback_ext.demo.train import adamw, flipped_batch, optimiser_step, set_learning_rate
    from pullback_ext.progress import progress_bar

    weights = class_weights(data["classes"], head.num_classes, args.class_power)
    optimiser = adamw(head, lambda name, p: p.dim() > 1, args)
    order = torch.Generator().manual_seed(args.seed + 1)
    running = None
    progress = progress_bar(range(args.steps), desc="train segmentation", unit="step")
    for step in progress:
        batch = flipped_batch(data, ("images", "classes"), args.batch_size, order)
        set_learning_rate(optimiser, step, args)
        maps = hooked_maps(model, batch["images"], not args.no_bf16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            logits = head(maps, model.image_size)
        loss = Fn.cross_entropy(logits.float(), batch["classes"].long(), weight=weights)
        optimiser_step(optimiser, loss, head)
        running = loss.detach() if running is None else 0.98 * running + 0.02 * loss.detach()
        if step % 10 == 0:
            progress.set_postfix(ce=f"{running:.3f}")
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} weighted ce {running:.4f} elapsed {time.time() - started:.0f}s", file=sys.stderr, flush=True)


def segmentation_record(args: argparse.Namespace, head, held: dict, files: dict, timing: dict) -> dict:
    """The ``segmentation`` section of the model card. ``files``: ``weights`` (file name),
    ``sha256`` (of the shipped file) and ``backbone_weights`` (digest of the backbone it reads)."""
    from pullback_ext.demo.train import run_stamp
    from pullback_ext.embedded.model import HOOK_LAYERS, SEGMENTATION_CHANNELS, SEGMENTATION_FEATURES
    from pullback_ext.embedded.scenes import SEGMENT_CLASS_NAMES

    return {
        "weights": files["weights"],
        "sha256": files["sha256"],
        "backbone_weights": files["backbone_weights"],
        "architecture": f"DPT-style on the depth head's hooks {list(HOOK_LAYERS)} (final norm applied): reassemble "
                        f"channels {list(SEGMENTATION_CHANNELS)} to 56/28/14/7, 4 fusion blocks ({SEGMENTATION_FEATURES} channels), "
                        f"{head.num_classes}-class logits at 56x56, bilinear to 112x112",
        "parameters": sum(p.numel() for p in head.parameters()),
        "classes": list(SEGMENT_CLASS_NAMES),
        "classes_why": "every pixel hits the ground, the wall or one object (scenes.render's segment map); objects are "
                       "labelled with the image labels' type x colour family, so 2 + 9 = 11 classes and an object "
                       "pixel's class is the image label of that object",
        "command": reproduce_command(args),
        "recipe": f"backbone frozen (the shipped demo weights); {args.steps} AdamW steps of {args.batch_size} images "
                  f"(of {args.train_images} training scenes, random horizontal flips), lr {args.lr:g} (warm-up "
                  f"{args.warmup}, cosine), weight decay {args.weight_decay:g}, cross-entropy weighted by class "
                  f"frequency^-{args.class_power:g}, {'float32' if args.no_bf16 else 'bf16 autocast'}, seed {args.seed}",
        **run_stamp(args, timing),
        "heldout": held,
    }


def write_record(out: Path, record: dict) -> None:
    """Put ``record`` into ``out/model_card.json`` as its ``segmentation`` section and rewrite
    ``MODEL_CARD.md`` from it (both atomic)."""
    from pullback_ext.demo.train import write_model_card
    from pullback_ext.errors import PullbackError

    card_path = Path(out) / "model_card.json"
    if not card_path.is_file():
        raise PullbackError(f"--out: {card_path} not found; the segmentation record goes into the demo model's card")
    card = json.loads(card_path.read_text())
    card["segmentation"] = record
    write_model_card(Path(out), card)


def main(argv=None) -> int:
    args = parse_args(argv)
    from pullback_ext.demo.metrics import evaluate_segmentation
    from pullback_ext.demo.train import cached_training_set, start_run
    from pullback_ext.embedded import heldout, load, load_segmentation_head
    from pullback_ext.embedded.model import SegmentationHead
    from pullback_ext.embedded.weights_io import save_weights, weights_digest

    started = start_run(args)
    model = load(args.weights)
    data = cached_training_set(args.train_images, args.seed, args.cache_dir, classes=True)
    data_seconds = time.time() - started
    head = SegmentationHead(num_prefix_tokens=int(model.backbone.num_prefix_tokens)).train()
    train_head(model, head, data, args, started)

    out_dir = Path(args.out)
    weights_path = out_dir / WEIGHTS_NAME
    backbone = weights_digest(model)
    save_weights(head, weights_path, metadata={"format": "pt", "model": "pullback_ext.embedded.SegmentationHead",
                                               "backbone_weights": backbone, "classes": str(head.num_classes)})
    shipped = load_segmentation_head(weights_path, model=model)
    held = evaluate_segmentation(model, shipped, heldout(args.eval_images, seed=0, classes=True))
    elapsed = time.time() - started
    print(f"held-out: pixel accuracy {held['pixel_accuracy']:.4f} mIoU {held['miou']:.4f} ({elapsed / 60:.1f} min)",
          file=sys.stderr, flush=True)
    files = {"weights": WEIGHTS_NAME, "sha256": hashlib.sha256(weights_path.read_bytes()).hexdigest(), "backbone_weights": backbone}
    write_record(out_dir, segmentation_record(args, shipped, held, files, {"wall_clock_min": elapsed / 60, "data_seconds": data_seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
