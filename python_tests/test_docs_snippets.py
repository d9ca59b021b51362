"""Every ```python block of the README and of docs/*.md (not docs/results/, whose pages are
generated) runs as written, each in a fresh namespace and a fresh temporary working directory, so
a documented example cannot rot. A block builds the objects it uses itself (random-weight timm or
transformers models, the demo model, small tensors).

A block written as an interactive session (``>>>`` prompts) runs its ``>>>`` / ``...`` lines; the
output shown after them is an example of one machine's and is not compared. A block may be left
out only by an HTML comment right before it that says why, ``<!-- snippet: skip (REASON) -->``;
such blocks are reported as skipped with their reason and must stay rare."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = re.compile(r"^<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->\s*$", re.M)  # a line of its own
MAX_SKIPPED = 2


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    source: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _runnable(body: list[str]) -> str:
    """The code of a block: as written, or its prompt lines when it is an interactive session."""
    if not any(line.startswith(">>>") for line in body):
        return "\n".join(body)
    return "\n".join(line[4:] for line in body if line.startswith((">>> ", "... ")) or line in (">>>", "..."))


def _blocks(page: Path) -> list[Snippet]:
    lines = page.read_text().splitlines()
    found, start, before = [], None, ""
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start, before = number, next((x for x in reversed(lines[: number - 1]) if x.strip()), "")
        elif start is not None and line.strip() == "```":
            skip = SKIP.search(before)
            found.append(Snippet(page.relative_to(ROOT).as_posix(), start, _runnable(lines[start:number - 1]),
                                 skip["reason"].strip() if skip else None))
            start = None
    return found


SNIPPETS = [snippet for page in PAGES for snippet in _blocks(page)]


def test_the_docs_have_python_snippets_and_few_are_skipped():
    assert len(SNIPPETS) >= 8, [s.name for s in SNIPPETS]
    skipped = [f"{s.name} ({s.skip_reason})" for s in SNIPPETS if s.skip_reason]
    assert len(skipped) <= MAX_SKIPPED, "too many snippets not run: " + "; ".join(skipped)


def test_skip_markers_sit_right_before_a_python_block():
    markers = sum(len(SKIP.findall(page.read_text())) for page in PAGES)
    assert markers == sum(1 for s in SNIPPETS if s.skip_reason), "a `snippet: skip` comment is not right before a ```python block"


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.name)
def test_snippet_runs_as_written(snippet, tmp_path, monkeypatch, seeded):
    if snippet.skip_reason:
        pytest.skip(f"{snippet.name}: {snippet.skip_reason}")
    monkeypatch.chdir(tmp_path)
    code = compile(snippet.source, snippet.name, "exec")  # tracebacks name the page and line of the block
    exec(code, {"__name__": "__main__"})
