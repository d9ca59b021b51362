"""Adapters that give the evaluation one view of a model: unpruned outputs, reduced outputs.

Outputs are dicts with ``embedding [B, E]`` (CLS task) and, for models with a dense decoder,
``depth [B, H, W]`` (and for the demo with its segmentation head, ``segmentation`` logits
``[B, C, H, W]``). ``full`` and ``reduced`` give every output the errors read; the cost of a
task is that of ``task_forward(task)``: the forward that task needs and nothing else (the demo's CLS
task runs the backbone and the CLS head, not the depth decoder; its depth task the backbone and the
depth decoder on the hooked layers, not the CLS head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.families import TimmFamily, detect
from pullback_ext.prune import timm_vit
from pullback_ext.prune.eta import eta
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import Reduction
from pullback_ext.sources.models import ModelSpec, load_model
from pullback_ext.sources.preprocess import Preprocess, hf_crop_preprocess, hf_preprocess, timm_preprocess, unit_range_preprocess


@dataclass
class Backbone:
    """A model seen by the evaluation: ``full(images)`` and ``reduced(reduction, images)`` -> outputs."""

    name: str
    depth: int
    num_prefix: int
    has_cls: bool
    image_size: int
    tasks: tuple
    full: Callable
    reduced: Callable
    features_dim: int
    block_tokens: Callable  # (images, layer) -> patch tokens [B, n, D] after block ``layer``, unreduced
    preprocess: Preprocess  # how its images are prepared
    eta: Optional[Callable] = None  # ReductionOptions -> η, the fraction of patch tokens removed (None: not known)
    task_forward: Optional[Callable] = None  # task -> (full, reduced) of that task alone (None: full and reduced)
    num_patches: Optional[int] = None  # patch tokens at image_size (None: not known)

    def forwards(self, task: str) -> tuple[Callable, Callable]:
        """``(full(images), reduced(reduction, images))`` of ``task`` alone: what its cost counts."""
        if task not in self.tasks:
            raise PullbackError(f"task {task!r}: {self.name} supports {', '.join(self.tasks)}")
        return (self.full, self.reduced) if self.task_forward is None else self.task_forward(task)


def demo_backbone(model, segmentation_head=None) -> Backbone:
    """The demo model (timm backbone + CLS head + DPT depth head reading ``hook_layers``).

    ``segmentation_head``: a :class:`~pullback_ext.embedded.model.SegmentationHead` for it
    (``pullback_ext.embedded.load_segmentation_head(model=model)``); with one, the outputs gain
    ``segmentation`` logits ``[B, C, H, W]`` and the tasks ``segmentation``.
    """
    bb = model.backbone

    def decode(final: torch.Tensor, hooked: dict) -> dict:
        out = model.decode(final, hooked)
        if segmentation_head is not None:
            out["segmentation"] = segmentation_head(model.hook_maps(hooked), model.image_size)
        return out

    def full(images: torch.Tensor) -> dict:
        hooked: dict = {}
        final = model.run_blocks(model.embed(images), 0, len(bb.blocks), hooked)
        return decode(final, hooked)

    def reduced(reduction: Reduction, images: torch.Tensor) -> dict:
        final, hooked = run_blocks(reduction, model.embed(images), bb.blocks, timm_vit.call_block, timm_vit.attention_probs,
                                   take=set(model.hook_layers), split=timm_vit.SPLIT)
        return decode(final, hooked)

    def block_tokens(images: torch.Tensor, layer: int) -> torch.Tensor:
        return model.run_blocks(model.embed(images), 0, layer + 1)[:, int(bb.num_prefix_tokens):]

    tasks = ("cls", "depth") + (("segmentation",) if segmentation_head is not None else ())
    return Backbone(
        name="demo", depth=len(bb.blocks), num_prefix=int(bb.num_prefix_tokens), has_cls=bb.cls_token is not None,
        image_size=int(model.image_size), tasks=tasks, full=full, reduced=reduced, features_dim=int(bb.embed_dim),
        block_tokens=block_tokens, preprocess=unit_range_preprocess(int(model.image_size)), eta=lambda options: eta(options, bb),
        task_forward=lambda task: _demo_task_forward(model, task, segmentation_head), num_patches=int(bb.patch_embed.num_patches),
    )


def _demo_task_forward(model, task: str, segmentation_head=None) -> tuple[Callable, Callable]:
    """The demo's forward of one task on ``images [B, 3, H, W]``: ``cls`` -> ``{"embedding" [B, E]}``
    (backbone, final norm, CLS head), ``depth`` -> ``{"depth" [B, H, W]}`` (backbone, the hooked
    layers through the final norm, depth head), ``segmentation`` -> ``{"segmentation" [B, C, H, W]}``
    (the same hooked layers, ``segmentation_head``). Reduced, the hooked layers are read at full
    length (merged tokens restored) as the depth head reads them."""
    bb, hooks = model.backbone, tuple(model.hook_layers)
    take = set(hooks) if task in ("depth", "segmentation") else set()

    def decode(final: torch.Tensor, hooked: dict) -> dict:
        if task == "cls":
            return {"embedding": model.cls_head(bb.norm(final)[:, 0])[0]}
        if task == "segmentation":
            return {"segmentation": segmentation_head(model.hook_maps(hooked), model.image_size)}
        return {"depth": model.depth_head(model.hook_maps(hooked), model.image_size)}

    def full(images: torch.Tensor) -> dict:
        hooked: dict = {}
        final = model.run_blocks(model.embed(images), 0, len(bb.blocks), hooked if take else None)
        return decode(final, hooked)

    def reduced(reduction: Reduction, images: torch.Tensor) -> dict:
        return decode(*run_blocks(reduction, model.embed(images), bb.blocks, timm_vit.call_block, timm_vit.attention_probs,
                                  take=take, split=timm_vit.SPLIT))

    return full, reduced


def timm_backbone(model) -> Backbone:
    """A timm VisionTransformer; the CLS task compares pre-logits features."""
    if not all(hasattr(model, a) for a in ("patch_embed", "_pos_embed", "blocks", "forward_head")):
        raise PullbackError(f"--model must name a timm VisionTransformer; got {type(model).__name__}")

    def full(images: torch.Tensor) -> dict:
        return {"embedding": model.forward_head(model.forward_features(images), pre_logits=True)}

    def reduced(reduction: Reduction, images: torch.Tensor) -> dict:
        return {"embedding": model.forward_head(timm_vit.forward_features(model, reduction, images), pre_logits=True)}

    def block_tokens(images: torch.Tensor, layer: int) -> torch.Tensor:
        return model.forward_intermediates(images, indices=[layer], output_fmt="NLC", intermediates_only=True)[0]

    size = model.patch_embed.img_size
    return Backbone(
        name=type(model).__name__, depth=len(model.blocks), num_prefix=int(model.num_prefix_tokens),
        has_cls=getattr(model, "cls_token", None) is not None, image_size=int(size[0] if isinstance(size, (tuple, list)) else size),
        tasks=("cls",), full=full, reduced=reduced, features_dim=int(model.embed_dim), block_tokens=block_tokens,
        preprocess=timm_preprocess(model), eta=lambda options: eta(options, model), num_patches=int(model.patch_embed.num_patches),
    )


def hf_backbone(model, folder: str | None = None) -> Backbone:
    """A Hugging Face model: a model of one of the ViT families of :mod:`pullback_ext.families`
    (CLS task: the family's image embedding, the probes' ``cls`` output) or a DPT / Depth Anything depth
    model (depth task: the predicted depth, and as the embedding the CLS token after the last encoder
    layer). ``folder`` holds its image processor config (mean and std)."""
    from pullback_ext.probes.hf_vision import embedding
    from pullback_ext.prune.hf_encoders import configured_patches, find_encoder, install, restore

    encoder = find_encoder(model)
    dense = hasattr(model, "head") and type(model).__name__.endswith("ForDepthEstimation")

    def full(images: torch.Tensor) -> dict:
        if not dense:
            return {"embedding": embedding(model, images)}
        out = model(pixel_values=images, output_hidden_states=True)
        return {"depth": out.predicted_depth, "embedding": out.hidden_states[-1][:, 0]}

    def reduced(reduction: Reduction, images: torch.Tensor) -> dict:
        install(encoder, reduction)
        try:
            return full(images)
        finally:
            restore(encoder.module)

    def block_tokens(images: torch.Tensor, layer: int) -> torch.Tensor:  # hidden_states[0] is the embedding
        return model(pixel_values=images, output_hidden_states=True).hidden_states[layer + 1][:, encoder.num_prefix:]

    config = getattr(model.config, "backbone_config", None) or model.config
    size = int(config.image_size if isinstance(config.image_size, int) else config.image_size[0])
    preprocess = hf_preprocess((size, size), folder) if dense else hf_crop_preprocess((size, size), folder)
    return Backbone(
        name=type(model).__name__, depth=len(encoder.layers), num_prefix=encoder.num_prefix, has_cls=encoder.has_cls,
        image_size=preprocess.size[0], tasks=("depth",) if dense else ("cls",), full=full, reduced=reduced,
        features_dim=int(config.hidden_size), block_tokens=block_tokens, preprocess=preprocess, num_patches=configured_patches(model),
    )


def load_backbone(spec: ModelSpec, weights: Optional[str] = None, task: Optional[str] = None,
                  device: torch.device | str = "cpu") -> tuple[Backbone, torch.nn.Module]:
    """``(Backbone, model)`` of ``spec``: the demo model, a timm VisionTransformer without its
    classifier (random weights unless ``weights``), or a local transformers folder (a ViT-family CLS
    model, DPT or Depth Anything; weights from ``weights`` or the folder). With ``task``
    ``segmentation`` the demo gets its shipped segmentation head (checked against its weights), on
    ``device`` with the model."""
    model, _ = load_model(spec, weights, headless=True)
    head = None
    if task == "segmentation" and spec.kind == "demo":
        from pullback_ext.embedded import load_segmentation_head

        head = load_segmentation_head(model=model).to(device)
    model.to(device)
    return backbone_of(model, spec.name if spec.kind == "hf" else None, who="--model", segmentation_head=head), model


def backbone_of(model, folder: Optional[str] = None, who: str = "model", segmentation_head=None) -> Backbone:
    """The :class:`Backbone` of a loaded ``model``: the demo model, a timm VisionTransformer or a
    Hugging Face model of a supported family (``folder``: its image processor config; ``who``:
    what the model is called in the error for an unknown one; ``segmentation_head``: the demo's,
    see :func:`demo_backbone`)."""
    from pullback_ext.embedded.model import DemoModel

    if isinstance(model, DemoModel):
        return demo_backbone(model, segmentation_head)
    if isinstance(detect(model, who=who), TimmFamily):
        return timm_backbone(model)
    return hf_backbone(model, folder)


def block_output_tokens(backbone: Backbone, images: torch.Tensor, layer: int) -> torch.Tensor:
    """Patch tokens ``[B, n, D]`` after block ``layer`` of the unreduced model."""
    with torch.no_grad():
        return backbone.block_tokens(images, layer)
