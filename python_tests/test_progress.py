"""Progress output: tqdm's bar on a terminal, one plain line per tenth of a stage anywhere else,
nothing with ``--quiet``; checked on the helper and on a real command whose stderr is not a
terminal (a captured stream, as a log file or a pipe would be)."""

from __future__ import annotations

import io

import pytest

from pullback_ext.cli import main
from pullback_ext.progress import LineProgress, info_line, progress_bar, silenced


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_stage_writes_a_line_per_tenth():
    stream = io.StringIO()
    for _ in progress_bar(range(1000), desc="work", unit="item", stream=stream):
        pass
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert len(lines) == 11  # the start, then every tenth
    assert lines[0].startswith("work: 0/1000 item (0%)") and lines[-1].startswith("work: 1000/1000 item (100%)")


def test_updates_by_hand_postfix_and_an_early_end():
    stream = io.StringIO()
    with progress_bar(total=7, desc="cost", unit="run", stream=stream) as bar:
        bar.set_postfix(loss="0.5")
        bar.update(3)
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 2)[1] for line in lines] == ["0/7", "3/7"] and lines[-1].endswith("[loss=0.5]")
    stream = io.StringIO()
    bar = progress_bar(total=None, desc="open", stream=stream)
    bar.update(5)
    bar.close()
    bar.close()
    assert stream.getvalue().splitlines()[-1].startswith("open: 5 it") and len(stream.getvalue().splitlines()) == 2


def test_a_terminal_gets_tqdm_and_disabled_or_silenced_get_nothing():
    from tqdm import tqdm

    terminal = Terminal()
    bar = progress_bar(range(3), desc="t", stream=terminal)
    assert isinstance(bar, tqdm) and not isinstance(bar, LineProgress)
    list(bar)
    assert "\r" in terminal.getvalue()
    stream = io.StringIO()
    list(progress_bar(range(50), desc="off", stream=stream, enabled=False))
    with silenced():
        list(progress_bar(range(50), desc="quiet", stream=Terminal()))
        list(progress_bar(range(50), desc="quiet", stream=stream))
    assert stream.getvalue() == ""


def test_info_lines_are_silenced_results_are_not(capsys):
    with silenced():
        info_line("wrote somewhere")
        print("a result")
    info_line("wrote here")
    assert capsys.readouterr().out == "a result\nwrote here\n"


def _train(image_folder, out, *extra):
    return main(["train", "head", "--model", "timm:vit_tiny_patch16_224", "--img-size", "32", "--layer", "10",
                 "--images", str(image_folder(count=6, size=(40, 40))), "--num-images", "4", "--heldout", "2", "--rank", "2",
                 "--steps", "40", "--batch-size", "2", "--hidden", "8", "--heads", "1", "--warmup", "1",
                 "--checkpoint-every", "40", "--out", str(out), *extra])


def test_a_command_logged_to_a_file_writes_few_plain_lines(image_folder, tmp_path, capsys):
    assert _train(image_folder, tmp_path / "run") == 0
    captured = capsys.readouterr()
    training = [line for line in captured.err.splitlines() if line.startswith("train head:")]
    assert 2 <= len(training) <= 11 and "\r" not in captured.err, captured.err
    assert training[-1].startswith("train head: 40/40 step (100%)")
    assert "wrote" in captured.out and "held-out Spearman rho" in captured.out


def test_quiet_silences_progress_and_info_but_not_results_or_warnings(image_folder, tmp_path, capsys):
    assert _train(image_folder, tmp_path / "quiet", "--quiet", "--threads", "1") == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "wrote" not in captured.out and "held-out Spearman rho" in captured.out


def test_train_no_progress_is_the_old_spelling_of_quiet():
    from pullback_ext.cli import build_parser
    from pullback_ext.commands.arguments import renamed_switch

    parse = build_parser().parse_args
    with pytest.warns(FutureWarning, match="--no-progress is deprecated.*write --quiet"):
        assert renamed_switch(parse(["train", "head", "--out", "o", "--no-progress"]), "--no-progress", "--quiet")
    assert renamed_switch(parse(["train", "head", "--out", "o", "--quiet"]), "--no-progress", "--quiet")
    assert not renamed_switch(parse(["train", "head", "--out", "o"]), "--no-progress", "--quiet")
