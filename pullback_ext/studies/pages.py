"""The studies' Markdown: the tables of DIR/table.md and of the generated results pages."""

from __future__ import annotations

from typing import Optional

from pullback_ext.results_pages import format_number, markdown_table
from pullback_ext.studies import diagnose_study


PER_TOKEN = ("token_energy", "importance")  # [N] per image and decoder: in DIR/study.json, not on the pages


def published(result: dict) -> dict:
    """``result`` for a results page: every per-image figure, without the per-token arrays of the
    diagnose study (they stay in ``DIR/study.json``; on the pages they would be megabytes)."""
    if result["kind"] != "diagnose":
        return result
    units = {layer: {decoder: dict(d, images=[{k: v for k, v in image.items() if k not in PER_TOKEN} for image in d["images"]])
                     for decoder, d in unit.items()} for layer, unit in result["units"].items()}
    return dict(result, units=units, per_token_arrays=f"left out here: {', '.join(PER_TOKEN)} per image are in the command's study.json")


def render(result: dict, picture: Optional[str] = None) -> str:
    """The study's tables (and the figure ``picture``, a file next to the page, when given)."""
    body = {"diagnose": _diagnose, "subspace": _subspace, "criteria": _criteria}[result["kind"]](result)
    return (f"![{result['kind']} study]({picture})\n\n" if picture else "") + body


def _diagnose(result: dict) -> str:
    return (f"Model `{result['model']}`, images `{result['images']}` ({len(result['files'])}), mean ± std over images.\n\n"
            + diagnose_study.table(result))


def _subspace(result: dict) -> str:
    parts = []
    for name, study in result["models"].items():
        s = study["summary"]
        parts.append(f"**{name}** ({study['quality_name']}): quality peaks at layer {s['peak_layer']} "
                     f"({format_number(s['peak_quality'])}).\n")
        rows = []
        for layer in study["layers"]:
            unit = study["units"][str(layer)]
            cells = [f"{format_number(q)} / {format_number(c)} / {format_number(r)}"
                     for q, c, r in zip(*(unit["curves"][kind] for kind in ("subspace", "complement", "random")))]
            rows.append((layer, unit["rank"], unit["quality"], unit["k95"], "; ".join(f"k={k}: {c}" for k, c in zip(unit["ks"], cells))))
        parts.append(markdown_table(["layer", "rank(W)", "quality", "k95", "top-k / complement / random"], rows))
    return "\n\n".join(parts)


def _criteria(result: dict) -> str:
    s = result["summary"]
    parts = []
    for task, t in s["tasks"].items():
        rows = [(c, *t["matrix"][i], t["mean"][c], t["ranking"].index(c) + 1) for i, c in enumerate(result["criteria"])]
        parts.append(f"**{task}**: {t['metric']} against the unpruned model, ratio {result['settings']['ratio']:g}, "
                     f"one stage after block ℓ\n\n"
                     + markdown_table(["criterion", *(f"ℓ={layer}" for layer in s["layers"]), "mean", "rank"], rows))
    if "kendall_tau" in s:
        tau = s["kendall_tau"]
        parts.append(f"Kendall τ between the {' and '.join(tau['tasks'])} rankings: {format_number(tau['tau'])} "
                     f"(p = {format_number(tau['p_value'])}).")
    if "recovery" in s:
        alphas = list(next(iter(s["recovery"].values()))["silog_x100"])
        rows = [(c, *(r["silog_x100"][a] for a in alphas), r["preferred"]) for c, r in s["recovery"].items()]
        parts.append("**depth recovery endpoints** (SILog ×100, mean over layers; α = 1 is the frozen copy)\n\n"
                     + markdown_table(["criterion", *(f"α={a}" for a in alphas), "preferred α"], rows))
    return "\n\n".join(parts)
