"""Probe from any function F[B,N,D] -> y[B,...] (flattened to y[B,M])."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from pullback_ext.probes.modes import jvp_friendly
from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features, as_features
from pullback_ext.errors import PullbackError


class CallableProbe(Probe):
    """Wraps ``fn``; runs it with math attention (modules found on ``fn`` if it is an nn.Module)."""

    def __init__(
        self,
        fn: Callable[[Tensor], Tensor],
        num_tokens: int,
        dim: int,
        features: Optional[Callable[[Tensor], Tensor]] = None,
        layer: int = 0,
        num_prefix_tokens: int = 0,
        output_transform: Optional[Tensor] = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn: expected a callable F[B,N,D] -> y[B,M], got {type(fn).__name__}")
        super().__init__(layer, num_tokens, dim, num_prefix_tokens, output_transform)
        self.fn = fn
        self._extract = features

    def features(self, images: Tensor) -> Features:
        """images -> F[B,N,D] from the feature extractor given at construction (no context)."""
        if self._extract is None:
            raise NotImplementedError("this probe was built from example features and has no feature extractor")
        return as_features(self._extract(images))

    def outputs(self, F: Tensor) -> Tensor:
        module = self.fn if isinstance(self.fn, torch.nn.Module) else torch.nn.Module()
        with jvp_friendly(module):
            y = self.fn(F)
        return y.reshape(F.shape[0], -1)


def from_callable(
    fn: Callable[[Tensor], Tensor],
    features: Union[Tensor, Callable[[Tensor], Tensor]],
    num_tokens: Optional[int] = None,
    dim: Optional[int] = None,
    layer: int = 0,
    num_prefix_tokens: int = 0,
    output_transform: Optional[Tensor] = None,
) -> CallableProbe:
    """Probe from ``fn``: F[B,N,D] -> y[B,...].

    ``features`` is either an example feature map F[B,N,D] / [N,D] (N and D are read from it) or a
    feature extractor images -> F, in which case ``num_tokens`` and ``dim`` are required.
    """
    if isinstance(features, Tensor):
        if features.dim() not in (2, 3):
            raise PullbackError(f"features: expected an example F of shape [B,N,D] or [N,D], got {tuple(features.shape)}")
        return CallableProbe(fn, features.shape[-2], features.shape[-1], None, layer, num_prefix_tokens, output_transform)
    if not callable(features):
        raise TypeError(f"features: expected an example tensor or a callable images -> F, got {type(features).__name__}")
    if not isinstance(num_tokens, int) or not isinstance(dim, int) or num_tokens < 1 or dim < 1:
        raise PullbackError(
            f"num_tokens, dim: expected positive ints when features is a callable, got {num_tokens!r}, {dim!r}"
        )
    return CallableProbe(fn, num_tokens, dim, features, layer, num_prefix_tokens, output_transform)
