"""Pareto results as people read them: the matched-speed-up tables, every point, and the
quality-against-speed-up plot (from :func:`pullback_ext.comparison.pareto.summarise`)."""

from __future__ import annotations

import os
from pathlib import Path

from pullback_ext.comparison.pareto import STATISTICS, cost_axes, frontier

AXIS_TITLES = {"flop_ratio": "FLOP ratio (unpruned / reduced FLOPs)"}
METRIC_TITLES = {"cosine_x100": "100·(1 − cos) of the CLS embedding", "silog_x100": "added SILog ×100 of the depth map",
                 "pixel_kl_x100": "100 · mean per-pixel KL(unreduced ‖ reduced) of the class distributions",
                 "miou_gap_x100": "100·(1 − mIoU) of the argmax map against the unreduced one"}


def axis_title(axis: str) -> str:
    return AXIS_TITLES.get(axis) or f"measured speed-up at batch {axis.removeprefix('speedup_batch')}"


def _fmt(value) -> str:
    if value is None:
        return "–"
    return f"{value:.2e}" if 0 < abs(value) < 0.01 else f"{value:.3f}"


def _cell(entry) -> str:
    if entry is None:
        return "–"
    return ("≈ " if entry.get("within_noise") else "") + ("≤ " if entry["bound"] else "") + _fmt(entry["value"])


def speedup_text(cost: dict, axis: str) -> str:
    """A point's speed-up on ``axis``: ``1.23×``, with ``[low, high]`` (its 90% interval) on a measured axis."""
    interval = cost.get(f"{axis}_ci90")
    return f"{cost[axis]:.2f}×" + ("" if interval is None else f" [{interval[0]:.2f}, {interval[1]:.2f}]")


def cost_note(result: dict) -> str:
    """How the page counts FLOPs and times, and what ``≈`` marks."""
    repeats = result["repeats"]
    timing = "" if not result["batches"] else (
        f" Measured speed-ups: {repeats} interleaved rounds (the unpruned model and every point in each round, the order "
        "rotating); a speed-up is the median over rounds of the round's unpruned / reduced time, with the bootstrap 90% "
        "interval of that median in brackets. On a measured axis ≈ marks a cell *within noise*: the row's error band at "
        "that speed-up (its matched error with every point at the high end of its interval, and with every point at the "
        "low end) overlaps another row's band there, so the two rows' order at that speed-up is not settled by this run.")
    return f"{result['flops']} The FLOP ratio is the stable axis and its table comes first.{timing}{alone_note(result)}\n"


def alone_note(result: dict) -> str:
    """What the rows measured one image at a time mean (:mod:`pullback_ext.comparison.pareto`), or ""
    where there are none."""
    names = list(dict.fromkeys(row_method(result, p["row"]).short for p in result["points"] if p.get("one_image_at_a_time")))
    if not names:
        return ""
    timed = "" if not result["batches"] else (
        "; their time at batch b is that of the same b images reduced one after another at batch 1, against the "
        "unpruned model's batch of b")
    return (f" {', '.join(names)}: an image's token counts depend on the other images of its batch, so these rows are "
            "measured one image at a time, the reduction each image gets alone: their errors at batch 1, their FLOPs per "
            f"image the mean over the images of each image's count at batch 1{timed}. Their batched run, where a batch "
            "shares its counts, is another reduction and is not measured.")


def stats(table: dict) -> list:
    """The statistics of :data:`~pullback_ext.comparison.pareto.STATISTICS` a matched table holds (a
    result written before the median was added holds mean, p95 and worst)."""
    return [stat for stat in STATISTICS if stat in table]


def matched_tables(result: dict) -> str:
    """One table per cost axis (FLOPs first): each row's mean / median / p95 / worst-image error at the matched speed-ups."""
    targets = [f"{t:g}" for t in result["targets"]]
    out = []
    for axis in cost_axes(result["batches"]):
        noise = "" if axis == "flop_ratio" else ", ≈ within noise"
        out.append(f"**{result['metric']} at matched {axis_title(axis)}** (mean / median / p95 / worst image; "
                   f"– not reachable, ≤ the row's slowest setting{noise})\n")
        out.append("| row | " + " | ".join(f"{t}×" for t in targets) + " | fastest reached |")
        out.append("|---|" + "---|" * (len(targets) + 1))
        for row in result["rows"]:
            cells = [" / ".join(_cell(result["matched"][axis][stat][row][t]) for stat in stats(result["matched"][axis]))
                     for t in targets]
            out.append(f"| {row} | " + " | ".join(cells) + f" | {_fastest(result, row, axis)} |")
        out.append("")
    return "\n".join(out)


def _fastest(result: dict, row: str, axis: str) -> str:
    mine = [p for p in result["points"] if p["row"] == row]
    best = max(mine, key=lambda p: p["cost"][axis])
    return f"{speedup_text(best['cost'], axis)} at {_knob(best)} (mean {_fmt(best['error']['mean'])}, worst {_fmt(best['error']['worst'])})"


def _knob(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point["knob"].items()) or "default"


def points_table(result: dict) -> str:
    """Every point: row, knob, η, cost (measured speed-ups with their 90% intervals), its error
    statistics, the mean of each other metric of the task and, where measured, its label mIoU."""
    measured = [a for a in cost_axes(result["batches"]) if a != "flop_ratio"]
    others = result.get("other_metrics", [])
    labelled = "label_miou_unpruned" in result
    head = ["row", "knob", "η", "FLOP ratio"] + [f"speed-up b{a.removeprefix('speedup_batch')}" for a in measured] + \
        ["mean", "median", "p95", "worst"] + [f"{m} mean" for m in others] + (["label mIoU"] if labelled else [])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in result["points"]:
        eta = "–" if p["eta"] is None else f"{p['eta']:.3f}"
        cells = [p["row"], _knob(p), eta, f"{p['cost']['flop_ratio']:.2f}"] + [speedup_text(p["cost"], a) for a in measured] + \
            [_fmt(p["error"][s]) for s in ("mean", "median", "p95", "worst")] + \
            [_fmt(p["other_errors"][m]["mean"]) for m in others] + ([_fmt(p["label_miou"])] if labelled else [])
        out.append("| " + " | ".join(cells) + " |")
    note = "" if not labelled else (f"\nlabel mIoU: the argmax map against the renderer's classes over all images "
                                    f"(unpruned {_fmt(result['label_miou_unpruned'])}).\n")
    return "\n".join(out) + "\n" + note


def row_method(result: dict, row: str):
    """The registered method of the points of row ``row``."""
    from pullback_ext.prune.methods import get

    return get(next(p["options"]["strategy"] for p in result["points"] if p["row"] == row))


def row_name(row: str) -> str:
    """A row's short name: its method as the row states it (``importance_tome (defaults)``)."""
    return row.split(" · ", 1)[0]


def standings(result: dict, axis: str = "flop_ratio") -> str:
    """Ours against the field at matched cost on ``axis``: at each target and statistic, the lowest
    matched error among the rows of our methods and among every other row, and the factor by which
    ours leads (the other's error / ours) or trails (ours / the other's). Empty without a row of ours
    or of another method."""
    ours = [row for row in result["rows"] if row_method(result, row).ours]
    others = [row for row in result["rows"] if row not in ours]
    if not ours or not others:
        return ""
    table = result["matched"][axis]

    def best(rows, stat, t):
        found = [(table[stat][row][t], row) for row in rows if table[stat][row][t] is not None]
        return min(found, key=lambda f: f[0]["value"], default=None)

    out = [f"**Ours against the best other method at matched {axis_title(axis)}** (the lowest error among our rows, "
           "and among every other row; – where a side does not reach the target)\n",
           "| target | statistic | ours | best other | standing |", "|---|---|---|---|---|"]
    trails = []
    for t in (f"{t:g}" for t in result["targets"]):
        for stat in stats(table):
            mine, theirs = best(ours, stat, t), best(others, stat, t)
            cells = [f"{_cell(e)} ({row_name(row)})" if e else "–" for e, row in (mine or (None, None), theirs or (None, None))]
            if mine and theirs:
                a, b = mine[0]["value"], theirs[0]["value"]
                lead = a < b or a == b == 0
                standing = (f"ours leads, {b / a:.3g}×" if a > 0 else "ours leads (ours 0)") if lead else \
                    f"**ours trails**, {a / b:.3g}×" if b > 0 else "**ours trails** (theirs 0)"
                trails += [] if lead else [f"{t}× {stat} (behind {row_name(theirs[1])})"]
            else:
                standing = "only ours reaches it" if mine else "only others reach it" if theirs else "–"
                trails += [f"{t}× {stat} (not reached by ours)"] if theirs and not mine else []
            out.append(f"| {t}× | {stat} | {cells[0]} | {cells[1]} | {standing} |")
    out.append("\n" + ("Ours trails at " + "; ".join(trails) + "." if trails else "Ours leads at every target and statistic.") + "\n")
    return "\n".join(out) + "\n"


def markdown(result: dict) -> str:
    return (cost_note(result) + "\n" + standings(result) + "\n" + matched_tables(result) + "\n**Every point**\n\n"
            + points_table(result))


def page_renderer(plot_name: str):
    """The results-page body: :func:`markdown` after the plot ``plot_name`` (next to the page)."""
    return lambda result: f"![error against speed-up]({plot_name})\n\n" + markdown(result)


ROW_MARKERS = ("o", "s", "^", "v", "D", "P")  # the 1st, 2nd, … row of one method


def row_styles(result: dict) -> dict:
    """``{row: Line2D keywords}``: its method's style in every figure
    (:func:`~pullback_ext.comparison.report.method_style`, by the points' ``strategy``: the one
    colour table, ours thicker), with a marker telling rows of one method apart."""
    from pullback_ext.comparison.report import method_style

    seen, styles = {}, {}
    for row in result["rows"]:
        strategy = next(p["options"]["strategy"] for p in result["points"] if p["row"] == row)
        k = seen[strategy] = seen.get(strategy, -1) + 1
        styles[row] = method_style(strategy) | {"marker": ROW_MARKERS[k % len(ROW_MARKERS)], "ms": 3}
    return styles


def figure(result: dict):
    """Mean (solid, on the row's frontier) and worst-image (dashed) error against speed-up, log y
    (whole decades; errors ≤ 0 at a stated floor), one panel per cost axis (FLOPs, and the largest
    measured batch when timed). A row's colour is its method's (the same in every figure)."""
    from pullback_ext.plots import decade_limits, note_floor, pyplot

    plt = pyplot()
    axes_shown = cost_axes(result["batches"])[:2]
    fig, axes = plt.subplots(1, len(axes_shown), figsize=(6 * len(axes_shown), 4.8), squeeze=False)
    styles = row_styles(result)
    floor = min((p["error"]["mean"] for p in result["points"] if p["error"]["mean"] > 0), default=1e-6) / 10
    for ax, axis in zip(axes[0], axes_shown):
        for row in result["rows"]:
            mine = [p for p in result["points"] if p["row"] == row]
            style = styles[row]
            for stat, ls in (("mean", "-"), ("worst", "--")):
                xs, ys = [p["cost"][axis] for p in mine], [max(p["error"][stat], floor) for p in mine]
                ax.scatter(xs, ys, s=10, color=style["color"], marker=style["marker"], alpha=0.5)
                front = frontier(xs, ys)
                ax.plot([xs[j] for j in front], [ys[j] for j in front], ls, label=row if stat == "mean" else None, **style)
        ax.set_yscale("log")
        decade_limits(ax)
        note_floor(ax, floor, sum(p["error"][stat] <= 0 for p in result["points"] for stat in ("mean", "worst")))
        ax.set_xlabel(axis_title(axis))
        ax.set_ylabel(METRIC_TITLES.get(result["metric"], result["metric"]))
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle(f"{result['model']}: {result['task']} error against speed-up on {result['images']} "
                 "(solid: mean on the row's frontier, dashed: worst image)")
    fig.tight_layout()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=7, frameon=False)  # below the data
    return fig


def plot(result: dict, path: str | os.PathLike) -> Path:
    """:func:`figure` written to ``path``."""
    from pullback_ext.plots import save_figure

    return save_figure(figure(result), path)
