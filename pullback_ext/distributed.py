"""torchrun helpers: process-group setup from the environment, sharding, gathering Python objects,
ending a rank's process.

Without torchrun (no ``WORLD_SIZE`` in the environment) everything degrades to a single process.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, Sequence, TypeVar

import torch
import torch.distributed as dist
from pullback_ext.errors import PullbackError

T = TypeVar("T")

_joined_a_group = False  # set once init_from_env has created a process group in this process


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    initialised_here: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(backend: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, nccl when CUDA is available).

    Returns rank 0 of 1 outside torchrun. Safe to call when a group already exists.
    """
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), False)
    if not launched_by_torchrun():
        return DistInfo(0, 1, 0, False)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    global _joined_a_group
    _joined_a_group = True
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, True)


def shutdown(info: DistInfo) -> None:
    """Destroy the process group if ``init_from_env`` created it (call it from a ``finally``).

    On the way out of a run that succeeded every rank first waits at a barrier, so that no rank
    tears down its connections while another (rank 0, still writing its checkpoint) has yet to
    reach the end. While an exception propagates it destroys at once: the other ranks may never
    reach a barrier."""
    if info.initialised_here and dist.is_initialized():
        if sys.exc_info()[0] is None:
            dist.barrier()
        dist.destroy_process_group()


def leave(code: int) -> NoReturn:
    """End the process with exit status ``code``: ``sys.exit`` unless ``init_from_env`` created a
    process group here; then ``os._exit`` once stdout, stderr and the logging handlers are flushed.

    With torch 2.14 ``destroy_process_group`` leaves gloo's worker threads running, and one can
    still be releasing a finished collective when the interpreter starts its teardown. If that
    release drops the last reference to a tensor Python has seen, the worker asks for the GIL, and
    a thread that does so during teardown is ended by an unwind that aborts the whole process
    (SIGABRT, "terminate called without an active exception"): the run's work is done and saved,
    but torchrun reports the rank as failed. Leaving through ``os._exit`` skips that teardown; call
    ``shutdown`` (and close files) first.
    """
    if _joined_a_group:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


def shard(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """Round-robin share of ``items`` for ``rank``: items[rank], items[rank + world_size], ..."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise PullbackError(f"rank, world_size: expected 0 <= rank < world_size, got {rank}, {world_size}")
    return list(items[rank::world_size])


def shard_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Indices 0..n-1 belonging to ``rank`` (same rule as ``shard``)."""
    return shard(range(n), rank, world_size)


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` in rank order (on all ranks); ``[obj]`` in a single process."""
    if info.world_size == 1:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def unshard(parts: Sequence[Sequence[T]]) -> list[T]:
    """Inverse of ``shard`` over all ranks: interleave the per-rank lists back into the original order."""
    world = len(parts)
    total = sum(len(p) for p in parts)
    return [parts[i % world][i // world] for i in range(total)]
