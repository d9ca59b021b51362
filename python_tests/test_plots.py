"""Every figure the package makes, built from small synthetic results of the structures the
commands pass, opened and checked: labelled axes, at least two labelled major ticks inside the
limits on each axis, log scale where the data span two decades, every series finite and inside
the limits, a colorbar on every image, legends whose entries differ in style and sit off the data;
and the headline check: in the CLS quality plot, strategies a decade apart in error are drawn a
decade apart. Deliberately broken variants of the figures (symlog axis, one style for LLF and
no-LLF, a missing colorbar) must fail the same checks."""

from __future__ import annotations

import contextlib
import math

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer
from matplotlib.colors import to_hex
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from pullback_ext.plots import pyplot, spans_decades, spectrum_figure, token_energy_figure

plt = pyplot()
RATIOS = [0.1, 0.3, 0.5]


# ---------- synthetic results -------------------------------------------------------------------

def _cells(means: list[float], metrics=("cosine_x100",)) -> dict:
    return {f"{r:g}": {m: {"mean": v, "std": 0.2 * v} for m in metrics} for r, v in zip(RATIOS, means)}


def cls_quality_result() -> dict:
    """CLS merge: importance a decade below ToMe, both under 1e-2 (where symlog would be linear)."""
    return {"task": "cls", "mode": "merge", "layers": [1], "ratios": RATIOS, "seeds": 1, "tables": {"merge": {
        "importance": _cells([2e-4, 6e-4, 2e-3]), "tome_score": _cells([2e-3, 6e-3, 2e-2]),
        "random": _cells([5e-2, 0.3, 1.5])}}}


def depth_quality_result() -> dict:
    """Dense prune with and without LLF, one error exactly 0 (drawn at the floor, not a fake zero)."""
    metrics = ("silog_x100", "cosine_x100")
    return {"task": "depth", "mode": "prune", "layers": [2, 4], "ratios": RATIOS, "seeds": 1, "tables": {
        "llf": {"importance": _cells([0.0, 1e-3, 4e-3], metrics), "tome_score": _cells([1e-3, 5e-3, 2e-2], metrics)},
        "no_llf": {"importance": _cells([1e-2, 0.1, 0.5], metrics), "tome_score": _cells([0.05, 0.4, 2.0], metrics)}}}


def spectra_energies() -> dict:
    """Mean σ_j²/T per decoder and layer; the depth spectrum spans less than one decade."""
    j = torch.arange(1, 11, dtype=torch.float64)
    return {"embedding": {1: 0.5 * j ** -3.0, 3: 0.3 * j ** -2.0},
            "depth": {1: 0.12 - 0.005 * j, 3: 0.11 - 0.004 * j}}


def pareto_result() -> dict:
    points = [{"row": row, "knob": {"r": k}, "eta": 0.1 * k, "options": {"strategy": row},
               "cost": {"speedup_batch16": 1 + 0.2 * k, "flop_ratio": 1 + 0.25 * k},
               "error": {"mean": scale * k ** 2 if k else 0.0, "median": scale * k, "p95": 2 * scale * k ** 2, "worst": 3 * scale * k ** 2}}
              for row, scale in (("tome", 1e-3), ("importance", 1e-4)) for k in range(4)]
    return {"rows": ["tome", "importance"], "points": points, "batches": [1, 16], "metric": "cosine_x100",
            "model": "demo", "task": "cls", "images": "builtin:scenes"}


def bench_result() -> dict:
    rows = [{"op": "fused_merge", "shape": "8x197x192", "speedup_vs_eager": 3.0, "speedup_vs_compiled": 1.4},
            {"op": "jvp_block", "shape": "8x197x192", "speedup_vs_eager": 250.0, "speedup_vs_compiled": None},
            {"op": "qr", "shape": "64x20", "speedup_vs_eager": 0.8, "speedup_vs_compiled": 0.5}]
    return {"rows": rows, "device": "cpu", "threads": 2}


def _quality(result):
    from pullback_ext.comparison.report import quality_figure

    return quality_figure(result)


def _spectra():
    from pullback_ext.demo.diagnostic_stage import spectra_figure

    return spectra_figure(spectra_energies())


def _importance():
    from pullback_ext.demo.diagnostic_stage import importance_figure

    g = torch.Generator().manual_seed(0)
    maps = {("embedding", 1): torch.rand(2, 4, 4, generator=g), ("depth", 3): torch.rand(2, 4, 4, generator=g) * 1e-3}
    return importance_figure(torch.rand(2, 3, 16, 16, generator=g), maps)


def _spectrum():
    sigmas = [torch.tensor([3.0, 1.0, 0.1, 0.01, 0.0]), torch.tensor([2.0, 0.8, 0.2, 0.02, 0.001])]
    return spectrum_figure(sigmas, [10.5, 5.0])


def _token_energy():
    g = torch.Generator().manual_seed(1)
    return token_energy_figure([torch.rand(17, generator=g), torch.ones(17)], num_prefix_tokens=1)


def _training():
    from pullback_ext.metric.training_run import training_figure

    rows = [{"step": s, "loss": 2.0 * 0.9 ** s} for s in range(0, 100, 10)]
    return training_figure(rows, rho=[0.8, 0.85, 0.9, 0.7])


def _pareto():
    from pullback_ext.comparison.pareto_report import figure

    return figure(pareto_result())


def _bench():
    from pullback_ext.bench.report import speedup_figure

    return speedup_figure(bench_result())


FIGURES = {"quality_cls": lambda: _quality(cls_quality_result()), "quality_depth": lambda: _quality(depth_quality_result()),
           "spectra": _spectra, "importance": _importance, "spectrum": _spectrum, "token_energy": _token_energy,
           "training": _training, "pareto": _pareto, "bench": _bench}


# ---------- the checks ---------------------------------------------------------------------------

def _is_colorbar(ax) -> bool:
    return hasattr(ax, "_colorbar")


def _data_lines(ax) -> list[Line2D]:
    """Lines drawn in data coordinates (axhline / axvline live partly in axes coordinates)."""
    return [line for line in ax.lines if line.get_transform() == ax.transData]


def _series_values(ax, which: str) -> np.ndarray:
    parts = [np.asarray(line.get_ydata() if which == "y" else line.get_xdata(), dtype=float) for line in _data_lines(ax)]
    parts += [c.get_offsets()[:, 1 if which == "y" else 0] for c in ax.collections if isinstance(c, PathCollection)]
    parts += [np.asarray(b.datavalues, dtype=float) for b in ax.containers
              if isinstance(b, BarContainer) and (b.orientation == "vertical") == (which == "y")]
    return np.concatenate([p.ravel() for p in parts]) if parts else np.zeros(0)


def _twin_has_label(ax, which: str) -> bool:
    shared = ax.get_shared_x_axes() if which == "x" else ax.get_shared_y_axes()
    return any((o.get_xlabel() if which == "x" else o.get_ylabel()) for o in shared.get_siblings(ax) if o is not ax)


def _axis_problems(ax, which: str) -> list[str]:
    axis = ax.xaxis if which == "x" else ax.yaxis
    label = ax.get_xlabel() if which == "x" else ax.get_ylabel()
    problems = [] if label or _twin_has_label(ax, which) else [f"{which} axis without a label"]
    low, high = sorted(ax.get_xlim() if which == "x" else ax.get_ylim())
    inside = [t for t, loc in zip(axis.get_majorticklabels(), axis.get_majorticklocs())
              if low - 1e-12 * abs(low) <= loc <= high + 1e-12 * abs(high) and t.get_text().strip()]
    if len(inside) < 2:
        problems.append(f"{which} axis has {len(inside)} labelled major tick(s) inside its limits")
    if "0" in [t.get_text().replace("$", "").replace("\\mathdefault{", "").rstrip("}") for t in inside] and \
            (ax.get_xscale() if which == "x" else ax.get_yscale()) != "linear":
        problems.append(f"{which} axis: a non-linear axis labels a tick 0")
    values = _series_values(ax, which)
    scale = ax.get_xscale() if which == "x" else ax.get_yscale()
    if spans_decades(values) and scale != "log":
        problems.append(f"{which} axis is {scale} but the data span {math.log10(values[values > 0].max() / values[values > 0].min()):.1f} decades")
    return problems


def _series_problems(ax) -> list[str]:
    problems = []
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    series = [(line.get_label(), np.column_stack([line.get_xdata(), line.get_ydata()]).astype(float)) for line in _data_lines(ax)]
    series += [(c.get_label(), np.asarray(c.get_offsets(), dtype=float)) for c in ax.collections if isinstance(c, PathCollection)]
    for name, xy in series:
        if xy.size == 0 or not np.isfinite(xy).all():
            problems.append(f"series {name!r} is empty or not finite")
        elif not ((xy[:, 0] >= x0 - 1e-9 * abs(x0)) & (xy[:, 0] <= x1 + 1e-9 * abs(x1)) &
                  (xy[:, 1] >= y0 - 1e-9 * abs(y0)) & (xy[:, 1] <= y1 + 1e-9 * abs(y1))).all():
            problems.append(f"series {name!r} has points outside the axis limits")
    return problems


def _style(handle) -> tuple:
    if isinstance(handle, Line2D):
        return to_hex(handle.get_color()), handle.get_linestyle(), handle.get_marker()
    if isinstance(handle, Patch):
        return to_hex(handle.get_facecolor()), handle.get_hatch()
    return (type(handle).__name__,)


def _legend_problems(fig) -> list[str]:
    problems = []
    data_axes = [ax for ax in fig.axes if ax.axison and not _is_colorbar(ax)]
    renderer = fig.canvas.get_renderer()
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None] + [(None, leg) for leg in fig.legends]
    for ax, legend in legends:
        styles = [_style(h) for h in legend.legend_handles]
        if len(set(styles)) < len(styles):
            problems.append(f"legend entries share a style: {[t.get_text() for t in legend.get_texts()]}")
        box = legend.get_window_extent(renderer)
        if ax is None and any(box.overlaps(a.get_window_extent(renderer)) for a in data_axes):
            problems.append("a figure legend overlaps a panel")
        if ax is not None and legend._loc != 0 and box.overlaps(ax.get_window_extent(renderer)):
            problems.append("a panel legend at a fixed place inside the data")
    return problems


def figure_problems(fig) -> list[str]:
    """Every rule the figure breaks (empty: none)."""
    fig.canvas.draw()
    problems = []
    scales = [ax._colorbar.mappable.norm for ax in fig.axes if _is_colorbar(ax)]
    for ax in fig.axes:
        if _is_colorbar(ax):
            continue
        problems += [f"image without a colorbar in {ax.get_title()!r}" for im in ax.images
                     if im.get_array().ndim == 2 and not any(im.norm is norm for norm in scales)]
        if not ax.axison:
            continue
        problems += _axis_problems(ax, "x") + _axis_problems(ax, "y") + _series_problems(ax)
    return problems + _legend_problems(fig)


def decade_gap_problems(fig, low: str = "importance — ours", high: str = "tome_score") -> list[str]:
    """Where ``low`` and ``high`` differ by a decade or more in data, their drawn y positions must
    be a decade apart on the panel's own scale (the display height of y = 1 … 10)."""
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in _data_lines(ax)}
    a, b = lines[low], lines[high]
    one_decade = abs(np.diff(ax.transData.transform([(0.0, 1.0), (0.0, 10.0)])[:, 1]))[0]
    problems = []
    for x, ya, yb in zip(a.get_xdata(), a.get_ydata(), b.get_ydata()):
        if ya > 0 and yb > 0 and abs(math.log10(yb / ya)) >= 1:
            gap = abs(np.diff(ax.transData.transform([(x, ya), (x, yb)])[:, 1]))[0]
            if gap < one_decade * (1 - 1e-6):
                problems.append(f"η={x}: {low} {ya:.1e} and {high} {yb:.1e} drawn {gap / one_decade:.2f} decades apart")
    return problems


# ---------- the tests ----------------------------------------------------------------------------

@contextlib.contextmanager
def opened(build):
    """The figure ``build()`` makes, closed afterwards whatever the test found."""
    fig = build()
    try:
        yield fig
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", list(FIGURES))
def test_the_figure_follows_the_rules(name):
    with opened(FIGURES[name]) as fig:
        assert figure_problems(fig) == []


def test_importance_and_tome_a_decade_apart_are_drawn_a_decade_apart():
    with opened(lambda: _quality(cls_quality_result())) as fig:
        assert fig.axes[0].get_yscale() == "log"
        assert decade_gap_problems(fig) == []


def test_zero_errors_are_drawn_at_a_stated_floor():
    with opened(lambda: _quality(depth_quality_result())) as fig:
        ax = fig.axes[0]
        floor_marks = [line for line in _data_lines(ax) if line.get_marker() == "v" and line.get_linestyle() == "None"]
        assert floor_marks and all(np.all(np.asarray(line.get_ydata()) > 0) for line in floor_marks)
        assert any("drawn at" in t.get_text() for t in ax.texts)


def _symlog(fig):
    for ax in fig.axes:
        if ax.axison and not _is_colorbar(ax):
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.set_ylim(0, None)


def _one_style(fig):
    for line in fig.axes[0].lines:
        line.set_linestyle("-")
        line.set_marker("o")
    handles, labels = fig.axes[0].get_legend_handles_labels()
    for legend in fig.legends:
        legend.remove()
    fig.legend(handles, labels, loc="outside right upper")


def _no_colorbar(fig):
    for ax in list(fig.axes):
        if _is_colorbar(ax):
            ax.remove()


BROKEN = {"symlog_quality": (lambda: _quality(cls_quality_result()), _symlog),
          "symlog_depth": (lambda: _quality(depth_quality_result()), _symlog),
          "one_style_for_llf_and_no_llf": (lambda: _quality(depth_quality_result()), _one_style),
          "heatmap_without_colorbar": (_importance, _no_colorbar)}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_figure_fails_the_checks(name):
    build, break_it = BROKEN[name]
    with opened(build) as fig:
        break_it(fig)
        problems = figure_problems(fig) + (decade_gap_problems(fig) if name == "symlog_quality" else [])
        assert problems, f"{name}: the checks did not notice"


@pytest.mark.parametrize("name", ["token_energy", "importance"])
def test_no_panel_or_colorbar_runs_into_another(name):
    """Rendered, the boxes of the panels and colorbars (their labels and ticks included) are
    disjoint: a colorbar's label does not overlap the next panel."""
    fig = FIGURES[name]()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible() and (ax.images or _is_colorbar(ax))]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap_w = min(a.x1, b.x1) - max(a.x0, b.x0)
            overlap_h = min(a.y1, b.y1) - max(a.y0, b.y0)
            assert overlap_w <= 1 or overlap_h <= 1, f"{name}: boxes {a} and {b} overlap"
    pyplot().close(fig)


def test_the_figures_name_what_the_tables_name():
    """importance.png heads its columns as the demo's table names the decoders; token_energy.png
    explains its 'prefix share'."""
    from pullback_ext.demo.diagnostic_stage import DECODER_LABELS

    fig = _importance()
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert any(title.startswith(DECODER_LABELS["embedding"]) for title in titles), titles
    assert not any(title.startswith("embedding") for title in titles), titles
    pyplot().close(fig)
    fig = _token_energy()
    assert "prefix share: the part of Σ_t e_t on the prefix tokens" in fig.get_suptitle()
    pyplot().close(fig)


def _lines_by_label(fig) -> dict:
    return {line.get_label(): line for ax in fig.axes for line in ax.lines if not line.get_label().startswith("_")}


def test_every_quality_figure_draws_a_method_in_its_one_colour_and_marks_ours():
    """One colour table (the registry's order) for every figure: importance and tome_score keep
    their colours from the CLS plot to the depth plot; rows of ours say so and are starred."""
    from pullback_ext.comparison.report import method_colours
    from pullback_ext.prune.methods import all_methods

    colours = method_colours()
    assert list(colours) == [m.name for m in all_methods()]
    assert len({to_hex(c) for c in colours.values()}) == len(colours)
    strong = {to_hex(c) for name in ("tab10", "Dark2") for c in matplotlib.colormaps[name].colors}
    assert all(to_hex(colours[m.name]) in strong for m in all_methods() if m.ours or m.kind == "original")
    seen: dict = {}
    for build in (cls_quality_result, depth_quality_result):
        with opened(lambda: _quality(build())) as fig:
            for label, line in _lines_by_label(fig).items():
                method = label.split(" ")[0]
                assert to_hex(line.get_color()) == to_hex(colours[method]), label
                seen.setdefault(method, set()).add(to_hex(line.get_color()))
                assert ("— ours" in label) == (method in {m.name for m in all_methods() if m.ours}), label
                assert ("— ours" in label) == (line.get_marker() == "*"), label
    assert all(len(c) == 1 for c in seen.values()) and {"importance", "tome_score"} <= set(seen)


def test_the_pareto_figure_draws_a_row_in_its_methods_colour_and_tells_rows_of_one_method_apart():
    from pullback_ext.comparison.report import method_colours

    result = pareto_result()
    twin = [dict(p, row="importance (lowest)", options={"strategy": "importance"},
                 error={k: 2 * v if k != "worst_image" else v for k, v in p["error"].items()})
            for p in result["points"] if p["row"] == "importance"]
    result = dict(result, rows=[*result["rows"], "importance (lowest)"], points=[*result["points"], *twin])
    colours = method_colours()
    with opened(lambda: figure_of(result)) as fig:
        lines = _lines_by_label(fig)
        assert {label: to_hex(line.get_color()) for label, line in lines.items()} == {
            "tome": to_hex(colours["tome"]), "importance": to_hex(colours["importance"]),
            "importance (lowest)": to_hex(colours["importance"])}
        assert lines["importance"].get_marker() != lines["importance (lowest)"].get_marker()
        assert lines["importance"].get_linewidth() > lines["tome"].get_linewidth()  # ours is drawn thicker


def figure_of(result):
    from pullback_ext.comparison.pareto_report import figure

    return figure(result)


def test_the_quality_figure_has_cost_on_x_and_names_the_output_on_y():
    result = depth_quality_result()
    result["flop_ratio"] = {key: {row: {f"{r:g}": 1 / (1 - r) for r in RATIOS} for row in table} for key, table in result["tables"].items()}
    with opened(lambda: _quality(result)) as fig:
        panels = [ax for ax in fig.axes if ax.lines]
        assert all("FLOP ratio" in ax.get_xlabel() for ax in panels)
        assert [ax.get_ylabel() for ax in panels] == ["added SILog ×100 of the depth map", "100·(1 − cos) of the CLS embedding"]
        xs = [x for line in panels[0].lines if not line.get_label().startswith("_") for x in line.get_xdata()]
        assert min(xs) == pytest.approx(1 / 0.9) and max(xs) == pytest.approx(2.0)


def test_a_row_identical_to_another_is_drawn_once_and_the_legend_says_so():
    result = depth_quality_result()
    result["tables"]["no_llf"]["tome_score"] = result["tables"]["llf"]["tome_score"]
    with opened(lambda: _quality(result)) as fig:
        labels = list(_lines_by_label(fig))
        assert "tome_score (= tome_score (no LLF), drawn once)" in labels and "tome_score (no LLF)" not in labels


def test_bands_are_drawn_and_explained_only_with_several_seeds():
    result = cls_quality_result()
    with opened(lambda: _quality(result)) as fig:
        assert not fig.axes[0].collections and not any("band" in t.get_text() for lg in fig.legends for t in lg.get_texts())
    result["seeds"] = 3
    with opened(lambda: _quality(result)) as fig:
        assert fig.axes[0].collections
        assert any("band: ± std of the mean across 3 seeds (where it stays > 0)" in t.get_text() for lg in fig.legends for t in lg.get_texts())
