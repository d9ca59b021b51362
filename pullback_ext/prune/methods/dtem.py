"""DTEM as its authors deploy it (Lee & Hong, "Learning to Merge Tokens via Decoupled Embedding for
Efficient Vision Transformers", NeurIPS 2024; code movinghoon/DTEM@13f2046).

ToMe's per-block bipartite merging (:mod:`.tome`) in which the similarity is measured on a learned
*decoupled* embedding instead of the attention keys:

1. every block ``i`` has its own embedding of the block's input ``x``, ``m_i(x) = W_i ·
   norm1_i(x) + b_i``: a linear map of width ``feat_dim`` on the block's own pre-attention norm,
   the input its ``qkv`` reads (``dtem/dtem.py:11-47``, called on ``norm1(x)`` at
   ``dtem/dtem.py:208``); it is used only to decide merges, never in the forward itself;
2. between attention and MLP, ToMe's rule on the unit vectors of ``m_i(x)``
   (``_merge_eval``, ``dtem/dtem.py:193-201``, which calls ToMe's ``bipartite_soft_matching``,
   ``dtem/utils.py:10-77``): A the even positions and B the odd ones among the patch tokens, each A
   token to its most similar B token, the ``r`` most similar pairs merge, size-weighted, the tokens
   continuing as ``[prefix, unmerged A, B]``; proportional attention from the first merge on
   (``dtem/dtem.py:77-82``). Everything but the metric is ToMe's loop
   (:class:`~pullback_ext.prune.methods.merging.MergingMethod`), and at inference each merge is
   ToMe's one fused op (``ops.merge_step``, rule ``tome``) on the embedding as one-head keys.

The embedding is trained separately, with the backbone frozen, through the authors' continuous
relaxation of this merge (``pullback train dtem``, :mod:`pullback_ext.dtem_training`). The
trained module, :class:`DecoupledEmbedding`, holds one linear map per block and a frozen copy of
each block's pre-attention LayerNorm, so that it computes the authors' ``metric_layer(norm1(x))``
on its own; it is given as ``head=`` (a :class:`DecoupledEmbedding` or the checkpoint folder of
``pullback train dtem``), like TAP's register, and serves the model it was trained on (its width
and depth are checked at patch time). Options: ToMe's ``r``, ``schedule``, ``block_range``
(:class:`DTEMOptions`) and ``prop_attn``. As in the authors' "modular training" only the embedding
learns, the backbone frozen; they train it on ImageNet labels, ``pullback train dtem`` on the
task's own distortion against the unreduced model (see the training module).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pullback_ext.errors import PullbackError
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop, Needs
from pullback_ext.prune.methods.merging import ToMeOptions
from pullback_ext.prune.methods.tome import ToMe


def default_feat_dim(dim: int, head_dim: int) -> int:
    """The authors' embedding width: ``head_dim`` below a width of 1024, else ``2·head_dim``
    (``dtem/dtem.py:54-59``)."""
    return int(head_dim) if int(dim) < 1024 else 2 * int(head_dim)


class DecoupledEmbedding(nn.Module):
    """One decoupled embedding per block: ``metric(i, x [B, K, dim]) -> [B, K, feat_dim]``,
    ``Linear_i(LayerNorm_i(x))`` with ``LayerNorm_i`` a frozen copy (buffers ``norm_weight``,
    ``norm_bias`` ``[depth, dim]``, ``eps``) of block ``i``'s pre-attention norm."""

    def __init__(self, dim: int, feat_dim: int, depth: int, eps: float = 1e-6):
        super().__init__()
        if min(int(dim), int(feat_dim), int(depth)) < 1:
            raise PullbackError(f"dim, feat_dim, depth: expected positive ints, got {dim}, {feat_dim}, {depth}")
        self.dim, self.feat_dim, self.depth, self.eps = int(dim), int(feat_dim), int(depth), float(eps)
        self.register_buffer("norm_weight", torch.ones(self.depth, self.dim))
        self.register_buffer("norm_bias", torch.zeros(self.depth, self.dim))
        self.layers = nn.ModuleList(nn.Linear(self.dim, self.feat_dim) for _ in range(self.depth))

    def config(self) -> dict:
        """The constructor arguments (stored in the checkpoint)."""
        return {"dim": self.dim, "feat_dim": self.feat_dim, "depth": self.depth, "eps": self.eps}

    @torch.no_grad()
    def copy_norms(self, norms) -> "DecoupledEmbedding":
        """Take the weights of the ``depth`` pre-attention LayerNorms ``norms`` (one per block)."""
        norms = list(norms)
        if len(norms) != self.depth:
            raise PullbackError(f"norms: expected one per block ({self.depth}), got {len(norms)}")
        for i, norm in enumerate(norms):
            self.norm_weight[i] = 1.0 if norm.weight is None else norm.weight.detach()
            self.norm_bias[i] = 0.0 if norm.bias is None else norm.bias.detach()
        return self

    def metric(self, block: int, x: torch.Tensor) -> torch.Tensor:
        """The embedding ``[B, K, feat_dim]`` of block ``block``'s input tokens ``x [B, K, dim]``."""
        h = F.layer_norm(x.to(self.norm_weight.dtype), (self.dim,), self.norm_weight[block], self.norm_bias[block], self.eps)
        return self.layers[block](h)

    def forward(self, runner, images: torch.Tensor):
        """Training forward: ``runner(self, images)``, the relaxed model's outputs (a call through the
        module, so that DDP synchronises the embedding's gradients)."""
        return runner(self, images)


CHECKPOINT_KINDS = {"dtem": DecoupledEmbedding}  # the checkpoint kind of `pullback train dtem`


def pre_attention_norms(model) -> tuple[list, int]:
    """``(norms, head_dim)``: each block's pre-attention LayerNorm of ``model`` (a timm ViT or a
    Hugging Face model of :mod:`pullback_ext.families`) and the head width of its attention."""
    from pullback_ext.families import TimmFamily, detect

    family = detect(model, who="model")
    layers = family.layers(model)
    if isinstance(family, TimmFamily):
        norms, head_dim = [block.norm1 for block in layers], layers[0].attn.head_dim
    else:
        norms = [getattr(layer, family.attention.norm) for layer in layers]
        head_dim = getattr(family.attention_module(layers[0]), family.attention.head_size)
    for i, norm in enumerate(norms):
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise PullbackError(f"DTEM reads each block's pre-attention LayerNorm; block {i} of this {family.title} "
                                f"has {type(norm).__name__}")
    if len({n.eps for n in norms}) != 1:
        raise PullbackError(f"DTEM: the blocks' pre-attention LayerNorms have different eps {sorted({n.eps for n in norms})}")
    return norms, int(head_dim)


def embedding_for(model, feat_dim: Optional[int] = None) -> DecoupledEmbedding:
    """An untrained :class:`DecoupledEmbedding` for ``model`` (its blocks' norms copied, each linear
    map nn.Linear's default initialisation, as the authors'; ``feat_dim`` None: :func:`default_feat_dim`),
    in the dtype and on the device of the model."""
    norms, head_dim = pre_attention_norms(model)
    dim = int(norms[0].normalized_shape[0])
    width = default_feat_dim(dim, head_dim) if feat_dim is None else int(feat_dim)
    param = next(model.parameters())
    module = DecoupledEmbedding(dim, width, len(norms), norms[0].eps).to(param.device, param.dtype)
    return module.copy_norms(norms)


def load_embedding(path: str | os.PathLike) -> DecoupledEmbedding:
    """The :class:`DecoupledEmbedding` of a ``pullback train dtem`` folder (eval mode); a missing or
    corrupt checkpoint raises one :class:`~pullback_ext.errors.CheckpointError` naming the file."""
    from pullback_ext.metric import checkpoint

    return checkpoint.load_model(path, kind="dtem", classes=CHECKPOINT_KINDS)[0]


def as_embedding(head) -> DecoupledEmbedding:
    """``head=`` of ``strategy="dtem"``: a :class:`DecoupledEmbedding`, or its checkpoint folder."""
    if isinstance(head, (str, os.PathLike)):
        head = load_embedding(head)
    if not isinstance(head, DecoupledEmbedding):
        raise PullbackError(f"strategy 'dtem' needs head= (a DTEM checkpoint folder from `pullback train dtem`, or a "
                            f"DecoupledEmbedding); got {head!r}")
    return head


@dataclass(frozen=True)
class DTEMOptions(ToMeOptions):
    """ToMe's ``r`` (required), ``schedule`` and ``block_range``: at inference DTEM takes ToMe's
    budget unchanged (the authors' ``--val-reduction``, a constant ``r`` in every block)."""


def check_fits(embedding: DecoupledEmbedding, depth: int, width: Optional[int] = None) -> None:
    """The embedding must have one map per block of a ``depth``-block model of token ``width``."""
    if embedding.depth != int(depth):
        raise PullbackError(f"head: the DTEM embedding has {embedding.depth} blocks but this model has {depth}: "
                            f"an embedding serves the model it was trained on")
    if width is not None and embedding.dim != int(width):
        raise PullbackError(f"head: the DTEM embedding is {embedding.dim}-wide but this model's tokens are {int(width)}-wide: "
                            f"an embedding serves the model it was trained on")


class DTEM(ToMe):
    """ToMe's loop, rule and fused merge (:class:`~.tome.ToMe`) with the learned per-block embedding
    of the block input as the metric (the keys its ranking reads)."""

    name, short, title = "dtem", "DTEM", "DTEM (ToMe's r per block, matched on a learned decoupled embedding)"
    options_type = DTEMOptions
    takes = ("prop_attn", "head")
    head_from, trained_by = "dtem", "pullback train dtem"
    needs = Needs(split_blocks="it merges between attention and MLP")
    rules = ("ToMe bipartite matching on the learned decoupled embedding of each block's input, r per block (authors' rule)",
             "size-weighted, proportional attention")

    def checked_head(self, head, layers: tuple):
        return as_embedding(head)

    def resolve(self, options, backbone: BackboneShape) -> dict:
        check_fits(options.head, backbone.depth)
        return super().resolve(options, backbone)

    def check_blocks(self, reduction, blocks, width: int) -> None:
        check_fits(reduction.options.head, len(blocks), width)

    def run(self, reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        """ToMe's loop, whose attention half also gives the decoupled embedding of the block's input
        as the one-head "keys" ``[B, 1, K, feat_dim]`` that ToMe's matching reads."""
        embedding, index = reduction.options.head, {id(block): i for i, block in enumerate(loop.blocks)}

        def attend(block, state, bias):
            attended = loop.split.attend(block, state, bias)
            return attended._replace(k=embedding.metric(index[id(block)], state.x)[:, None])

        return super().run(reduction, x, loop._replace(split=type(loop.split)(attend, loop.split.feed_forward)), take)


ORDER = 14
METHODS = (DTEM(),)
