"""TAP checkpoints: the task register (and TAP-J's LoRA adapters) in the metric checkpoint format
(:mod:`pullback_ext.metric.checkpoint`: ``model.safetensors`` + ``config.json``, kind ``tap``).
The metric package knows only its own kinds; this module adds 'tap' (:func:`model_classes`)."""

from __future__ import annotations

import os

import torch
from torch import nn

from pullback_ext.errors import PullbackError
from pullback_ext.metric import checkpoint
from pullback_ext.tap.register import TaskRegister


def model_classes() -> dict[str, type]:
    """{kind: model class} of every model stored in the checkpoint format: the metric models and
    TAP's register ('tap')."""
    return checkpoint.model_classes() | {"tap": TaskRegister}


def load_model(path: str | os.PathLike, kind: str | None = None, dtype: torch.dtype | None = None) -> tuple[nn.Module, dict]:
    """:func:`pullback_ext.metric.checkpoint.load_model` knowing every kind, 'tap' included ->
    (model in eval mode, config)."""
    return checkpoint.load_model(path, kind, dtype, classes=model_classes())


def load_register(path: str | os.PathLike) -> TaskRegister:
    """The :class:`TaskRegister` stored in the TAP checkpoint folder ``path`` (eval mode)."""
    register, _ = load_model(path, kind="tap")
    return register


def as_register(head) -> TaskRegister:
    """``head=`` of ``strategy="tap"``: a :class:`TaskRegister`, or a TAP checkpoint folder."""
    if isinstance(head, TaskRegister):
        return head
    if isinstance(head, (str, os.PathLike)):
        return load_register(head)
    raise PullbackError(f"strategy 'tap' needs head= (a TAP checkpoint folder from `pullback train tap`, or a TaskRegister); "
                        f"got {head!r}")
