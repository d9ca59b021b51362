"""Head schedules: one importance head per stage of a multi-stage reduction, in one folder.

A schedule folder (``pullback train head --stages 2,4,6 --out DIR``) holds one head checkpoint
per stage in ``DIR/stage-<layer>/`` and ``DIR/schedule.json``::

    {"format": "pullback_ext.head_schedule/1", "stages": [2, 4, 6],
     "heads": ["stage-2", "stage-4", "stage-6"], "probe_layers": [1, 3, 5], "model": "demo", ...}

A stage at layer ℓ reduces the *input* of block ℓ, so its head was trained on the output of block
ℓ − 1 (its probe layer). ``schedule.json`` is written last, so a folder that has one is complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.fileio import atomic_write_json

FORMAT = "pullback_ext.head_schedule/1"
SCHEDULE_FILE = "schedule.json"


def stage_folder(layer: int) -> str:
    """The sub-folder name of the head of the stage at ``layer``: ``stage-<layer>``."""
    return f"stage-{layer}"


def check_stages(stages, depth: int, flag: str = "stages") -> tuple:
    """``stages`` as a tuple of strictly increasing block indices in [1, depth − 1]: each stage
    reduces the input of its block, and its head reads the output of the block before."""
    stages = tuple(stages)
    if not stages:
        raise PullbackError(f"{flag}: expected at least one stage layer")
    if any(not isinstance(s, int) or isinstance(s, bool) for s in stages):
        raise PullbackError(f"{flag}: expected block indices (ints), got {list(stages)}")
    if any(b <= a for a, b in zip(stages, stages[1:])):
        raise PullbackError(f"{flag}: expected strictly increasing layers, got {list(stages)}")
    if stages[0] < 1 or stages[-1] > depth - 1:
        raise PullbackError(f"{flag}: expected layers in [1, {depth - 1}] (a stage at layer ℓ reduces the input of block ℓ of "
                            f"this {depth}-block model and its head reads the output of block ℓ - 1), got {list(stages)}")
    return stages


def is_schedule(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding a ``schedule.json``."""
    return (Path(path) / SCHEDULE_FILE).is_file()


def write_schedule(directory: str | os.PathLike, stages, extra: Optional[dict[str, Any]] = None) -> Path:
    """Write ``directory/schedule.json`` (atomically) naming ``stages`` and their sub-folders;
    ``extra`` (the shared probe settings) is stored alongside."""
    stages = tuple(int(s) for s in stages)
    path = Path(directory) / SCHEDULE_FILE
    atomic_write_json(path, {"format": FORMAT, "stages": list(stages), "heads": [stage_folder(s) for s in stages],
                             "probe_layers": [s - 1 for s in stages], **(extra or {})})
    return path


def read_schedule(directory: str | os.PathLike) -> tuple[tuple[Path, ...], tuple[int, ...]]:
    """``(head folders, stage layers)`` named by ``directory/schedule.json``, checked for form
    (the heads are not loaded). Raises CheckpointError when the file is missing or malformed."""
    directory = Path(directory)
    path = directory / SCHEDULE_FILE
    if not path.is_file():
        raise CheckpointError(f"{directory}: not a head schedule (no {SCHEDULE_FILE})")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable schedule ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a head schedule (expected format {FORMAT!r})")
    stages, heads = data.get("stages"), data.get("heads")
    if not (isinstance(stages, list) and isinstance(heads, list) and stages and len(stages) == len(heads)
            and all(isinstance(s, int) and not isinstance(s, bool) for s in stages) and all(isinstance(h, str) for h in heads)):
        raise CheckpointError(f"{path}: expected 'stages' (ints) and 'heads' (folder names) of the same non-zero length")
    return tuple(directory / h for h in heads), tuple(stages)


def load_schedule(directory: str | os.PathLike, dtype: Optional[torch.dtype] = None) -> tuple[tuple, tuple[int, ...]]:
    """``(heads, layers)`` of the head schedule in ``directory``: the importance heads (eval mode,
    frozen, cast to ``dtype`` when given) and their stage layers, ready for
    ``patch.timm(model, head=heads, layers=layers, ...)``. Each head must have been trained on the
    output of the block before its stage (CheckpointError otherwise)."""
    from pullback_ext.metric.checkpoint import load_model

    folders, layers = read_schedule(directory)
    heads = []
    for folder, layer in zip(folders, layers):
        head, config = load_model(folder, kind="head", dtype=dtype)
        trained_on = config.get("probe", {}).get("layer")
        if trained_on != layer - 1:
            raise CheckpointError(f"{folder}: the head of the stage at layer {layer} must be trained on the output of block "
                                  f"{layer - 1}, but its probe layer is {trained_on!r}")
        heads.append(head.eval().requires_grad_(False))
    return tuple(heads), layers
