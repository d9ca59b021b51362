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


def pareto_cls_photos() -> tuple[str, ...]:
    """The photo CLS sentence: importance_tome (its two block_range settings: the lower error at each
    target) against the original ToMe and PiToMe at matched FLOP ratio, at ToMe's largest ratio,
    and at matched batch-64 speed-up."""
    result = _page("pareto-cls-photos")
    ours, tome, pitome = _rows(result, "importance_tome · "), [_row(result, "tome · ")], [_row(result, "pitome · ")]
    targets = ("1.1", "1.25", "1.5", "2")

    def at(axis: str, stat: str, rows: list, keys=targets) -> str:
        return " / ".join(figure(_best(result, axis, stat, rows, t)["value"]) for t in keys)

    top = max(p["cost"]["flop_ratio"] for p in result["points"] if p["row"] == tome[0])
    noisy = all(_best(result, "speedup_batch64", stat, rows, t)["within_noise"]
                for rows in (ours, tome) for stat in ("mean", "p95") for t in ("1.1", "1.25"))
    return ("matched FLOP ratio 1.1× / 1.25× / 1.5× / 2×: importance_tome",
            f"{at('flop_ratio', 'mean', ours)} mean and {at('flop_ratio', 'p95', ours)} p95 against the original ToMe's "
            f"{at('flop_ratio', 'mean', tome)} and {at('flop_ratio', 'p95', tome)} and PiToMe's {at('flop_ratio', 'mean', pitome)} and "
            f"{at('flop_ratio', 'p95', pitome)} (100·(1 − cos))",
            f"at ToMe's largest FLOP ratio, {speedup(top)}, ours {figure(_at_ratio(result, ours, 'mean', top))} against "
            f"{figure(_at_ratio(result, tome, 'mean', top))}",
            f"at matched batch-64 speed-up 1.1× / 1.25× ours {at('speedup_batch64', 'mean', ours, ('1.1', '1.25'))} against ToMe's "
            f"{at('speedup_batch64', 'mean', tome, ('1.1', '1.25'))}",
            "every one of these cells within the noise of" if noisy else "not every one of these cells within the noise of")


def pareto_depth_photos() -> tuple[str, ...]:
    """The photo depth sentence: importance_tome without a head, and with the depth head, against
    the original ToMe (with unmerging) at matched FLOP ratio 1.1× / 1.25× / 1.5×, mean added SILog."""
    result = _page("pareto-depth-photos")
    ours = _rows(result, "importance_tome · ")
    free, guided = [r for r in ours if "no head" in r], [r for r in ours if "no head" not in r]
    tome = [_row(result, "tome · ")]

    def at(rows: list) -> str:
        return " / ".join(figure(_best(result, "flop_ratio", "mean", rows, t)["value"]) for t in ("1.1", "1.25", "1.5"))

    return ("depth (merge-and-restore) at matched FLOP ratio 1.1× / 1.25× / 1.5×: importance_tome without a head",
            f"{at(free)} against ToMe's {at(tome)}", f"with the depth head {at(guided)}")


def demo_run() -> tuple[str, ...]:
    """The demo sentence: per decoder, ours against ToMe in the largest cost group of the headline,
    the measured winners, and the shipped heads' held-out ρ."""
    stages = _page("demo-run")["stages"]
    fragments = []
    for task, ours_row, name in (("cls", "importance_tome", "CLS"), ("depth", "importance_tome (no head)", "depth")):
        headline = stages["pruning"]["result"][task]["headline"]
        top = max(row["knob"]["tome_r"] for row in headline["rows"])
        group = {row["row"]: row for row in headline["rows"] if row["knob"]["tome_r"] == top}
        fragments.append(f"{name}: {ours_row} {figure(group[ours_row]['error']['mean'])} against ToMe's "
                         f"{figure(group['tome']['error']['mean'])}, the winner {headline['winner']['row']}")
    rho = {task: head["spearman"]["mean"] for task, head in stages["importance_head"]["result"].items()}
    return (f"at the cost of ToMe r = {top}", *fragments, f"held-out Spearman ρ against imp* {rho['cls']:.2f} (CLS) and {rho['depth']:.2f} (depth)")


# generated page -> the README text it backs: fragments that appear in this order (the README may
# say more between them: which run, which head)
QUOTED = {"pareto-cls-photos": pareto_cls_photos, "pareto-depth-photos": pareto_depth_photos, "demo-run": demo_run}


def _readme_glance() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Results at a glance", 1)[1].split("\n## ", 1)[0]
    return " ".join(section.split())


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


def test_every_generated_page_the_readme_quotes_is_checked():
    linked = set(re.findall(r"\(docs/results/([\w-]+)\.md\)", _readme_glance()))
    generated = {name for name in linked if (RESULTS / f"{name}.json").exists()}
    assert generated == set(QUOTED), "a generated page linked from 'Results at a glance' needs its sentence in QUOTED"
