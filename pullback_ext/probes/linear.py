"""Per-token linear probes y_t = W F_t (+ b): the Jacobian is I_N ⊗ W, so every diagnostic has a closed form."""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features, as_features
from pullback_ext.errors import PullbackError


class LinearTokenProbe(Probe):
    """y[B, N·C] = (F[B,N,D] Wᵀ + b) flattened; ``features`` delegates to an optional extractor."""

    def __init__(
        self,
        W: Tensor,
        num_tokens: int,
        bias: Optional[Tensor] = None,
        features: Optional[Callable[[Tensor], Tensor]] = None,
        layer: int = 0,
        num_prefix_tokens: int = 0,
        output_transform: Optional[Tensor] = None,
    ) -> None:
        if not isinstance(W, Tensor) or W.dim() != 2 or not W.is_floating_point():
            raise PullbackError(
                "W: expected a floating 2-D tensor [C,D], got "
                + (f"shape {tuple(W.shape)} dtype {W.dtype}" if isinstance(W, Tensor) else type(W).__name__)
            )
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise PullbackError(f"num_tokens: expected a positive int, got {num_tokens!r}")
        if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (W.shape[0],)):
            raise PullbackError(
                f"bias: expected shape [{W.shape[0]}], got "
                + (str(tuple(bias.shape)) if isinstance(bias, Tensor) else type(bias).__name__)
            )
        super().__init__(layer, num_tokens, W.shape[1], num_prefix_tokens, output_transform)
        self.register_buffer("W", W.detach().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._extract = features

    def features(self, images: Tensor) -> Features:
        """images -> F[B,N,D] from the feature extractor given at construction (no context)."""
        if self._extract is None:
            raise NotImplementedError("this linear probe has no feature extractor; pass `features=` when building it")
        return as_features(self._extract(images))

    def outputs(self, F: Tensor) -> Tensor:
        y = F @ self.W.to(F.dtype).T
        if self.bias is not None:
            y = y + self.bias.to(F.dtype)
        return y.reshape(F.shape[0], -1)


def linear_probe(
    W: Tensor,
    num_tokens: int,
    bias: Optional[Tensor] = None,
    features: Optional[Callable[[Tensor], Tensor]] = None,
    layer: int = 0,
    num_prefix_tokens: int = 0,
    output_transform: Optional[Tensor] = None,
) -> LinearTokenProbe:
    """Per-token linear head W[C,D] on N tokens (M = N·C); Jᵀ J = I_N ⊗ WᵀW exactly."""
    return LinearTokenProbe(W, num_tokens, bias, features, layer, num_prefix_tokens, output_transform)
