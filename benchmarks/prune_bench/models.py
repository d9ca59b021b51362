"""The models and methods of the end-to-end pruning benchmark (``benchmarks/bench_prune.py``).

Every model has random weights (the cost of a forward does not depend on them) and is built at
the image size asked for. A *method* is one setting of the patch API; the grid: the unpruned
model, our importance merge and prune + masked LLF at several η (one stage, and three stages),
the merge with proportional attention folded into the dot product (``prop_attn="folded"``, which
keeps SDPA's fast kernels) beside the mask form, the prune with masked LLF as two maskless
attention calls (the same option) beside the mask form, the original ToMe at several ``r`` with its
constant schedule, the importance-guarded merge in every block at ToMe's token counts
(``importance_tome`` with the same ``r`` and ``early_merges=True``: its FLOPs are ToMe's plus the
head's), ToMe's token counts reached by dropping tokens (no merging: the speed a merge at those
counts could reach at most, :mod:`prune_bench.dropped_tokens`), the per-block clusterings at the
same keep rate and blocks (ATC's 3, 6, 9 of 12: ATC with its average linkage, importance_cluster
with its bound, without a head, one ``ops.agglomerate`` call per clustering block either way), and
our merge at the FLOPs of ToMe ``r = 16`` (η found by bisection on the FLOP count). The importance
heads are untrained (``ImportanceHead``'s default size): a trained head costs exactly as much.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

import pullback_ext.patch as patch
from prune_bench.dropped_tokens import dropped_tokens
from pullback_ext.comparison.cost import count_flops
from pullback_ext.metric.head import ImportanceHead


@dataclass(frozen=True)
class ModelCase:
    """One benchmarked model: ``build(size)`` gives it in eval mode; ``dense``: a depth model
    (pruned with LLF; the originals do not apply); ``embed_dim`` / ``depth`` of its encoder;
    ``head_hidden``: the importance heads' width (the shipped default)."""

    key: str
    title: str
    build: Callable[[int], nn.Module]
    embed_dim: int
    depth: int
    dense: bool = False
    head_hidden: int = 256


def _timm(name: str, **kwargs) -> Callable[[int], nn.Module]:
    def build(size: int) -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=0, img_size=size, **kwargs).eval().requires_grad_(False)

    return build


def _depth_anything_small(size: int) -> nn.Module:
    """Depth Anything V2 small's shape: a DINOv2-S/14 encoder (12 blocks, 384 channels) and its DPT head."""
    from transformers import DepthAnythingConfig, DepthAnythingForDepthEstimation, Dinov2Config

    backbone = Dinov2Config(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
                            image_size=size, patch_size=14, out_features=["stage3", "stage6", "stage9", "stage12"],
                            reshape_hidden_states=False)
    config = DepthAnythingConfig(backbone_config=backbone, reassemble_hidden_size=384, neck_hidden_sizes=[48, 96, 192, 384],
                                 fusion_hidden_size=64, patch_size=14)
    return DepthAnythingForDepthEstimation(config).eval().requires_grad_(False)


MODELS = {
    "vit_b16": ModelCase("vit_b16", "timm ViT-B/16", _timm("vit_base_patch16_224"), 768, 12),
    "dinov2_b14_reg": ModelCase("dinov2_b14_reg", "timm DINOv2-B/14 with 4 registers (LayerScale)",
                                _timm("vit_base_patch14_reg4_dinov2"), 768, 12),
    "depth_anything_s": ModelCase("depth_anything_s", "HF Depth Anything (small shape)", _depth_anything_small, 384, 12, dense=True),
    "vit_s16": ModelCase("vit_s16", "timm ViT-S/16", _timm("vit_small_patch16_224"), 384, 12),
}


@dataclass(frozen=True)
class Method:
    """One row: its ``name`` and the patch keywords (``{}``: unpruned). ``heads``: how many
    importance heads it scores with (one per stage; 0 for training-free methods). ``build``: a row
    that is not a patch (e.g. :func:`~prune_bench.dropped_tokens.dropped_tokens`) builds its model
    from the unpruned one instead."""

    name: str
    options: dict = field(default_factory=dict)
    heads: int = 0
    build: Optional[Callable[[nn.Module], nn.Module]] = None

    def apply(self, model: nn.Module, case: ModelCase) -> nn.Module:
        """A patched deep copy of ``model`` (the unpruned method: the copy itself)."""
        if self.build is not None:
            return self.build(model)
        model = copy.deepcopy(model)
        if self.options:
            heads = [ImportanceHead(case.embed_dim, hidden=case.head_hidden) for _ in range(self.heads)]
            dtype, device = _dtype_device(model)
            heads = [h.to(device=device, dtype=dtype).eval().requires_grad_(False) for h in heads]
            options = dict(self.options) | ({"head": heads if len(heads) > 1 else heads[0]} if heads else {})
            (patch.hf_dinov2 if case.dense else patch.timm)(model, **options)
        return model


def _dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    p = next(model.parameters())
    return p.dtype, p.device


def stage_layers(depth: int, stages: int) -> tuple[int, ...]:
    """The blocks whose input is reduced: block depth/3 for one stage (4 of 12, the paper's
    ViT-B choice), depth/4, depth/2, 3·depth/4 for three (3, 6, 9 of 12)."""
    if stages == 1:
        return (depth // 3,)
    return tuple(depth * (s + 1) // (stages + 1) for s in range(stages))


DROPPED = "tokens dropped at ToMe"  # the name of the rows of ToMe's token counts without merging
CLUSTER_KEEP_RATE = 0.7  # the clustering rows' keep rate: 137, 96, 67 of 196 patch tokens at blocks 3, 6, 9


def method_grid(case: ModelCase, etas: tuple[float, ...], tome_rs: tuple[int, ...]) -> list[Method]:
    """The methods run on ``case``: see the module docstring (dense models: prune + LLF only)."""
    one, three = stage_layers(case.depth, 1), stage_layers(case.depth, 3)
    methods = [Method("unpruned")]
    for eta in etas:
        if not case.dense:
            methods.append(Method(f"importance merge η={eta:g} @{one[0]}",
                                  dict(strategy="importance", mode="merge", ratio=eta, layers=one), heads=1))
        methods.append(Method(f"importance prune+LLF η={eta:g} @{one[0]}",
                              dict(strategy="importance", mode="prune", llf=True, ratio=eta, layers=one), heads=1))
    top = max(etas)
    if not case.dense:  # proportional attention as a mask (above) against folded into the dot product
        methods.append(Method(f"importance merge η={top:g} @{one[0]} folded prop-attn",
                              dict(strategy="importance", mode="merge", ratio=top, layers=one, prop_attn="folded"), heads=1))
    if not case.dense:  # timm models: masked LLF as a -inf mask (above) against two maskless attention calls
        methods.append(Method(f"importance prune+LLF η={top:g} @{one[0]} two-call LLF",
                              dict(strategy="importance", mode="prune", llf=True, ratio=top, layers=one, prop_attn="folded"), heads=1))
    mode = dict(mode="prune", llf=True) if case.dense else dict(mode="merge")
    methods.append(Method(f"importance {mode['mode']} η={top:g} 3 stages {list(three)}",
                          dict(strategy="importance", ratio=top, layers=three, **mode), heads=3))
    if not case.dense:
        methods += [Method(f"ToMe r={r} constant", dict(strategy="tome", r=r, schedule="constant")) for r in tome_rs]
        methods += [Method(f"{DROPPED} r={r}'s counts, no merging (the bound)", build=partial(dropped_tokens, r=r))
                    for r in tome_rs]
        methods += [Method(f"importance_tome r={r} (ToMe r={r}'s token counts)",
                           dict(strategy="importance_tome", r=r, schedule="constant", early_merges=True), heads=1) for r in tome_rs]
        rate = CLUSTER_KEEP_RATE
        methods += [Method(f"ATC keep_rate={rate:g} average linkage", dict(strategy="atc", keep_rate=rate)),
                    Method(f"importance_cluster keep_rate={rate:g} (ATC's blocks, no head)",
                           dict(strategy="importance_cluster", keep_rate=rate))]
    return methods


def matched_merge(case: ModelCase, model: nn.Module, image: torch.Tensor, target: Method, steps: int = 12) -> Method:
    """Our single-stage importance merge whose FLOPs on ``image [1, 3, H, W]`` come closest to
    ``target``'s (bisection on η over ``steps`` halvings; the token count is discrete, so the
    match is exact only to one token's FLOPs, which the benchmark reports as a ratio)."""
    goal = count_flops(target.apply(model, case), image)
    layer = stage_layers(case.depth, 1)[0]
    lo, hi, best = 0.0, 0.95, None
    for _ in range(steps):
        eta = round((lo + hi) / 2, 4)
        trial = Method(f"importance merge @{layer} at {target.name}'s FLOPs (η={eta:.3f})",
                       dict(strategy="importance", mode="merge", ratio=eta, layers=(layer,)), heads=1)
        flops = count_flops(trial.apply(model, case), image)
        if best is None or abs(flops - goal) < best[0]:
            best = (abs(flops - goal), trial)
        lo, hi = (eta, hi) if flops > goal else (lo, eta)
    return best[1]


def find_method(methods: list[Method], prefix: str) -> Optional[Method]:
    return next((m for m in methods if m.name.startswith(prefix)), None)
