"""Benchmark of the learned metric at inference (docs/formulas.md §3, issue 5).

1. Importance head vs computing imp* with the diagnostic's randomized SVD (rank 20, q = 2,
   oversampling 10) on a ViT-S/16 CLS probe at layer 10 (timm, random weights): seconds per image.
2. Importance head vs one forward pass of the ViT-S backbone at the same batch.
3. SPN metric products through the kernels (``pullback_ext.ops``) vs the eager reference
   (``pullback_ext.reference``): lowrank_metric_apply, lowrank_metric_quadform, token_importance.

Prints a table and writes JSON (``--out``); ``--results-page`` also writes
docs/results/bench-metric.json and .md, stamped with the machine, versions and command.
``--quick`` uses a smaller input (N = 50 tokens) and fewer repeats, for shared machines.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pullback_ext.fileio import atomic_write_json  # noqa: E402
from pullback_ext.results_pages import ALLOW_DIRTY_HELP, current_command, markdown_table, publish, refuse_dirty, stamp  # noqa: E402


def median_seconds(fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_head(img_size: int, batch: int, diag_images: int, repeats: int) -> dict:
    import timm

    from pullback_ext.metric import ImportanceHead, TargetConfig, compute_targets, parameter_count
    from pullback_ext.probes import from_timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=img_size).eval().requires_grad_(False)
    probe = from_timm(vit, 10, "cls")
    images = torch.rand(batch, 3, img_size, img_size)
    F = probe.features(images).F
    head = ImportanceHead(probe.dim).eval()
    with torch.no_grad():
        head_s = median_seconds(lambda: head(F), repeats)
        forward_s = median_seconds(lambda: vit(images), repeats)
    config = TargetConfig(mode="randnla", rank=20, power=2, oversample=10, keep_basis=False)
    start = time.perf_counter()
    compute_targets(probe, F[:diag_images], config)
    imp_star_per_image = (time.perf_counter() - start) / diag_images
    head_per_image = head_s / batch
    return {
        "model": f"vit_small_patch16_224@{img_size} (random weights), CLS probe layer 10",
        "N": probe.num_tokens,
        "D": probe.dim,
        "batch": batch,
        "head_parameters": parameter_count(head),
        "head_seconds_per_batch": head_s,
        "head_seconds_per_image": head_per_image,
        "imp_star_seconds_per_image": imp_star_per_image,
        "imp_star_images": diag_images,
        "speedup_vs_imp_star": imp_star_per_image / head_per_image,
        "backbone_forward_seconds_per_batch": forward_s,
        "head_fraction_of_forward": head_s / forward_s,
    }


def bench_kernels(N: int, D: int, r: int, batches: tuple[int, ...], ks: tuple[int, ...], repeats: int) -> list[dict]:
    from pullback_ext import ops, reference

    rows = []
    for B in batches:
        U = torch.linalg.qr(torch.randn(B, N * D, r)).Q.contiguous()
        lam = torch.rand(B, r) + 0.1
        for k in ks:
            v = torch.randn(B, N * D, k)
            for name, args in (
                ("lowrank_metric_apply", (U, lam, v, 1e-3)),
                ("lowrank_metric_quadform", (U, lam, v, 1e-3)),
            ):
                fused = median_seconds(lambda: getattr(ops, name)(*args), repeats)
                eager = median_seconds(lambda: getattr(reference, name)(*args), repeats)
                rows.append({"op": name, "B": B, "k": k, "N": N, "D": D, "r": r, "kernel_s": fused, "eager_s": eager,
                             "speedup": eager / fused, "compiled": ops.uses_compiled(U)})
        fused = median_seconds(lambda: ops.token_importance(U, lam, N), repeats)
        eager = median_seconds(lambda: reference.token_importance(U, lam, N), repeats)
        rows.append({"op": "token_importance", "B": B, "k": None, "N": N, "D": D, "r": r, "kernel_s": fused, "eager_s": eager,
                     "speedup": eager / fused, "compiled": ops.uses_compiled(U)})
    return rows


def render(result: dict) -> str:
    """Markdown body of the results page: the head against imp* and the backbone, then the kernels."""
    h = result["head"]
    head = markdown_table(["", "value"], [
        ("importance head, ms per image", 1e3 * h["head_seconds_per_image"]),
        ("imp* by randomized SVD (r = 20, q = 2), ms per image", 1e3 * h["imp_star_seconds_per_image"]),
        ("head speed-up over imp*", h["speedup_vs_imp_star"]),
        (f"backbone forward, ms per batch of {h['batch']}", 1e3 * h["backbone_forward_seconds_per_batch"]),
        ("head cost, % of the backbone forward", 100 * h["head_fraction_of_forward"]),
        ("head parameters", h["head_parameters"]),
    ])
    kernels = markdown_table(["op", "B", "k", "kernel ms", "eager ms", "× eager", "compiled"], [
        (r["op"], r["B"], r["k"], 1e3 * r["kernel_s"], 1e3 * r["eager_s"], r["speedup"], r["compiled"]) for r in result["kernels"]
    ])
    return (f"## Importance head\n\n{h['model']}: N = {h['N']}, D = {h['D']}, batch {h['batch']}; imp* timed on "
            f"{h['imp_star_images']} image(s).\n\n{head}\n\n## Metric kernels against the eager reference\n\n"
            f"N = {h['N']}, D = {h['D']}, r = 20; medians of the timed repeats.\n\n{kernels}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 50 tokens (112 px), fewer repeats")
    parser.add_argument("--batch", type=int, default=16, help="images per head / backbone forward")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--results-page", action="store_true", help="also write docs/results/bench-metric.json and .md")
    parser.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    args = parser.parse_args(argv)
    if args.results_page:
        refuse_dirty(args.allow_dirty)
    if args.threads:
        torch.set_num_threads(args.threads)
    img_size = 112 if args.quick else 224
    repeats = 3 if args.quick else 7
    head = bench_head(img_size, args.batch, diag_images=1 if args.quick else 2, repeats=repeats)
    N, D = head["N"], head["D"]
    kernels = bench_kernels(N, D, 20, (1, 8), (1, 20), repeats)
    print(f"\n{head['model']}: N={N}, D={D}, batch {head['batch']}, head {head['head_parameters']:,} parameters")
    print(f"  importance head        {head['head_seconds_per_image'] * 1e3:10.3f} ms/image")
    print(f"  imp* (rSVD r=20, q=2)  {head['imp_star_seconds_per_image'] * 1e3:10.1f} ms/image   -> head is {head['speedup_vs_imp_star']:,.0f}x faster")
    print(f"  ViT-S forward          {head['backbone_forward_seconds_per_batch'] * 1e3:10.1f} ms/batch  -> head costs {100 * head['head_fraction_of_forward']:.1f}% of it")
    print(f"\n{'op':<26}{'B':>3}{'k':>4}{'kernel ms':>11}{'eager ms':>10}{'speedup':>9}  compiled")
    for row in kernels:
        k = "-" if row["k"] is None else row["k"]
        print(f"{row['op']:<26}{row['B']:>3}{k:>4}{row['kernel_s'] * 1e3:>11.3f}{row['eager_s'] * 1e3:>10.3f}{row['speedup']:>9.2f}  {row['compiled']}")
    result = {"stamp": stamp(current_command(None if argv is None else [__file__, *argv])), "quick": args.quick,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "head": head, "kernels": kernels}
    if args.out:
        atomic_write_json(args.out, result)
    if args.results_page:
        note = ("Reduced settings (`--quick`): 112 px (N = 50 tokens), fewer repeats, one image for imp*, on a shared "
                "2-core machine (busy when its load average is above 2); not comparable with the full-size run ([cpu-benchmarks.md](cpu-benchmarks.md)).") if args.quick else ""
        print("wrote", *publish(result, "bench-metric", "Learned metric at inference (`benchmarks/bench_metric.py`)", render, note,
                                      allow_dirty=args.allow_dirty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
