"""pullback_ext.distributed.shutdown: a barrier before the process group goes on the way out of a
run that succeeded (a rank that closes its gloo connections while another still sends aborts),
none while an exception propagates (the other ranks may never reach it). distributed.leave: a rank
of a torchrun job ends with its exit status, without the interpreter's teardown (where gloo's
worker threads can abort the process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from pullback_ext import distributed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.append("destroy"))
    return seen


def _run(info, fail: bool):
    try:
        if fail:
            raise RuntimeError("a rank failed")
    finally:
        distributed.shutdown(info)


def test_a_run_that_succeeded_waits_for_every_rank_before_the_group_goes(calls):
    _run(distributed.DistInfo(1, 2, 1, True), fail=False)
    assert calls == ["barrier", "destroy"]


def test_a_failing_run_destroys_the_group_without_waiting(calls):
    with pytest.raises(RuntimeError, match="a rank failed"):
        _run(distributed.DistInfo(1, 2, 1, True), fail=True)
    assert calls == ["destroy"]


def test_a_group_the_caller_made_is_left_alone(calls):
    _run(distributed.DistInfo(0, 2, 0, False), fail=False)
    assert calls == []


def test_leave_exits_with_the_code_in_a_process_that_joined_no_group():
    with pytest.raises(SystemExit) as exc:
        distributed.leave(3)
    assert exc.value.code == 3


LEAVING_WORKER = textwrap.dedent(
    """
    import atexit, sys, torch
    from pullback_ext import distributed
    atexit.register(lambda: print("interpreter teardown ran", flush=True))
    info = distributed.init_from_env("gloo")
    try:
        total = torch.ones(3, dtype=torch.float64)
        torch.distributed.all_reduce(total)
        sys.stdout.write(f"rank {info.rank} sum {total.sum().item():g}\\n")  # one write: the ranks share the pipe
    finally:
        distributed.shutdown(info)
    distributed.leave(int(sys.argv[1]))
    """
)


@pytest.mark.distributed
@pytest.mark.parametrize("code", [0, 5])
def test_a_rank_leaves_with_its_code_and_without_the_interpreter_teardown(tmp_path, code):
    script = tmp_path / "worker.py"
    script.write_text(LEAVING_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(code)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    output = f"stdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == ["rank 0 sum 6", "rank 1 sum 6"], output
    assert "interpreter teardown ran" not in proc.stdout, output
    if code == 0:
        assert proc.returncode == 0, output
    else:
        assert proc.returncode != 0 and f"exitcode  : {code}" in proc.stderr, output


def test_the_command_line_ends_with_the_status_of_its_command():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = lambda *args: subprocess.run([sys.executable, "-m", "pullback_ext", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run("--version").returncode == 0
    bad = run("diagnose", "--no-such-option")
    assert bad.returncode == 2 and "pullback diagnose: error:" in bad.stderr, bad.stderr
