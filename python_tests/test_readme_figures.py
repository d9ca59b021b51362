"""The README's headline figures are read from the generated results pages' JSON: every number the
README quotes from such a page is rebuilt here from the page's JSON, formatted as the README
writes it, so a quoted figure cannot drift from its page. Regenerating a page whose figures the
README quotes means updating the README in the same commit."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"


def figure(value: float) -> str:
    """An error as the README writes it: two significant figures below 0.1 (scientific with an
    unpadded exponent below 0.01: ``3.0e-4``), two decimals from 0.1 on."""
    if abs(value) < 0.01:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{value:.2g}" if abs(value) < 0.1 else f"{value:.2f}"


def speedup(value: float) -> str:
    return f"{value:.1f}×"


def _page(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _row(result: dict, prefix: str) -> str:
    (row,) = _rows(result, prefix)
    return row


def _rows(result: dict, prefix: str) -> list:
    return [r for r in result["rows"] if r.startswith(prefix)]


def _best(result: dict, axis: str, stat: str, rows: list, target: str):
    """The lowest matched ``stat`` error among ``rows`` at ``target`` on ``axis`` (a method's
    frontier over the rows of its settings), or None where none reaches it."""
    cells = [result["matched"][axis][stat][row][target] for row in rows]
    return min((c for c in cells if c is not None), key=lambda c: c["value"], default=None)


def _at_ratio(result: dict, rows: list, stat: str, target: float) -> float:
    """The lowest ``stat`` error among ``rows`` at FLOP ratio ``target``, read off the points as the page reads its cells."""
    from pullback_ext.comparison.pareto import matched_error

    found = []
    for row in rows:
        points = [p for p in result["points"] if p["row"] == row]
        cell = matched_error([p["cost"]["flop_ratio"] for p in points], [p["error"][stat] for p in points], target)
        found += [cell["value"]] if cell is not None else []
    return min(found)


def _split(result: dict) -> tuple[list, list]:
    """The page's rows of our methods (the registry's ``ours``) and every other row."""
    from pullback_ext.prune.methods import get

    strategy = {p["row"]: p["options"]["strategy"] for p in result["points"]}
    ours = [row for row in result["rows"] if get(strategy[row]).ours]
    return ours, [row for row in result["rows"] if row not in ours]


def _matched(result: dict, stat: str, rows: list, targets: list, names: bool = False) -> str:
    """``a / b / …``: the lowest matched ``stat`` at each FLOP-ratio target among ``rows`` (– where
    none reaches it); with ``names`` the method of that row instead."""
    cells = [_best(result, "flop_ratio", stat, rows, t) for t in targets]
    if not names:
        return " / ".join("–" if c is None else figure(c["value"]) for c in cells)
    table = result["matched"]["flop_ratio"][stat]
    return " / ".join("–" if c is None else next(r for r in rows if table[r][t] is c).split(" · ")[0]
                      for c, t in zip(cells, targets))


def _trails(result: dict, ours: list, others: list, stats: tuple, targets: list) -> str:
    """Where the best of ``ours`` is above the best of ``others`` (or does not reach a target they reach)."""
    missed = []
    for t in targets:
        for stat in stats:
            mine, theirs = (_best(result, "flop_ratio", stat, rows, t) for rows in (ours, others))
            if theirs is not None and (mine is None or mine["value"] > theirs["value"]):
                missed.append(f"{t}× {stat}")
    return "ours trails at " + ", ".join(missed) if missed else "ours leads in every one of these cells"


def _reach(result: dict, rows: list) -> float:
    return max(p["cost"]["flop_ratio"] for p in result["points"] if p["row"] in rows)


def pareto_cls_photos() -> tuple[str, ...]:
    """The photo CLS sentence: at every FLOP-ratio target of the page, our best row against the best
    other row (with its method) and the original ToMe, mean / p95 / worst crop; importance_tome with
    its defaults (r alone) and its reach against ToMe's; where ours trails."""
    result = _page("pareto-cls-photos")
    ours, others = _split(result)
    defaults, tome = _rows(result, "importance_tome (defaults) · "), [_row(result, "tome · ")]
    targets = [f"{t:g}" for t in result["targets"]]
    stats = ("mean", "p95", "worst")

    def three(rows: list) -> str:
        return ", ".join(_matched(result, stat, rows, targets) for stat in stats)

    return ("CLS at matched FLOP ratio " + " / ".join(f"{t}×" for t in targets) + ", mean, p95 and worst crop of "
            "100·(1 − cos): ours (the best of our rows at each ratio)", three(ours),
            f"the best other row ({_matched(result, 'mean', others, targets, names=True)} for the mean)", three(others),
            "the original ToMe", three(tome),
            f"importance_tome with its defaults (`r` alone): {_matched(result, 'mean', defaults, targets)} mean and "
            f"{_matched(result, 'p95', defaults, targets)} p95, reaching {speedup(_reach(result, defaults))} "
            f"(ToMe {speedup(_reach(result, tome))})", _trails(result, ours, others, stats, targets))


def pareto_depth_photos() -> tuple[str, ...]:
    """The photo depth sentence: at 1.1× / 1.25× / 1.5× / 2×, our best row against the best other
    row (with its method) and the original ToMe (with unmerging), mean and worst crop of the added
    SILog; where ours trails."""
    result = _page("pareto-depth-photos")
    ours, others = _split(result)
    tome = [_row(result, "tome · ")]
    targets = ["1.1", "1.25", "1.5", "2"]

    def two(rows: list) -> str:
        return " and ".join(_matched(result, stat, rows, targets) for stat in ("mean", "worst"))

    return ("depth (merge-and-restore) at matched FLOP ratio 1.1× / 1.25× / 1.5× / 2×, mean and worst crop of the added "
            "SILog ×100: ours", two(ours),
            f"the best other row ({_matched(result, 'mean', others, targets, names=True)} for the mean)", two(others),
            "the original ToMe", two(tome), _trails(result, ours, others, ("mean", "worst"), targets))


def demo_run() -> tuple[str, ...]:
    """The demo sentence: per decoder (CLS, depth, segmentation), ours against ToMe in the largest
    cost group of the headline, the measured winners, and the shipped heads' held-out ρ."""
    stages = _page("demo-run")["stages"]
    fragments = []
    for task, ours_row, name in (("cls", "importance_tome", "CLS"), ("depth", "importance_tome (no head)", "depth"),
                                 ("segmentation", "importance_tome (no head)", "segmentation")):
        headline = stages["pruning"]["result"][task]["headline"]
        top = max(row["knob"]["tome_r"] for row in headline["rows"])
        group = {row["row"]: row for row in headline["rows"] if row["knob"]["tome_r"] == top}
        winner = headline["winner"]["row"] if headline["winner"] else "none (no row measured faster than the unpruned model)"
        fragments.append(f"{name}: {ours_row} {figure(group[ours_row]['error']['mean'])} against ToMe's "
                         f"{figure(group['tome']['error']['mean'])}, the winner {winner}")
    rho = {task: head["spearman"]["mean"] for task, head in stages["importance_head"]["result"].items()}
    return (f"at the cost of ToMe r = {top}", *fragments, f"held-out Spearman ρ against imp* {rho['cls']:.2f} (CLS) and {rho['depth']:.2f} (depth)")


# generated page -> the README text it backs: fragments that appear in this order (the README may
# say more between them: which run, which head)
QUOTED = {"pareto-cls-photos": pareto_cls_photos, "pareto-depth-photos": pareto_depth_photos, "demo-run": demo_run}


def _readme_glance() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Results at a glance", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())


def prune_md_cls_table() -> str:
    """docs/prune.md's table of the CLS photo page: at each FLOP-ratio target, mean / p95 / worst crop of
    our best row, of importance_tome with its defaults, of the best other row (its method named for
    the mean) and of the original ToMe."""
    result = _page("pareto-cls-photos")
    ours, others = _split(result)
    defaults, tome = _rows(result, "importance_tome (defaults) · "), [_row(result, "tome · ")]
    targets = [f"{t:g}" for t in result["targets"]]

    def cells(rows: list) -> str:
        columns = [[_best(result, "flop_ratio", stat, rows, t) for stat in ("mean", "p95", "worst")] for t in targets]
        return " | ".join(" / ".join("–" if c is None else figure(c["value"]) for c in column) for column in columns)

    return "\n".join([
        "| FLOP ratio | " + " | ".join(f"{t}×" for t in targets) + " |",
        "|---" * (len(targets) + 1) + "|",
        f"| ours (best row) | {cells(ours)} |",
        f"| importance_tome (defaults) | {cells(defaults)} |",
        f"| best other row ({_matched(result, 'mean', others, targets, names=True)} for the mean) | {cells(others)} |",
        f"| ToMe (original) | {cells(tome)} |"])


BENCH_ROWS = (  # (label, the method's name prefix on bench-prune's page)
    ("single-stage merge, η = 0.5", "importance merge η=0.5 @"),
    ("single-stage prune + LLF, η = 0.5", "importance prune+LLF η=0.5 @"),
    ("ToMe, r = 8", "ToMe r=8 constant"),
    ("importance_tome at ToMe r = 8's counts", "importance_tome r=8 "),
    ("the bound at r = 8's counts (no merging)", "tokens dropped at ToMe r=8's"),
    ("ToMe, r = 16", "ToMe r=16 constant"),
    ("importance_tome at ToMe r = 16's counts", "importance_tome r=16 "),
    ("the bound at r = 16's counts (no merging)", "tokens dropped at ToMe r=16's"),
    ("ATC, keep rate 0.7", "ATC keep_rate=0.7"),
    ("importance_cluster, keep rate 0.7 (no head)", "importance_cluster keep_rate=0.7"))
BENCH_CELLS = (("vit_s16", 1), ("vit_s16", 16), ("vit_b16", 1), ("vit_b16", 16))


def prune_md_bench_table() -> str:
    """docs/prune.md's table of bench-prune's page: speed-up ÷ FLOP ratio of each row in the eager
    cells of ViT-S/16 and ViT-B/16 at batch 1 and 16 (224 px, float32, the torch rows)."""
    result = _page("bench-prune")

    def value(model: str, batch: int, prefix: str) -> str:
        (row,) = [r for r in result["rows"] if r["model"] == model and r["batch"] == batch and r["compiled"] is False
                  and r.get("runtime", "torch") == "torch" and r["method"].startswith(prefix)]
        return f"{row['speedup_over_flop_ratio']:.3f}"

    def over_tome(model: str, batch: int, r: int) -> str:
        (check,) = [c for c in result["checks"] if c["model"] == model and c["batch"] == batch and c["compiled"] is False
                    and c["check"].startswith(f"importance_tome r={r} ") and " over ToMe " in c["check"]]
        return f"{check['value']:.3f}"

    titles = {"vit_s16": "ViT-S/16", "vit_b16": "ViT-B/16"}
    return "\n".join([
        "| speed-up ÷ FLOP ratio | " + " | ".join(f"{titles[m]}, batch {b}" for m, b in BENCH_CELLS) + " |",
        "|---" * (len(BENCH_CELLS) + 1) + "|"] + [
        f"| {label} | " + " | ".join(value(m, b, prefix) for m, b in BENCH_CELLS) + " |" for label, prefix in BENCH_ROWS] + [
        f"| *importance_tome's images/s over ToMe's, r = {r}* | " + " | ".join(over_tome(m, b, r) for m, b in BENCH_CELLS) + " |"
        for r in (8, 16)])


def test_the_formats():
    assert [figure(v) for v in (3.0001e-4, 3.39e-3, 0.0371, 0.0449, 0.993, 1.126)] == ["3.0e-4", "3.4e-3", "0.037", "0.045", "0.99", "1.13"]
    assert speedup(2.09) == "2.1×"


def test_every_quoted_figure_equals_its_page():
    glance = _readme_glance()
    for name, sentence in QUOTED.items():
        at = 0
        for fragment in sentence():
            found = glance.find(fragment, at)
            assert found >= 0, f"README.md quotes docs/results/{name}.md; from its JSON it should read, in this order:\n" + \
                "\n".join(sentence())
            at = found + len(fragment)


def test_the_cls_table_of_prune_md_equals_its_page():
    table = prune_md_cls_table()
    assert table in (REPO / "docs" / "prune.md").read_text(), \
        "docs/prune.md's table of docs/results/pareto-cls-photos.md should read, from its JSON:\n" + table


def test_the_bench_table_of_prune_md_equals_its_page():
    table = prune_md_bench_table()
    text = "\n".join(line.strip() for line in (REPO / "docs" / "prune.md").read_text().splitlines())  # a list item's indent
    assert table in text, \
        "docs/prune.md's table of docs/results/bench-prune.md should read, from its JSON:\n" + table


def test_every_generated_page_the_readme_quotes_is_checked():
    linked = set(re.findall(r"\(docs/results/([\w-]+)\.md\)", _readme_glance()))
    generated = {name for name in linked if (RESULTS / f"{name}.json").exists()}
    assert generated == set(QUOTED), "a generated page linked from 'Results at a glance' needs its sentence in QUOTED"
