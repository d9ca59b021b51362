"""The tasks a reduced model is compared on: one table that ``pullback evaluate`` (plain and
``--pareto``), the backbones and the cost accounting read.

A task names the output its decoder gives (the key of the backbone outputs), whether that output is
dense (a map read at full length from the hooked layers: merged tokens are restored and
``--mode auto`` prunes), its per-image error measures (primary first; names of
:mod:`pullback_ext.comparison.quality` functions scaled ×100), the decoder its FLOPs count and the
decoder's name as pages print it.
Kept free of torch so the command line can build its options from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pullback_ext.errors import PullbackError


@dataclass(frozen=True)
class Task:
    name: str
    output: str  # key of the task's output in a backbone's outputs
    dense: bool  # a map from the hooked layers (merge-and-restore; mode auto prunes)
    metrics: tuple  # per-image errors against the unreduced model, primary first
    decoder: str  # what its FLOP count includes besides the backbone
    label: str  # the decoder as pages and summaries name it

    @property
    def primary(self) -> str:
        return self.metrics[0]

    @property
    def auto_mode(self) -> str:
        """The reduction mode ``--mode auto`` picks: prune for a dense task, merge otherwise."""
        return "prune" if self.dense else "merge"


TASKS = {
    "cls": Task("cls", "embedding", False, ("cosine_x100",), "the CLS head", "CLS embedding"),
    "depth": Task("depth", "depth", True, ("silog_x100", "cosine_x100"), "the depth decoder on its hooked layers", "DPT depth"),
    "segmentation": Task("segmentation", "segmentation", True, ("pixel_kl_x100", "miou_gap_x100", "cosine_x100"),
                         "the segmentation head on the same hooked layers", "DPT segmentation"),
}
DENSE = tuple(name for name, task in TASKS.items() if task.dense)


def get(name: str) -> Task:
    """The :class:`Task` called ``name``; an unknown one is a :class:`~pullback_ext.errors.PullbackError`."""
    if name not in TASKS:
        raise PullbackError(f"task {name!r}: choose from {', '.join(TASKS)}")
    return TASKS[name]


def resolve_mode(mode: str, task: str) -> str:
    """``mode`` (``auto``, ``merge`` or ``prune``) with ``auto`` resolved for ``task``."""
    return get(task).auto_mode if mode == "auto" else mode
