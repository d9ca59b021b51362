"""End-to-end cost of token reduction: whole patched models against the unpruned model and ToMe.

    python benchmarks/bench_prune.py                       # the CPU matrix (35-45 minutes on 2 cores)
    python benchmarks/bench_prune.py --results-page        # also docs/results/bench-prune.{json,md}
    python benchmarks/bench_prune.py --models vit_s16 --repeats 2 --no-overhead   # a quick look (about 10 minutes)
    python benchmarks/bench_prune.py --device cuda         # the GPU headline cells (see --preset)
    python benchmarks/bench_prune.py --device cuda --preset latency   # the CUDA batch-1 cells (a few minutes)
    python benchmarks/bench_prune.py --device cuda --preset full

Presets (each value can be overridden by its flag):
- ``cpu`` (default on the CPU): ViT-S/16 and ViT-B/16 at 224 px, batch 1, 16 and 64, float32,
  eager and ``torch.compile`` (inductor); the methods: unpruned, ToMe r = 8 and 16 (constant
  schedule), importance_tome at ToMe r = 8 and 16's token counts, those counts with the tokens
  dropped (no merging: the bound), ATC and importance_cluster (no head) at keep rate 0.7, the single-stage merge and prune + LLF at η = 0.5 (block 4); compiled: the unpruned model, ToMe r = 8, importance_tome r = 8
  and the merge (each compiles twice: batch 1, then a graph dynamic in the batch). The batch-1 eager
  cells also time the unpruned, ToMe and importance_tome models exported to ONNX in ONNX Runtime.
  Batch 64 takes ``--big-batch-repeats`` rounds. On 2 cores of an AMD EPYC the run takes 35-45
  minutes (ViT-B/16 about two thirds of it; the 16 compilations, 15-75 s each, about 10 minutes;
  ``--models vit_s16 --repeats 2`` on one thread took 11 minutes).
- ``latency`` (for a short GPU slot): the same methods but the clusterings (a crash of their
  never-run CUDA kernel would end the slot's timings) on CUDA at batch 1, bf16: ViT-S/16 eager and
  ``torch.compile(mode="reduce-overhead")`` (CUDA graphs; the unpruned model, ToMe r = 8 and
  importance_tome r = 8 compiled), ViT-B/16 eager.
- ``headline`` (default on CUDA): the two cells of the performance targets — ViT-B/16 at 448 px,
  batch 64, bf16, η = 0.5 single-stage prune + LLF, eager and compiled; ViT-B/16 at 224 px, batch
  256, bf16, our merge at ToMe r = 16's FLOPs against ToMe r = 16 (constant schedule).
- ``full``: ViT-B/16 at 224 and 448, DINOv2-B/14 with registers at 224, Depth Anything (small) at
  518; batch 1, 64, 256; fp16 and bf16; eager and compiled; every method.

Every method of a cell runs in one interleaved timing run (``pullback_ext.comparison.cost``, the
harness of ``pullback evaluate``); every row also gives the operators one eager forward
dispatches (``aten ops per forward``, :func:`pullback_ext.bench.dispatch.count_aten_ops`) and their
ratio to the unpruned forward's, on CUDA the kernels and launches per forward; the page adds the
latency figures, where batch-1 eager time goes (``pullback_ext.bench.forward_profile``) and the ONNX
Runtime rows (``prune_bench.onnx_rows``). The JSON records what ran, with the machine, versions
and command (``pullback_ext.results_pages.stamp``).
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

# the methods of the latency presets: the unpruned model, ToMe, importance_tome, ToMe's counts without merging
# and the default forms of the single-stage merge and prune + LLF (not their folded / two-call variants, not
# three stages); the CPU preset adds the clusterings, whose CUDA kernel gpu_check.sh tests before any timing
LATENCY_METHODS = dict(methods=("importance merge η=", "importance prune+LLF η=", "ToMe r=", "importance_tome r=",
                                "tokens dropped at ToMe r="),
                       exclude=("folded", "two-call", "stages"), matched_r=None)
CLUSTERINGS = ("ATC keep_rate=", "importance_cluster keep_rate=")
PRESETS = {
    "cpu": [dict(model=m, sizes=(224,), batches=(1, 16, 64), dtypes=("float32",), compiled=(False, True),
                 compiled_methods=("ToMe r=8 ", "importance_tome r=8 ", "importance merge η="), onnx_batches=(1,),
                 **dict(LATENCY_METHODS, methods=LATENCY_METHODS["methods"] + CLUSTERINGS)) for m in ("vit_s16", "vit_b16")],
    "latency": [dict(model="vit_s16", sizes=(224,), batches=(1,), dtypes=("bfloat16",), compiled=(False, "reduce-overhead"),
                     compiled_methods=("ToMe r=8 ", "importance_tome r=8 "), **LATENCY_METHODS),
                dict(model="vit_b16", sizes=(224,), batches=(1,), dtypes=("bfloat16",), compiled=(False,), **LATENCY_METHODS)],
    "headline": [
        dict(model="vit_b16", sizes=(448,), batches=(64,), dtypes=("bfloat16",), compiled=(False, True),
             methods=("importance prune+LLF η=0.5 @",), matched_r=None),
        dict(model="vit_b16", sizes=(224,), batches=(256,), dtypes=("bfloat16",), compiled=(False, True),
             methods=("ToMe r=16 ", "importance merge @"), matched_r=16),
    ],
    "full": [dict(model=m, sizes=s, batches=(1, 64, 256), dtypes=("float16", "bfloat16"), compiled=(False, True))
             for m, s in (("vit_b16", (224, 448)), ("dinov2_b14_reg", (224,)), ("depth_anything_s", (518,)))],
}
PRESET_ETAS = {"cpu": "0.5", "latency": "0.5"}  # the others: 0.25,0.5
COMPILE_CHOICES = {"off": (False,), "on": (True,), "both": (False, True), "reduce-overhead": (False, "reduce-overhead"),
                   "all": (False, True, "reduce-overhead")}


def parse_args(argv=None) -> argparse.Namespace:
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP

    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description="\n\n".join(doc[:2]), epilog="\n\n".join(doc[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="default: cpu on the CPU, headline on CUDA")
    p.add_argument("--models", default=None, help="comma list overriding the preset's models (vit_b16, dinov2_b14_reg, depth_anything_s, vit_s16)")
    p.add_argument("--sizes", default=None, help="comma list of image sizes (overrides the preset)")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (overrides the preset)")
    p.add_argument("--dtypes", default=None, help="comma list: float32, float16, bfloat16 (overrides the preset)")
    p.add_argument("--compile", choices=tuple(COMPILE_CHOICES), default=None,
                   help="eager (off), torch.compile (on), both, eager and mode='reduce-overhead' (CUDA graphs), or all three "
                        "(overrides the preset)")
    p.add_argument("--etas", default=None, help="η of our merge and prune rows (default: 0.5 for the cpu and latency presets, "
                                                 "else 0.25,0.5)")
    p.add_argument("--tome-r", default="8,16", help="r of the ToMe rows")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed rounds per cell (the speed-ups' medians and intervals)")
    p.add_argument("--big-batch-repeats", type=int, default=3,
                   help="rounds of the cells of batch 64 and more (at most --repeats; 0: as many as --repeats)")
    p.add_argument("--no-onnx", action="store_true", help="no ONNX Runtime rows")
    p.add_argument("--no-overhead", action="store_true", help="skip the per-step overhead measurement")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--results-page", action="store_true", help="also write docs/results/bench-prune.json and .md")
    p.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    return p.parse_args(argv)


def sweeps(args) -> tuple[list, str]:
    """The preset's sweeps with the flags' overrides, and the preset's name. ``--models``: each
    named model takes the preset's sweeps of that model, or its first sweep where it has none."""
    from prune_bench.matrix import Sweep
    from pullback_ext.commands.arguments import comma_ints

    preset = args.preset or ("cpu" if args.device == "cpu" else "headline")
    specs = PRESETS[preset]
    if args.models:
        names = [m.strip() for m in args.models.split(",") if m.strip()]
        specs = [dict(s, model=m) for m in names for s in ([s for s in specs if s["model"] == m] or specs[:1])]
    out = []
    for spec in specs:
        spec = dict(spec)
        if args.sizes:
            spec["sizes"] = tuple(comma_ints(args.sizes, "--sizes"))
        if args.batches:
            spec["batches"] = tuple(comma_ints(args.batches, "--batches"))
        if args.dtypes:
            spec["dtypes"] = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        if args.compile:
            spec["compiled"] = COMPILE_CHOICES[args.compile]
        if getattr(args, "no_onnx", False):
            spec["onnx_batches"] = ()
        out.append(Sweep(**spec))
    return out, preset


def main(argv=None) -> int:
    import torch

    from prune_bench import report as prune_report
    from prune_bench.matrix import BIG_BATCH, run_sweep
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
    etas = tuple(comma_floats(args.etas or PRESET_ETAS.get(preset, "0.25,0.5"), "--etas"))
    tome_rs = tuple(comma_ints(args.tome_r, "--tome-r"))
    big = args.big_batch_repeats or None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    result = {"stamp": stamp(current_command(None if argv is None else [__file__, *argv])), "device": name,
              "settings": {"preset": preset, "etas": etas, "tome_r": tome_rs, "repeats": args.repeats,
                           "big_batch_repeats": big, "big_batch": BIG_BATCH, "sweeps": [asdict(s) for s in plan]},
              "rows": [], "skipped": []}
    for sweep in plan:
        result["rows"] += run_sweep(sweep, etas, tome_rs, device, args.repeats, progress=not args.quiet,
                                    big_batch_repeats=big, skipped=result["skipped"])
    result["checks"] = prune_report.headline_checks(result["rows"])
    first = next((s for s in plan if not MODELS[s.model].dense), None)
    if first is not None and not args.no_overhead:
        result["overhead"] = measure_overhead(MODELS[first.model], first.sizes[0], min(first.batches[-1], 16), max(etas),
                                              args.repeats, device)
    print(prune_report.format_rows(result["rows"]))
    for c in result["checks"]:
        print(f"check: {prune_report.cell_title(c)}: {c['check']} = {c['value']:.3f} (target ≥ {c['target']})")
    for s in result["skipped"]:
        print(f"left out: {s['method']} ({prune_report.mode_name(s['compiled'])}, batch {s['batch']}): {s['reason']}")
    if args.out:
        atomic_write_json(args.out, result)
    if args.results_page:
        print("wrote", *publish(result, "bench-prune", "Token reduction, end to end (`benchmarks/bench_prune.py`)", prune_report.render,
                                      allow_dirty=args.allow_dirty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
