"""The pruning benchmark's outputs: the per-cell tables, the headline checks, the latency figures
(operators dispatched, speed-up ÷ FLOP ratio, importance_tome against ToMe), where batch-1 eager
time goes, the ONNX Runtime rows, the overhead table and what was skipped."""

from __future__ import annotations

from itertools import groupby

from prune_bench.models import DROPPED
from pullback_ext.bench.forward_profile import CATEGORIES, LABELS
from pullback_ext.comparison.cost import speedup_interval
from pullback_ext.results_pages import format_number, markdown_table

CELL = ("model", "title", "size", "batch", "dtype", "compiled")
# the performance targets: prune + LLF, the single-stage merge and importance_tome within 0.9 of their
# FLOP ratios at small batches and within 0.95 from BULK_BATCH on; our merge at ToMe's FLOPs, and
# importance_tome at ToMe's token counts, at least as fast
FLOP_TARGET, BULK_FLOP_TARGET, BULK_BATCH = 0.9, 0.95, 16
MATCHED_TARGET, OVER_TOME_TARGET = 1.0, 1.0


def flop_target(batch: int) -> float:
    """The speed-up ÷ FLOP ratio the single-stage methods and importance_tome must reach at ``batch``."""
    return BULK_FLOP_TARGET if batch >= BULK_BATCH else FLOP_TARGET


def cells(rows: list[dict]) -> list[tuple[dict, list[dict]]]:
    """Rows grouped by cell, in run order: ``[(cell, rows)]``."""
    key = lambda r: tuple(r[k] for k in CELL)  # noqa: E731
    return [(dict(zip(CELL, k)), list(g)) for k, g in groupby(rows, key=key)]


def torch_rows(group: list[dict]) -> list[dict]:
    """The rows of the torch models (not the ONNX Runtime ones)."""
    return [r for r in group if r.get("runtime", "torch") == "torch"]


def _single_stage(group: list[dict], kind: str) -> list[dict]:
    return [r for r in group if r["method"].startswith(f"importance {kind} η=") and "stages" not in r["method"]]


def _pairs(group: list[dict], ours: str, theirs: str, their_suffix: str = "") -> list[tuple[dict, dict]]:
    """(our row, their row) of a cell whose names start with ``ours`` / ``theirs`` (and theirs end
    with ``their_suffix``) and share their setting, the names' second word (``r=8``, ``keep_rate=0.7``)."""
    by_setting = {r["method"].split()[1]: r for r in group
                  if r["method"].startswith(theirs) and r["method"].endswith(their_suffix)}
    return [(r, by_setting[r["method"].split()[1]]) for r in group
            if r["method"].startswith(ours) and r["method"].split()[1] in by_setting]


def _tome_pairs(group: list[dict]) -> list[tuple[dict, dict]]:
    """(importance_tome r=R, ToMe r=R constant) of a cell: the same token counts."""
    return _pairs(group, "importance_tome r=", "ToMe r=", " constant")


def _cluster_pair(group: list[dict]) -> list[tuple[dict, dict]]:
    """(importance_cluster, ATC) of a cell at the same keep rate: the same token counts, another linkage."""
    return _pairs(group, "importance_cluster keep_rate=", "ATC keep_rate=")


def _verdict(spread: dict) -> str:
    verdict = "faster" if spread["low"] > 1 else "slower" if spread["high"] < 1 else "within noise"
    return f"{spread['median']:.3f} [{spread['low']:.3f}, {spread['high']:.3f}]: {verdict}"


def over(row: dict, other: dict) -> dict:
    """``row``'s speed over ``other``'s in the same rounds: the median of the per-round ratios and
    its bootstrap 90% interval (``{"median", "low", "high"}``; without round times, the medians' ratio)."""
    if row.get("times_s") and other.get("times_s") and len(row["times_s"]) == len(other["times_s"]):
        return speedup_interval(other["times_s"], row["times_s"])
    ratio = other["median_s"] / row["median_s"]
    return {"median": ratio, "low": ratio, "high": ratio}


def headline_checks(rows: list[dict]) -> list[dict]:
    """Per cell: the single-stage prune + LLF and merge at the largest η against their FLOP ratios,
    our merge at a ToMe row's FLOPs against that row, each importance_tome row against its FLOP
    ratio and against ToMe at the same ``r`` (same token counts, same rounds), where the cell has them."""
    out = []
    for cell, group in cells(rows):
        group = torch_rows(group)
        target = flop_target(cell["batch"])
        for kind in ("prune+LLF", "merge"):
            single = _single_stage(group, kind)
            if single:
                top = max(single, key=lambda r: r["flop_ratio"])
                out.append(dict(cell, check=f"{top['method']}: speed-up ÷ FLOP ratio", value=top["speedup_over_flop_ratio"],
                                target=target))
        for ours in (r for r in group if r["method"].startswith("importance merge @") and "'s FLOPs" in r["method"]):
            tome = next(r for r in group if f" at {r['method']}'s FLOPs" in ours["method"])
            out.append(dict(cell, check=f"{ours['method']} over {tome['method']} (FLOPs {ours['gflops_per_image'] / tome['gflops_per_image']:.3f}×)",
                            value=ours["images_per_s"] / tome["images_per_s"], target=MATCHED_TARGET))
        for every in (r for r in group if r["method"].startswith("importance_tome ")):
            out.append(dict(cell, check=f"{every['method']}: speed-up ÷ FLOP ratio", value=every["speedup_over_flop_ratio"],
                            target=target))
        for every, tome in _tome_pairs(group):
            spread = over(every, tome)
            out.append(dict(cell, check=f"{every['method']} over {tome['method']} (images/s, same rounds)",
                            value=spread["median"], interval=[spread["low"], spread["high"]], target=OVER_TOME_TARGET))
    return out


def mode_name(compiled) -> str:
    return {False: "eager", True: "torch.compile"}.get(compiled, f"torch.compile ({compiled}, CUDA graphs)")


def cell_title(cell: dict) -> str:
    return f"{cell['title']}, {cell['size']} px, batch {cell['batch']}, {cell['dtype']}, {mode_name(cell['compiled'])}"


def _ratio(row: dict) -> str:
    return "–" if row.get("aten_ops_ratio") is None else f"{row['aten_ops_ratio']:.2f}×"


def _launches(row: dict) -> str:
    """``kernels / launches`` per forward (CUDA rows; – elsewhere)."""
    got = row.get("launches")
    return "–" if not got else f"{format_number(got['kernels'])} / {format_number(got['launches'])}"


def format_rows(rows: list[dict]) -> str:
    """The printed table: one block per cell."""
    lines = []
    for cell, group in cells(rows):
        lines.append(cell_title(cell))
        for r in group:
            share = "-" if r["kernel_share"] is None else f"{100 * r['kernel_share']:.1f}%"
            lines.append(f"  {r['method']:<58} {r['images_per_s']:10.1f} img/s  ×{r['speedup']:5.2f}  "
                         f"FLOPs ×{r['flop_ratio']:5.2f}  ÷ {r['speedup_over_flop_ratio']:5.2f}  ours {share:>6}  "
                         f"ops {_aten_ops(r)} ({_ratio(r)})" + (f"  launches {_launches(r)}" if r.get("launches") else ""))
    return "\n".join(lines)


def _speedup(row: dict, key: str = "speedup") -> str:
    """``1.23× [1.18, 1.27]``: the speed-up and its 90% interval (rows from before the intervals: the speed-up alone)."""
    interval = row.get(f"{key}_ci90")
    return f"{row[key]:.2f}×" + ("" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]")


def _aten_ops(row: dict) -> str:
    """The operators one eager forward dispatches (rows from before that column: –)."""
    return "–" if row.get("aten_ops") is None else f"{row['aten_ops']:,}"


def _cell_table(group: list[dict]) -> str:
    cuda = any(r.get("launches") for r in group)
    compiled = any(r.get("compile_s") is not None for r in group)
    headers = ["method", "images/s", "speed-up", "GFLOPs/image", "FLOP ratio", "speed-up ÷ FLOP ratio", "our ops",
               "aten ops per forward", "aten ops ÷ unpruned"]
    headers += ["CUDA kernels / launches per forward"] if cuda else []
    headers += ["first two calls (s)"] if compiled else []
    return markdown_table(headers, [
        (r["method"], r["images_per_s"], _speedup(r), r["gflops_per_image"], r["flop_ratio"], r["speedup_over_flop_ratio"],
         "–" if r["kernel_share"] is None else f"{100 * r['kernel_share']:.1f}%", _aten_ops(r), _ratio(r))
        + ((_launches(r),) if cuda else ()) + ((r.get("compile_s"),) if compiled else ()) for r in group])


def _figures(group: list[dict]) -> dict[str, str]:
    """The latency figures of one eager cell, by label: operators per forward (and their ratio to
    the unpruned forward's), speed-up ÷ FLOP ratio (of ToMe's token counts without merging too, the
    bound of a merge at those counts), importance_tome's speed over ToMe's and importance_cluster's
    over ATC's."""
    group = torch_rows(group)
    by = {r["method"]: r for r in group}
    tome = [r for r in group if r["method"].startswith("ToMe r=")]
    every = [r for r in group if r["method"].startswith("importance_tome r=")]
    merges = _single_stage(group, "merge")
    merge = [max(merges, key=lambda r: r["flop_ratio"])] if merges else []
    dropped = [r for r in group if r["method"].startswith(DROPPED)]
    clusters = [r for pair in _cluster_pair(group) for r in reversed(pair)]
    out = {}
    if "unpruned" in by:
        out["aten ops per forward: unpruned"] = _aten_ops(by["unpruned"])
    for r in tome + every + merge + clusters:
        out[f"aten ops per forward: {r['method']} (÷ unpruned)"] = f"{_aten_ops(r)} ({_ratio(r)})"
    for r in every + dropped + merge + clusters:
        out[f"speed-up ÷ FLOP ratio: {r['method']}"] = f"{r['speedup_over_flop_ratio']:.3f} (×{r['speedup']:.2f} ÷ {r['flop_ratio']:.2f})"
    for r, t in _tome_pairs(group):
        out[f"{r['method'].split(' (')[0]} over ToMe {r['method'].split()[1]} (images/s ratio)"] = _verdict(over(r, t))
    for r, a in _cluster_pair(group):
        out[f"importance_cluster over ATC at {r['method'].split()[1]} (images/s ratio)"] = _verdict(over(r, a))
    return out


def _latency_section(rows: list[dict]) -> list[str]:
    """Per model, size and dtype: the eager cells' latency figures, one column per batch."""
    eager = [(c, g) for c, g in cells(rows) if c["compiled"] is False]
    parts = []
    key = lambda cg: (cg[0]["title"], cg[0]["size"], cg[0]["dtype"])  # noqa: E731
    for (title, size, dtype), members in groupby(eager, key=key):
        members = list(members)
        figures = [(c["batch"], _figures(g)) for c, g in members]
        labels = list(dict.fromkeys(label for _, f in figures for label in f))
        if not labels:
            continue
        parts += [f"### {title}, {size} px, {dtype}, eager", markdown_table(
            ["figure"] + [f"batch {b}" for b, _ in figures], [[label] + [f.get(label, "–") for _, f in figures] for label in labels])]
    if not parts:
        return []
    return ["## Latency figures (eager)",
            "Operators one eager forward dispatches and their ratio to the unpruned forward's; speed-up ÷ FLOP ratio "
            f"(targets for importance_tome and the single-stage merge: ≥ {FLOP_TARGET} below batch {BULK_BATCH}, "
            f"≥ {BULK_FLOP_TARGET} from it on; "
            f"*{DROPPED} r=R's counts, no merging*: the same token counts reached by slicing, the most a merge at "
            "those counts could reach); "
            "importance_tome's images/s over ToMe's at the same r (the same token counts after every block), and "
            "importance_cluster's over ATC's at the same keep rate (the same blocks and counts, the bound for ATC's average "
            "linkage), each the median of the per-round ratios of the same interleaved run with its bootstrap 90% interval (*faster* when the whole "
            "interval is above 1). Where a target is missed, the next section says where the time goes."] + parts


def _ms_share(us: float | None, wall_us: float | None) -> str:
    if us is None:
        return "–"
    return f"{us / 1e3:.2f} ({100 * us / wall_us:.0f}%)" if wall_us else f"{us / 1e3:.2f}"


def _profile_section(rows: list[dict]) -> list[str]:
    """Where the batch-1 eager time goes, per method: the profiled forward's wall time split into
    matmuls, attention, our ops, everything else (with its largest ops) and outside any op."""
    parts = []
    for cell, group in cells(rows):
        profiled = [r for r in group if r.get("time_split") and cell["batch"] == 1 and cell["compiled"] is False]
        if not profiled:
            continue
        parts += [f"### {cell_title(cell)}", markdown_table(
            ["method", "profiled forward (ms)"] + [f"{LABELS[c]} (ms)" for c in CATEGORIES] + ["outside any op (ms)",
                                                                                            "largest of everything else (ms)"],
            [[r["method"], r["time_split"]["wall_us"] / 1e3 if r["time_split"]["wall_us"] else None]
             + [_ms_share(r["time_split"]["us"][c], r["time_split"]["wall_us"]) for c in CATEGORIES]
             + [_ms_share(r["time_split"]["outside_us"], r["time_split"]["wall_us"]),
                ", ".join(f"{name} {us / 1e3:.2f}" for name, us in r["time_split"]["top_other"][:3]) or "–"]
             for r in profiled])]
    if not parts:
        return []
    return ["## Where batch-1 eager time goes",
            "Three eager forwards, each under its own `torch.profiler` (after a warm-up forward), and of the one with the "
            "median wall time: the CPU self time of every operator on the CPU, the device time of the kernels each launched "
            "on CUDA, each operator's time credited to its outermost "
            "classified caller: *matmuls and linear layers* (`aten::linear`/`addmm`/`mm`/`bmm`/`matmul`/`einsum`, the patch "
            "embedding's convolution; ToMe's similarity matmul included), *attention (SDPA)* (`scaled_dot_product_attention` "
            "and its kernels, its math path included), *this extension's ops* (`pullback_ext::`), *everything else* (its "
            "three largest ops by outermost name in the last column); *outside any op* = the forward's wall time less the "
            "operators' time (CPU: Python and dispatch between operators; CUDA: the device idle between kernels). "
            "Shares are of the profiled forward, which the profiler slows a little."] + parts


def _onnx_section(rows: list[dict]) -> list[str]:
    parts = []
    for cell, group in cells(rows):
        onnx = [r for r in group if r.get("runtime") == "onnxruntime"]
        if not onnx:
            continue
        eager = {r["method"]: r for r in torch_rows(group)}
        parts += [f"### {cell_title(cell)}", markdown_table(
            ["method", "eager ms", "ONNX Runtime ms", "ONNX Runtime speed ÷ eager", "ONNX Runtime speed-up over eager unpruned",
             "max abs diff from eager"],
            [(r["eager_method"], 1e3 * eager[r["eager_method"]]["median_s"], 1e3 * r["median_s"], _speedup(r, "over_eager"),
              _speedup(r), r["max_abs_diff"]) for r in onnx])]
    if not parts:
        return []
    return ["## ONNX Runtime beside eager",
            "The models exported with `pullback_ext.export.export_onnx` (at the cell's input shape, float32) and run by ONNX "
            "Runtime's CPU provider with the benchmark's thread count (one inter-op thread, no spin-waiting), timed in the "
            "same interleaved rounds as the eager forwards: medians in ms, the speed ratio over the same method's eager "
            "forward and the speed-up over the eager unpruned model, each with its bootstrap 90% interval."] + parts


def render(result: dict) -> str:
    """Markdown body of the results page."""
    parts = [f"Device: {result['device']}. {result['settings']['repeats']} interleaved rounds"
             + (f" ({result['settings']['big_batch_repeats']} from batch {result['settings']['big_batch']})"
                if result["settings"].get("big_batch_repeats") else "")
             + " (CUDA events on a GPU, wall "
             "clock on the CPU): images/s from the median time, speed-up the median over rounds of the round's unpruned ÷ "
             "method time with the bootstrap 90% interval of that median in brackets; FLOP ratio = unpruned FLOPs ÷ the "
             "method's (torch's flop counter over the whole forward at batch 1); "
             "*our ops* = share of the eager forward's operator time in `pullback_ext::` ops; *aten ops per forward* = "
             "operators one eager forward at the cell's batch dispatches (ATen's and this library's, counted by a "
             "`TorchDispatchMode`; a compiled row repeats its eager count); on CUDA, the kernels one forward runs and the "
             "launch calls the host makes for them (a CUDA graph replay is one launch; `torch.profiler`); *first two calls* "
             "of a compiled row: compiling (where the shape needs a graph) and two forwards."]
    checks = result.get("checks", [])
    if checks:
        parts += ["## Headline checks", markdown_table(
            ["cell", "check", "value", "target", "met"],
            [(cell_title(c), c["check"], c["value"] if c.get("interval") is None else
              f"{c['value']:.3f} [{c['interval'][0]:.3f}, {c['interval'][1]:.3f}]", f"≥ {c['target']}",
              "yes" if c["value"] >= c["target"] else "no") for c in checks])]
    parts += _latency_section(result["rows"])
    for cell, group in cells(result["rows"]):
        parts += [f"## {cell_title(cell)}", _cell_table(group)]
    parts += _profile_section(result["rows"]) + _onnx_section(result["rows"])
    if "overhead" in result:
        o = result["overhead"]
        parts += [f"## Overhead of one stage: {o['model']}, {o['image_size']} px, batch {o['batch']}, block {o['layer']}",
                  f"{o['tokens']} tokens, {o['removed']} removed. Seconds are medians; percentages are of the unpruned forward.",
                  markdown_table(["step", "seconds", "% of the unpruned forward"],
                                 [(k, s, o["percent_of_forward"][k]) for k, s in o["seconds"].items()]),
                  f"Scoring + selection + LLF: {o['scoring_plus_llf_pct_of_forward']:.2f}% of the forward, "
                  f"{o['over_tome_scoring_pct_of_forward']:.2f}% more than ToMe's scoring (head: {o['head_parameters']:,} parameters)."]
    if result.get("skipped"):
        parts += ["## Left out", markdown_table(["cell", "method", "reason"],
                                                [(cell_title(s), s["method"], s["reason"]) for s in result["skipped"]])]
    return "\n\n".join(parts)
