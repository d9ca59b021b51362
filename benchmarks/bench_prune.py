"""End-to-end cost of token reduction: whole patched models against the unpruned model and ToMe.

    python benchmarks/bench_prune.py                       # the reduced CPU matrix (a few minutes)
    python benchmarks/bench_prune.py --results-page        # also docs/results/bench-prune.{json,md}
    python benchmarks/bench_prune.py --device cuda         # the GPU headline cells (see --preset)
    python benchmarks/bench_prune.py --device cuda --preset full

Presets (each value can be overridden by its flag):
- ``cpu`` (default on the CPU): ViT-S/16 at 224 px, batch 1 and 16, float32, eager.
- ``headline`` (default on CUDA): the two cells of the performance targets — ViT-B/16 at 448 px,
  batch 64, bf16, η = 0.5 single-stage prune + LLF, eager and compiled; ViT-B/16 at 224 px, batch
  256, bf16, our merge at ToMe r = 16's FLOPs against ToMe r = 16 (constant schedule).
- ``full``: ViT-B/16 at 224 and 448, DINOv2-B/14 with registers at 224, Depth Anything (small) at
  518; batch 1, 64, 256; fp16 and bf16; eager and compiled; every method.

Every method of a cell runs in one interleaved timing run (``pullback_ext.comparison.cost``, the
harness of ``pullback evaluate``); every row also gives the operators one eager forward
dispatches (``aten ops per forward``, :func:`pullback_ext.bench.dispatch.count_aten_ops`). The JSON
records what ran, with the machine, versions and command (``pullback_ext.results_pages.stamp``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler behind the "our ops" column is quiet
# run from a source checkout without installing; the script's own modules are in prune_bench/ beside it
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

PRESETS = {
    "cpu": [dict(model="vit_s16", sizes=(224,), batches=(1, 16), dtypes=("float32",), compiled=(False,))],
    "headline": [
        dict(model="vit_b16", sizes=(448,), batches=(64,), dtypes=("bfloat16",), compiled=(False, True),
             methods=("importance prune+LLF η=0.5 @",), matched_r=None),
        dict(model="vit_b16", sizes=(224,), batches=(256,), dtypes=("bfloat16",), compiled=(False, True),
             methods=("ToMe r=16 ", "importance merge @"), matched_r=16),
    ],
    "full": [dict(model=m, sizes=s, batches=(1, 64, 256), dtypes=("float16", "bfloat16"), compiled=(False, True))
             for m, s in (("vit_b16", (224, 448)), ("dinov2_b14_reg", (224,)), ("depth_anything_s", (518,)))],
}


def parse_args(argv=None) -> argparse.Namespace:
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="default: cpu on the CPU, headline on CUDA")
    p.add_argument("--models", default=None, help="comma list overriding the preset's models (vit_b16, dinov2_b14_reg, depth_anything_s, vit_s16)")
    p.add_argument("--sizes", default=None, help="comma list of image sizes (overrides the preset)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (overrides the preset)")
    p.add_argument("--dtypes", default=None, help="comma list: float32, float16, bfloat16 (overrides the preset)")
    p.add_argument("--compile", choices=("off", "on", "both"), default=None, help="eager, torch.compile or both (overrides the preset)")
    p.add_argument("--etas", default="0.25,0.5", help="η of our merge and prune rows")
    p.add_argument("--tome-r", default="8,16", help="r of the ToMe rows")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds per cell (the speed-ups' medians and intervals)")
    p.add_argument("--no-overhead", action="store_true", help="skip the per-step overhead measurement")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--results-page", action="store_true", help="also write docs/results/bench-prune.json and .md")
    p.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    return p.parse_args(argv)


def sweeps(args) -> tuple[list, str]:
    """The preset's sweeps with the flags' overrides, and the preset's name."""
    from prune_bench.matrix import Sweep
    from pullback_ext.commands.arguments import comma_ints

    preset = args.preset or ("cpu" if args.device == "cpu" else "headline")
    out = []
    for spec in PRESETS[preset]:
        spec = dict(spec)
        if args.sizes:
            spec["sizes"] = tuple(comma_ints(args.sizes, "--sizes"))
        if args.batches:
            spec["batches"] = tuple(comma_ints(args.batches, "--batches"))
        if args.dtypes:
            spec["dtypes"] = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        if args.compile:
            spec["compiled"] = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
        models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else [spec.pop("model")]
        spec.pop("model", None)
        out += [Sweep(model=m, **spec) for m in models]
    return out, preset


def main(argv=None) -> int:
    import torch

    from prune_bench import report as prune_report
    from prune_bench.matrix import run_sweep
    from prune_bench.models import MODELS
    from prune_bench.overhead import measure_overhead
    from pullback_ext.commands.arguments import comma_floats, comma_ints
    from pullback_ext.fileio import atomic_write_json
    from pullback_ext.results_pages import current_command, publish, refuse_dirty, stamp

    args = parse_args(argv)
    if args.results_page:
        refuse_dirty(args.allow_dirty)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    plan, preset = sweeps(args)
    etas, tome_rs = tuple(comma_floats(args.etas, "--etas")), tuple(comma_ints(args.tome_r, "--tome-r"))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    result = {"stamp": stamp(current_command(None if argv is None else [__file__, *argv])), "device": name,
              "settings": {"preset": preset, "etas": etas, "tome_r": tome_rs, "repeats": args.repeats,
                           "sweeps": [asdict(s) for s in plan]}, "rows": []}
    for sweep in plan:
        result["rows"] += run_sweep(sweep, etas, tome_rs, device, args.repeats, progress=not args.quiet)
    result["checks"] = prune_report.headline_checks(result["rows"])
    first = next((s for s in plan if not MODELS[s.model].dense), None)
    if first is not None and not args.no_overhead:
        result["overhead"] = measure_overhead(MODELS[first.model], first.sizes[0], min(first.batches[-1], 16), max(etas),
                                              args.repeats, device)
    print(prune_report.format_rows(result["rows"]))
    for c in result["checks"]:
        print(f"check: {c['check']} = {c['value']:.3f} (target ≥ {c['target']})")
    if args.out:
        atomic_write_json(args.out, result)
    if args.results_page:
        print("wrote", *publish(result, "bench-prune", "Token reduction, end to end (`benchmarks/bench_prune.py`)", prune_report.render,
                                      allow_dirty=args.allow_dirty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
