"""Architecture rules of pullback_ext, checked on the source tree.

(a) Layering: library modules never import an application package (``pullback_ext.demo``,
    ``pullback_ext.commands``, ``pullback_ext.bench``, ``pullback_ext.cli``, ``pullback_ext.__main__``),
    not in a function body, not as a relative import and not as a dotted module name in a string
    (``importlib.import_module("pullback_ext.demo.train")``). The package face
    ``pullback_ext/__init__.py`` may name ``demo`` for its lazy attribute lookup.
(b) No function longer than 80 lines.
(c) No run of 6 or more identical or same-shape lines in two places. "Same shape": equal once
    names, numbers and strings are replaced by placeholders. Imports, docstrings, comments,
    function signatures and decorators, dataclass-style field declarations and ``__all__`` are
    not code for this purpose; neither is a window of fewer than 3 distinct lines (a list of
    same-shape entries such as keyword arguments or registrations), nor two overlapping windows
    of one file (a repeated pattern, not a copy).

(d) No import cycle between subpackages: in the graph whose nodes are the first-level subpackages
    of pullback_ext (``pullback_ext.prune``, ``pullback_ext.tap``, …; a top-level module such as
    ``pullback_ext.plots`` is its own node) and whose edges are the imports between them (in
    function bodies and relative ones included, as in (a)), no two nodes reach each other. Each
    cycle is reported with one example import (module:line) per edge.
(e) No import cycle between the modules of one subpackage: the same rule, in the graph whose nodes
    are the modules of one first-level subpackage (its face ``__init__`` and the modules of the
    packages nested in it included) and whose edges are the imports between them, counted as in
    (d). An import counts for the module it names (``from a import b``: ``a.b`` when that is a
    module, else ``a``), not for the packages above it that Python initialises first. A shared
    piece that two modules need lives in a module below both, not behind an import in a function.

Each checker is a plain function returning its findings, and is tested on small bad examples.
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import textwrap
import tokenize
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pullback_ext"
APPLICATION = ("pullback_ext.demo", "pullback_ext.commands", "pullback_ext.bench", "pullback_ext.cli", "pullback_ext.__main__")
MAX_FUNCTION_LINES = 80
MIN_DUPLICATE_LINES = 6
_DOTTED = re.compile(r"pullback_ext(\.\w+)+(:\w+)?")


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """``pullback_ext/prune/tokens.py`` -> ``pullback_ext.prune.tokens`` (``__init__`` -> the package)."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_application(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPLICATION)


def python_files(package: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Absolute module names an import statement (or a dotted-name string) refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        return [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value.strip()):
        return [node.value.strip().split(":")[0]]
    return []


def layering_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """``"module:line imports NAME"`` for each reference from library ``module`` to an application
    package; [] for an application module itself."""
    if is_application(module):
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        for name in _imported_names(node, module, is_package):
            if not is_application(name):
                continue
            if module == "pullback_ext" and name == "pullback_ext.demo":
                continue  # the package face names the demo application for lazy lookup
            found.append(f"{module}:{node.lineno} imports {name}")
    return found


def long_functions(source: str, label: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``"label:line name (n lines)"`` for each function or method longer than ``limit`` lines
    (from ``def`` to its last line, decorators excluded)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{label}:{node.lineno} {node.name} ({length} lines)")
    return found


def _not_code_lines(tree: ast.Module) -> set[int]:
    """Lines the duplicate scan skips: imports, docstrings, signatures and decorators, class-level
    field declarations (``name: type`` or ``name: type = constant``) and ``__all__``."""
    skip: set[int] = set()

    def cover(node: ast.AST, end: int | None = None) -> None:
        skip.update(range(node.lineno, (end if end is not None else node.end_lineno) + 1))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            cover(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            cover(node)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                cover(body[0])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            skip.update(range(start, node.body[0].lineno))
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and (stmt.value is None or isinstance(stmt.value, ast.Constant)):
                    cover(stmt)
    return skip


_PLACEHOLDER = {tokenize.NUMBER: "0", tokenize.STRING: "S"}
_SKIPPED_TOKENS = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
_KEPT_NAMES = {"True", "False", "None", "self", "cls"}


def shape_lines(source: str) -> list[tuple[int, str]]:
    """``(line number, shape)`` of every code line: its tokens with names, numbers and strings
    replaced by placeholders (keywords, operators and brackets kept)."""
    skip = _not_code_lines(ast.parse(source))
    lines: dict[int, list[str]] = defaultdict(list)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIPPED_TOKENS or tok.start[0] in skip:
            continue
        text = _PLACEHOLDER.get(tok.type, tok.string)
        if tok.type == tokenize.NAME and not keyword.iskeyword(text) and text not in _KEPT_NAMES:
            text = "N"
        elif tok.type in {getattr(tokenize, "FSTRING_START", -1)}:
            text = "S"
        elif tok.type in {getattr(tokenize, "FSTRING_MIDDLE", -1), getattr(tokenize, "FSTRING_END", -1)}:
            continue
        lines[tok.start[0]].append(text)
    return [(row, " ".join(tokens)) for row, tokens in sorted(lines.items())]


def duplicate_blocks(sources: dict[str, str], min_lines: int = MIN_DUPLICATE_LINES) -> list[str]:
    """``"a.py:12 = b.py:40"`` for each run of ``min_lines`` or more same-shape code lines found in
    two places (identical lines are same-shape too), named by the first line of each copy;
    overlapping windows of one file do not count."""
    places: dict[tuple, list[tuple[str, int, int]]] = defaultdict(list)
    for label, source in sources.items():
        lines = shape_lines(source)
        for i in range(len(lines) - min_lines + 1):
            window = tuple(shape for _, shape in lines[i:i + min_lines])
            if len(set(window)) >= 3:
                places[window].append((label, i, lines[i][0]))
    windows = set()
    for where in places.values():
        distinct: list[tuple[str, int, int]] = []
        for label, i, line in where:
            if not any(label == other and abs(i - j) < min_lines for other, j, _ in distinct):
                distinct.append((label, i, line))
        if len(distinct) > 1:
            windows.add(tuple(distinct))
    # a run of k lines shows as k - min_lines + 1 windows whose indices all advance by one
    positions = {tuple((label, i) for label, i, _ in w) for w in windows}
    starts = [w for w in windows if tuple((label, i - 1) for label, i, _ in w) not in positions]
    return sorted(" = ".join(f"{label}:{line}" for label, _, line in w) for w in starts)


def import_edges(package: Path = PACKAGE) -> dict[tuple[str, str], str]:
    """``{(a, b): "module:line"}``: for each pair of first-level nodes of ``package`` where a module
    of ``a`` imports ``b`` (or something inside it), the first such import (by module, then line).
    The package face (``package/__init__.py``) is no node."""
    root = package.name
    files = {p: module_name(p, package) for p in python_files(package)}
    nodes = {".".join(name.split(".")[:2]) for name in files.values() if "." in name}
    edges: dict[tuple[str, str], tuple[str, int]] = {}
    for path, module in files.items():
        source = ".".join(module.split(".")[:2])
        if source not in nodes:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported_names(node, module, path.name == "__init__.py"):
                target = ".".join(name.split(".")[:2])
                if name.startswith(root + ".") and target in nodes and target != source:
                    edges[source, target] = min(edges.get((source, target), (module, node.lineno)), (module, node.lineno))
    return {edge: f"{module}:{line}" for edge, (module, line) in sorted(edges.items())}


def _owner(name: str, modules: set[str]) -> str | None:
    """The module of ``modules`` that ``name`` (a module, or a name inside one) belongs to: its
    longest dotted prefix among them; None for a name outside them."""
    parts = name.split(".")
    return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)


def _named_modules(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` an import statement (or a dotted-name string) names: ``import
    a.b`` names ``a.b``; ``from a import b`` names ``a.b`` when that is a module, else ``a``."""
    names = _imported_names(node, module, is_package)
    if isinstance(node, ast.ImportFrom):
        names = names[1:]  # ``a.b`` for each imported ``b``: the module itself only through a name inside it
    return {owner for owner in (_owner(name, modules) for name in names) if owner is not None}


def module_import_edges(package: Path = PACKAGE) -> dict[tuple[str, str], str]:
    """``{(a, b): "a:line"}``: for each pair of distinct modules ``a``, ``b`` of one first-level
    subpackage of ``package`` (a top-level module is a subpackage of its own) where ``a`` imports
    ``b`` (in a function body, relatively or as a dotted-name string too, as in (a)), the first
    such import of ``a`` (by line). An import names the module it loads (:func:`_named_modules`),
    not the packages above it, which Python initialises first: counted, they would close a cycle
    between every package face that imports its own modules and each of those modules. The face
    of ``package`` belongs to no subpackage."""
    files = {p: module_name(p, package) for p in python_files(package)}
    modules = set(files.values())

    def subpackage(name: str) -> str:
        return ".".join(name.split(".")[:2])

    edges: dict[tuple[str, str], int] = {}
    for path, module in files.items():
        if "." not in module:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _named_modules(node, module, path.name == "__init__.py", modules):
                if target != module and subpackage(target) == subpackage(module):
                    edges[module, target] = min(edges.get((module, target), node.lineno), node.lineno)
    return {edge: f"{edge[0]}:{line}" for edge, line in sorted(edges.items())}


def _shortest_path(successors: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest path ``[start, …, goal]`` (breadth first, neighbours in name order); None if none."""
    before: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        node = todo.pop(0)
        if node == goal:
            path = [node]
            while before[path[-1]] is not None:
                path.append(before[path[-1]])
            return path[::-1]
        for nxt in sorted(successors[node] - before.keys()):
            before[nxt] = node
            todo.append(nxt)
    return None


def import_cycles(edges: dict[tuple[str, str], str]) -> list[str]:
    """The cycles of the graph ``edges`` (:func:`import_edges`), one line each: for every edge that
    lies on a cycle, the shortest cycle through it, written ``a -> b (example import) -> … -> a
    (example import)`` from its first node by name; each cycle once."""
    successors: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        successors[a].add(b)
    cycles = set()
    for a, b in edges:
        back = _shortest_path(successors, b, a)
        if back is not None:
            ring = [a] + back[:-1]
            first = ring.index(min(ring))
            cycles.add(tuple(ring[first:] + ring[:first]))
    found = []
    for ring in sorted(cycles):
        steps = zip(ring, ring[1:] + ring[:1])
        found.append(ring[0] + "".join(f" -> {b} ({edges[a, b]})" for a, b in steps))
    return found


def _tree_sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text() for p in python_files()}


# ---- the rules on the tree ----------------------------------------------------------------------


def test_library_modules_never_import_an_application_package():
    found = []
    for path in python_files():
        found += layering_violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert not found, "library modules import application packages:\n" + "\n".join(found)


def test_no_function_is_longer_than_80_lines():
    found = [f for label, source in _tree_sources().items() for f in long_functions(source, label)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_no_duplicated_blocks_of_six_same_shape_lines():
    found = duplicate_blocks(_tree_sources())
    assert not found, f"blocks of {MIN_DUPLICATE_LINES}+ same-shape lines in two places:\n" + "\n".join(found)


def test_no_import_cycle_between_subpackages():
    found = import_cycles(import_edges())
    assert not found, "import cycles between subpackages:\n" + "\n".join(found)


def test_no_import_cycle_inside_a_subpackage():
    found = import_cycles(module_import_edges())
    assert not found, "import cycles between the modules of a subpackage:\n" + "\n".join(found)


def test_the_tree_is_scanned():
    files = python_files()
    assert len(files) > 20 and PACKAGE / "prune" / "tokens.py" in files
    assert module_name(PACKAGE / "prune" / "tokens.py") == "pullback_ext.prune.tokens"
    assert module_name(PACKAGE / "demo" / "__init__.py") == "pullback_ext.demo"


# ---- each checker fails on a bad example --------------------------------------------------------


@pytest.mark.parametrize("source", [
    "import pullback_ext.demo.train\n",
    "from pullback_ext.commands import diagnose\n",
    "from pullback_ext import cli\n",
    "from pullback_ext import demo as d\n",
    "def f():\n    from pullback_ext.demo.metrics import spearman\n    return spearman\n",
    "from ..demo import metrics\n",
    "from .. import commands\n",
    "import importlib\nstage = importlib.import_module('pullback_ext.demo.pruning_stage')\n",
    "ENTRY = 'pullback_ext.cli:main'\n",
    "class A:\n    def m(self):\n        import pullback_ext.bench.ops\n",
])
def test_layering_checker_catches(source):
    assert layering_violations(source, "pullback_ext.prune.tokens")


@pytest.mark.parametrize("source", [
    "from pullback_ext.embedded import load\nfrom pullback_ext.prune import tokens\n",
    '"""Docs may mention ``pullback_ext.demo`` and pullback_ext.commands.demo in prose."""\n',
    "from .tokens import TokenState\nfrom . import strategies\n",
    "NAME = 'pullback_ext.embedded.scenes'\n",
])
def test_layering_checker_accepts(source):
    assert layering_violations(source, "pullback_ext.prune.pipeline") == []


def test_layering_checker_exempts_application_modules_and_the_package_face():
    assert layering_violations("from pullback_ext.demo import train\n", "pullback_ext.commands.demo") == []
    assert layering_violations("from pullback_ext.commands import demo\n", "pullback_ext.cli") == []
    face = "import importlib\n_SUBMODULES = {'demo'}\nM = 'pullback_ext.demo'\n"
    assert layering_violations(face, "pullback_ext", is_package=True) == []
    assert layering_violations("import pullback_ext.commands\n", "pullback_ext", is_package=True)
    assert layering_violations("from .demo import x\n", "pullback_ext.embedded", is_package=True) == []  # embedded.demo
    assert layering_violations("from ..demo import x\n", "pullback_ext.embedded", is_package=True)


def test_long_function_checker():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert long_functions(f"def fits():\n{body[: -len('    x79 = 79') - 1]}", "m.py") == []
    assert long_functions(f"def too_long():\n{body}", "m.py") == ["m.py:1 too_long (81 lines)"]
    nested = "class A:\n    def method(self):\n" + textwrap.indent(body, "    ")
    assert long_functions(nested, "m.py") == ["m.py:2 method (81 lines)"]


_BLOCK = """
def {name}(layer, x, bias=None):
    attn = layer.{a}
    h = layer.{n}(x)
    b, k, _ = h.shape
    shape = (b, k, attn.heads, attn.{size})
    q = attn.{q}(h).view(shape).transpose(1, 2)
    key = attn.{k}(h).view(shape).transpose(1, 2)
    return mean_probs(q, key, attn.scaling, bias)
"""


def test_duplicate_checker_finds_identical_and_same_shape_blocks():
    first = _BLOCK.format(name="f", a="attention", n="norm", size="head_dim", q="query", k="key")
    renamed = _BLOCK.format(name="g", a="attn", n="norm1", size="dim", q="q_proj", k="k_proj")
    assert duplicate_blocks({"a.py": first, "b.py": first}) == ["a.py:3 = b.py:3"]
    assert duplicate_blocks({"a.py": first, "b.py": renamed}) == ["a.py:3 = b.py:3"]
    assert duplicate_blocks({"a.py": first + "\n" + renamed}) == ["a.py:3 = a.py:13"]


def test_duplicate_checker_ignores_what_is_not_a_copy():
    first = _BLOCK.format(name="f", a="attention", n="norm", size="head_dim", q="query", k="key")
    short = "\n".join(first.splitlines()[:6])  # five code lines
    assert duplicate_blocks({"a.py": short, "b.py": short}) == []
    kwargs = "def f(a, b, c, d, e, g, h):\n    return dict(\n" + "".join(f"        {v}={v},\n" for v in "abcdegh") + "    )\n"
    assert duplicate_blocks({"a.py": kwargs, "b.py": kwargs.replace("dict", "Result")}) == []
    fields = "@dataclass\nclass A:\n" + "".join(f"    {v}: int = {i}\n" for i, v in enumerate("abcdefgh"))
    assert duplicate_blocks({"a.py": fields, "b.py": fields.replace("A:", "B:")}) == []
    imports = "".join(f"import m{i}\nfrom p{i} import q\n" for i in range(4))
    assert duplicate_blocks({"a.py": imports, "b.py": imports}) == []
    documented = '"""Module doc\n\nover\nseveral\nlines\nand more\nstill\n"""\n'
    assert duplicate_blocks({"a.py": documented, "b.py": documented}) == []


def _package(root: Path, files: dict[str, str]) -> Path:
    """A scratch package ``root/pkg`` with ``files`` ({path inside pkg: source})."""
    for name, source in {"__init__.py": "", **files}.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "pkg"


_LAYERED = {
    "low/__init__.py": "",
    "low/core.py": "import math\n",
    "grids.py": "from pkg.low.core import math\n",
    "high/__init__.py": "from pkg.low import core\n",
    "high/run.py": "from ..grids import math\nfrom . import other\n\n\ndef f():\n    import pkg.low.core\n",
    "high/other.py": "",
}


def test_cycle_checker_finds_a_cycle_through_function_bodies_and_relative_imports(tmp_path):
    package = _package(tmp_path, _LAYERED | {
        "low/core.py": "import math\n\n\ndef late():\n    from pkg.high import run\n    return run\n",
        "grids.py": "from .low.core import math\n",
    })
    edges = import_edges(package)
    assert edges[("pkg.low", "pkg.high")] == "pkg.low.core:5"  # in a function body
    assert edges[("pkg.grids", "pkg.low")] == "pkg.grids:1"  # relative, from a top-level module
    assert edges[("pkg.high", "pkg.grids")] == "pkg.high.run:1"  # relative, two levels up
    assert import_cycles(edges) == [
        "pkg.grids -> pkg.low (pkg.grids:1) -> pkg.high (pkg.low.core:5) -> pkg.grids (pkg.high.run:1)",
        "pkg.high -> pkg.low (pkg.high:1) -> pkg.high (pkg.low.core:5)",
    ]


def test_cycle_checker_accepts_a_layered_package(tmp_path):
    package = _package(tmp_path, _LAYERED | {"__init__.py": "from pkg.high import run\nfrom pkg import grids\n"})
    edges = import_edges(package)
    assert edges == {("pkg.grids", "pkg.low"): "pkg.grids:1", ("pkg.high", "pkg.grids"): "pkg.high.run:1",
                     ("pkg.high", "pkg.low"): "pkg.high:1"}  # the package face is no node
    assert import_cycles(edges) == []


def test_cycle_checker_reports_each_cycle_once_with_an_example_import_per_edge():
    edges = {("a", "b"): "a.x:1", ("b", "c"): "b:2", ("c", "a"): "c.y:3", ("c", "d"): "c:4", ("b", "a"): "b.z:5",
             ("e", "f"): "e:5", ("f", "e"): "f:6", ("d", "e"): "d:7"}
    assert import_cycles(edges) == [
        "a -> b (a.x:1) -> a (b.z:5)",
        "a -> b (a.x:1) -> c (b:2) -> a (c.y:3)",
        "e -> f (e:5) -> e (f:6)",
    ]


_LAYERED_MODULES = {
    "low/__init__.py": "from pkg.low.core import norm\nfrom pkg.low import table\n",
    "low/core.py": "import math\n\n\ndef norm(x):\n    return math.sqrt(x)\n",
    "low/table.py": "import pkg.low.core\n",
    "low/nested/__init__.py": "",
    "low/nested/deep.py": "from ..core import norm\nfrom pkg.low import nested\n",
    "high/__init__.py": "",
    "high/run.py": "from pkg.low import core\n",
}


def test_module_cycle_checker_finds_cycles_through_function_bodies_relative_imports_and_faces(tmp_path):
    package = _package(tmp_path, _LAYERED_MODULES | {
        "low/core.py": "import math\n\n\ndef norm(x):\n    from .nested import deep\n    return math.sqrt(x)\n",
        "low/table.py": "def walk():\n    from pkg.low import norm\n    return norm\n",
    })
    edges = module_import_edges(package)
    assert edges[("pkg.low.core", "pkg.low.nested.deep")] == "pkg.low.core:5"  # relative, in a function body
    assert edges[("pkg.low.nested.deep", "pkg.low.core")] == "pkg.low.nested.deep:1"  # relative, two levels up
    assert edges[("pkg.low.table", "pkg.low")] == "pkg.low.table:2"  # a name of the face, in a function body
    assert import_cycles(edges) == [
        "pkg.low -> pkg.low.table (pkg.low:2) -> pkg.low (pkg.low.table:2)",
        "pkg.low.core -> pkg.low.nested.deep (pkg.low.core:5) -> pkg.low.core (pkg.low.nested.deep:1)",
    ]


def test_module_cycle_checker_accepts_a_layered_subpackage(tmp_path):
    package = _package(tmp_path, _LAYERED_MODULES | {
        "__init__.py": "from pkg.high import run\n",
        "low/core.py": "import math\n\n\ndef late():\n    from pkg.high import run\n    return run\n",
    })
    edges = module_import_edges(package)
    # a submodule imported from a face names the submodule; the packages above a module are not
    # counted; imports between subpackages (pkg.low.core <-> pkg.high.run) are check (d)'s
    assert edges == {("pkg.low", "pkg.low.core"): "pkg.low:1", ("pkg.low", "pkg.low.table"): "pkg.low:2",
                     ("pkg.low.nested.deep", "pkg.low.core"): "pkg.low.nested.deep:1",
                     ("pkg.low.nested.deep", "pkg.low.nested"): "pkg.low.nested.deep:2",
                     ("pkg.low.table", "pkg.low.core"): "pkg.low.table:1"}
    assert import_cycles(edges) == []
