"""The single-stage criteria: which patch tokens a stage removes (or merges away).

Every scorer maps the current tokens to *keep scores* ``[B, n]`` over the ``n`` current patch
tokens (prefix tokens — CLS, registers — are never scored); a stage removes the ``R`` tokens with
the lowest scores, so every scorer removes exactly ``R`` tokens through the same pipeline
(:mod:`pullback_ext.prune.methods.single_stage`, which registers one method per entry of
:data:`SCORERS`).

Names: ``importance`` (learned head or SPN), ``oracle`` (imp* from the diagnostic, any callable),
``random``, ``tome_score`` (ToMe bipartite score), ``evit_score`` (CLS attention), ``norm`` (token l2
norm), ``cls_sim`` (cosine similarity to CLS), ``asap_score`` (diffusion distance to the attention
sink). The original methods these scores are taken from run in their own modules of
:mod:`pullback_ext.prune.methods`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pullback_ext import ops
from pullback_ext.errors import PullbackError
from pullback_ext.prune.attention_sink import ALPHA, lazy_walk, sink_distances
from pullback_ext.prune.matching import working_precision

NEEDS_SCORER = ("importance", "oracle")


@dataclass
class StageContext:
    """What a strategy may look at when a stage runs.

    ``x [B, K, D]``: current tokens, prefix first. ``attentions``: head-averaged attention
    probabilities ``[B, K, K]`` of the blocks run on this token set since the previous stage
    (oldest first; filled only for strategies that ask for them). ``seed``: for ``random``.
    """

    x: torch.Tensor
    num_prefix: int
    has_cls: bool
    attentions: list = field(default_factory=list)
    seed: int = 0
    stage: int = 0  # index of the stage in the schedule
    importance: Optional[torch.Tensor] = None  # [B, K], set by scorer strategies for merge weights


class Strategy:
    """Base class: ``keep_scores(ctx) -> [B, n]`` over the current patch tokens."""

    name = ""
    title = ""  # what the scorer rates, in words
    attention = "none"  # "none" | "last" (block before the stage) | "all" (blocks since last stage)
    reads_cls: Optional[str] = None  # why it needs a class token, when it does

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def merge_weights(self, ctx: StageContext) -> Optional[torch.Tensor]:
        """Per-token merge weights ``[B, K]`` (all current tokens), or None for size weights."""
        return None


class ScorerStrategy(Strategy):
    """Keep the tokens a scorer rates most important (``importance`` and ``oracle``).

    ``scorer.importance(F [B, K, D]) -> [B, K]`` (the importance head) when the scorer has that
    method, else ``scorer(F) -> [B, K]`` non-negative importance for every current token; an SPN
    returning ``(U [B, K*D, r], lam [B, r])`` is reduced to ``imp_θ`` with the
    ``token_importance`` kernel: eager forwards check its values (``lam >= 0``, finite; one host
    read), compiled ones skip the check so that the graph has no break (the project's SPN gives a
    softplus ``lam``, never negative). ``scorer`` may also be a sequence with one
    scorer per stage of the schedule (e.g. heads trained at each stage's layer).
    """

    title = "the tokens a scorer (importance head, SPN, imp*) rates least important"

    def __init__(self, name: str, scorer):
        self.name = name
        self.scorers = tuple(scorer) if isinstance(scorer, (list, tuple)) else (scorer,)

    def importance(self, x: torch.Tensor, stage: int = 0) -> torch.Tensor:
        """Importance ``[B, K]`` of all current tokens, from the scorer of stage ``stage``."""
        scorer = self.scorers[stage if len(self.scorers) > 1 else 0]
        method = getattr(scorer, "importance", None)
        out = method(x) if callable(method) else scorer(x)
        if isinstance(out, (tuple, list)):
            u, lam = out[0], out[1]
            out = ops.token_importance(u, lam, x.shape[1], check_values=not torch.compiler.is_compiling())
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape[:2]):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise PullbackError(f"{self.name} scorer must return scores of shape {tuple(x.shape[:2])}, got {got}")
        return out.to(x.dtype)

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        ctx.importance = self.importance(ctx.x, ctx.stage)
        return ctx.importance[:, ctx.num_prefix:]

    def merge_weights(self, ctx: StageContext) -> Optional[torch.Tensor]:
        w = ctx.importance if ctx.importance is not None else self.importance(ctx.x, ctx.stage)
        return w.clamp_min(torch.finfo(w.dtype).tiny)


class RandomStrategy(Strategy):
    """Uniform scores from a counter-based hash of (seed, stage, image in the batch, token): the same
    for a given seed on every call and device, with no ``torch.Generator`` (which ``torch.compile``
    cannot create inside a graph)."""

    name = "random"
    title = "random tokens"

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        b, k, _ = ctx.x.shape
        return hashed_uniform(b, k - ctx.num_prefix, ctx.seed * 1_000_003 + ctx.stage, ctx.x.device, ctx.x.dtype)


def hashed_uniform(rows: int, cols: int, seed: int, device, dtype) -> torch.Tensor:
    """``[rows, cols]`` values in [0, 1) from the splitmix64 finaliser of ``seed`` and each position
    (int64 arithmetic wraps; the top 24 bits make the fraction, exact in every float dtype)."""
    z = torch.arange(rows * cols, device=device, dtype=torch.int64).reshape(rows, cols) + (seed * 0x9E3779B9 + 1) % (1 << 62)
    for shift, multiplier in ((30, -4658895280553007687), (27, -7723592293110705685)):  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
        z = (z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))) * multiplier
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return (((z >> 40) & 0xFFFFFF).to(torch.float64) / float(1 << 24)).to(dtype)


class ToMeScoreStrategy(Strategy):
    """Single-stage ToMe score (the original is ``tome``): tokens alternate between sets A (even) and B (odd); A tokens go in
    order of their highest cosine similarity to any B token; B tokens are always kept (they come
    after every A token, ordered the same way against A, should R exceed |A|)."""

    name = "tome_score"
    title = "ToMe's bipartite score, once per stage"

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        t = torch.nn.functional.normalize(working_precision(ctx.x[:, ctx.num_prefix:]), dim=-1)
        a, b = t[:, 0::2], t[:, 1::2]
        sim = a @ b.transpose(1, 2)  # [B, |A|, |B|]
        score_a = -sim.amax(dim=2)  # in [-1, 1]
        score_b = 4.0 - sim.amax(dim=1)  # in [3, 5]: after every A token
        scores = torch.empty(t.shape[:2], dtype=t.dtype, device=t.device)
        scores[:, 0::2] = score_a
        scores[:, 1::2] = score_b
        return scores


class EViTScoreStrategy(Strategy):
    """Single-stage EViT score (the original is ``evit``): attention from CLS to each token in the
    block before the stage, averaged over heads."""

    name = "evit_score"
    title = "EViT's class-token attention, once per stage"
    attention = "last"
    reads_cls = "it ranks the tokens by the class token's attention"

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        return ctx.attentions[-1][:, 0, ctx.num_prefix:]


class NormStrategy(Strategy):
    """Token l2 norm: the smallest-norm tokens go first."""

    name = "norm"
    title = "smallest token norm"

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        return working_precision(ctx.x[:, ctx.num_prefix:]).norm(dim=-1)


class ClsSimilarityStrategy(Strategy):
    """Cosine similarity to the CLS token: the tokens least similar to CLS go first."""

    name = "cls_sim"
    title = "least cosine similarity to the class token"
    reads_cls = "it compares every token with the class token"

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        x = working_precision(ctx.x)
        return torch.nn.functional.cosine_similarity(x[:, ctx.num_prefix:], x[:, :1], dim=-1)


class ASAPScoreStrategy(Strategy):
    """Single-stage ASAP score (the reconstructed method is ``asap``, :mod:`pullback_ext.prune.methods.asap`):
    lazy random walk over the attention since the previous stage.

    ``P_l = α I + (1-α) A_l``, ``T = P_last ⋯ P_first``; the sink is the token with the largest
    column mass; ``d_i = ‖(T_i· − T_s·)/sqrt(π)‖`` with ``π`` = column mass / K is the diffusion
    distance to the sink. Tokens nearest the sink are background and go first; the sink itself
    (distance 0) is the anchor and scores +inf, so it goes only when every patch token goes.
    Radial rings of ``d`` order tokens exactly as ``d`` itself does, so with an exact budget the
    rings need not be materialised.
    """

    name = "asap_score"
    title = "ASAP's diffusion distance to the attention sink, once per stage"
    attention = "all"

    def __init__(self, alpha: float = ALPHA):
        self.alpha = alpha

    def keep_scores(self, ctx: StageContext) -> torch.Tensor:
        sink, d = sink_distances(lazy_walk(ctx.attentions, self.alpha))
        d = d.scatter(1, sink[:, None], float("inf"))
        return d[:, ctx.num_prefix:].to(ctx.x.dtype)


_TRAINING_FREE_CLASSES = {
    "random": RandomStrategy,
    "tome_score": ToMeScoreStrategy,
    "evit_score": EViTScoreStrategy,
    "norm": NormStrategy,
    "cls_sim": ClsSimilarityStrategy,
    "asap_score": ASAPScoreStrategy,
}
TRAINING_FREE = tuple(_TRAINING_FREE_CLASSES)
SCORERS = {"importance": ScorerStrategy, **_TRAINING_FREE_CLASSES, "oracle": ScorerStrategy}
STRATEGIES = tuple(SCORERS)  # the single-stage keep-score criteria


def check_scorer(name: str, scorer) -> None:
    """``importance`` and ``oracle`` need ``scorer``: a callable, or a non-empty sequence of
    callables (one per stage); the other strategies ignore it."""
    if name not in NEEDS_SCORER:
        return
    if isinstance(scorer, (list, tuple)) and scorer and all(callable(s) for s in scorer):
        return
    if scorer is None or not callable(scorer):
        what = "an importance head or SPN" if name == "importance" else "a callable returning imp* per token"
        raise PullbackError(f"strategy {name!r} needs head= ({what}); got {scorer!r}")


def make_strategy(name: str, scorer=None) -> Strategy:
    """Build the scorer ``name`` of :data:`SCORERS`; ``importance`` and ``oracle`` need ``scorer``
    (see :func:`check_scorer`)."""
    if name not in SCORERS:
        raise PullbackError(f"strategy must be one of {', '.join(STRATEGIES)}; got {name!r}")
    check_scorer(name, scorer)
    return ScorerStrategy(name, scorer) if name in NEEDS_SCORER else SCORERS[name]()


def lowest(keep_scores: torch.Tensor, count: int, num_prefix: int) -> torch.Tensor:
    """Indices ``[B, count]`` (into the current sequence) of the lowest-scoring patch tokens."""
    idx = torch.topk(working_precision(keep_scores), count, dim=1, largest=False, sorted=False).indices
    return idx + num_prefix
