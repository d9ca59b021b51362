"""The pruning benchmark's outputs: the per-cell tables, the headline checks, the overhead table."""

from __future__ import annotations

from itertools import groupby

from pullback_ext.results_pages import markdown_table

CELL = ("model", "title", "size", "batch", "dtype", "compiled")
# the performance targets: prune + LLF and importance_tome within 0.9 of their FLOP ratios; our merge at
# ToMe's FLOPs at least as fast
PRUNE_TARGET, MATCHED_TARGET, EVERY_BLOCK_TARGET = 0.9, 1.0, 0.9


def cells(rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Rows grouped by cell, in run order: ``[(cell, rows)]``."""
    key = lambda r: tuple(r[k] for k in CELL)  # noqa: E731
    return [(dict(zip(CELL, k)), list(g)) for k, g in groupby(rows, key=key)]


def headline_checks(rows: list[dict]) -> list[dict]:
    """Per cell: the single-stage prune + LLF at the largest η against its FLOP ratio, our merge at
    a ToMe row's FLOPs against that row, and each importance_tome row against its FLOP ratio, where
    the cell has them."""
    out = []
    for cell, group in cells(rows):
        prunes = [r for r in group if r["method"].startswith("importance prune+LLF η=") and "stages" not in r["method"]]
        if prunes:
            top = max(prunes, key=lambda r: r["flop_ratio"])
            out.append(dict(cell, check=f"{top['method']}: speed-up ÷ FLOP ratio", value=top["speedup_over_flop_ratio"],
                            target=PRUNE_TARGET))
        for ours in (r for r in group if r["method"].startswith("importance merge @") and "'s FLOPs" in r["method"]):
            tome = next(r for r in group if f" at {r['method']}'s FLOPs" in ours["method"])
            out.append(dict(cell, check=f"{ours['method']} over {tome['method']} (FLOPs {ours['gflops_per_image'] / tome['gflops_per_image']:.3f}×)",
                            value=ours["images_per_s"] / tome["images_per_s"], target=MATCHED_TARGET))
        for every in (r for r in group if r["method"].startswith("importance_tome ")):
            out.append(dict(cell, check=f"{every['method']}: speed-up ÷ FLOP ratio", value=every["speedup_over_flop_ratio"],
                            target=EVERY_BLOCK_TARGET))
    return out


def _cell_title(cell: dict) -> str:
    mode = "torch.compile" if cell["compiled"] else "eager"
    return f"{cell['title']}, {cell['size']} px, batch {cell['batch']}, {cell['dtype']}, {mode}"


def format_rows(rows: list[dict]) -> str:
    """The printed table: one block per cell."""
    lines = []
    for cell, group in cells(rows):
        lines.append(_cell_title(cell))
        for r in group:
            share = "-" if r["kernel_share"] is None else f"{100 * r['kernel_share']:.1f}%"
            lines.append(f"  {r['method']:<58} {r['images_per_s']:10.1f} img/s  ×{r['speedup']:5.2f}  "
                         f"FLOPs ×{r['flop_ratio']:5.2f}  ÷ {r['speedup_over_flop_ratio']:5.2f}  ours {share:>6}  "
                         f"ops {_aten_ops(r)}")
    return "\n".join(lines)


def _speedup(row: dict) -> str:
    """``1.23× [1.18, 1.27]``: the speed-up and its 90% interval (rows from before the intervals: the speed-up alone)."""
    interval = row.get("speedup_ci90")
    return f"{row['speedup']:.2f}×" + ("" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]")


def _aten_ops(row: dict) -> str:
    """The operators one eager forward dispatches (rows from before that column: –)."""
    return "–" if row.get("aten_ops") is None else f"{row['aten_ops']:,}"


def render(result: dict) -> str:
    """Markdown body of the results page."""
    parts = [f"Device: {result['device']}. {result['settings']['repeats']} interleaved rounds (CUDA events on a GPU, wall "
             "clock on the CPU): images/s from the median time, speed-up the median over rounds of the round's unpruned ÷ "
             "method time with the bootstrap 90% interval of that median in brackets; FLOP ratio = unpruned FLOPs ÷ the "
             "method's (torch's flop counter over the whole forward at batch 1); "
             "*our ops* = share of the eager forward's time in `pullback_ext::` ops; *aten ops per forward* = operators one "
             "eager forward at the cell's batch dispatches (ATen's and this library's, counted by a `TorchDispatchMode`; a "
             "compiled row repeats its eager count)."]
    checks = result.get("checks", [])
    if checks:
        parts += ["## Headline checks", markdown_table(
            ["cell", "check", "value", "target", "met"],
            [(_cell_title(c), c["check"], c["value"], f"≥ {c['target']}", "yes" if c["value"] >= c["target"] else "no") for c in checks])]
    for cell, group in cells(result["rows"]):
        parts += [f"## {_cell_title(cell)}", markdown_table(
            ["method", "images/s", "speed-up", "GFLOPs/image", "FLOP ratio", "speed-up ÷ FLOP ratio", "our ops",
             "aten ops per forward"],
            [(r["method"], r["images_per_s"], _speedup(r), r["gflops_per_image"], r["flop_ratio"], r["speedup_over_flop_ratio"],
              "–" if r["kernel_share"] is None else f"{100 * r['kernel_share']:.1f}%", _aten_ops(r)) for r in group])]
    if "overhead" in result:
        o = result["overhead"]
        parts += [f"## Overhead of one stage: {o['model']}, {o['image_size']} px, batch {o['batch']}, block {o['layer']}",
                  f"{o['tokens']} tokens, {o['removed']} removed. Seconds are medians; percentages are of the unpruned forward.",
                  markdown_table(["step", "seconds", "% of the unpruned forward"],
                                 [(k, s, o["percent_of_forward"][k]) for k, s in o["seconds"].items()]),
                  f"Scoring + selection + LLF: {o['scoring_plus_llf_pct_of_forward']:.2f}% of the forward, "
                  f"{o['over_tome_scoring_pct_of_forward']:.2f}% more than ToMe's scoring (head: {o['head_parameters']:,} parameters)."]
    return "\n\n".join(parts)
