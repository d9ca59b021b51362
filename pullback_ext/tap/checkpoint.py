"""TAP checkpoints: the task register (and TAP-J's LoRA adapters) in the metric checkpoint format
(:mod:`pullback_ext.metric.checkpoint`: ``model.safetensors`` + ``config.json``, kind ``tap``)."""

from __future__ import annotations

import os

from pullback_ext.errors import PullbackError
from pullback_ext.metric import checkpoint
from pullback_ext.tap.register import TaskRegister


def load_register(path: str | os.PathLike) -> TaskRegister:
    """The :class:`TaskRegister` stored in the TAP checkpoint folder ``path`` (eval mode)."""
    register, _ = checkpoint.load_model(path, kind="tap")
    return register


def as_register(head) -> TaskRegister:
    """``head=`` of ``strategy="tap"``: a :class:`TaskRegister`, or a TAP checkpoint folder."""
    if isinstance(head, TaskRegister):
        return head
    if isinstance(head, (str, os.PathLike)):
        return load_register(head)
    raise PullbackError(f"strategy 'tap' needs head= (a TAP checkpoint folder from `pullback train tap`, or a TaskRegister); "
                        f"got {head!r}")
