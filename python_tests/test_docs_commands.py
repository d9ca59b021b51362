"""Every `pullback ...` line in the README's and docs' shell blocks parses against the CLI, so a
documented command cannot drift from the real options (torchrun lines and `...` elisions skipped)."""

import re
import shlex
from pathlib import Path

import pytest

from pullback_ext.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def documented_commands() -> list[tuple[str, str]]:
    """(page, command line) of each `pullback ...` line in a bash/sh/console block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("pullback ") and "..." not in line:
                    found.append((page.relative_to(ROOT).as_posix(), line))
    return found


def test_the_docs_document_commands():
    assert len(documented_commands()) >= 5


@pytest.mark.parametrize("page,line", documented_commands())
def test_documented_command_parses(page, line):
    try:
        build_parser().parse_args(shlex.split(line)[1:])
    except SystemExit as exc:
        pytest.fail(f"{page}: `{line}` does not parse (exit {exc.code})")


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation but - and _ dropped, spaces -> -."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in text.splitlines() if line.startswith("#")}


def test_each_command_of_the_readme_table_points_to_a_page_that_documents_it():
    rows = re.findall(r"^\| `pullback ([a-z-]+)[^`]*` \|[^|]*\| (.+) \|$", (ROOT / "README.md").read_text(), re.M)
    assert {command for command, _ in rows} >= {"demo", "diagnose", "train", "eval-head", "evaluate", "subprobe", "study", "bench"}
    for command, cell in rows:
        links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", cell)
        assert links, f"README: no link for pullback {command}"
        pages = [(ROOT / path).read_text() for path, _ in links]
        assert any(f"pullback {command}" in page for page in pages), f"README: pullback {command} points to {links}, which never name it"
        for (path, anchor), page in zip(links, pages):
            assert not anchor or anchor in _anchors(page), f"README: {path}#{anchor} is no heading of {path}"
