"""The run of ``pullback demo``: the demo model's held-out quality, then the stages in order.

Each stage is a module of this package listed in :data:`STAGES` (``NAME``, ``run_demo_stage``,
and ``PLAN`` / ``EXPECTED_S``: what it does and its expected seconds on an idle 2-core machine,
by ``quick``: measured on a 2-core machine with nothing else running); the run states that plan first, and each stage's time against it when it ends. The
heads a stage trains are handed to the stages after it. After every stage
``DIR/results.json`` is rewritten atomically, so it is always valid JSON describing the stages
done so far; a stage that fails is recorded and the later ones still run.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from pullback_ext.demo import diagnostic_stage, importance_stage, pruning_stage
from pullback_ext.demo.stages import DemoInputs
from pullback_ext.demo.summary import summary
from pullback_ext.fileio import atomic_write_json
from pullback_ext.progress import info_line

# add a stage with one line here
STAGES = (diagnostic_stage, importance_stage, pruning_stage)
NUM_SCENES = {True: 4, False: 16}  # held-out scenes (seed 0) of a quick / full run


def jsonable(value):
    """Tensors -> lists, non-finite floats -> None, paths -> str; recursively."""
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):
        return jsonable(value.item())
    return str(value)


def quality_text(quality: dict) -> str:
    """The model's held-out quality in words (``quality``: :func:`~pullback_ext.demo.metrics.evaluate`'s)."""
    text = f"top-1 {quality['top1']:.3f}, depth AbsRel {quality['abs_rel']:.3f}, δ1 {quality['delta1']:.3f}"
    if "miou" in quality:
        text += f", segmentation mIoU {quality['miou']:.3f} (pixel accuracy {quality['pixel_accuracy']:.3f})"
    return text


def plan_lines(quick: bool) -> list[str]:
    """The plan a run states when it starts: each stage, its expected time and what it does."""
    total = sum(stage.EXPECTED_S[quick] for stage in STAGES)
    lines = [f"pullback demo{' --quick' if quick else ''}: {len(STAGES)} stages, about {total / 60:.0f} min on an idle "
             "2-core machine (longer on a busy one):"]
    return lines + [f"  {stage.NAME:<16} ~{stage.EXPECTED_S[quick]:>4.0f} s  {stage.PLAN[quick]}" for stage in STAGES]


def run_stages(inputs: DemoInputs, results: dict, results_path: Path, started: float) -> list[str]:
    """Run :data:`STAGES` in order into ``results["stages"]`` (rewriting ``results_path`` after
    each); returns the names of the stages that failed."""
    from pullback_ext.progress import progress_bar

    failed = []
    for stage in progress_bar(STAGES, desc="pullback demo", unit="stage"):
        stage_started, cpu_started = time.time(), time.process_time()
        try:
            output = stage.run_demo_stage(inputs)
            inputs = replace(inputs, heads=inputs.heads + output.heads)
            seconds = time.time() - stage_started
            results["stages"][stage.NAME] = {"status": "ok", "seconds": seconds, "cpu_seconds": time.process_time() - cpu_started,
                                             "result": output.report}
            info_line(f"[{stage.NAME}] done in {seconds:.0f} s (expected ~{stage.EXPECTED_S[inputs.quick]:.0f} s on an idle 2-core machine)")
        except Exception as exc:
            traceback.print_exc()
            print(f"[{stage.NAME}] failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            results["stages"][stage.NAME] = {"status": "failed", "seconds": time.time() - stage_started,
                                             "error": f"{type(exc).__name__}: {exc}"}
            failed.append(stage.NAME)
        results["seconds"] = time.time() - started
        atomic_write_json(results_path, jsonable(results))
    return failed


def segmentation_head(model, weights: str | None):
    """The shipped segmentation head for ``model``; None, said on stderr, when ``weights`` (other
    demo weights than the shipped ones) are not those it was trained for."""
    from pullback_ext.embedded import load_segmentation_head
    from pullback_ext.errors import CheckpointError

    try:
        return load_segmentation_head(model=model)
    except CheckpointError as exc:
        if weights is None:
            raise
        print(f"the segmentation decoder is left out: {exc}", file=sys.stderr, flush=True)
        return None


def demo_inputs(out_dir: Path, quick: bool, weights: str | None = None) -> DemoInputs:
    """The demo model (``weights``: default the shipped ones), its segmentation head and its
    held-out scenes, through the library's sources (``--model demo``, ``--images builtin:scenes``)."""
    from pullback_ext.sources.images import open_images
    from pullback_ext.sources.models import ModelSpec, load_model
    from pullback_ext.sources.preprocess import unit_range_preprocess

    model, _ = load_model(ModelSpec("demo"), weights)
    preprocess = unit_range_preprocess(model.image_size)
    images = open_images("builtin:scenes")
    scenes = images.heldout(preprocess, NUM_SCENES[quick]).load()
    return DemoInputs(model=model, preprocess=preprocess, images=images, scenes=scenes, out_dir=Path(out_dir), quick=quick,
                      segmentation_head=segmentation_head(model, weights))


def run_demo(out_dir: Path, quick: bool, weights: str | None = None) -> int:
    """The whole demo into ``out_dir`` (results.json and the stages' files); exit code 1 when a stage failed."""
    import json

    from pullback_ext import __version__
    from pullback_ext.demo.metrics import evaluate
    from pullback_ext.embedded.weights_io import CARD_JSON

    started = time.time()
    info_line("\n".join(plan_lines(quick)))
    inputs = demo_inputs(out_dir, quick, weights)
    card = json.loads(CARD_JSON.read_text()).get("heldout", {}) if weights is None and CARD_JSON.is_file() else {}
    quality = evaluate(inputs.model, inputs.scenes, inputs.segmentation_head)
    results = {
        "pullback_ext": __version__,
        "quick": quick,
        "torch": torch.__version__,
        "scenes": {"source": inputs.images.spec, "seed": 0, "num_images": int(inputs.scenes["labels"].shape[0])},
        "model": {"reported_heldout": card, "this_run": quality},
        "stages": {},
    }
    print(f"demo model on {quality['num_images']} held-out scenes: {quality_text(quality)}", flush=True)
    results_path = Path(out_dir) / "results.json"
    atomic_write_json(results_path, jsonable(results))
    failed = run_stages(inputs, results, results_path, started)
    info_line(f"\nwrote {results_path} ({results['seconds']:.0f} s)")
    print(summary(results, Path(out_dir)), flush=True)
    if failed:
        print(f"stages failed: {', '.join(failed)}", file=sys.stderr, flush=True)
        return 1
    return 0
