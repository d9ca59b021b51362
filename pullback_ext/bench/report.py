"""The op benchmark's outputs: the printed table, the JSON file and a speed-up plot."""

from __future__ import annotations

import os

import numpy as np

from pullback_ext.bench.kernel_breakdown import Breakdown
from pullback_ext.fileio import atomic_write_json
from pullback_ext.plots import decade_limits, pyplot, save_figure, spans_decades


def format_table(result: dict) -> str:
    """The printed table: one line per case."""
    unchecked = any(r.get("unchecked_ms") is not None for r in result["rows"])
    head = (f"{'op':<24} {'shape':<30} {'fused ms':>9} {'eager ms':>9} {'compile ms':>10} "
            f"{'x eager':>8} {'x compile':>9} {'GB/s':>7} {'% read bw':>9} {'fresh out ms':>12}"
            + (f" {'unchecked ms':>12} {'% read bw':>9}" if unchecked else ""))
    lines = [f"device {result['device']} ({result['device_name']}), {result['threads']} threads, "
             f"read bandwidth {result['read_bandwidth_gbps']:.1f} GB/s"
             + (f" (copy {result['copy_bandwidth_gbps']:.1f} GB/s)" if result.get("copy_bandwidth_gbps") else "")
             + ", kernels: "
             f"{'compiled' if result['compiled_ops'] else 'reference fallback'} (cpu isa {result['cpu_isa']})",
             head, "-" * len(head)]
    for r in result["rows"]:
        comp = f"{r['compiled_ms']:10.3f}" if r["compiled_ms"] is not None else f"{'-':>10}"
        xcomp = f"{r['speedup_vs_compiled']:9.2f}" if r["speedup_vs_compiled"] is not None else f"{'-':>9}"
        note = "".join(f" {k}={v:.2e}" for k, v in r["extra"].items())
        lines.append(f"{r['op']:<24} {r['shape']:<30} {r['fused_ms']:9.3f} {r['eager_ms']:9.3f} {comp} "
                     f"{r['speedup_vs_eager']:8.2f} {xcomp} {r['effective_gbps']:7.1f} "
                     f"{100 * r['share_of_read_bandwidth']:8.0f}% "
                     + (f"{r['fresh_output_ms']:12.3f}" if r.get("fresh_output_ms") is not None else f"{'-':>12}")
                     + (f" {r['unchecked_ms']:12.3f} {100 * r['unchecked_share_of_read_bandwidth']:8.0f}%"
                        if r.get("unchecked_ms") is not None else f" {'-':>12} {'-':>9}" if unchecked else "")
                     + note)
    profiled = [r for r in result["rows"] if r.get("kernels")]
    if profiled:
        lines += ["", "unchecked calls profiled (medians, us): span = kernels + gaps; lead-in = dispatch after the marker"]
        lines += [f"{r['op']:<24} {r['shape']:<30} {Breakdown(**r['kernels']).describe()}" for r in profiled]
    return "\n".join(lines)


def write_outputs(result: dict, path: str) -> list[str]:
    """Atomically write the JSON to ``path`` and a speed-up bar plot next to it; returns the paths."""
    atomic_write_json(path, result)
    plot_path = os.path.splitext(path)[0] + ".png"
    _plot(result, plot_path)
    return [path, plot_path]


def speedup_figure(result: dict):
    """Bars of the fused ops' speed-up against eager and against torch.compile, one row per
    (op, shape); a missing torch.compile time is left out (with a note), not drawn as 0; log x when
    the speed-ups span two decades."""
    rows = result["rows"]
    fig, ax = pyplot().subplots(figsize=(8, 0.45 * len(rows) + 1.8), layout="constrained")
    ys = np.arange(len(rows))
    ax.barh(ys - 0.2, [r["speedup_vs_eager"] for r in rows], height=0.4, label="vs eager", color="tab:blue")
    compiled = [(y, r["speedup_vs_compiled"]) for y, r in zip(ys, rows) if r.get("speedup_vs_compiled")]
    if compiled:
        ax.barh([y + 0.2 for y, _ in compiled], [v for _, v in compiled], height=0.4, label="vs torch.compile",
                color="tab:orange", hatch="//")
    if len(compiled) < len(rows):
        ax.annotate(f"{len(rows) - len(compiled)} row(s) without a torch.compile time (no orange bar)", xy=(0.99, 0.01),
                    xycoords="axes fraction", ha="right", va="bottom", fontsize=7, color="dimgray")
    ax.axvline(1.0, color="k", lw=0.8)
    if spans_decades([r["speedup_vs_eager"] for r in rows] + [v for _, v in compiled]):
        ax.set_xscale("log")
        decade_limits(ax, "x")
    ax.set_yticks(list(ys), [f"{r['op']}\n{r['shape']}" for r in rows], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of the fused op (× faster; 1 = as fast)")
    ax.set_ylabel("op and shape")
    ax.set_title(f"pullback_ext ops on {result['device']} ({result['threads']} threads)")
    ax.legend(loc="best")
    return fig


def _plot(result: dict, path: str) -> None:
    save_figure(speedup_figure(result), path)
