"""pullback_ext.distributed.shutdown: a barrier before the process group goes on the way out of a
run that succeeded (a rank that closes its gloo connections while another still sends aborts),
none while an exception propagates (the other ranks may never reach it)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from pullback_ext import distributed


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
