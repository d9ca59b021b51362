"""The probe-map protocol: ψ_ℓ maps the features F[B,N,D] of one ViT layer to task outputs y[B,M].

A probe knows how to produce its own input (``features``: images -> ``Features``, F at layer
``layer`` with any per-image context) and how to run everything downstream of that layer
(``forward``: remaining blocks, decoder, optional output transform L). The diagnostic
differentiates ``forward`` only, of the probe bound to one image's context (``bind``). A probe
keeps no state between calls: what one image needs besides F travels in its ``Features``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.probes.features import Features


class Probe(torch.nn.Module):
    """ψ_ℓ: features F[B,N,D] at layer `layer` -> outputs y[B,M].

    Attributes:
        layer: index of the ViT block whose output is F (0-based; ``features`` returns the
            tokens after block ``layer``).
        num_tokens: N, all tokens including CLS and registers.
        dim: D, the channel width.
        num_prefix_tokens: number of leading non-patch tokens (CLS + registers).
        output_transform: optional L[M_out,M]; when set, ``forward`` returns L·y, so the
            Euclidean metric on the transformed output is the metric H = LᵀL on y (docs/formulas.md writes
            H = L Lᵀ for the transposed factor).

    Subclasses implement ``features`` and ``outputs`` (or override ``forward`` and call
    ``apply_output_transform`` themselves); those whose ψ also reads constants of the image name
    them in ``context_keys``, return them in ``Features.context`` and implement ``_bind``.
    """

    layer: int
    num_tokens: int
    dim: int
    num_prefix_tokens: int

    def __init__(
        self,
        layer: int,
        num_tokens: int,
        dim: int,
        num_prefix_tokens: int = 0,
        output_transform: Optional[Tensor] = None,
    ) -> None:
        super().__init__()
        self.layer = int(layer)
        self.num_tokens = int(num_tokens)
        self.dim = int(dim)
        self.num_prefix_tokens = int(num_prefix_tokens)
        self._output_dim: Optional[int] = None
        if output_transform is not None:
            if not isinstance(output_transform, Tensor) or output_transform.dim() != 2:
                raise PullbackError(
                    "output_transform: expected a 2-D tensor L[M_out, M], got "
                    f"{type(output_transform).__name__}"
                    + (f" of shape {tuple(output_transform.shape)}" if isinstance(output_transform, Tensor) else "")
                )
        self.register_buffer("output_transform", output_transform, persistent=False)

    @property
    def num_patch_tokens(self) -> int:
        """Tokens that sit on the patch grid (N minus CLS and registers)."""
        return self.num_tokens - self.num_prefix_tokens

    @property
    def ambient_dim(self) -> int:
        """P = N·D."""
        return self.num_tokens * self.dim

    def features(self, images: Tensor) -> Features:
        """images[B,3,H,W] -> ``Features``: F[B,N,D] at layer ``layer`` and the context ``bind`` takes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement features()")

    def outputs(self, F: Tensor) -> Tensor:
        """F[B,N,D] -> raw task outputs y[B,M] (before the output transform)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement outputs()")

    def apply_output_transform(self, y: Tensor) -> Tensor:
        """y[B,M] -> (L y)[B,M_out] when an output transform L[M_out,M] is set, else y."""
        L = self.output_transform
        if L is None:
            return y
        if L.shape[1] != y.shape[-1]:
            raise PullbackError(
                f"output_transform: expected L with {y.shape[-1]} columns (the probe's output "
                f"dim M), got shape {tuple(L.shape)}"
            )
        return y @ L.to(dtype=y.dtype, device=y.device).T

    def forward(self, F: Tensor) -> Tensor:
        """F[B,N,D] -> y[B,M] (output transform applied)."""
        return self.apply_output_transform(self.outputs(F))

    @property
    def context_keys(self) -> tuple[str, ...]:
        """Names of the per-image constants ψ reads besides F (``Features.context``); none by default."""
        return ()

    def bind(self, context: dict[str, Tensor]) -> "Probe":
        """ψ with the per-image context given (``features(images).context``, or one image's rows of
        it): F[k,N,D] -> y[k,M]. A probe whose ψ depends on F alone takes an empty context and
        returns itself."""
        keys = self.context_keys
        if set(context) != set(keys):
            raise PullbackError(
                f"context: this probe reads {list(keys) or 'nothing'} of each image besides F, got "
                f"{sorted(context) or 'no context'}; pass the Features of probe.features(images), not only its tensor"
            )
        return self._bind(context) if keys else self

    def _bind(self, context: dict[str, Tensor]) -> "Probe":
        """The bound map of a probe with ``context_keys`` (subclasses that read context override it)."""
        raise NotImplementedError(f"{type(self).__name__} declares context {self.context_keys} but cannot bind it")

    def check_features(self, F: Tensor, name: str = "F") -> None:
        """Raise unless F is a floating tensor (else TypeError) of shape [B,N,D] or [N,D] for this probe."""
        if not isinstance(F, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(F).__name__}")
        if not F.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got dtype {F.dtype}")
        if F.dim() not in (2, 3) or tuple(F.shape[-2:]) != (self.num_tokens, self.dim):
            raise PullbackError(
                f"{name}: expected shape [B,{self.num_tokens},{self.dim}] or "
                f"[{self.num_tokens},{self.dim}] (N, D of the probe), got {tuple(F.shape)}"
            )

    @property
    def output_dim(self) -> int:
        """M, found by running ``forward`` once on a zero feature map (cached)."""
        if self._output_dim is None:
            param = next(iter(self.parameters()), None)
            buf = next(iter(self.buffers()), None)
            ref = param if param is not None else buf
            device = ref.device if ref is not None else torch.device("cpu")
            dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
            with torch.no_grad():
                y = self.forward(torch.zeros(1, self.num_tokens, self.dim, device=device, dtype=dtype))
            self._output_dim = int(y.shape[-1])
        return self._output_dim
