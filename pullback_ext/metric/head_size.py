"""The default size of an importance head: a small, stated share of its backbone's FLOPs.

``pullback train head`` without ``--hidden`` builds the largest head of one family — hidden width
``H`` in 32, 64, 96, …, ``H / 32`` attention heads (the encoder attends in ``H / 4`` channels, so
every head is 8 channels wide) and a per-token MLP of width ``H`` in each of its two blocks — whose
FLOPs on the probe's tokens are at most :data:`SHARE` of one forward of the backbone's blocks
(:func:`largest_within`); ``--heads`` and ``--mlp-hidden``, when given, replace the family's values
in that search. With ``--hidden`` given the head is the one asked for (4 heads and no MLP unless
given: the fixed defaults of before).

Why 1.5%: the head's FLOPs come off every saving a reduced model makes, and the smallest target the
comparison pages read is 1.1× (9% of the forward saved), so a head within 1.5% keeps at least
five sixths of it. On the demo model (8 blocks, width 192, 197 tokens) the family's head within
1.5% is ``H = 64`` (2 heads, MLP 64): 38,337 parameters at 1.2% of the blocks' FLOPs by the count
below (the findings write ~1.6%), the small head docs/importance_tome_findings.md chose on
held-out crops over the 250k-parameter one (256 wide, 4 heads, MLP 64: 7.2% by this count), whose
ranking was no better; the next of the family (``H = 96``) costs 2.2%.

FLOPs are counted in closed form, as torch's flop counter counts them
(:func:`~pullback_ext.comparison.cost.count_flops`: matrix products and attention, not norms and
activations; ``python_tests/test_head_size.py`` checks both forms against it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import PullbackError

SHARE = 0.015  # of one forward of the backbone's blocks
STEP = 32  # the family's hidden widths: multiples of this, H / STEP heads of 8 channels
ENCODER_BLOCKS = 2  # attention blocks of the head's token encoder (pullback_ext.metric.trunk)
GIVEN_HEADS, GIVEN_MLP = 4, 0  # with --hidden given: the heads and MLP width unless given too
RULE = (f"the largest hidden width H of {STEP}, {2 * STEP}, ... (H/{STEP} heads, per-token MLP H) whose FLOPs are at most "
        f"{SHARE:.1%} of one forward of the backbone's blocks; given values replace the family's")


def head_flops(dim: int, tokens: int, hidden: int, mlp_hidden: int, blocks: int = ENCODER_BLOCKS) -> int:
    """FLOPs of :class:`~pullback_ext.metric.head.ImportanceHead` on ``F [1, tokens, dim]``: the input
    projection and log-RMS embedding, per block the qkv into ``hidden / 4`` channels, the output
    projection and the MLP, attention over the tokens, and the per-token score."""
    attn = hidden // 4
    per_token = 2 * dim * hidden + 2 * hidden + 2 * hidden + blocks * (2 * hidden * 3 * attn + 2 * attn * hidden
                                                                         + 4 * hidden * mlp_hidden)
    return tokens * per_token + blocks * 4 * tokens * tokens * attn


def backbone_flops(tokens: int, depth: int, width: int, mlp: int) -> int:
    """FLOPs of ``depth`` ViT blocks of ``width`` (MLP hidden width ``mlp``) on ``tokens`` tokens:
    qkv and output projection, the MLP and attention (``2·N²·D`` each for ``q kᵀ`` and the values)."""
    return depth * (2 * tokens * (4 * width * width + 2 * width * mlp) + 4 * tokens * tokens * width)


def largest_within(dim: int, tokens: int, budget: float, heads: Optional[int] = None,
                   mlp_hidden: Optional[int] = None) -> tuple[int, int, int]:
    """``(hidden, heads, mlp_hidden)``: the largest head of the family (module docstring) whose
    :func:`head_flops` on ``tokens`` tokens of width ``dim`` are at most ``budget`` (the smallest
    one where none is); ``heads`` / ``mlp_hidden`` given replace the family's, and then only widths
    whose ``hidden / 4`` channels they divide take part."""
    def shape(hidden: int) -> tuple[int, int, int]:
        return hidden, hidden // STEP if heads is None else heads, hidden if mlp_hidden is None else mlp_hidden

    widths = (shape(h) for h in itertools.count(STEP, STEP) if (h // 4) % shape(h)[1] == 0)
    best = next(widths)
    for candidate in widths:
        if head_flops(dim, tokens, candidate[0], candidate[2]) > budget:
            break
        best = candidate
    return best


def backbone_of(probe) -> Optional[tuple[int, int, int]]:
    """``(depth, width, mlp)`` of the backbone a probe reads (a VAE latent's or a linear read-out's
    through the probe they wrap): a timm ViT (the demo model's included) or a Hugging Face family;
    None when the probe holds no model it knows."""
    for _ in range(4):
        model = getattr(probe, "model", None)
        if isinstance(model, torch.nn.Module):
            return _shape(model)
        probe = getattr(probe, "base", None) or getattr(getattr(probe, "_extract", None), "__self__", None)
    return None


def _shape(model) -> Optional[tuple[int, int, int]]:
    from pullback_ext.families import detect

    vit = getattr(model, "backbone", model)  # the demo model holds its timm ViT as .backbone
    if hasattr(vit, "blocks") and hasattr(vit, "embed_dim"):
        fc1 = getattr(getattr(vit.blocks[0], "mlp", None), "fc1", None)
        width = int(vit.embed_dim)
        return len(vit.blocks), width, int(fc1.out_features) if fc1 is not None else 4 * width
    try:
        layers = detect(model).layers(model)
    except PullbackError:
        return None
    config = getattr(model.config, "backbone_config", None) or model.config
    width, ratio = int(config.hidden_size), getattr(config, "mlp_ratio", None)  # DINOv2 states a ratio, the others a width
    return len(layers), width, int(ratio * width if ratio else getattr(config, "intermediate_size", None) or 4 * width)


@dataclass(frozen=True)
class HeadSize:
    """An importance head's ``hidden``, ``heads``, ``mlp_hidden``; its ``flops`` on the probe's
    tokens, the ``backbone_flops`` of one forward of the blocks (None: backbone not known) and
    which fields the rule chose (``sized``; empty with ``--hidden`` given)."""

    hidden: int
    heads: int
    mlp_hidden: int
    flops: int
    backbone_flops: Optional[int]
    sized: tuple[str, ...]

    def record(self, parameters: int) -> dict:
        """What the checkpoint's config and results.json keep of it, with the head's ``parameters``."""
        share = None if self.backbone_flops is None else self.flops / self.backbone_flops
        return {"hidden": self.hidden, "heads": self.heads, "mlp_hidden": self.mlp_hidden, "parameters": parameters,
                "flops": self.flops, "backbone_flops": self.backbone_flops, "flop_share": share, "share_limit": SHARE,
                "sized": list(self.sized), "rule": RULE}


def choose(probe, hidden: Optional[int] = None, heads: Optional[int] = None, mlp_hidden: Optional[int] = None) -> HeadSize:
    """The :class:`HeadSize` of a head on ``probe`` (its ``dim`` and ``num_tokens``) with the given
    ``hidden`` / ``heads`` / ``mlp_hidden`` (None: the default, see the module docstring)."""
    shape = backbone_of(probe)
    total = None if shape is None else backbone_flops(probe.num_tokens, *shape)
    if hidden is not None:
        size, sized = (hidden, GIVEN_HEADS if heads is None else heads, GIVEN_MLP if mlp_hidden is None else mlp_hidden), ()
    elif total is None:
        raise PullbackError("--hidden: the default head is sized to a share of the backbone's FLOPs, and this probe's backbone "
                            "is not one whose blocks are known; give --hidden (and --heads, --mlp-hidden)")
    else:
        size = largest_within(probe.dim, probe.num_tokens, SHARE * total, heads, mlp_hidden)
        sized = tuple(name for name, value in (("hidden", hidden), ("heads", heads), ("mlp_hidden", mlp_hidden)) if value is None)
    return HeadSize(*size, flops=head_flops(probe.dim, probe.num_tokens, size[0], size[2]), backbone_flops=total, sized=sized)
