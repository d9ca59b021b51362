"""Models by name: the one grammar ``demo | timm:NAME | hf:DIR`` and the loading of each kind."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError

MODEL_GRAMMAR = "demo | timm:NAME | hf:DIR"
KINDS = ("demo", "timm", "hf")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model name: ``kind`` demo | timm | hf, and ``name`` (the timm model name or the
    transformers folder; empty for demo). ``str(spec)`` is the canonical spelling."""

    kind: str
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS or (self.kind == "demo") == bool(self.name):
            raise PullbackError(f"--model: expected {MODEL_GRAMMAR}, got kind {self.kind!r} and name {self.name!r}")

    def __str__(self) -> str:
        return self.kind if self.kind == "demo" else f"{self.kind}:{self.name}"


def parse_model(text: str, flag: str = "--model") -> ModelSpec:
    """``"demo"``, ``"timm:NAME"`` or ``"hf:DIR"`` -> :class:`ModelSpec`.

    A bare ``NAME`` (no prefix) still means ``timm:NAME`` for this release, with a FutureWarning.
    """
    if not isinstance(text, str) or not text.strip():
        raise PullbackError(f"{flag}: expected {MODEL_GRAMMAR}, got {text!r}")
    if text == "demo":
        return ModelSpec("demo")
    kind, colon, name = text.partition(":")
    if not colon:
        warnings.warn(f"{flag} {text}: a bare timm model name is deprecated and will be removed in the next release; "
                      f"write {flag} timm:{text}", FutureWarning, stacklevel=2)
        return ModelSpec("timm", text)
    if kind not in ("timm", "hf") or not name:
        raise PullbackError(f"{flag}: expected {MODEL_GRAMMAR}, got {text!r}")
    return ModelSpec(kind, name)


def create_timm(name: str, weights: Optional[str], img_size: Optional[int] = None, headless: bool = False) -> torch.nn.Module:
    """``timm.create_model(name, pretrained=False)`` (at ``img_size``; without a classifier when
    ``headless``), then strictly the local ``weights``; eval mode, no gradients."""
    import timm

    from pullback_ext.sources.weights import load_into

    kwargs = {"img_size": img_size} if img_size is not None else {}
    if headless:
        kwargs["num_classes"] = 0
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as exc:
        raise PullbackError(f"--model: timm has no model {name!r} ({exc})") from exc
    if weights is not None:
        load_into(model, weights)
    return model.eval().requires_grad_(False)


def load_model(spec: ModelSpec, weights: Optional[str] = None, img_size: Optional[int] = None,
               headless: bool = False, random_weights: bool = False) -> tuple[torch.nn.Module, Optional[str]]:
    """``(model, weights file used)`` for ``spec`` in float32 and eval mode, without gradients.

    ``weights``: a local file (hf:DIR: default the folder's own weights; demo: default the
    shipped ones; timm: default random). ``img_size`` builds a timm model for that input size;
    ``headless`` drops a timm model's classifier. An hf:DIR folder without weights is refused
    unless ``random_weights`` (see :func:`~pullback_ext.sources.hf_models.load_hf_model`).
    """
    if img_size is not None and spec.kind != "timm":
        raise PullbackError(f"--img-size: only applies to timm models, got --model {spec}")
    if spec.kind == "demo":
        from pullback_ext.embedded import load

        return load(weights), weights
    if spec.kind == "hf":
        from pullback_ext.sources.hf_models import load_hf_model

        return load_hf_model(spec.name, weights, random_weights)
    return create_timm(spec.name, weights, img_size, headless), weights
