"""The plain-language summary ``pullback demo`` ends with, read from its ``results.json`` content:
what the diagnostic found per decoder (regime, κ_cap), per decoder our method against the
original ToMe at matched FLOP ratio with the measured speed-up, and the recommendation: the
measured winner (:func:`pullback_ext.demo.headline.winner`), and where the files are (the
pictures of the merges per decoder among them)."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

from pullback_ext.demo.diagnostic_stage import DECODER_LABELS
from pullback_ext.demo.headline import TASK_LABELS, speed, verdict

DECODERS = ", ".join(f"pruning/{task}/" for task in TASK_LABELS)
FILES = (("results.json", "every number of this run"), ("spectra.png, importance.png", "the diagnostic's spectra and imp* maps"),
         ("importance_head/", "importance heads trained in this run (none when the shipped ones fit)"),
         (DECODERS, "per decoder: table.md and quality.png of the strategy comparison, and merges.png: what ToMe and ours "
                    "merged at matched cost on a held-out scene"),
         ("pruning/subspace.json", "the linear depth probe's subspace analysis"))


def _joined(values) -> str:
    return " / ".join(values)


def diagnostic_lines(rows: list[dict]) -> list[str]:
    """One line per decoder of the diagnostic table ``rows``: κ_cap per layer, then each run of
    layers with the same regime and recommendation."""
    lines = []
    for decoder, mine in groupby(rows, key=lambda r: r["decoder"]):
        mine = list(mine)
        kappas = f"κ_cap {_joined(format(r['kappa_cap'], '.2f') for r in mine)} at layers {_joined(str(r['layer']) for r in mine)}"
        verdicts = []
        for (regime, name), same in groupby(mine, key=lambda r: (r["regime"], r["regime_name"])):
            layers = [str(r["layer"]) for r in same]
            where = "" if len(layers) == len(mine) else f"layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: "
            verdicts.append(f"{where}regime ({regime}) {name}")
        lines.append(f"  {DECODER_LABELS.get(decoder, decoder)}: {kappas}. " + " | ".join(verdicts))
    return lines


def headline_lines(pruning: dict) -> list[str]:
    """Per decoder of the pruning stage's result (the tasks it ran, in the task table's order): ours
    against the original ToMe at its largest ``r``'s cost (error, FLOP ratio, measured speed-up:
    median and 90% interval), then the measured winner."""
    lines = []
    for task, label in TASK_LABELS.items():
        if task not in pruning:
            continue
        result = pruning[task]["headline"]
        top = max(row["knob"]["tome_r"] for row in result["rows"])
        cells = [f"{row['row']}{' (ours)' if row['ours'] else ''} {row['error']['mean']:.3g} at FLOP ratio {row['flop_ratio']:.2f}, "
                 f"{speed(row)}"
                 for row in result["rows"] if row["knob"]["tome_r"] == top]
        lines.append(f"  {label}, {result['metric']} at the cost of ToMe r = {top} (speed-up at batch {result['batch']}: median of "
                     f"{result['repeats']} rounds (90% interval)): " + "; ".join(cells))
        lines.append(f"    recommended for {label} (measured winner): {verdict(result)}")
        if "figure" in result:
            lines.append(f"    what each merged on held-out scene {result['figure']['scene']}: {result['figure']['file']}")
    return lines


def _missing(stages: dict, name: str) -> list[str]:
    """Why the stage ``name`` has nothing to summarise (empty: it ran)."""
    entry = stages.get(name)
    if entry is None:
        return [f"  (the {name} stage did not run)"]
    return [] if entry["status"] == "ok" else [f"  (the {name} stage failed: {entry['error']})"]


def summary(results: dict, out_dir: Path) -> str:
    """The closing summary of a demo run (``results``: the content of its results.json)."""
    stages = results["stages"]
    lines = ["", "Summary", "What the diagnostic found:"]
    lines += _missing(stages, "diagnostic") or diagnostic_lines(stages["diagnostic"]["result"]["table"])
    lines.append("Ours against the original ToMe at matched FLOP ratio, and the recommendation:")
    lines += _missing(stages, "pruning") or headline_lines(stages["pruning"]["result"])
    lines.append(f"Files in {out_dir}:")
    lines += [f"  {name:<30} {what}" for name, what in FILES]
    return "\n".join(lines)
