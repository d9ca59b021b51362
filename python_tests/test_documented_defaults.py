"""Every default the docs state equals the code's: the `DiagnoseConfig` table of docs/diagnose.md,
the `TrainConfig` table of docs/metric.md and the command-line defaults its "Defaults, and why"
names (the vocabulary table of docs/cli.md is checked option by option in test_cli_vocabulary.py)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from pullback_ext.cli import build_parser
from pullback_ext.diagnostics import DiagnoseConfig, Thresholds, diagnose
from pullback_ext.metric import TrainConfig

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _field_table(page: str, header: str = "| field | default | meaning |") -> dict[str, str]:
    """``{name: default cell}`` of the first table of ``page`` whose header is ``header`` (or
    ``| option | default | meaning |``)."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() in (header, "| option | default | meaning |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        name, default = (cell.strip() for cell in line.strip().strip("|").split("|")[:2])
        rows[name.strip("`")] = default.strip("`")
    return rows


def _value(cell: str):
    """A default cell as a Python value: a number, True/False/None, or a quoted string."""
    if cell in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[cell]
    if cell.startswith('"') and cell.endswith('"'):
        return cell[1:-1]
    return float(cell)


def test_the_diagnose_config_table_states_the_code_defaults():
    documented = _field_table("diagnose.md")
    defaults = {f.name: f.default for f in dataclasses.fields(DiagnoseConfig) if f.default is not dataclasses.MISSING}
    defaults["thresholds"] = DiagnoseConfig().thresholds
    assert set(documented) - {"keep_vectors"} == set(defaults) - {"adaptive_tol"}, "a field missing from the table (or a stale row)"
    for name, cell in documented.items():
        if name == "thresholds":
            kappa, cv = map(float, re.fullmatch(r"κ ([\d.]+), CV ([\d.]+)", cell).groups())
            assert Thresholds(kappa=kappa, cv=cv) == defaults["thresholds"]
        elif name == "keep_vectors":  # an argument of diagnose(), not a config field
            assert inspect.signature(diagnose).parameters["keep_vectors"].default is _value(cell)
        else:
            assert _value(cell) == defaults[name], f"docs/diagnose.md: {name} = {cell}, the code's is {defaults[name]!r}"


def test_the_train_config_table_states_the_code_defaults():
    documented = _field_table("metric.md")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert set(documented) == set(defaults), "a field missing from the table (or a stale row)"
    for name, cell in documented.items():
        assert _value(cell) == defaults[name], f"docs/metric.md: {name} = {cell}, the code's is {defaults[name]!r}"


def _train_parser() -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]


@pytest.mark.parametrize("option,documented", [
    ("--targets", "randnla"),  # "RandNLA targets with q = 1 power round (--targets randnla --power 1)"
    ("--power", 1),
    ("--hidden", None),  # "A head sized to the backbone by default (--hidden, --heads, --mlp-hidden unset ...)"
    ("--heads", None),
    ("--w-rank", 0.5),  # "w_rank = 0.5"
    ("--target", "imp"),  # "imp*, not the plain block norm (--target imp)"
    ("--ema", 0.0),  # "Weight averaging (--ema 0.999, off by default)"
    ("--mlp-hidden", None),  # sized with the head unless given
])
def test_the_train_defaults_metric_md_names_are_the_parser_defaults(option, documented):
    page = (DOCS / "metric.md").read_text()
    assert option.lstrip("-").replace("-", "_") in page.replace("-", "_"), f"docs/metric.md no longer names {option}"
    action = next(a for a in _train_parser()._actions if option in a.option_strings)
    assert action.default == documented
