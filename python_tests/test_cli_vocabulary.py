"""The command-line vocabulary table of docs/cli.md against every subcommand's parser: each option
the table lists for a command exists there with that default (and is absent where the table says
``—``), and every option of a parser that names a shared concept is in the table. The old
spellings of the "Old spellings" table still parse and warn."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pullback_ext.cli import COMMANDS, build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
DEPRECATED_HELP = "deprecated spelling of"
# Options that name a concept several commands share even where only one command has them today.
CONCEPTS = {"--model", "--weights", "--images", "--num-images", "--head", "--spn", "--layer", "--layers", "--stages",
            "--task", "--targets", "--seed", "--seeds", "--out", "--threads", "--quiet", "--no-progress"}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table(header_start: str) -> list[dict[str, str]]:
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    header = _cells(lines[start])
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, _cells(line))))
    return rows


def _flag(cell: str) -> str:
    return re.match(r"`(--[a-z-]+)", cell)[1]


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


SUBPARSERS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
TABLE = {_flag(row["flag"]): row for row in _table("| flag |")}


def _expected(action: argparse.Action | None) -> str:
    if action is None or (action.help or "").startswith(DEPRECATED_HELP):
        return "—"  # a deprecated spelling lives in the old-spellings table
    if action.required:
        return "required"
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    return "optional" if action.default is None else f"`{action.default}`"


def test_the_table_has_a_column_per_command_and_no_empty_row():
    assert set(next(iter(TABLE.values()))) == {"flag", "meaning and convention", *COMMANDS}
    for flag, row in TABLE.items():
        assert any(row[c] != "—" for c in COMMANDS), f"{flag}: no command has it"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_parser_agrees_with_the_table(command):
    options = _options(SUBPARSERS[command])
    for flag, row in TABLE.items():
        cell, action = row[command], options.get(flag)
        expected = _expected(action)
        if cell == "required" and expected == "optional":
            continue  # required at run time, where the error can say what to give
        assert cell == expected, f"docs/cli.md, {flag} of `pullback {command}`: the table says {cell}, the parser {expected}"


def test_every_shared_option_is_in_the_table():
    counts: dict[str, int] = {}
    for parser in SUBPARSERS.values():
        for flag, action in _options(parser).items():
            if not (action.help or "").startswith(DEPRECATED_HELP):
                counts[flag] = counts.get(flag, 0) + 1
    shared = {flag for flag, n in counts.items() if n > 1 or flag in CONCEPTS}
    assert not shared - set(TABLE), f"shared options missing from docs/cli.md: {sorted(shared - set(TABLE))}"


def test_every_deprecated_option_is_an_old_spelling_of_the_table():
    old = {re.match(r"`(--[a-z-]+)", row["old"])[1] for row in _table("| old |")}
    for command, parser in SUBPARSERS.items():
        for flag, action in _options(parser).items():
            if (action.help or "").startswith(DEPRECATED_HELP):
                assert flag in old, f"`pullback {command} {flag}` is deprecated but not in docs/cli.md's old spellings"


def test_eval_head_checkpoint_is_the_old_spelling_of_head():
    from pullback_ext.commands.arguments import renamed
    from pullback_ext.errors import PullbackError

    args = build_parser().parse_args(["eval-head", "--checkpoint", "runs/head"])
    with pytest.warns(FutureWarning, match="--checkpoint is deprecated.*write --head"):
        assert renamed(args, "--checkpoint", "--head") == "runs/head"
    args = build_parser().parse_args(["eval-head", "--checkpoint", "runs/a", "--head", "runs/b"])
    with pytest.warns(FutureWarning), pytest.raises(PullbackError, match="--checkpoint: conflicts with --head"):
        renamed(args, "--checkpoint", "--head")
    assert renamed(build_parser().parse_args(["eval-head", "--head", "runs/b"]), "--checkpoint", "--head") == "runs/b"


def test_task_means_the_cls_embedding_for_every_model_and_the_old_decoder_keeps_its_meaning():
    import argparse

    import pytest

    from pullback_ext.commands.arguments import add_task_argument, probe_decoder
    from pullback_ext.errors import PullbackError

    parser = argparse.ArgumentParser()
    add_task_argument(parser)
    parse = parser.parse_args
    assert probe_decoder(parse(["--task", "cls"]), "demo") == "embedding"  # the demo probe's CLS embedding
    assert probe_decoder(parse(["--task", "logits"]), "demo") == "cls"  # the demo probe's class logits
    assert probe_decoder(parse(["--task", "cls"]), "timm:vit_small_patch16_224") == "cls"
    assert probe_decoder(parse([]), "demo", default="cls") == "embedding" and probe_decoder(parse([]), "demo") is None
    assert probe_decoder(parse(["--task", "depth"]), "demo") == "depth"
    with pytest.raises(PullbackError, match="--task logits"):
        probe_decoder(parse(["--task", "logits"]), "timm:vit_small_patch16_224")
    with pytest.raises(PullbackError, match="spelled cls"):
        probe_decoder(parse(["--task", "embedding"]), "demo")
    with pytest.warns(FutureWarning, match="write --task logits"):
        assert probe_decoder(parse(["--decoder", "cls"]), "demo") == "cls"  # old meaning kept
    with pytest.warns(FutureWarning, match="write --task cls"):
        assert probe_decoder(parse(["--decoder", "embedding"]), "demo") == "embedding"
    with pytest.raises(PullbackError, match="conflicts with --task"):
        probe_decoder(parse(["--decoder", "cls", "--task", "cls"]), "demo")


def _help(*argv: str) -> str:
    import contextlib
    import io

    from pullback_ext.cli import main

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main([*argv, "--help"]) == 0
    return text.getvalue()


def test_the_top_level_help_names_every_train_target_tap_included():
    line = next(line for line in _help().splitlines() if line.strip().startswith("train "))
    train = next(a for a in SUBPARSERS["train"]._actions if a.dest == "kind")
    assert set(train.choices) == {"spn", "head", "vae", "tap", "dtem", "finetune"}
    for words in ("SPN", "importance head", "VAE", "TAP", "DTEM", "fine-tune"):
        assert words in line, line


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_help_has_two_sections_of_one_name(command):
    sections = [line[:-1] for line in _help(command).splitlines() if re.fullmatch(r"[a-z][^:]*:", line)]
    assert len(sections) == len(set(sections)), sections


@pytest.mark.parametrize("command,argv,resumable", [
    ("study", ["study", "diagnose", "--model", "demo", "--out", "x"], True),
    ("train", ["train", "head", "--model", "demo", "--out", "x"], True),
    ("diagnose", ["diagnose", "--model", "demo", "--out", "x"], False),
])
def test_the_interrupt_message_says_how_to_resume_where_a_command_can(monkeypatch, capsys, command, argv, resumable):
    import importlib

    from pullback_ext.cli import main

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(COMMANDS[command][0]), "run", interrupted)
    assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"pullback {command}: interrupted") and len(err.splitlines()) == 1
    assert ("--resume" in err) == resumable, err
