"""The plain-language summary ``pullback demo`` ends with, read from its ``results.json`` content:
what the diagnostic found per decoder (regime, κ_cap) and the method it recommends (the
diagnosis's own recommendation, as ``pullback diagnose`` prints it), the importance head's gain
against the baselines at one operating point of the CLS merge, and where the files are."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path

from pullback_ext.demo.diagnostic_stage import DECODER_LABELS

FILES = (("results.json", "every number of this run"), ("spectra.png, importance.png", "the diagnostic's spectra and imp* maps"),
         ("importance_head/", "the trained importance head"),
         ("pruning/cls/, pruning/depth/", "table.md and quality.png of the strategy comparison"),
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
        for (regime, name, method), same in groupby(mine, key=lambda r: (r["regime"], r["regime_name"], r["recommended"])):
            layers = [str(r["layer"]) for r in same]
            where = "" if len(layers) == len(mine) else f"layer{'s' if len(layers) > 1 else ''} {', '.join(layers)}: "
            verdicts.append(f"{where}regime ({regime}) {name}; recommended: {method}")
        lines.append(f"  {DECODER_LABELS.get(decoder, decoder)}: {kappas}. " + " | ".join(verdicts))
    return lines


def _times(ratio: float) -> str:
    return f"{ratio:.1f}×" if ratio < 100 else f"{ratio:,.0f}×"


def gain_line(cls: dict) -> str:
    """The importance head's CLS merge error against the training-free baselines at the middle
    ratio of ``cls`` (the pruning stage's CLS result)."""
    ratios, table = cls["ratios"], cls["tables"]["merge"]
    ratio = f"{ratios[len(ratios) // 2]:g}"
    error = {s: cells[ratio]["cosine_x100"]["mean"] for s, cells in table.items()}
    baselines = sorted((v, s) for s, v in error.items() if s != "importance")
    listed = ", ".join(f"{s} {v:.2g}" for v, s in baselines)
    point = f"CLS soft merge of η = {ratio} of the tokens at block {cls['layers'][0]}, cosine distance ×100 (lower is better)"
    if "importance" not in error:
        return f"  {point}: no importance head ran; the baselines: {listed}"
    mine, (best, name) = error["importance"], baselines[0]
    verdict = f"{_times(best / mine)} lower than" if mine < best else f"{_times(mine / best)} higher than" if mine > best else "equal to"
    return f"  {point}: importance head {mine:.2g}, {verdict} the best baseline ({name} {best:.2g}); all baselines: {listed}"


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
    lines.append("Measured gain:")
    lines += _missing(stages, "pruning") or [gain_line(stages["pruning"]["result"]["cls"])]
    lines.append(f"Files in {out_dir}:")
    lines += [f"  {name:<30} {what}" for name, what in FILES]
    return "\n".join(lines)
