"""``pullback demo``: everything the library does, on the embedded demo model and held-out scenes.

The run is a list of stages. Each stage is a module exposing
``run_demo_stage(model, scenes, out_dir, quick) -> dict``; a stage whose module (or function) does
not exist yet is recorded as skipped. After every stage ``DIR/results.json`` is rewritten
atomically, so it is always valid JSON describing the stages done so far.
"""

from __future__ import annotations

import argparse

# (name, module exposing run_demo_stage); add a stage with one line here.
STAGES = (
    ("diagnostic", "pullback_ext.demo.diagnostic_stage"),
    ("importance_head", "pullback_ext.demo.importance_stage"),
    ("pruning", "pullback_ext.demo.pruning_stage"),
)
HELDOUT_SEED = 0
NUM_SCENES = {True: 4, False: 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", metavar="DIR", help="output folder (default: out/demo)")
    parser.add_argument("--quick", action="store_true", help="smaller, faster run (about 2 minutes on 2 cores)")
    parser.add_argument("--weights", default=None, metavar="FILE",
                        help="demo model weights (.safetensors; default: the weights shipped with the package)")


def _stage_function(module_name: str):
    """The stage's run_demo_stage, or (None, reason) when it does not exist yet."""
    import importlib
    import importlib.util

    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return None, f"module {module_name} is not available"
    function = getattr(importlib.import_module(module_name), "run_demo_stage", None)
    if function is None:
        return None, f"{module_name} has no run_demo_stage"
    return function, ""


def _jsonable(value):
    """Tensors -> lists, non-finite floats -> None, paths -> str; recursively."""
    import math
    from pathlib import Path

    import torch

    if isinstance(value, torch.Tensor):
        return _jsonable(value.tolist())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


def run(args: argparse.Namespace) -> int:
    import time
    import traceback
    from pathlib import Path

    import torch
    from tqdm.auto import tqdm

    from pullback_ext import __version__
    from pullback_ext.embedded import heldout, load
    from pullback_ext.demo.metrics import evaluate
    from pullback_ext.embedded.weights_io import CARD_JSON
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.errors import PullbackError

    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise PullbackError(f"--out: expected a folder, got the existing file {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = bool(args.quick)
    started = time.time()

    model = load(args.weights)
    scenes = heldout(NUM_SCENES[quick], HELDOUT_SEED)
    card = {}
    if args.weights is None and CARD_JSON.is_file():
        import json

        card = json.loads(CARD_JSON.read_text()).get("heldout", {})
    results = {
        "pullback_ext": __version__,
        "quick": quick,
        "torch": torch.__version__,
        "scenes": {"source": "pullback_ext.embedded.heldout", "seed": HELDOUT_SEED, "num_images": int(scenes["labels"].shape[0])},
        "model": {"reported_heldout": card, "this_run": evaluate(model, scenes)},
        "stages": {},
    }
    quality = results["model"]["this_run"]
    print(f"demo model on {quality['num_images']} held-out scenes: top-1 {quality['top1']:.3f}, "
          f"depth AbsRel {quality['abs_rel']:.3f}, δ1 {quality['delta1']:.3f}", flush=True)
    results_path = out_dir / "results.json"
    atomic_write_json(results_path, _jsonable(results))

    failed = []
    for name, module_name in tqdm(STAGES, desc="pullback demo", unit="stage"):
        function, reason = _stage_function(module_name)
        if function is None:
            print(f"[{name}] skipped: {reason}", flush=True)
            results["stages"][name] = {"status": "skipped", "reason": reason}
        else:
            stage_started = time.time()
            try:
                output = function(model, scenes, out_dir, quick)
                results["stages"][name] = {"status": "ok", "seconds": time.time() - stage_started, "result": output}
            except Exception as exc:
                traceback.print_exc()
                print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)
                results["stages"][name] = {"status": "failed", "seconds": time.time() - stage_started,
                                           "error": f"{type(exc).__name__}: {exc}"}
                failed.append(name)
        results["seconds"] = time.time() - started
        atomic_write_json(results_path, _jsonable(results))

    print(f"\nwrote {results_path} ({results['seconds']:.0f} s)", flush=True)
    if failed:
        print(f"stages failed: {', '.join(failed)}", flush=True)
        return 1
    return 0
