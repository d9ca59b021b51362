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
