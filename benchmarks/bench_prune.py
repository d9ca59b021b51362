"""Cost of token pruning on a frozen ViT (CPU, random weights).

1. Overhead: importance-head scoring + selection + LLF re-insertion, as a share of the unpruned
   forward (ViT-B/16 at 224 px by default), next to the ToMe score's cost.
2. Speed-up: ViT-B/16 at 448 px, prune ratio 0.5 at one stage with LLF: wall-clock speed-up at a
   large batch against the theoretical FLOP ratio (torch's flop counter), and batch-1 latency.

    python benchmarks/bench_prune.py --batch 64 --out out/bench_prune.json
    python benchmarks/bench_prune.py --quick --results-page     # docs/results/bench-prune.{json,md}

Batch 64 at 448 px needs minutes per forward on a small CPU; ``--batch`` sets what is feasible
(``--quick``: batch 4 at 224 px, 1 repeat) and the JSON records what ran, with the machine,
versions and command (``pullback_ext.results_pages.stamp``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# run from a source checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pullback_ext.fileio import atomic_write_json  # noqa: E402
from pullback_ext.results_pages import current_command, markdown_table, publish, stamp  # noqa: E402

QUICK = {"overhead_batch": 4, "size": 224, "batch": 4, "repeats": 1}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="vit_base_patch16_224", help="timm model name (random weights)")
    p.add_argument("--overhead-size", type=int, default=224, help="image size for the overhead measurement")
    p.add_argument("--overhead-batch", type=int, default=None, help="default 16 (--quick: 4)")
    p.add_argument("--size", type=int, default=None, help="image size for the speed-up measurement (default 448, --quick: 224)")
    p.add_argument("--batch", type=int, default=None, help="large batch for the speed-up (default 64, --quick: 4)")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--layers", default="4", help="stage layers (comma list, the model's block indices)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per median (default 3, --quick: 1)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-speedup", action="store_true", help="only the overhead measurement")
    p.add_argument("--quick", action="store_true", help="small settings for a shared 2-core machine (a few minutes)")
    p.add_argument("--out", default=None, help="JSON output file")
    p.add_argument("--results-page", action="store_true", help="also write docs/results/bench-prune.json and .md")
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else {"overhead_batch": 16, "size": 448, "batch": 64, "repeats": 3}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def timed(fn, *args, repeats: int) -> float:
    """Median seconds over ``repeats`` runs after one warm-up."""
    import statistics

    import torch

    times = []
    with torch.no_grad():
        fn(*args)
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(name: str, size: int):
    import timm

    return timm.create_model(name, pretrained=False, num_classes=0, img_size=size).eval().requires_grad_(False)


def overhead(args, layers) -> dict:
    """Per-stage costs at the overhead size, as fractions of the unpruned forward."""
    import torch

    from pullback_ext import ops
    from pullback_ext.metric.head import ImportanceHead
    from pullback_ext.prune.strategies import StageContext, lowest, make_strategy
    from pullback_ext.prune.tokens import TokenState, split_budget

    model = build(args.model, args.overhead_size)
    head = ImportanceHead(model.embed_dim).eval().requires_grad_(False)
    x = torch.rand(args.overhead_batch, 3, args.overhead_size, args.overhead_size)
    with torch.no_grad():
        feats = model.blocks[: layers[0]](model.norm_pre(model._pos_embed(model.patch_embed(x))))
    p = model.num_prefix_tokens
    count = split_budget(feats.shape[1] - p, args.ratio, 1)[0]
    importance = make_strategy("importance", head)
    tome = make_strategy("tome_score")
    ctx = StageContext(x=feats, num_prefix=p, has_cls=True)
    scores = importance.keep_scores(ctx)
    pruned = TokenState.start(feats, p).prune(lowest(scores, count, p))

    t_full = timed(model, x, repeats=args.repeats)
    t_head = timed(lambda: importance.keep_scores(ctx), repeats=args.repeats)
    t_select = timed(lambda: TokenState.start(feats, p).prune(lowest(scores, count, p)), repeats=args.repeats)
    t_reinsert = timed(lambda: ops.reinsert_tokens(pruned.x, pruned.positions, pruned.frozen, pruned.frozen_positions), repeats=args.repeats)
    t_tome = timed(lambda: lowest(tome.keep_scores(ctx), count, p), repeats=args.repeats)
    added = t_head + t_select + t_reinsert
    return {
        "image_size": args.overhead_size, "batch": args.overhead_batch, "tokens": int(feats.shape[1]), "removed": count,
        "unpruned_forward_s": t_full, "head_scoring_s": t_head, "selection_and_gather_s": t_select,
        "llf_reinsert_s": t_reinsert, "tome_scoring_s": t_tome,
        "scoring_plus_llf_pct_of_forward": 100.0 * added / t_full,
        "over_tome_scoring_pct_of_forward": 100.0 * (added - t_tome) / t_full,
        "head_parameters": sum(q.numel() for q in head.parameters()),
    }


def speedup(args, layers) -> dict:
    """Unpruned vs pruned (importance head, LLF) at the large batch and at batch 1."""
    import torch

    import pullback_ext.patch as patch
    from pullback_ext.metric.head import ImportanceHead
    from pullback_ext.prune.cost import count_flops

    model = build(args.model, args.size)
    head = ImportanceHead(model.embed_dim).eval().requires_grad_(False)
    big = torch.rand(args.batch, 3, args.size, args.size)
    one = big[:1]
    flops_full = count_flops(model, one)
    t_full = timed(model, big, repeats=args.repeats)
    t_full_1 = timed(model, one, repeats=max(args.repeats, 5))
    patch.timm(model, head=head, ratio=args.ratio, layers=layers, mode="prune", strategy="importance", llf=True)
    flops_pruned = count_flops(model, one)
    t_pruned = timed(model, big, repeats=args.repeats)
    t_pruned_1 = timed(model, one, repeats=max(args.repeats, 5))
    flop_ratio = flops_full / flops_pruned
    wall = t_full / t_pruned
    return {
        "image_size": args.size, "batch": args.batch, "ratio": args.ratio, "layers": list(layers), "llf": True,
        "gflops_per_image_unpruned": flops_full / 1e9, "gflops_per_image_pruned": flops_pruned / 1e9,
        "flop_ratio": flop_ratio, "unpruned_s": t_full, "pruned_s": t_pruned, "wall_clock_speedup": wall,
        "speedup_over_flop_ratio": wall / flop_ratio,
        "batch1_latency_unpruned_ms": 1e3 * t_full_1, "batch1_latency_pruned_ms": 1e3 * t_pruned_1,
        "batch1_speedup": t_full_1 / t_pruned_1,
    }


def render(result: dict) -> str:
    """Markdown body of the results page: the overhead table, then the speed-up table."""
    o = result["overhead"]
    parts = [f"## Overhead at {o['image_size']} px, batch {o['batch']}\n\n"
             f"{result['model']}, random weights, {o['tokens']} tokens, {o['removed']} removed at the first stage. "
             "Seconds are medians; percentages are of the unpruned forward.",
             markdown_table(["step", "seconds", "% of the unpruned forward"], [
                 ("unpruned forward", o["unpruned_forward_s"], 100.0),
                 ("importance-head scoring", o["head_scoring_s"], 100 * o["head_scoring_s"] / o["unpruned_forward_s"]),
                 ("selection and gather", o["selection_and_gather_s"], 100 * o["selection_and_gather_s"] / o["unpruned_forward_s"]),
                 ("LLF re-insertion", o["llf_reinsert_s"], 100 * o["llf_reinsert_s"] / o["unpruned_forward_s"]),
                 ("ToMe scoring (for comparison)", o["tome_scoring_s"], 100 * o["tome_scoring_s"] / o["unpruned_forward_s"]),
             ]),
             f"Scoring + selection + LLF: {o['scoring_plus_llf_pct_of_forward']:.2f}% of the forward, "
             f"{o['over_tome_scoring_pct_of_forward']:.2f}% more than ToMe's scoring "
             f"(head: {o['head_parameters']:,} parameters)."]
    if "speedup" in result:
        s = result["speedup"]
        parts += [f"## Speed-up at {s['image_size']} px, η = {s['ratio']}, stages {s['layers']}, masked LLF",
                  markdown_table(["", "unpruned", "pruned", "ratio"], [
                      ("GFLOPs per image", s["gflops_per_image_unpruned"], s["gflops_per_image_pruned"], s["flop_ratio"]),
                      (f"seconds at batch {s['batch']}", s["unpruned_s"], s["pruned_s"], s["wall_clock_speedup"]),
                      ("ms at batch 1", s["batch1_latency_unpruned_ms"], s["batch1_latency_pruned_ms"], s["batch1_speedup"]),
                  ]),
                  f"Wall-clock speed-up / FLOP ratio at batch {s['batch']}: {s['speedup_over_flop_ratio']:.2f}."]
    return "\n\n".join(parts)


def main(argv=None) -> int:
    import torch

    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    layers = tuple(int(t) for t in args.layers.split(","))
    result = {"stamp": stamp(current_command(None if argv is None else [__file__, *argv])), "model": args.model,
              "settings": {k: getattr(args, k) for k in ("quick", "overhead_size", "overhead_batch", "size", "batch", "ratio", "repeats")}}
    result["overhead"] = overhead(args, layers)
    print(json.dumps(result["overhead"], indent=2))
    if not args.skip_speedup:
        result["speedup"] = speedup(args, layers)
        print(json.dumps(result["speedup"], indent=2))
    if args.out:
        atomic_write_json(args.out, result)
    if args.results_page:
        note = ("Reduced settings (`--quick`) for a shared 2-core machine (busy when its load average is above 2): smaller batches and 224 px for the speed-up, "
                "so the figures are not comparable with the full-size run "
                "([cpu-benchmarks.md](cpu-benchmarks.md#pruning)).") if args.quick else ""
        print("wrote", *publish(result, "bench-prune", "Token pruning cost (`benchmarks/bench_prune.py`)", render, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
