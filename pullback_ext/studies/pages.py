"""The studies' Markdown: the tables of DIR/table.md and of the generated results pages."""

from __future__ import annotations

from typing import Optional

from pullback_ext.comparison.tasks import get as get_task
from pullback_ext.results_pages import format_number, markdown_table
from pullback_ext.studies import criteria_study, diagnose_study


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
    if s["kendall_tau"]:
        rows = [(" / ".join(pair["tasks"]), pair["tau"], pair["p_value"], " ".join(format_number(v) for v in pair["per_layer"]),
                 " / ".join(pair["best"]), "agree" if pair["agree"] else "differ") for pair in s["kendall_tau"]]
        parts.append(f"**Do the tasks rank the criteria alike?** Kendall τ between two tasks' criteria, of their mean errors "
                     f"(with its p-value) and at each layer ℓ = {', '.join(map(str, s['layers']))}; the rankings agree at "
                     f"τ ≥ {criteria_study.AGREE_TAU:g}\n\n"
                     + markdown_table(["tasks", "τ (means)", "p", "τ per layer", "best criteria", "rankings"], rows))
    for task, r in s.get("recovery", {}).items():
        alphas = list(next(iter(r["criteria"].values()))["mean"])
        rows = [(c, *(e["mean"][a] for a in alphas), e["preferred"]) for c, e in r["criteria"].items()]
        parts.append(f"**{task} recovery endpoints** ({r['metric']}, mean over layers; α = 1 is the frozen copy)\n\n"
                     + markdown_table(["criterion", *(f"α={a}" for a in alphas), "preferred α"], rows))
    seed = _against_seed_003(s)
    if seed:
        parts.append("**Against seed 003 (TAP's probes)**\n\n" + seed)
    return "\n\n".join(parts)


def _against_seed_003(s: dict) -> str:
    """One line per finding of seed 003 the study can look at, from ``s["seed_003"]``."""
    found, lines = s["seed_003"], []
    pairs = [p for p in s["kendall_tau"] if "segmentation" in p["tasks"]]
    other = [task for task in s["tasks"] if task != "segmentation" and get_task(task).dense]
    where = (f"there is no detection here; the other dense task is {', '.join(other)}" if pairs and other else
             "there is no detection here" if pairs else "this run has neither task; its pairs of tasks instead")
    if s["kendall_tau"]:
        said = "; ".join(f"{' and '.join(p['tasks'])} {'agree' if p['agree'] else 'differ'} (τ = {format_number(p['tau'])}, "
                         f"p = {format_number(p['p_value'])}, best {' / '.join(p['best'])})" for p in pairs or s["kendall_tau"])
        lines.append(f"- *Segmentation and detection rank the criteria differently* ({where}): {said}.")
    if "attention" in found:
        a = found["attention"]
        early = ", ".join(map(str, a["early_layers"]))
        cells = []
        for c in a["criteria"]:
            ratios = ", ".join(f"{task} {format_number(r[c]['early'])}" for task, r in a["ratio_to_random"].items())
            cls = a["ratio_to_random"]["cls"][c]
            verdict = {True: "holds", False: "does not hold", None: "not testable (no later layers)"}[a["cls_most_sensitive_early"][c]]
            cells.append(f"{c}: {verdict} (error over random's at ℓ = {early}: {ratios}; cls after them "
                         f"{format_number(cls['later'])})")
        lines.append(f"- *Classification is especially sensitive to attention-based pruning in the earliest layers*: "
                     + "; ".join(cells) + ".")
    if "endpoints" in found:
        e = found["endpoints"]
        prefs = "; ".join(f"{c} " + " / ".join(by_task.values())
                          for c, by_task in e["preferred"].items())
        lines.append(f"- *The dense tasks prefer opposite recovery endpoints*: {' and '.join(e['tasks'])} prefer opposite "
                     f"ends of the α range under {len(e['opposite'])} of {len(e['preferred'])} criteria"
                     f"{' (' + ', '.join(e['opposite']) + ')' if e['opposite'] else ''}; preferred α ({' / '.join(e['tasks'])}): "
                     f"{prefs}.")
    return "\n".join(lines)
