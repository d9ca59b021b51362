"""What a probe's ``features(images)`` returns: the feature maps F and the per-image context.

Some probe maps read more of the image than F: a depth decoder that also reads hooked layers
*before* the probe layer treats them as constants of the image. ``Features`` carries those
constants next to F, so a probe never has to remember the last batch it saw; ``image_map`` binds
a probe to the context of one image (``Probe.bind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

from torch import Tensor

from pullback_ext.errors import PullbackError


@dataclass(frozen=True)
class Features:
    """F[B,N,D] at the probe layer and ``context[name]`` [B, ...]: per-image constants ψ reads
    besides F (empty when ψ depends on F alone)."""

    F: Tensor
    context: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.F, Tensor) or self.F.dim() != 3:
            got = tuple(self.F.shape) if isinstance(self.F, Tensor) else type(self.F).__name__
            raise PullbackError(f"F: expected feature maps [B,N,D], got {got}")
        for name, value in self.context.items():
            if not isinstance(value, Tensor) or value.dim() < 1 or value.shape[0] != self.F.shape[0]:
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise PullbackError(f"context[{name!r}]: expected a tensor with one row per image ({self.F.shape[0]}), got {got}")

    def __len__(self) -> int:
        return self.F.shape[0]

    def image(self, index: int) -> "Features":
        """Image ``index`` alone: F[1,N,D] and its context rows [1, ...]."""
        if not -len(self) <= index < len(self):
            raise IndexError(f"index: expected an image of the {len(self)} in these features, got {index}")
        rows = slice(index % len(self), index % len(self) + 1)
        return Features(self.F[rows], {k: v[rows] for k, v in self.context.items()})

    def detach(self) -> "Features":
        return Features(self.F.detach(), {k: v.detach() for k, v in self.context.items()})


def as_features(F: Union[Tensor, Features]) -> Features:
    """``F`` itself when it is ``Features``; a bare tensor F[B,N,D] carries no context."""
    return F if isinstance(F, Features) else Features(F)


def image_map(probe: Callable[[Tensor], Tensor], features: Features, index: int) -> Callable[[Tensor], Tensor]:
    """ψ of image ``index``: F[k,N,D] -> y[k,M]. A ``Probe`` is bound to that image's context
    (``probe.bind``); any other callable F -> y is its own map and takes no context."""
    context = features.image(index).context
    bind = getattr(probe, "bind", None)
    if bind is not None:
        return bind(context)
    if context:
        raise PullbackError(f"probe: a plain callable F -> y reads no per-image context, got context {sorted(context)}")
    return probe


def context_rows(context: dict[str, Tensor], batch: int) -> dict[str, Tensor]:
    """The context of a bound probe for a batch of ``batch`` feature maps: as given when it has that
    many rows, one image's rows repeated when it has one."""
    rows = {v.shape[0] for v in context.values()}
    if rows <= {batch}:
        return context
    if rows == {1}:
        return {k: v.expand(batch, *v.shape[1:]) for k, v in context.items()}
    raise PullbackError(
        f"F: expected {rows.pop()} feature maps (one per image of the bound context) or a context of one image, got {batch}"
    )
