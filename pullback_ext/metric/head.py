"""Importance head: F[B,N,D] -> per-token log-importance scores[B,N] (docs/formulas.md §3)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pullback_ext.metric.trunk import TokenEncoder
from pullback_ext.errors import PullbackError


class ImportanceHead(nn.Module):
    """``head(F[B,N,D]) -> scores[B,N]``, the predicted log imp(t).

    Token encoder + per-token scalar; 331,521 parameters at D = 768 with the defaults (docs/metric.md
    compares them with the paper's ≈ 0.31 M).
    ``mlp_hidden > 0`` adds a per-token MLP of that width to each encoder block (≈ +2·2·H·mlp_hidden
    parameters). ``importance(F)`` returns exp(scores), comparable to imp* itself. ``probe_layer``:
    the block whose output it was trained on, where the checkpoint records it (else None).
    """

    def __init__(self, dim: int, hidden: int = 256, heads: int = 4, mlp_hidden: int = 0) -> None:
        super().__init__()
        self.dim, self.hidden, self.heads, self.mlp_hidden = dim, hidden, heads, mlp_hidden
        self.probe_layer = None  # the block whose output it was trained on (set by the checkpoint loader)
        self.encoder = TokenEncoder(dim, hidden, heads, mlp_hidden=mlp_hidden)
        self.score = nn.Linear(hidden, 1)

    def config(self) -> dict:
        return {"dim": self.dim, "hidden": self.hidden, "heads": self.heads, "mlp_hidden": self.mlp_hidden}

    @torch.no_grad()
    def set_score_offset(self, target: Tensor) -> None:
        """Start the scores at the mean log of the positive training targets (imp* can sit many
        orders of magnitude away from 1, which would otherwise dominate the first steps)."""
        positive = target[target > 0].double()
        if positive.numel() == 0:
            raise PullbackError("target: expected some positive importance values, got none")
        self.score.bias.fill_(float(positive.log().mean()))

    def forward(self, F: Tensor) -> Tensor:
        return self.score(self.encoder(F)).squeeze(-1)

    def importance(self, F: Tensor) -> Tensor:
        return self(F).exp()


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
