"""Every command that writes a results folder refuses, before any work, a folder an earlier run
filled: exit 2, one stderr line naming the folder and ``--overwrite``, and the earlier files left
byte for byte; with ``--overwrite`` the run goes ahead and replaces them. Each command runs at the
cheapest settings it has (the demo model, one or two images, a step of training); the demo and
the benchmark run stubbed stages, since their refusal is the command's, not the stages'."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pullback_ext.cli import main

DEMO = ["--model", "demo"]
TRAIN = ["--num-images", "2", "--heldout", "2", "--steps", "1", "--batch-size", "2", "--quiet"]
HEAD = [*DEMO, "--task", "logits", "--rank", "2", "--power", "0", "--hidden", "8", "--heads", "2", "--warmup", "0", *TRAIN]
DIAGNOSE = ["--rank", "2", "--power", "1", "--probes", "4", "--slq-steps", "0"]

# command -> (argv before --out, the file whose content tells the two runs apart, resumable)
COMMANDS = {
    "diagnose": (["diagnose", *DEMO, "--layer", "2", "--task", "logits", "--num-images", "1", *DIAGNOSE, "--quiet"],
                 "diagnosis.json", False),
    "train spn": (["train", "spn", *DEMO, "--layer", "1", *HEAD], "results.json", True),
    "train head": (["train", "head", *DEMO, "--layer", "1", *HEAD], "results.json", True),
    "train vae": (["train", "vae", *DEMO, "--layer", "1", "--latent-dim", "2", "--diagnose-images", "0", *TRAIN],
                  "results.json", True),
    "train head --stages": (["train", "head", *DEMO, "--stages", "2", *HEAD], "schedule.json", True),
    "train tap": (["train", "tap", *DEMO, *TRAIN], "results.json", True),
    "train dtem": (["train", "dtem", *DEMO, "--r", "8", *TRAIN], "results.json", True),
    "evaluate": (["evaluate", *DEMO, "--num-images", "2", "--seeds", "1", "--ratios", "0.5", "--layers", "2",
                  "--strategies", "tome_score", "--no-timing", "--quiet"], "results.json", False),
    "evaluate --pareto": (["evaluate", *DEMO, "--pareto", "--methods", "random", "--ratios", "0.5", "--num-images", "2",
                           "--seeds", "1", "--no-timing", "--quiet"], "pareto.json", False),
    "subprobe": (["subprobe", *DEMO, "--probe", "PROBE", "--num-images", "2", "--k", "1", "--quiet"], "subspace.json", False),
    "study diagnose": (["study", "diagnose", *DEMO, "--layers", "0", "--num-images", "1", "--decoders", "cls", *DIAGNOSE,
                        "--quiet"], "study.json", True),
    "study subspace": (["study", "subspace", *DEMO, "--layers", "0", "--num-images", "2", "--probe-targets", "TARGETS",
                        "--quiet"], "study.json", True),
    "study criteria": (["study", "criteria", *DEMO, "--layers", "0", "--num-images", "2", "--tasks", "cls", "--criteria",
                        "random", "--quiet"], "study.json", True),
    "visualize": (["visualize", *DEMO, "--num-images", "1", "--strategy", "tome", "--r", "8", "--blocks", "2", "--quiet"],
                  "groups.json", False),
    "demo": (["demo", "--quick", "--quiet"], "results.json", False),
    "bench": (["bench", "--quick", "--quiet"], "results.json", False),
}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused_then_overwritten(argv: list, folder: Path, marked: str, resumable: bool, capsys) -> None:
    """A first run into ``folder``; a second is refused and changes nothing; ``--overwrite`` runs
    and replaces ``marked`` (edited in between, so that the two runs' files differ)."""
    assert main([*argv, "--out", str(folder)]) == 0
    target = folder / marked
    target.write_text(json.dumps({"earlier run": json.loads(target.read_text())}))  # tell the two runs apart
    before = _files(folder)
    capsys.readouterr()
    assert main([*argv, "--out", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert str(folder) in err and "--overwrite" in err and "--out" in err, err
    assert ("--resume" in err) == resumable, err
    assert _files(folder) == before, "the refused run changed the earlier run's files"
    assert main([*argv, "--out", str(folder), "--overwrite"]) == 0
    assert "earlier run" not in target.read_text()


@pytest.fixture
def stubbed(monkeypatch):
    """The demo with one instant stage, and a benchmark of one canned row (the refusal is the command's)."""
    from pullback_ext.bench import ops
    from pullback_ext.demo import pipeline
    from pullback_ext.demo.stages import StageResult

    row = {"decoder": "embedding", "layer": 1, "kappa_cap": 0.9, "regime": "v", "regime_name": "low rank, localised",
           "recommended": "either"}
    stage = SimpleNamespace(NAME="diagnostic", run_demo_stage=lambda inputs: StageResult({"table": [row]}),
                            PLAN={True: "a stage", False: "a stage"}, EXPECTED_S={True: 1, False: 1})
    monkeypatch.setattr(pipeline, "STAGES", (stage,))
    bench_row = {"op": "token_importance", "shape": "B=1", "fused_ms": 1.0, "eager_ms": 2.0, "compiled_ms": None,
                 "bytes_moved": 1, "extra": {}, "unchecked_ms": None, "fresh_output_ms": None, "kernels": None,
                 "speedup_vs_eager": 2.0, "speedup_vs_compiled": None, "effective_gbps": 1.0, "share_of_read_bandwidth": 0.5,
                 "unchecked_share_of_read_bandwidth": None}
    monkeypatch.setattr(ops, "run", lambda *args, **kwargs: {
        "device": "cpu", "device_name": "x86_64", "threads": 1, "torch": "x", "compiled_ops": True, "cpu_isa": "x", "quick": True,
        "repeats": 1, "read_bandwidth_gbps": 1.0, "copy_bandwidth_gbps": None, "rows": [dict(bench_row)]})
    monkeypatch.setattr("pullback_ext.machine.busy_note", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def probe_files(tmp_path_factory):
    """A random linear token probe [2, D] of the demo model and per-token targets [2 images, 196
    patches, 1] (no probe fitted on rendered scenes: the cheapest inputs of subprobe and study subspace)."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("probe")
    generator = torch.Generator().manual_seed(0)
    save_file({"weight": torch.randn(2, 192, generator=generator)}, str(folder / "probe.safetensors"))
    save_file({"targets": torch.randn(2, 196, 1, generator=generator)}, str(folder / "targets.safetensors"))
    return {"PROBE": str(folder / "probe.safetensors"), "TARGETS": str(folder / "targets.safetensors")}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_second_run_into_the_same_folder_needs_overwrite(command, tmp_path, capsys, stubbed, probe_files):
    argv, marked, resumable = COMMANDS[command]
    argv = [probe_files.get(a, a) for a in argv]
    _refused_then_overwritten(argv, tmp_path / "out", marked, resumable, capsys)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    folder = tmp_path_factory.mktemp("head") / "head"
    assert main(["train", "head", *DEMO, "--layer", "1", *HEAD, "--out", str(folder)]) == 0
    return folder


def test_eval_head_needs_overwrite_for_a_second_result(head, tmp_path, capsys):
    argv = ["eval-head", "--head", str(head), "--heldout", "2", "--rank", "2", "--quiet"]
    _refused_then_overwritten(argv, tmp_path / "out", "results.json", False, capsys)


def test_resume_and_overwrite_together_are_refused(tmp_path, capsys):
    assert main(["train", "head", *DEMO, "--layer", "1", *HEAD, "--out", str(tmp_path), "--resume", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--overwrite" in err and "--resume" in err and len(err.splitlines()) == 1


def test_a_folder_without_earlier_results_is_not_refused(tmp_path):
    """Only what the command itself writes counts: other files (another command's, a training
    run's target cache) do not make a folder an earlier run of this command."""
    from pullback_ext.commands.arguments import refuse_earlier_results

    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "manifest.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    args = SimpleNamespace(overwrite=False, resume=False)
    refuse_earlier_results(args, tmp_path, ("results.json", "layers/layer-*.json"), "a run")
    (tmp_path / "layers").mkdir()
    (tmp_path / "layers" / "layer-03.json").write_text("{}")
    from pullback_ext.errors import PullbackError

    with pytest.raises(PullbackError, match=r"already holds a run \(layers/layer-03\.json\); pass --overwrite"):
        refuse_earlier_results(args, tmp_path, ("results.json", "layers/layer-*.json"), "a run")


def test_study_diagnose_progress_moves_inside_a_layer(tmp_path, capsys):
    """One layer, two images, two decoders: the sweep's progress (off a terminal: plain lines on
    stderr) counts each image under each decoder, names the decoder and image in hand, and counts
    the passes through ψ within an image (randomized SVD: several batches of products)."""
    argv = ["study", "diagnose", *DEMO, "--layers", "3", "--num-images", "2", "--decoders", "cls,depth", "--output-size", "2",
            *DIAGNOSE, "--svd", "randomized", "--out", str(tmp_path / "out")]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("study diagnose:")]
    at = {line.split()[2]: line for line in lines}  # the last line at each count
    assert list(at) == ["0/4", "1/4", "2/4", "3/4", "4/4"], lines
    assert "decoder=cls, image=1/2" in at["1/4"] and "decoder=depth, image=2/2" in at["4/4"], lines
    assert all("layer=3 (1/1)" in line for line in lines[1:]), lines
    assert max(int(line.rsplit("passes=", 1)[1].rstrip("]")) for line in lines[1:]) > 1, lines


def test_a_heartbeat_line_comes_while_a_long_step_reports(monkeypatch):
    """A step that takes minutes still writes a line at least every heartbeat, as long as it
    reports (a status change), and none more often."""
    from pullback_ext import progress

    now = [0.0]
    monkeypatch.setattr(progress, "time", SimpleNamespace(monotonic=lambda: now[0]))
    stream = io.StringIO()
    bar = progress.progress_bar(total=100, desc="work", unit="step", stream=stream, heartbeat=30)
    for now[0], passes in ((10, 1), (31, 2), (40, 3), (62, 4)):
        bar.set_postfix(passes=passes)
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 4)[-1] for line in lines] == ["0.0 s", "31.0 s [passes=2]", "62.0 s [passes=4]"], lines
    assert all("0/100" in line for line in lines)
