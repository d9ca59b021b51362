"""The task register and its read-out: TAP's only learned parts (with TAP-J's LoRA adapters).

One learned register token per task is inserted after the model's own prefix tokens (CLS,
registers) at the input of block 0; only the current task's register is in the sequence. At each
eligible layer ``j`` (the input of block ``layers[0] + j``) a small read-out of the register's
state ``r`` (layer-normed, with the keep rate ρ appended: ``h = [LN(r), ρ]``) gives

- token scores ``s_t = ⟨q_j, k_t⟩ / sqrt(d)`` with ``q_j = LN(r) W_q^j`` and ``k_t = LN(x_t) W_k``
  (the lowest-scoring tokens go);
- share logits ``W_s h + b_s`` over the eligible layers, of which those of the layers ``j..L−1``
  still to come are used (softmax: the shares of the remaining budget, :mod:`~pullback_ext.tap.budget`);
- for dense tasks the recovery scale ``α_j = σ(w_α^j · h + b_α^j)`` per image (re-inserted features
  ``α·x^frozen + (1 − α)·m``, :func:`pullback_ext.prune.recovery.recover`).

TAP-J adds LoRA adapters ``W + (α_lora / r) B A`` to the attention and MLP linears of every block
(each family's ``lora_targets``, :mod:`pullback_ext.families`: timm's ``qkv``, ``proj``, ``fc1``, ``fc2``;
a Hugging Face family's query, key, value, attention output and two MLP linears); the backbone's own weights are never changed (the
adapted weights are handed to the block for each call, :func:`torch.func.functional_call`). The
adapters are keyed by the linears' names in the model they were trained on, so they deploy on a
model with the same layer layout only (:func:`check_adapters`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import nn

from pullback_ext.errors import PullbackError
from pullback_ext.families import family

TASKS = ("cls", "depth")


class Readout(NamedTuple):
    """``scores [B, n]`` of the current patch tokens, ``shares [B, L − j]`` (softmax over the
    layers still to come), ``alpha [B]`` (dense tasks) or None."""

    scores: torch.Tensor
    shares: torch.Tensor
    alpha: Optional[torch.Tensor]


class TaskRegister(nn.Module):
    """Register token + read-out for ``task`` (``cls`` or ``depth``) on a ``dim``-wide backbone.

    ``layers = (start, stop)``: the eligible block inputs ``start..stop−1``; ``key_dim``: width of the
    score keys and queries; ``lora``: ``{"<block>.<target>": [out, in]}`` shapes of the adapted
    linears (empty: TAP-F, the backbone frozen), ``lora_rank``, ``lora_alpha``.
    """

    def __init__(self, dim: int, layers: tuple, task: str, key_dim: int = 32, lora: Optional[dict] = None,
                 lora_rank: int = 4, lora_alpha: float = 8.0):
        super().__init__()
        if task not in TASKS:
            raise PullbackError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
        start, stop = (int(v) for v in layers)
        if not 0 <= start < stop:
            raise PullbackError(f"layers must be (start, stop) with 0 <= start < stop; got {tuple(layers)}")
        self.dim, self.layers, self.task, self.key_dim = int(dim), (start, stop), task, int(key_dim)
        self.lora_shapes = {k: [int(v[0]), int(v[1])] for k, v in (lora or {}).items()}
        self.lora_rank, self.lora_alpha = int(lora_rank), float(lora_alpha)
        count = stop - start
        self.register = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.keys = nn.Linear(dim, key_dim, bias=False)
        self.queries = nn.Parameter(torch.randn(count, dim, key_dim) / math.sqrt(dim))
        self.shares = nn.Linear(dim + 1, count)
        nn.init.zeros_(self.shares.weight)
        nn.init.zeros_(self.shares.bias)
        self.alpha = None
        if task == "depth":
            self.alpha = nn.Linear(dim + 1, count)
            nn.init.zeros_(self.alpha.weight)
            nn.init.constant_(self.alpha.bias, 2.0)  # α ≈ 0.88: start near the frozen copy
        self.lora_a = nn.ParameterDict({_key(k): nn.Parameter(torch.randn(self.lora_rank, i) / math.sqrt(i))
                                        for k, (o, i) in self.lora_shapes.items()})
        self.lora_b = nn.ParameterDict({_key(k): nn.Parameter(torch.zeros(o, self.lora_rank)) for k, (o, i) in self.lora_shapes.items()})
        self._targets: dict = {}
        for name in self.lora_shapes:
            index, target = name.split(".", 1)
            self._targets.setdefault(int(index), []).append(target)

    def config(self) -> dict:
        """The constructor arguments (stored in the checkpoint)."""
        return {"dim": self.dim, "layers": list(self.layers), "task": self.task, "key_dim": self.key_dim,
                "lora": self.lora_shapes, "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha}

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def adapted(self) -> bool:
        """TAP-J (LoRA adapters on the backbone) rather than TAP-F."""
        return bool(self.lora_shapes)

    def stage(self, block: int) -> Optional[int]:
        """Index among the eligible layers of the input of ``block``, or None."""
        start, stop = self.layers
        return block - start if start <= block < stop else None

    def insert(self, x: torch.Tensor, num_prefix: int) -> torch.Tensor:
        """``x [B, N, D]`` with the register after its ``num_prefix`` prefix tokens: ``[B, N + 1, D]``."""
        if x.shape[-1] != self.dim:
            raise PullbackError(f"the task register is {self.dim}-wide but the backbone's tokens are {x.shape[-1]}-wide")
        reg = self.register.to(x.dtype).expand(x.shape[0], 1, self.dim)
        return torch.cat([x[:, :num_prefix], reg, x[:, num_prefix:]], dim=1)

    def read(self, stage: int, state: torch.Tensor, patches: torch.Tensor, rho: float) -> Readout:
        """The read-out at eligible layer ``stage`` from the register ``state [B, D]`` over the
        current ``patches [B, n, D]`` at keep rate ``rho``."""
        r = self.norm(state)
        h = torch.cat([r, r.new_full((r.shape[0], 1), float(rho))], dim=1)
        q = r @ self.queries[stage].to(r.dtype)
        scores = torch.einsum("bnk,bk->bn", self.keys(self.norm(patches)), q) / math.sqrt(self.key_dim)
        shares = self.shares(h)[:, stage:].softmax(dim=1)
        alpha = None if self.alpha is None else torch.sigmoid(self.alpha(h)[:, stage])
        return Readout(scores, shares, alpha)

    def forward(self, runner, images: torch.Tensor, rho: float):
        """Training forward: ``runner(self, images, rho)``, the pruned model's outputs (a call through
        the module, so that DDP synchronises the register's gradients)."""
        return runner(self, images, rho)

    def block_caller(self, call_block):
        """``call(index, block, state, bias)``: ``call_block`` with the block's LoRA-adapted weights
        (TAP-J), or ``call_block`` itself (TAP-F)."""
        if not self.adapted:
            return lambda index, block, state, bias: call_block(block, state, bias)
        scale = self.lora_alpha / self.lora_rank

        def call(index, block, state, bias):
            weights = {}
            for target in self._targets.get(index, ()):
                key = _key(f"{index}.{target}")
                base = block.get_parameter(f"{target}.weight")
                weights[f"block.{target}.weight"] = base + scale * (self.lora_b[key] @ self.lora_a[key]).to(base.dtype)
            return torch.func.functional_call(_Caller(block, call_block), weights, (state, bias), strict=False)

        return call


class _Caller(nn.Module):
    """``call_block(block, state, bias)`` as a module whose parameters are ``block``'s (``block.*``)."""

    def __init__(self, block, call_block):
        super().__init__()
        self.block = block
        self._call = call_block

    def forward(self, state, bias):
        return self._call(self.block, state, bias)


def lora_shapes(blocks, layout: str = "timm_vit") -> dict:
    """``{"<i>.<target>": [out, in]}`` of the attention and MLP linears of ``blocks`` of the family
    named ``layout`` (its ``lora_targets``, :mod:`pullback_ext.families`; the names a block lacks
    are skipped; the demo model's blocks are timm's)."""
    targets = family(layout).lora_targets
    shapes = {}
    for i, block in enumerate(blocks):
        linears = dict(block.named_modules())
        for target in targets:
            if isinstance(linears.get(target), nn.Linear):
                shapes[f"{i}.{target}"] = list(linears[target].weight.shape)
    if not shapes:
        raise PullbackError(f"TAP-J: these blocks have none of the {layout} linears {', '.join(targets)} to adapt")
    return shapes


def check_adapters(register: TaskRegister, blocks) -> None:
    """TAP-J's adapters must name linears of ``blocks`` of the shapes they were trained on: a
    register trained on one layer layout (timm's fused ``attn.qkv``, a Hugging Face family's
    ``q_proj`` / ``query``, ...) does not deploy on another."""
    for name, shape in register.lora_shapes.items():
        index, target = name.split(".", 1)
        linear = dict(blocks[int(index)].named_modules()).get(target) if int(index) < len(blocks) else None
        if not isinstance(linear, nn.Linear) or list(linear.weight.shape) != shape:
            have = [n for n, m in blocks[0].named_modules() if isinstance(m, nn.Linear)]
            raise PullbackError(f"this TAP-J register adapts {target} {shape} of block {index}, which this model's layers do not have "
                                f"(their linears: {', '.join(have)}); its LoRA adapters are keyed on the layer layout it was "
                                f"trained on: train a register on this model (pullback train tap --model ... --adapt lora)")


def _key(name: str) -> str:
    return name.replace(".", "-")
