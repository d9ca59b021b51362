"""``pullback train head --stages 2,4,6``: one importance head per stage of a schedule, in one folder.

The head of the stage at layer ℓ (which reduces the input of block ℓ) is trained on the output of
block ℓ − 1 into ``OUT/stage-<ℓ>/``, every other setting (targets, steps, images) shared; then
``OUT/schedule.json`` names the stages and their folders (written last: a folder that has one is
complete). With ``--resume`` a stage whose run finished at ``--steps`` is skipped and an
interrupted one continues. An explicit ``--cache DIR`` keeps each stage's targets in
``DIR/stage-<ℓ>``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pullback_ext.errors import PullbackError
from pullback_ext.progress import info_line


def parse_stages(text: str) -> tuple:
    """``"2,4,6"`` -> ``(2, 4, 6)``."""
    from pullback_ext.commands.arguments import comma_floats

    values = comma_floats(text, "--stages")
    if any(v != int(v) for v in values):
        raise PullbackError(f"--stages: expected block indices (ints), got {text!r}")
    return tuple(int(v) for v in values)


def checked_stages(args: argparse.Namespace) -> tuple:
    """``(stage layers, model spec)`` of ``--stages``, checked against the command's other flags
    and the model's depth."""
    from pullback_ext.commands.arguments import model_spec
    from pullback_ext.comparison.backbones import load_backbone
    from pullback_ext.metric.schedule import check_stages

    if args.kind != "head":
        raise PullbackError(f"--stages: only for `pullback train head` (one importance head per stage), got {args.kind}")
    if args.layer is not None:
        raise PullbackError("--stages: give either --layer (one head) or --stages (one head per stage), not both")
    if args.vae is not None:
        raise PullbackError("--stages: not with --vae (a feature VAE belongs to the one layer it was trained at)")
    stages = parse_stages(args.stages)
    model = model_spec(args)
    backbone, _ = load_backbone(model, args.weights)
    return check_stages(stages, backbone.depth, "--stages"), model


def _finished(folder: Path, steps: int) -> bool:
    """Whether ``folder`` holds a run that finished at ``steps`` (its results.json written)."""
    try:
        results = json.loads((folder / "results.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return results.get("train", {}).get("steps") == steps


def _check_out(args: argparse.Namespace) -> Path:
    """``--out`` of a schedule: never a single-head run's folder; one holding an earlier schedule
    (or a stage of one) only with ``--resume`` or ``--overwrite``."""
    from pullback_ext.commands.arguments import results_folder
    from pullback_ext.commands.train_config import RUN_FILES
    from pullback_ext.metric.checkpoint import STATE_FILE
    from pullback_ext.metric.schedule import SCHEDULE_FILE, stage_folder

    stages = (f"{stage_folder('*')}/{name}" for name in RUN_FILES)  # a stage's run, finished or not
    out = results_folder(args, (SCHEDULE_FILE, *stages), "a head schedule", resumable=True)
    if (out / STATE_FILE).exists():
        raise PullbackError(f"--out: {str(out)!r} holds a single-head training run; choose another folder for a schedule")
    return out


def run(args: argparse.Namespace) -> int:
    """Train the heads of ``--stages`` one after the other, then write ``OUT/schedule.json``."""
    from pullback_ext import distributed
    from pullback_ext.commands.arguments import probe_decoder
    from pullback_ext.commands.train_config import print_results, run_config
    from pullback_ext.metric.checkpoint import STATE_FILE
    from pullback_ext.metric.schedule import stage_folder, write_schedule
    from pullback_ext.metric.training_run import TrainingRun

    stages, model = checked_stages(args)
    out = _check_out(args)
    info = distributed.init_from_env()
    try:
        for k, layer in enumerate(stages, 1):
            folder = out / stage_folder(layer)
            title = f"stage {k}/{len(stages)} (layer {layer})"
            if args.resume and _finished(folder, args.steps):
                if info.is_main:
                    info_line(f"{title}: finished in {folder}, skipped")
                continue
            if info.is_main:
                info_line(f"{title}: head on the output of block {layer - 1} -> {folder}")
            stage_args = argparse.Namespace(**{
                **vars(args), "layer": layer - 1, "out": str(folder), "resume": args.resume and (folder / STATE_FILE).exists(),
                "cache": None if args.cache is None else str(Path(args.cache) / stage_folder(layer))})
            results = TrainingRun(run_config(stage_args), info).run()
            if info.is_main:
                print_results("head", results, folder)
        if info.is_main:
            path = write_schedule(out, stages, {"model": str(model), "decoder": probe_decoder(args, str(model), default="cls"),
                                                "weights": args.weights})
            info_line(f"wrote {path}")
    finally:
        distributed.shutdown(info)
    return 0
