"""Matrix-free Jacobian operators J = ∂ψ/∂F of shape (M, P), P = N·D.

Only products are exposed: ``jvp(V[P,k]) -> [M,k]`` (forward mode) and ``vjp(U[M,k]) -> [P,k]``
(reverse mode). Tangents are batched with ``torch.func.vmap`` in chunks of ``chunk_size`` so that
memory stays bounded by the chunk, not by k.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor
from pullback_ext.errors import PullbackError


@functools.cache
def load_forward_ad() -> None:
    """Load torch's forward-mode AD decompositions ahead of the first JVP.

    torch imports them lazily at the first ``make_dual`` and scripts them with ``torch.jit.script``,
    which recent torch releases flag with a FutureWarning the caller can do nothing about. Importing
    the module here with that one warning ignored (inside ``catch_warnings``, so no filter outlives
    the import) keeps it from reaching the user; any other warning still shows.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning)
        from torch._decomp import decompositions_for_jvp  # noqa: F401


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """Route ``scaled_dot_product_attention`` to the math kernel, which supports forward-mode AD.

    The fused CPU/flash kernels have no forward derivative; the math kernel computes the same
    function. The previous backend selection is restored on exit.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def _check_block(X: Tensor, rows: int, name: str, like: Tensor) -> None:
    if not isinstance(X, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(X).__name__}")
    if X.dim() != 2 or X.shape[0] != rows:
        raise PullbackError(f"{name}: expected shape [{rows}, k], got {tuple(X.shape)}")
    if X.dtype != like.dtype:
        raise TypeError(f"{name}: expected dtype {like.dtype}, got {X.dtype}")
    if X.device != like.device:
        raise PullbackError(f"{name}: expected device {like.device}, got {X.device}")


class LinearOperatorBase:
    """An (M, P) operator known through ``jvp`` (right products) and ``vjp`` (left products).

    Counts the tangent passes it serves in ``num_jvp`` and ``num_vjp`` (one per column).
    """

    shape: tuple[int, int]
    dtype: torch.dtype
    device: torch.device

    def __init__(self) -> None:
        self.num_jvp = 0
        self.num_vjp = 0

    @property
    def M(self) -> int:
        return self.shape[0]

    @property
    def P(self) -> int:
        return self.shape[1]

    def jvp(self, V: Tensor) -> Tensor:
        """J V: V[P,k] -> [M,k]."""
        _check_block(V, self.P, "V", self._like())
        self.num_jvp += V.shape[1]
        if V.shape[1] == 0:
            return V.new_zeros(self.M, 0)
        return self._jvp(V)

    def vjp(self, U: Tensor) -> Tensor:
        """Jᵀ U: U[M,k] -> [P,k]."""
        _check_block(U, self.M, "U", self._like())
        self.num_vjp += U.shape[1]
        if U.shape[1] == 0:
            return U.new_zeros(self.P, 0)
        return self._vjp(U)

    def gram(self, V: Tensor) -> Tensor:
        """Jᵀ J V: V[P,k] -> [P,k]."""
        return self.vjp(self.jvp(V))

    def gram_t(self, U: Tensor) -> Tensor:
        """J Jᵀ U: U[M,k] -> [M,k]."""
        return self.jvp(self.vjp(U))

    def _like(self) -> Tensor:
        return torch.empty(0, dtype=self.dtype, device=self.device)

    def _jvp(self, V: Tensor) -> Tensor:
        raise NotImplementedError

    def _vjp(self, U: Tensor) -> Tensor:
        raise NotImplementedError


class DenseOperator(LinearOperatorBase):
    """An explicit matrix J[M,P] behind the operator interface (closed forms, tests)."""

    def __init__(self, J: Tensor) -> None:
        super().__init__()
        if not isinstance(J, Tensor) or J.dim() != 2 or not J.is_floating_point():
            raise PullbackError(
                "J: expected a 2-D floating tensor [M, P], got "
                + (f"shape {tuple(J.shape)} dtype {J.dtype}" if isinstance(J, Tensor) else type(J).__name__)
            )
        self.J = J
        self.shape = (J.shape[0], J.shape[1])
        self.dtype = J.dtype
        self.device = J.device

    def _jvp(self, V: Tensor) -> Tensor:
        return self.J @ V

    def _vjp(self, U: Tensor) -> Tensor:
        return self.J.T @ U


class JacobianOperator(LinearOperatorBase):
    """J = ∂ψ/∂F at one feature map F[N,D], as an (M, P) operator.

    ``probe`` maps F[B,N,D] -> y[B,M] (a ``Probe`` or any callable with that contract). The
    reverse-mode linearisation is taken once here and reused by every ``vjp``; ``jvp`` batches
    forward-mode tangents with ``vmap`` (the primal is evaluated once per chunk). All products run
    with math attention so forward-mode AD works on models with fused attention.

    Args:
        probe: callable F[B,N,D] -> y[B,M].
        F: features of one image, [N,D] (or [1,N,D]).
        chunk_size: tangents per vmap call (None: all at once). Peak memory grows with it.
    """

    def __init__(self, probe: Callable[[Tensor], Tensor], F: Tensor, chunk_size: Optional[int] = 32) -> None:
        super().__init__()
        if not callable(probe):
            raise TypeError(f"probe: expected a callable F[B,N,D] -> y[B,M], got {type(probe).__name__}")
        if not isinstance(F, Tensor):
            raise TypeError(f"F: expected a torch.Tensor [N,D], got {type(F).__name__}")
        if F.dim() == 3 and F.shape[0] == 1:
            F = F[0]
        if F.dim() != 2:
            raise PullbackError(f"F: expected one feature map of shape [N,D] (or [1,N,D]), got {tuple(F.shape)}")
        if not F.is_floating_point():
            raise TypeError(f"F: expected a floating-point tensor, got dtype {F.dtype}")
        if not torch.isfinite(F).all():
            raise PullbackError("F: contains NaN or Inf")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise PullbackError(f"chunk_size: expected a positive int or None, got {chunk_size!r}")
        self.probe = probe
        self.F = F.detach()
        self.chunk_size = chunk_size
        self.dtype = F.dtype
        self.device = F.device
        # outer no_grad: parameters that require grad are not tracked; the transforms still differentiate F
        with torch.no_grad(), math_attention():
            y, self._vjp_fn = torch.func.vjp(self._single, self.F)
        y = y.detach()
        if not torch.isfinite(y).all():
            raise PullbackError("probe: output at F contains NaN or Inf")
        self.output = y
        self.token_shape = (F.shape[0], F.shape[1])
        self.shape = (y.shape[0], F.shape[0] * F.shape[1])

    def _single(self, f: Tensor) -> Tensor:
        return self.probe(f.unsqueeze(0)).reshape(-1)

    def _tangent_jvp(self, t: Tensor) -> Tensor:
        return torch.func.jvp(self._single, (self.F,), (t,))[1]

    def _jvp(self, V: Tensor) -> Tensor:
        load_forward_ad()
        T = V.T.reshape(V.shape[1], *self.token_shape)
        with torch.no_grad(), math_attention():
            out = torch.func.vmap(self._tangent_jvp, chunk_size=self.chunk_size)(T)
        return out.detach().T.contiguous()

    def _vjp(self, U: Tensor) -> Tensor:
        with torch.no_grad(), math_attention():
            out = torch.func.vmap(lambda u: self._vjp_fn(u)[0], chunk_size=self.chunk_size)(U.T.contiguous())
        return out.detach().reshape(U.shape[1], -1).T.contiguous()

    def single_jvp(self, v: Tensor) -> Tensor:
        """One un-batched tangent pass J v, v[P] -> [M] (the cost unit of the benchmarks)."""
        with torch.no_grad(), math_attention():
            return self._tangent_jvp(v.reshape(self.token_shape)).detach()
