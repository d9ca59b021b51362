"""Probe maps ψ_ℓ of the demo model: features after block ℓ -> CLS logits, embedding, depth or
segmentation logits.

The dense decoders (depth, and segmentation with the shipped segmentation head) read four hooked blocks. Hooks at or after ℓ are recomputed from F inside
``forward`` (so the Jacobian sees them); hooks *before* ℓ do not depend on F: they are frozen
constants of the image, returned by ``features(images)`` as context (``"block{h}"``: [B,N,D]).
``bind(context)`` gives the map of those images: row b of the context for row b of F, or one
image's context for any batch F[k,N,D] -> y[k,M] (what the diagnostic uses). The unbound probe
needs no context unless frozen hooks are read, and then refuses to run.

The probe works on its own deep copy of the model with math attention (timm's
``fused_attn = False``), because forward-mode AD is not implemented for fused SDPA.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as Fn
from torch import Tensor

from pullback_ext.probes.base import Probe
from pullback_ext.probes.cls_row import run_blocks_for_cls_row
from pullback_ext.probes.features import Features, context_rows
from pullback_ext.errors import PullbackError

DECODERS = ("cls", "embedding", "depth", "segmentation")
DENSE = ("depth", "segmentation")  # decoders reading the hooked blocks; output_size pools their maps


def _size_pair(output_size, name: str = "output_size") -> Optional[tuple[int, int]]:
    if output_size is None:
        return None
    pair = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    if len(pair) != 2 or not all(isinstance(s, int) and s >= 1 for s in pair):
        raise PullbackError(f"{name}: expected None, a positive int or a pair of positive ints, got {output_size!r}")
    return pair


class DemoProbe(Probe):
    """ψ_ℓ for the demo model: F[B,197,192] after block ``layer`` -> y[B,M].

    decoder "cls": logits (M = 9); "embedding": CLS embedding (M = 128); "depth": metric depth
    map, average-pooled to ``output_size`` when given (M = h·w, default 112·112), row-major;
    "segmentation": the class logits of ``segmentation_head`` (default the shipped one,
    ``pullback_ext.embedded.load_segmentation_head(model=model)``), each class's map average-pooled
    to ``output_size`` as the depth map is (M = C·h·w, default 11·112·112), class-major then row-major.
    """

    def __init__(self, model: torch.nn.Module, layer: int, decoder: str = "cls", output_size=None,
                 output_transform: Optional[Tensor] = None, segmentation_head: Optional[torch.nn.Module] = None) -> None:
        depth = len(model.backbone.blocks)
        if not isinstance(layer, int) or not 0 <= layer < depth:
            raise PullbackError(f"layer: expected an int in [0, {depth - 1}] (a block of the demo model), got {layer!r}")
        if decoder not in DECODERS:
            raise PullbackError(f"decoder: expected one of {DECODERS}, got {decoder!r}")
        self.output_size = _size_pair(output_size)
        if self.output_size is not None and decoder not in DENSE:
            raise PullbackError(f"output_size: only meaningful for the dense decoders {DENSE}, got {output_size!r} with decoder={decoder!r}")
        if segmentation_head is not None and decoder != "segmentation":
            raise PullbackError(f"segmentation_head: only read by decoder='segmentation', got decoder={decoder!r}")
        bb = model.backbone
        num_tokens = bb.patch_embed.num_patches + bb.num_prefix_tokens
        super().__init__(layer, num_tokens, bb.embed_dim, bb.num_prefix_tokens, output_transform)
        self.decoder = decoder
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        for block in self.model.backbone.blocks:
            block.attn.fused_attn = False
        self.frozen_layers = tuple(h for h in self.model.hook_layers if h < layer) if decoder in DENSE else ()
        if decoder == "segmentation" and segmentation_head is None:
            from pullback_ext.embedded import load_segmentation_head

            segmentation_head = load_segmentation_head(model=model)
        self.segmentation_head = None if segmentation_head is None else copy.deepcopy(segmentation_head).eval().requires_grad_(False)

    @property
    def output_dim(self) -> int:
        """M without a forward pass (before any output transform)."""
        if self.output_transform is not None:
            return int(self.output_transform.shape[0])
        if self.decoder == "cls":
            return self.model.num_classes
        if self.decoder == "embedding":
            return self.model.cls_head.embedding.out_features
        h, w = self.output_size or (self.model.image_size, self.model.image_size)
        return h * w * (self.segmentation_head.num_classes if self.decoder == "segmentation" else 1)

    @property
    def context_keys(self) -> tuple[str, ...]:
        """``"block{h}"`` for every hooked block h before the probe layer (dense decoders only)."""
        return tuple(f"block{h}" for h in self.frozen_layers)

    @torch.no_grad()
    def features(self, images: Tensor) -> Features:
        """images[B,3,112,112] in [0,1] -> F[B,N,D] after block ``layer``, with the frozen hooks as context."""
        hooked: dict[int, Tensor] = {}
        F = self.model.run_blocks(self.model.embed(images), 0, self.layer + 1, hooked)
        return Features(F, {f"block{h}": hooked[h].detach() for h in self.frozen_layers})

    def _bind(self, context: dict[str, Tensor]) -> Probe:
        return _BoundDemoProbe(self, {h: context[f"block{h}"] for h in self.frozen_layers})

    def outputs(self, F: Tensor) -> Tensor:
        """F[B,N,D] -> y[B,M]."""
        self.check_features(F)
        if self.frozen_layers:
            raise PullbackError(
                f"F: the {self.decoder} decoder reads blocks {list(self.frozen_layers)} before the probe layer "
                f"{self.layer} from the images; bind the probe to them first: probe.bind(features.context) "
                "with the Features of probe.features(images)"
            )
        return self.decode(F[None], {})[0] if F.dim() == 2 else self.decode(F, {})

    def decode(self, F: Tensor, frozen: dict[int, Tensor]) -> Tensor:
        """Blocks ``layer+1..``, final norm and decoder on F[B,N,D], with the frozen hooks given."""
        model = self.model
        hooked = {h: t.to(F.dtype) for h, t in frozen.items()}
        if self.layer in model.hook_layers:
            hooked[self.layer] = F
        # the CLS and embedding heads read the CLS token alone: last block for that row only
        final = run_blocks_for_cls_row(model.backbone.blocks[self.layer + 1:], F) if self.decoder not in DENSE else None
        if final is None:
            final = model.run_blocks(F, self.layer + 1, len(model.backbone.blocks), hooked)
        if self.decoder in DENSE:
            maps = model.hook_maps(hooked)
            y = model.depth_head(maps, model.image_size)[:, None] if self.decoder == "depth" else \
                self.segmentation_head(maps, model.image_size)
            if self.output_size is not None:
                y = Fn.adaptive_avg_pool2d(y, self.output_size)
            return y.flatten(1)
        embedding, logits = model.cls_head(model.backbone.norm(final)[:, 0])
        return logits if self.decoder == "cls" else embedding


class _BoundDemoProbe(Probe):
    """A dense ``DemoProbe`` with the frozen hooks fixed: frozen[h] is [B,N,D] for a batch F[B,N,D],
    or [1,N,D] (one image) for any batch."""

    def __init__(self, parent: DemoProbe, frozen: dict[int, Tensor]) -> None:
        super().__init__(parent.layer, parent.num_tokens, parent.dim, parent.num_prefix_tokens, parent.output_transform)
        self.parent = parent
        self.frozen = frozen

    @property
    def output_dim(self) -> int:
        return self.parent.output_dim

    def outputs(self, F: Tensor) -> Tensor:
        self.check_features(F)
        batch = F[None] if F.dim() == 2 else F
        y = self.parent.decode(batch, context_rows(self.frozen, batch.shape[0]))
        return y[0] if F.dim() == 2 else y


def demo_probe(model: torch.nn.Module, layer: int, decoder: str = "cls", output_size=None,
               output_transform: Optional[Tensor] = None, segmentation_head: Optional[torch.nn.Module] = None) -> DemoProbe:
    """The probe map ψ_ℓ of the demo model at block ``layer`` for ``decoder`` (see :class:`DemoProbe`)."""
    return DemoProbe(model, layer, decoder, output_size, output_transform, segmentation_head)
