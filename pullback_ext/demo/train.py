"""Train the demo model (backbone, CLS head and depth head jointly) on rendered scenes.

    python -m pullback_ext.demo.train [--steps 800] [--batch-size 24] [--train-images 6144] [--cache-dir DIR]

The training scenes are rendered once into an in-memory cache (uint8 images, fp16 depth; kept on
disk for the next run with ``--cache-dir``), then sampled with random horizontal flips. Loss: cross-entropy (label smoothing 0.1) on the logits
plus L1 on log-depth. AdamW with warm-up and cosine decay, bf16 autocast on the CPU. Seeded:
the same command on the same thread count reproduces the weights. At the end the model is
evaluated on held-out scenes *after* the fp16 round trip of the shipped file, and the weights,
``model_card.json`` and ``MODEL_CARD.md`` are written (atomically) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    from pullback_ext.embedded.weights_io import WEIGHTS_DIR

    p = argparse.ArgumentParser(prog="python -m pullback_ext.demo.train", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=800, help="optimiser steps (default 800)")
    p.add_argument("--batch-size", type=int, default=24, help="images per step (default 24)")
    p.add_argument("--train-images", type=int, default=6144, help="rendered training scenes (default 6144)")
    p.add_argument("--eval-images", type=int, default=512, help="held-out scenes for the model card (default 512)")
    p.add_argument("--lr", type=float, default=7e-4, help="peak learning rate (default 7e-4)")
    p.add_argument("--warmup", type=int, default=60, help="warm-up steps (default 60)")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--depth-weight", type=float, default=1.0, help="weight of the log-depth L1 loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: on a busy machine a second thread mostly waits at barriers)")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 instead of bf16 autocast")
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR, help="output folder (default: the package's weights/)")
    p.add_argument("--init", type=Path, default=None,
                   help="start from these weights (.safetensors) instead of a random initialisation; the "
                        "model_card.json next to them, if any, is recorded as the previous training stage")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="keep the rendered training set in this folder and reuse it on the next run")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "train_images", "eval_images", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    return args


def render_training_set(num_images: int, seed: int, chunk: int = 256, classes: bool = False) -> dict:
    """Render the training scenes (seeds below the held-out range) into a compact cache;
    ``classes``: with the per-pixel class maps (uint8) too."""
    import torch
    from pullback_ext.progress import progress_bar

    from pullback_ext.embedded.scenes import render

    keys = ("images", "depth", "labels", "classes") if classes else ("images", "depth", "labels")
    parts: dict = {key: [] for key in keys}
    for index in progress_bar(range(0, num_images, chunk), desc="render training scenes", unit="chunk"):
        part = render(min(chunk, num_images - index), seed * 100_000 + index // chunk, classes=classes)
        part["images"] = (part["images"] * 255).round().to(torch.uint8)
        part["depth"] = part["depth"].to(torch.float16)
        if classes:
            part["classes"] = part["classes"].to(torch.uint8)
        for key in keys:
            parts[key].append(part[key])
    return {key: torch.cat(values) for key, values in parts.items()}


def cached_training_set(num_images: int, seed: int, cache_dir: Path | None, classes: bool = False) -> dict:
    """``render_training_set``, stored in / reused from ``cache_dir`` when given."""
    import io

    import torch

    from pullback_ext.fileio import atomic_write_bytes

    if cache_dir is None:
        return render_training_set(num_images, seed, classes=classes)
    path = Path(cache_dir) / f"train_{num_images}_seed{seed}{'_classes' if classes else ''}.pt"
    if path.is_file():
        print(f"training scenes loaded from {path}", file=sys.stderr, flush=True)
        return torch.load(path)
    data = render_training_set(num_images, seed, classes=classes)
    buffer = io.BytesIO()
    torch.save(data, buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return data


def command_flags(args: argparse.Namespace, loss_flags: list[str]) -> list[str]:
    """The flags of a training command shared by the demo's training scripts, ``loss_flags``
    (the script's own loss settings) after the weight decay."""
    flags = [f"--steps {args.steps}", f"--batch-size {args.batch_size}", f"--train-images {args.train_images}",
             f"--lr {args.lr:g}", f"--warmup {args.warmup}", f"--weight-decay {args.weight_decay:g}",
             *loss_flags, f"--seed {args.seed}", f"--threads {args.threads}", f"--eval-images {args.eval_images}"]
    return flags + (["--no-bf16"] if args.no_bf16 else [])


def reproduce_command(args: argparse.Namespace) -> str:
    """The training command with every setting that affects the weights spelled out."""
    flags = command_flags(args, [f"--depth-weight {args.depth_weight:g}"])
    if args.init is not None:
        flags.append(f"--init {Path(args.init).name}")
    return "python -m pullback_ext.demo.train " + " ".join(flags)


def start_run(args: argparse.Namespace) -> float:
    """Thread count and seed of a training run; refuses seeds whose training scenes would reach
    the held-out range. Returns the start time."""
    import torch

    from pullback_ext.embedded.scenes import HELDOUT_SEED_OFFSET

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.seed * 100_000 + args.train_images // 256 + 1 >= HELDOUT_SEED_OFFSET:
        raise SystemExit("--seed: too large, training seeds would reach the held-out range")
    return time.time()


def flipped_batch(data: dict, keys: tuple, batch_size: int, order) -> dict:
    """A random batch of ``data`` (drawn with the generator ``order``), each image flipped
    horizontally with probability ½: ``keys`` of it (``images`` as float in [0, 1], the others
    as stored), the maps ([B, ..., H, W]) flipped alike, per-image values ([B]) as they are."""
    import torch

    index = torch.randint(0, data["images"].shape[0], (batch_size,), generator=order)
    flip = torch.rand(batch_size, generator=order) < 0.5
    out = {}
    for key in keys:
        x = data[key][index].float() / 255 if key == "images" else data[key][index]
        out[key] = torch.where(flip.reshape(-1, *[1] * (x.dim() - 1)), x.flip(-1), x) if x.dim() >= 3 else x
    return out


def adamw(module, decayed, args: argparse.Namespace):
    """AdamW on ``module``'s parameters at ``args.lr``: weight decay ``args.weight_decay`` on those
    where ``decayed(name, parameter)``, none on the others."""
    import torch

    named = list(module.named_parameters())
    decay = [p for n, p in named if decayed(n, p)]
    no_decay = [p for n, p in named if not decayed(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)


def optimiser_step(optimiser, loss, module) -> None:
    """Backward of ``loss``, gradients of ``module`` clipped to norm 1, one step."""
    import torch

    optimiser.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimiser.step()


def set_learning_rate(optimiser, step: int, args: argparse.Namespace) -> None:
    for group in optimiser.param_groups:
        group["lr"] = learning_rate(step, args)


def run_stamp(args: argparse.Namespace, timing: dict) -> dict:
    """Where and how long a training run ran: ``timing`` (``wall_clock_min``, ``data_seconds``),
    threads, machine and torch version."""
    import torch

    return {"wall_clock_min": timing["wall_clock_min"], "data_seconds": timing["data_seconds"], "threads": args.threads,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__}


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * progress))


def write_model_card(out: Path, card: dict) -> None:
    from pullback_ext.fileio import atomic_write_bytes, atomic_write_json

    atomic_write_json(out / "model_card.json", card)
    held = card["heldout"]
    lines = [
        "# pullback_ext demo model",
        "",
        "A small Vision Transformer trained from scratch on scenes rendered by",
        "`pullback_ext.embedded.scenes`, with a CLS head (embedding + 9-way classifier) and a DPT-style",
        "metric-depth decoder. It exists so that the library's diagnostics, learned metrics and",
        "token pruning run on a genuinely trained backbone–decoder pair without downloads.",
        "",
        "## Architecture",
        f"- backbone: {card['architecture']['backbone']}",
        f"- CLS head: {card['architecture']['cls_head']}",
        f"- depth head: {card['architecture']['depth_head']}",
        f"- parameters: {card['architecture']['parameters']:,} (stored as fp16 safetensors)",
        "",
        "## Data",
        f"- {card['data']['train_images']} training scenes rendered from seeds {card['data']['train_seeds']}",
        f"- {card['data']['description']}",
        f"- classes: {', '.join(card['data']['class_names'])}",
        "",
        "## Training",
        *([f"- first stage: `{card['training']['previous_stage']['command']}` "
           f"(held-out top-1 {card['training']['previous_stage']['heldout']['top1']:.3f}, "
           f"{card['training']['previous_stage']['wall_clock_min']:.1f} min), then"]
          if "previous_stage" in card["training"] else []),
        f"- command: `{card['training']['command']}`",
        f"- {card['training']['recipe']}",
        f"- wall-clock: {card['training']['wall_clock_min']:.1f} min on {card['training']['threads']} CPU threads "
        f"({card['training']['machine']})"
        + (f", of which {card['training']['data_seconds'] / 60:.1f} min rendering or loading the training scenes"
           if card["training"].get("data_seconds") is not None else ""),
        "",
        "## Held-out quality",
        f"Measured on {held['num_images']} held-out scenes (`pullback_ext.embedded.heldout(n, seed=0)`),",
        "with the fp16 weights as shipped:",
        "",
        "| top-1 | depth AbsRel | depth δ1 |",
        "|---|---|---|",
        f"| {held['top1']:.3f} | {held['abs_rel']:.4f} | {held['delta1']:.4f} |",
        "",
        "Targets set for the model: top-1 ≥ 0.80, AbsRel ≤ 0.15.",
        "",
    ]
    if card.get("notes"):
        lines += ["## Notes", *[f"- {note}" for note in card["notes"]], ""]
    if card.get("segmentation"):
        lines += segmentation_section(card["segmentation"])
    atomic_write_bytes(out / "MODEL_CARD.md", "\n".join(lines).encode())


def segmentation_section(seg: dict) -> list[str]:
    """The model card's lines on the segmentation head (``seg``: the card's ``segmentation`` record,
    written by ``python -m pullback_ext.demo.train_segmentation``)."""
    held = seg["heldout"]
    iou = " | ".join("–" if v is None else f"{v:.3f}" for v in held["class_iou"].values())
    return [
        "## Segmentation head",
        f"`{seg['weights']}` (sha256 `{seg['sha256'][:16]}…`, {seg['parameters']:,} parameters, fp16), trained on the",
        f"frozen backbone (weights digest `{seg['backbone_weights']}`; `pullback_ext.embedded.load_segmentation_head`",
        "refuses a model with other weights).",
        "",
        f"- architecture: {seg['architecture']}",
        f"- classes ({len(seg['classes'])}): {', '.join(seg['classes'])}; {seg['classes_why']}",
        f"- command: `{seg['command']}`",
        f"- {seg['recipe']}",
        f"- wall-clock: {seg['wall_clock_min']:.1f} min on {seg['threads']} CPU thread(s) ({seg['machine']}), of which "
        f"{seg['data_seconds'] / 60:.1f} min rendering or loading the training scenes",
        "",
        f"Held-out quality on {held['num_images']} held-out scenes (`heldout(n, seed=0, classes=True)`), fp16 head as shipped:",
        "",
        "| pixel accuracy | mIoU |",
        "|---|---|",
        f"| {held['pixel_accuracy']:.3f} | {held['miou']:.3f} |",
        "",
        "Per-class IoU:",
        "",
        "| " + " | ".join(held["class_iou"]) + " |",
        "|" + "---|" * len(held["class_iou"]),
        f"| {iou} |",
        "",
        *([f"- {note}" for note in seg["notes"]] + [""] if seg.get("notes") else []),
    ]


def initial_model(args: argparse.Namespace):
    """``(DemoModel in training mode, previous stage or None)``: random, or the ``--init`` weights
    (and the training record of the model card next to them)."""
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.embedded.weights_io import load_weights

    model = DemoModel().train()
    previous_stage = None
    if args.init is not None:
        load_weights(model, args.init)
        init_card = Path(args.init).parent / "model_card.json"
        if init_card.is_file():
            previous = json.loads(init_card.read_text())
            previous_stage = {**previous["training"], "heldout": previous["heldout"]}
    return model, previous_stage


def train_model(model, data: dict, args: argparse.Namespace, started: float) -> None:
    """AdamW (no weight decay on biases, norms, tokens and position embeddings) on random
    flipped batches of ``data``: cross-entropy on the logits plus L1 on log-depth."""
    import torch
    import torch.nn.functional as Fn
    from pullback_ext.progress import progress_bar

    decayed = lambda n, p: p.dim() > 1 and "pos_embed" not in n and "token" not in n  # noqa: E731
    optimiser = adamw(model, decayed, args)
    order = torch.Generator().manual_seed(args.seed + 1)
    running = None
    progress = progress_bar(range(args.steps), desc="train", unit="step")
    for step in progress:
        batch = flipped_batch(data, ("images", "depth", "labels"), args.batch_size, order)
        depth = batch["depth"].float()
        set_learning_rate(optimiser, step, args)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            out = model(batch["images"])
        ce = Fn.cross_entropy(out["logits"].float(), batch["labels"], label_smoothing=0.1)
        depth_l1 = (out["depth"].float().log() - depth.log()).abs().mean()
        optimiser_step(optimiser, ce + args.depth_weight * depth_l1, model)
        values = torch.stack([ce.detach(), depth_l1.detach()])
        running = values if running is None else 0.98 * running + 0.02 * values
        if step % 10 == 0:
            progress.set_postfix(ce=f"{running[0]:.3f}", log_depth_l1=f"{running[1]:.3f}")
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step} ce {running[0]:.4f} log_depth_l1 {running[1]:.4f} "
                  f"elapsed {time.time() - started:.0f}s", file=sys.stderr, flush=True)


def model_card(args: argparse.Namespace, shipped, held: dict, n_train: int, timing: dict, weights_name: str) -> dict:
    """The model card of the shipped model: architecture, data, training record, held-out quality.
    ``timing``: ``wall_clock_min`` and ``data_seconds`` of the run."""
    from pullback_ext.embedded.scenes import CLASS_NAMES

    return {
        "name": "pullback_ext demo ViT",
        "weights": weights_name,
        "architecture": {
            "backbone": "timm VisionTransformer, 112x112, patch 8 (196 patch tokens + CLS), width 192, 8 blocks, 3 heads, MLP ratio 4",
            "cls_head": "final-norm CLS -> Linear(192,128) embedding -> Linear(128,9) classifier",
            "depth_head": f"DPT-style: hooks at blocks {list(shipped.hook_layers)} (0-based, final norm applied), "
                          "reassemble to 56/28/14/7, 4 fusion blocks (32 channels), log-depth head at 56x56, bilinear to 112x112",
            "parameters": sum(p.numel() for p in shipped.parameters()),
            "hook_layers": list(shipped.hook_layers),
        },
        "data": {
            "train_images": n_train,
            "train_seeds": f"render(256, {args.seed} * 100000 + chunk) for chunk in 0..{(n_train - 1) // 256}",
            "heldout": "pullback_ext.embedded.heldout(n, seed): seeds from 1e9 on, never used for training",
            "description": "ground plane, back wall, 1-6 spheres/boxes/cylinders, random camera height/pitch/fov, "
                           "checker and stripe textures, Lambertian light with shadows; label = type and colour "
                           "family of the object covering most pixels",
            "class_names": list(CLASS_NAMES),
        },
        "training": {
            "command": reproduce_command(args),
            "recipe": f"{args.steps} AdamW steps of {args.batch_size} images, lr {args.lr} (warm-up {args.warmup}, cosine), "
                      f"weight decay {args.weight_decay}, CE (label smoothing 0.1) + {args.depth_weight} x L1(log depth), "
                      f"random horizontal flips, {'float32' if args.no_bf16 else 'bf16 autocast'}, seed {args.seed}",
            **run_stamp(args, timing),
        },
        "heldout": held,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    from pullback_ext.demo.metrics import evaluate
    from pullback_ext.embedded import heldout, load
    from pullback_ext.embedded.weights_io import save_weights

    started = start_run(args)
    data = cached_training_set(args.train_images, args.seed, args.cache_dir)
    render_seconds = time.time() - started
    model, previous_stage = initial_model(args)
    train_model(model, data, args, started)

    out_dir = Path(args.out)
    weights_path = out_dir / "demo_vit.safetensors"
    save_weights(model, weights_path, metadata={"format": "pt", "model": "pullback_ext.embedded.DemoModel"})
    shipped = load(weights_path)
    held = evaluate(shipped, heldout(args.eval_images, seed=0))
    elapsed = time.time() - started
    print(f"held-out: top1 {held['top1']:.4f} abs_rel {held['abs_rel']:.4f} delta1 {held['delta1']:.4f} "
          f"({elapsed / 60:.1f} min)", file=sys.stderr, flush=True)
    card = model_card(args, shipped, held, data["labels"].shape[0], {"wall_clock_min": elapsed / 60, "data_seconds": render_seconds},
                      weights_path.name)
    if previous_stage is not None:
        card["training"]["previous_stage"] = previous_stage
    write_model_card(out_dir, card)
    return 0


if __name__ == "__main__":
    sys.exit(main())
