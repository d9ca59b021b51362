"""The op benchmark's outputs: the printed table, the JSON file and a speed-up plot."""

from __future__ import annotations

import os

from pullback_ext.bench.kernel_breakdown import Breakdown
from pullback_ext.fileio import atomic_write_json
from pullback_ext.plots import save_figure


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


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['op']}\n{r['shape']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["speedup_vs_eager"] for r in rows], height=0.4, label="vs eager")
    ax.barh([y + 0.2 for y in ys], [r["speedup_vs_compiled"] or 0 for r in rows], height=0.4, label="vs torch.compile")
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys), labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up of the fused op")
    ax.set_title(f"pullback_ext ops on {result['device']} ({result['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
