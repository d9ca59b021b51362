"""docs/families.md: every cell of the support table names tests that exist, or says why it names none."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "families.md"
TESTS = Path(__file__).resolve().parent
COLUMNS = ["family", "diagnose", "train", "merge", "prune", "LLF", "prop-attn", "RoPE", "tome", "evit", "pitome",
           "expedite", "asap"]
REFERENCE = re.compile(r"`(test_\w+\.py)::(test_\w+)`")
WITHOUT_TEST = ("no:", "n/a:", "untested:")  # what a cell that names no test starts with


def support_table(text: str) -> list[dict]:
    """The rows (column -> cell) of the first markdown table whose header is :data:`COLUMNS`."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if [c.strip() for c in line.strip().strip("|").split("|")] == COLUMNS:
            break
    else:
        raise AssertionError(f"no table with the columns {COLUMNS} in {PAGE.name}")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), f"row {cells[0]!r} has {len(cells)} cells, expected {len(COLUMNS)}"
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def defined_tests(path: Path) -> set:
    """The names of the test functions defined at the top of a test module (what pytest collects by name)."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def problems(rows: list[dict], tests_dir: Path) -> list[str]:
    """What is wrong with the table: a cell without a test or a reason, a named test that does not exist."""
    found, cache = [], {}
    for row in rows:
        for column, cell in list(row.items())[1:]:
            references = REFERENCE.findall(cell)
            where = f"{row['family']} / {column}"
            if not references and not cell.startswith(WITHOUT_TEST):
                found.append(f"{where}: names no test and does not start with {' / '.join(WITHOUT_TEST)}")
            for module, name in references:
                path = tests_dir / module
                if module not in cache:
                    cache[module] = defined_tests(path) if path.is_file() else None
                if cache[module] is None:
                    found.append(f"{where}: {module} does not exist")
                elif name not in cache[module]:
                    found.append(f"{where}: {module} has no test {name}")
    return found


def test_every_cell_names_existing_tests_or_a_reason():
    rows = support_table(PAGE.read_text())
    families = [row["family"] for row in rows]
    for expected in ("timm `VisionTransformer`", "timm `Eva`", "HF DINOv2", "HF DPT", "HF Depth Anything", "HF ViT",
                     "HF CLIP", "HF SigLIP", "HF DINOv3"):
        assert any(f.startswith(expected) for f in families), f"no row for {expected}"
    assert problems(rows, TESTS) == []


@pytest.mark.parametrize("cell,expected", [
    ("yes: `test_probes.py::test_no_such_test`", "test_probes.py has no test test_no_such_test"),
    ("yes: `test_nowhere.py::test_bad_inputs`", "test_nowhere.py does not exist"),
    ("yes, it works", "names no test"),
])
def test_the_check_catches_a_cell_that_points_at_nothing(cell, expected):
    row = {column: "no: reason" for column in COLUMNS}
    row.update(family="some family", merge=cell)
    assert problems([row], TESTS) and expected in problems([row], TESTS)[0]
    row["merge"] = "yes: `test_probes.py::test_bad_inputs`"
    assert problems([row], TESTS) == []
