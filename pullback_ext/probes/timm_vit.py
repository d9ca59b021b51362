"""Probe maps for timm VisionTransformer models (ViT/DeiT, DINOv2 with or without registers, CLIP)
and timm ``Eva`` models (EVA-02, the RoPE ViTs, timm's DINOv3 ports).

An ``Eva``'s blocks also read the rotary position table of the patch grid (one table, or one per
block for the "mixed" RoPE): a constant of the image size, computed once and kept as a buffer.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch import Tensor

from pullback_ext.probes.base import Probe
from pullback_ext.probes.cls_row import run_blocks_for_cls_row
from pullback_ext.probes.features import Features
from pullback_ext.probes.modes import evaluation, jvp_friendly
from pullback_ext.errors import PullbackError
from pullback_ext.families.timm_eva import ADAPTER as EVA

OUTPUTS = ("cls", "tokens", "pooled")


def _check_timm_vit(model: torch.nn.Module) -> None:
    missing = [a for a in ("patch_embed", "blocks", "norm", "num_prefix_tokens", "_pos_embed") if not hasattr(model, a)]
    if missing:
        raise TypeError(
            f"model: expected a timm VisionTransformer (attributes patch_embed, blocks, norm, "
            f"num_prefix_tokens), {type(model).__name__} lacks {', '.join(missing)}"
        )


def _rotary_table(model: torch.nn.Module) -> Optional[Tensor]:
    """The rotary table an ``Eva``'s blocks read ([n, d], or [depth, H, n, d] for the mixed RoPE);
    None for a model without RoPE."""
    if not EVA.matches(model):
        return None
    with torch.no_grad(), evaluation(model):
        return EVA.rotary_table(model)


class TimmViTProbe(Probe):
    """ψ_ℓ for a timm VisionTransformer or Eva: blocks ℓ+1.., final norm, then the chosen output.

    output: "cls" -> y = CLS token [B,D]; "tokens" -> all normed tokens flattened [B,N·D];
    "pooled" -> the model's own pre-logits pooling (token / avg / map + fc_norm) [B,D];
    or a callable mapping the normed tokens [B,N,D] to [B,M].

    With output "cls" and ``cls_row`` (default) the last block runs for the CLS row only (keys and
    values of all tokens, everything else for one token): the same outputs, and on a ViT-S probe
    at the second-to-last block a diagnostic 2.5–3× faster. ``cls_row=False`` runs it in full.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layer: int,
        output: Union[str, Callable[[Tensor], Tensor]] = "cls",
        output_transform: Optional[Tensor] = None,
        cls_row: bool = True,
    ) -> None:
        _check_timm_vit(model)
        depth = len(model.blocks)
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < depth:
            raise PullbackError(f"layer: expected an int in [0, {depth - 1}] (the model has {depth} blocks), got {layer!r}")
        if not callable(output) and output not in OUTPUTS:
            raise PullbackError(f"output: expected one of {OUTPUTS} or a callable, got {output!r}")
        prefix = int(model.num_prefix_tokens)
        if output == "cls" and (getattr(model, "cls_token", None) is None or prefix < 1):
            raise PullbackError("output: 'cls' needs a model with a CLS token; this one has none (use 'pooled' or 'tokens')")
        grid = tuple(int(g) for g in model.patch_embed.grid_size)
        super().__init__(
            layer=layer,
            num_tokens=grid[0] * grid[1] + prefix,
            dim=int(model.embed_dim),
            num_prefix_tokens=prefix,
            output_transform=output_transform,
        )
        self.grid_size = grid
        self.model = model
        self.output = output
        self.cls_row = bool(cls_row)
        self.eva = EVA.matches(model)
        self.register_buffer("rotary", _rotary_table(model), persistent=False)

    def _run_blocks(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x[B,N,D] through blocks ``start``..``stop - 1`` (an Eva's with their rotary rows)."""
        for index in range(start, stop):
            block = self.model.blocks[index]
            if not self.eva:
                x = block(x)
            else:
                per_block = self.rotary is not None and getattr(self.model, "rope_mixed", False)
                x = block(x, rope=self.rotary[index] if per_block else self.rotary)
        return x

    @torch.no_grad()
    def features(self, images: Tensor) -> Features:
        """images[B,3,H,W] (preprocessed) -> F[B,N,D], the tokens after block ``layer`` (no context)."""
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
            raise PullbackError(
                "images: expected a tensor [B,3,H,W], got "
                + (str(tuple(images.shape)) if isinstance(images, Tensor) else type(images).__name__)
            )
        m = self.model
        with evaluation(m):
            x = m._pos_embed(m.patch_embed(images))
            if self.eva:  # an Eva's also returns its rotary table (kept as self.rotary) and drops patches itself
                x = x[0]
            else:
                x = m.patch_drop(x) if hasattr(m, "patch_drop") else x
            x = m.norm_pre(x) if hasattr(m, "norm_pre") else x
            x = self._run_blocks(x, 0, self.layer + 1)
        return Features(x)

    def outputs(self, F: Tensor) -> Tensor:
        m = self.model
        with jvp_friendly(m):
            blocks = m.blocks[self.layer + 1 :]
            x = run_blocks_for_cls_row(blocks, F) if self.output == "cls" and self.cls_row else None
            if x is None:
                x = self._run_blocks(F, self.layer + 1, len(m.blocks))
            x = m.norm(x)
            if callable(self.output):
                y = self.output(x)
            elif self.output == "cls":
                y = x[:, 0]
            elif self.output == "tokens":
                y = x.reshape(x.shape[0], -1)
            else:
                y = m.forward_head(x, pre_logits=True)
        return y.reshape(y.shape[0], -1)


def from_timm(
    model: torch.nn.Module,
    layer: int,
    output: Union[str, Callable[[Tensor], Tensor]] = "cls",
    output_transform: Optional[Tensor] = None,
    cls_row: bool = True,
) -> TimmViTProbe:
    """Probe at block ``layer`` (0-based; F is that block's output) of a timm VisionTransformer or Eva."""
    return TimmViTProbe(model, layer, output, output_transform, cls_row)
