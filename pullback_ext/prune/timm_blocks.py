"""What the block loops of the two timm families (:mod:`pullback_ext.prune.timm_vit`,
:mod:`pullback_ext.prune.timm_eva`) share: the :class:`BlockRunner` an adapter hands the loop, the
queries and keys a timm attention computed (:func:`attention_with_qk`), which the attention halves
of their split blocks return, a timm attention run with given probabilities
(:func:`attention_given`), and the methods that split blocks, named in a refusal
(:func:`splitting_methods`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods import all_methods
from pullback_ext.prune.split_block import SplitBlock


class BlockRunner(NamedTuple):
    """How the block loop runs a model's blocks: ``call_block(block, state, bias)``,
    ``attention_probs(block, x, bias)`` (see :func:`~pullback_ext.prune.pipeline.run_blocks`) and the
    :class:`SplitBlock` of the originals (None: the blocks cannot be split)."""

    call_block: Callable
    attention_probs: Callable
    split: Optional[SplitBlock]


def attention_with_qk(attn, *args, **kwargs):
    """``attn(*args, **kwargs)`` and the queries and keys ``[B, H, K, hd]`` it computed, caught at
    its ``q_norm`` / ``k_norm`` (before any rotary embedding).

    The attention's own ``forward`` runs on a stand-in that records what the two norms return
    (rather than forward hooks, whose registration ``torch.compile`` cannot trace)."""
    recorder = _QKRecorder(attn)
    out = type(attn).forward(recorder, *args, **kwargs)
    return out, recorder.seen["q"], recorder.seen["k"]


class _QKRecorder:
    """``attn`` with its ``q_norm`` / ``k_norm`` outputs recorded in ``seen``; every other attribute is ``attn``'s."""

    def __init__(self, attn):
        self._attn = attn
        self.seen = {}

    def __getattr__(self, name):
        return getattr(self._attn, name)

    def q_norm(self, q: torch.Tensor) -> torch.Tensor:
        self.seen["q"] = self._attn.q_norm(q)
        return self.seen["q"]

    def k_norm(self, k: torch.Tensor) -> torch.Tensor:
        self.seen["k"] = self._attn.k_norm(k)
        return self.seen["k"]


def _known_attentions() -> tuple:
    from timm.layers.attention import Attention, AttentionRope
    from timm.models.eva import EvaAttention

    return Attention, AttentionRope, EvaAttention


def _values(attn, h: torch.Tensor) -> torch.Tensor:
    """The values ``[B, H, K, hd]`` of a timm attention on its normed input ``h [B, K, D]``: the last
    third of a fused ``qkv`` (with Eva's separate ``v_bias``) or ``v_proj``, repeated per query head
    (grouped-query attention)."""
    b, k, _ = h.shape
    if getattr(attn, "qkv", None) is not None:
        rows = attn.qkv.weight.shape[0] // 3
        bias = None if attn.qkv.bias is None else attn.qkv.bias[2 * rows:]
        if getattr(attn, "v_bias", None) is not None:
            bias = attn.v_bias if bias is None else bias + attn.v_bias
        v = F.linear(h, attn.qkv.weight[2 * rows:], bias)
    else:
        v = attn.v_proj(h)
    v = v.reshape(b, k, -1, attn.head_dim).transpose(1, 2)
    return v.repeat_interleave(getattr(attn, "num_kv_groups", 1), dim=1)


def attention_given(attn, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """What the timm attention ``attn`` (``Attention``, ``AttentionRope``, ``EvaAttention``) returns
    on its normed input ``h [B, K, D]`` when its attention probabilities are ``probs [B, H, K, K]``:
    ``proj(norm(probs @ V))``, gated where the attention is (inference: no dropout)."""
    if not any(type(attn).forward is known.forward for known in _known_attentions()):
        raise PullbackError(f"attend_with: runs timm's Attention, AttentionRope or EvaAttention with given attention "
                            f"probabilities; got {type(attn).__name__}")
    b, k, _ = h.shape
    out = attn.norm((probs.to(h.dtype) @ _values(attn, h)).transpose(1, 2).reshape(b, k, -1))
    if getattr(attn, "gate", None) is not None:
        out = out * attn.gate(h).sigmoid()
    return attn.proj_drop(attn.proj(out))


def splitting_methods() -> str:
    """The methods of the registry that run a block in two halves (``needs.split_blocks``), in
    words: ``"ToMe, EViT and PiToMe"``."""
    names = [m.short for m in all_methods() if m.needs.split_blocks]
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
