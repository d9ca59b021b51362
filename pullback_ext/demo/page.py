"""The generated page of a demo run (``pullback demo --results-page``, ``docs/results/demo-run.md``):
what the run printed that a reader wants to look up, rendered from its ``results.json`` content.

The page holds the model's held-out quality, each stage's time against the plan, the importance
heads' held-out ρ, the diagnostic table, each decoder's headline (ours against the original ToMe at matched FLOP ratio, with the
measured speed-up; the decoders of the task table the run had) and the summary's verdicts, which name
each decoder's picture of the merges in the run's folder; the JSON beside it holds every number of the run.
"""

from __future__ import annotations

from pullback_ext.demo.headline import TASK_LABELS, headline_table
from pullback_ext.demo.summary import diagnostic_lines, headline_lines
from pullback_ext.results_pages import markdown_table

PAGE = "demo-run"
TITLE = "The demo model: `pullback demo`"


def _stage_rows(results: dict, expected: dict) -> list:
    rows = []
    for name, entry in results["stages"].items():
        status = entry["status"] if entry["status"] == "ok" else f"failed: {entry['error']}"
        rows.append((name, status, f"{entry['seconds']:.0f}", f"{expected.get(name, float('nan')):.0f}"))
    return rows


def render(results: dict) -> str:
    """Markdown of a demo run's ``results`` (the content of its results.json, stamped)."""
    from pullback_ext.demo.pipeline import STAGES, quality_text

    quick = results["quick"]
    quality = results["model"]["this_run"]
    expected = {stage.NAME: stage.EXPECTED_S[quick] for stage in STAGES}
    parts = [f"`pullback demo{' --quick' if quick else ''}` on {results['scenes']['num_images']} held-out scenes "
             f"(`{results['scenes']['source']}`, seed {results['scenes']['seed']}); the whole run took "
             f"{results['seconds']:.0f} s. The demo model there: {quality_text(quality)}.",
             "## Stages\n\n" + markdown_table(("stage", "status", "seconds", "expected on an idle 2-core machine (s)"),
                                               _stage_rows(results, expected))]
    stages = results["stages"]
    if stages.get("importance_head", {}).get("status") == "ok":
        heads = stages["importance_head"]["result"]
        parts.append("## Importance heads\n\n" + markdown_table(
            ("decoder", "head", "block", "parameters", "held-out Spearman ρ against imp* (mean ± std over images)"),
            [(TASK_LABELS.get(task, task), head["origin"], head["layer"], head["parameters"],
              f"{head['spearman']['mean']:.3f} ± {head['spearman']['std']:.3f} ({head['spearman']['count']} images)")
             for task, head in heads.items()]))
    if stages.get("diagnostic", {}).get("status") == "ok":
        parts.append("## Diagnostic\n\n```\n" + stages["diagnostic"]["result"]["table_text"].rstrip() + "\n```\n\n"
                     + "\n".join(line.strip() for line in diagnostic_lines(stages["diagnostic"]["result"]["table"])))
    if stages.get("pruning", {}).get("status") == "ok":
        pruning = stages["pruning"]["result"]
        parts.append("## Ours against the original ToMe at matched FLOP ratio\n\n"
                     + "\n".join(headline_table(pruning[task]["headline"], title) for task, title in TASK_LABELS.items()
                                 if task in pruning)
                     + "\nAs the run's summary says it:\n\n```\n" + "\n".join(headline_lines(pruning)) + "\n```")
    return "\n\n".join(parts)
