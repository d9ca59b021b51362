"""Pictures of the merges: which patch positions share a token after chosen blocks of a reduced forward.

:func:`group_maps` runs one reduced forward of a model (the embedded demo model, a timm
VisionTransformer, a Hugging Face model of a supported family) on a batch of images with one
reduction (the options of :func:`pullback_ext.patch.timm`: ``strategy="tome", r=8``, …) and reads,
from the method's own token tracking of that very forward
(:mod:`pullback_ext.prune.token_maps`: the map its full-length features are restored by), the
*group map* of every chosen block: for each original patch position the id of the token that
holds it after the block. Positions merged into one token share an id; a pruned position is
:data:`~pullback_ext.prune.token_maps.PRUNED` (-1). Ids are indices among that block's current
tokens, so they mean nothing across blocks or images. Where the model has an image decoder (a
depth map: the demo model, DPT, Depth Anything; class logits: the demo model with its
segmentation head) it also gives the decoder's output with and without the reduction; where the
strategy reads an importance head, the head's importance of the patch tokens at its first call
(the input of the first reduced block, before any reduction). With ``task`` it runs that task's
forward alone (what its cost counts: the demo's CLS task without the depth decoder).

:func:`merge_figure` draws one image of such maps (compute and draw are separate): the input, then
each chosen block with every merged group painted one colour of :func:`group_colours` over the
image (a group of one position is left as the image, a pruned position hatched, group borders
outlined), the importance map, and the decoder's outputs (a class map as its argmax, one colour
per class); :func:`comparison_figure` draws several reductions of one image, a row each.
``pullback visualize`` writes one per image (docs/visualize.md); ``pullback demo`` one comparison per
decoder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from pullback_ext.errors import PullbackError
from pullback_ext.grids import grid_shape
from pullback_ext.plots import colour_range, pyplot, save_figure, spans_decades
from pullback_ext.prune.token_maps import PRUNED, recording

SCORED = ("importance", "oracle")  # head_from of the methods whose head gives an importance map
MERGED_ALPHA = 0.6  # opacity of a merged group's colour over the image


@dataclass
class GroupMaps:
    """What :func:`group_maps` read of one reduced forward of ``B`` images.

    - ``groups``: ``{block: [B, h, w] int64}``, the id of the token holding each patch position
      after the block (shared by merged positions; ``PRUNED`` = -1 for pruned ones);
    - ``grid``: the patch grid ``(h, w)``; ``blocks``: the blocks drawn, increasing; ``depth``: the model's;
    - ``display``: ``[B, 3, H, W]`` the images in [0, 1] as the model saw them (normalisation undone);
    - ``importance``: ``[B, h, w]`` the head's importance of the patch tokens at its first call, or None;
    - ``outputs``, ``full_outputs``: ``{name: [B, H', W'] map or [B, C, H', W'] class logits}`` the
      decoder's image outputs (``depth``, ``segmentation``) with and without the reduction (empty for
      a model without an image decoder);
    - ``options``: the resolved :class:`~pullback_ext.prune.reduction_options.ReductionOptions`;
      ``model``: the model's name.
    """

    groups: dict
    grid: tuple
    blocks: tuple
    depth: int
    display: torch.Tensor
    options: object
    model: str = ""
    importance: Optional[torch.Tensor] = None
    outputs: dict = field(default_factory=dict)
    full_outputs: dict = field(default_factory=dict)

    def counts(self, image: int) -> dict:
        """``{block: group_counts(...)}`` of image ``image``."""
        return {block: group_counts(self.groups[block][image]) for block in self.blocks}


def group_counts(groups: torch.Tensor) -> dict:
    """What a group map ``[h, w]`` (or any shape) holds: ``tokens`` (distinct tokens holding a
    position), ``merged_groups`` (those holding two or more), ``merged_positions`` (the positions
    they hold), ``largest_group`` and ``pruned`` (positions out of the sequence)."""
    ids = groups.flatten()
    kept = ids[ids != PRUNED]
    sizes = torch.unique(kept, return_counts=True)[1] if kept.numel() else torch.zeros(0, dtype=torch.long)
    merged = sizes[sizes > 1]
    return {"tokens": int(sizes.numel()), "merged_groups": int(merged.numel()), "merged_positions": int(merged.sum()),
            "largest_group": int(sizes.max()) if sizes.numel() else 0, "pruned": int((ids == PRUNED).sum())}


class _RecordedHead:
    """A head (``importance(F)`` or ``F -> [B, K]``) that keeps the importance of its first call."""

    def __init__(self, head):
        self.head, self.first = head, None

    def importance(self, x: torch.Tensor):
        method = getattr(self.head, "importance", None)
        out = method(x) if callable(method) else self.head(x)
        if self.first is None and isinstance(out, torch.Tensor) and out.dim() == 2:
            self.first = out.detach()
        return out

    def __call__(self, x: torch.Tensor):
        return self.importance(x)


def _recorded_head(options):
    """``(options, recorder or None)``: the head of a scored strategy wrapped to keep its first importance."""
    head = options.head
    if options.method.head_from not in SCORED or head is None:
        return options, None
    if isinstance(head, tuple):
        recorder = _RecordedHead(head[0])
        return options.replace(head=(recorder, *head[1:])), recorder
    recorder = _RecordedHead(head)
    return options.replace(head=recorder), recorder


def checked_blocks(blocks: Sequence[int], depth: int) -> tuple:
    """``blocks`` as increasing distinct 0-based block indices of a ``depth``-block model."""
    if isinstance(blocks, int):
        blocks = (blocks,)
    values = list(blocks)
    if not values or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in values):
        raise PullbackError(f"blocks: expected one or more block indices (ints); got {blocks!r}")
    outside = [int(b) for b in values if not 0 <= b < depth]
    if outside:
        raise PullbackError(f"blocks: block {outside[0]} is out of range; this {depth}-block model has blocks 0..{depth - 1}")
    return tuple(sorted({int(b) for b in values}))


def _check_strategy(model, strategy: str) -> None:
    """Refuse, with the family's reason, a strategy the model cannot run (as patching does)."""
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.families import detect
    from pullback_ext.prune.methods import check_supported
    from pullback_ext.prune.methods.base import Traits

    inner = model.backbone if isinstance(model, DemoModel) else model
    family = detect(inner, who="model")
    check_supported(strategy, Traits.of(family, inner), family.title)


def _display(images: torch.Tensor, preprocess) -> torch.Tensor:
    """The model's input images ``[B, 3, H, W]`` back in [0, 1] (its preprocessing's normalisation undone)."""
    x = images.detach().float().cpu()
    if preprocess.mean is not None and preprocess.std is not None:
        x = x * torch.tensor(preprocess.std)[:, None, None] + torch.tensor(preprocess.mean)[:, None, None]
    return x.clamp(0.0, 1.0)


def _image_outputs(outputs: dict, batch: int) -> dict:
    """The outputs that are images, on the CPU: ``[B, H, W]`` maps (depth) and ``[B, C, H, W]``
    class logits (segmentation)."""
    return {name: value.detach().float().cpu() for name, value in outputs.items()
            if isinstance(value, torch.Tensor) and value.dim() in (3, 4) and value.shape[0] == batch}


def group_maps(model, images: torch.Tensor, /, blocks: Sequence[int], options=None, *, task: Optional[str] = None,
               segmentation_head=None, **overrides) -> GroupMaps:
    """The group maps of ``blocks`` (0-based) of one reduced forward of ``model`` on ``images
    [B, 3, H, W]`` (prepared as the model expects: the demo model's in [0, 1], a timm or Hugging
    Face model's normalised), with the reduction ``options`` and keyword ``overrides`` (those of
    :func:`pullback_ext.patch.timm`; ``mode="auto"`` prunes on a model whose only decoder is dense
    (DPT, Depth Anything) or for a dense ``task``, and merges otherwise). ``task``: run that task's
    forward alone (:meth:`~pullback_ext.comparison.backbones.Backbone.forwards`; None: the model's
    whole forward); ``segmentation_head``: the demo model's (``load_segmentation_head``), which
    gives it the ``segmentation`` output. The model is not patched. See :class:`GroupMaps`.
    """
    from pullback_ext.comparison.backbones import backbone_of
    from pullback_ext.comparison.tasks import get as get_task
    from pullback_ext.prune.reduction_options import BackboneShape, with_overrides

    backbone = backbone_of(model, segmentation_head=segmentation_head)
    if segmentation_head is not None and "segmentation" not in backbone.tasks:
        raise PullbackError(f"segmentation_head: only the demo model takes one; got a {backbone.name}")
    blocks = checked_blocks(blocks, backbone.depth)
    options = with_overrides(options, **overrides)
    _check_strategy(model, options.strategy)
    full_forward, reduced_forward = (backbone.full, backbone.reduced) if task is None else backbone.forwards(task)
    options, recorder = _recorded_head(options)
    dense = get_task(task).dense if task is not None else "depth" in backbone.tasks and "cls" not in backbone.tasks
    reduction = options.resolve(BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=backbone.has_cls,
                                              dense_neck=dense, num_patch=backbone.num_patches))
    with torch.no_grad():
        with recording(blocks) as recorded:
            reduced = _image_outputs(reduced_forward(reduction, images), images.shape[0])
        full = _image_outputs(full_forward(images), images.shape[0]) if reduced else {}
    num_patch = backbone.num_patches
    groups = {}
    for block in blocks:
        held = recorded.maps.get(block)
        if not held:
            raise PullbackError(f"strategy {options.strategy!r} does not report where its tokens go "
                                f"(pullback_ext.prune.token_maps.report), so its groups cannot be drawn")
        held = held[0].cpu()
        num_patch = num_patch or held.shape[1] - backbone.num_prefix
        groups[block] = held[:, -num_patch:]
    h, w = grid_shape(num_patch)
    groups = {block: g.reshape(-1, h, w) for block, g in groups.items()}
    importance = None
    if recorder is not None and recorder.first is not None and recorder.first.shape[1] >= num_patch:
        importance = recorder.first[:, -num_patch:].float().cpu().reshape(-1, h, w)
    return GroupMaps(groups=groups, grid=(h, w), blocks=blocks, depth=backbone.depth, display=_display(images, backbone.preprocess),
                     options=reduction.options, model=backbone.name, importance=importance, outputs=reduced, full_outputs=full)


# drawing

def group_colours() -> np.ndarray:
    """The colour table of merged groups, ``[40, 3]`` RGB in [0, 1] (matplotlib's tab20 and tab20b):
    groups take them in the order of their first position, cycling."""
    plt = pyplot()
    return np.asarray(plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors, dtype=float)


def group_overlay(groups: torch.Tensor) -> np.ndarray:
    """``[h, w, 4]`` RGBA over the image for a group map ``[h, w]``: each merged group one colour of
    :func:`group_colours` at :data:`MERGED_ALPHA`, groups of one position and pruned ones clear
    (pruned positions are hatched by :func:`merge_figure`)."""
    ids = groups.numpy()
    flat = ids.ravel()
    overlay = np.zeros(ids.shape + (4,))
    kept = flat[flat != PRUNED]
    values, first, sizes = np.unique(kept, return_index=True, return_counts=True)
    colours = group_colours()
    merged = [(f, v) for v, f, s in zip(values, first, sizes) if s > 1]
    for rank, (_, value) in enumerate(sorted(merged)):
        overlay[ids == value] = (*colours[rank % len(colours)], MERGED_ALPHA)
    return overlay


def _borders(groups: np.ndarray, cell: tuple) -> list:
    """Line segments (image pixels) around the merged groups: between neighbouring patch cells of
    different groups, one of them merged (two cells that each hold themselves get no line)."""
    values, inverse, sizes = np.unique(groups, return_inverse=True, return_counts=True)
    merged = ((sizes > 1) & (values != PRUNED))[inverse.reshape(groups.shape)]
    ch, cw = cell
    segments = []
    edges = (groups[:, 1:] != groups[:, :-1]) & (merged[:, 1:] | merged[:, :-1])
    for y, x in zip(*np.nonzero(edges)):
        segments.append([((x + 1) * cw, y * ch), ((x + 1) * cw, (y + 1) * ch)])
    edges = (groups[1:] != groups[:-1]) & (merged[1:] | merged[:-1])
    for y, x in zip(*np.nonzero(edges)):
        segments.append([(x * cw, (y + 1) * ch), ((x + 1) * cw, (y + 1) * ch)])
    return segments


def _groups_panel(ax, picture: np.ndarray, groups: torch.Tensor, block: int) -> None:
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    height, width = picture.shape[:2]
    h, w = groups.shape
    cell = (height / h, width / w)
    ax.imshow(picture, extent=(0, width, height, 0))
    ax.imshow(group_overlay(groups), extent=(0, width, height, 0), interpolation="nearest")
    for y, x in zip(*np.nonzero(groups.numpy() == PRUNED)):
        ax.add_patch(Rectangle((x * cell[1], y * cell[0]), cell[1], cell[0], facecolor=(0.2, 0.2, 0.2, 0.45),
                               edgecolor="white", hatch="////", linewidth=0))
    ax.add_collection(LineCollection(_borders(groups.numpy(), cell), colors="white", linewidths=0.6, alpha=0.9))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    c = group_counts(groups)
    merged = (f"{c['merged_groups']} merged group{'s' if c['merged_groups'] > 1 else ''} (largest {c['largest_group']})"
              if c["merged_groups"] else "no merged group")
    pruned = f", {c['pruned']} pruned (hatched)" if c["pruned"] else ""
    ax.set_title(f"after block {block}: {c['tokens']} tokens\n{merged}{pruned}", fontsize=8)


def _heatmap(fig, ax, values: torch.Tensor, title: str, label: str, cmap: str, limits: Optional[tuple] = None) -> None:
    """A heatmap with its colorbar (a log colour scale when the positive values span two decades)."""
    from matplotlib.colors import LogNorm

    v = values.double().numpy()
    if spans_decades(v) and (v > 0).all():
        im = ax.imshow(v, cmap=cmap, norm=LogNorm(*(limits or (v.min(), v.max()))))
    else:
        low, high = limits or colour_range(values.double())
        im = ax.imshow(v, cmap=cmap, vmin=low, vmax=high)
    fig.colorbar(im, ax=ax, location="bottom", shrink=0.8, label=label, format="%.2g")
    ax.set_title(title, fontsize=8)


def _classes(fig, ax, logits: torch.Tensor, title: str) -> None:
    """The argmax class map of ``logits [C, H, W]``, one colour per class (:func:`group_colours`, cycling)."""
    from matplotlib.colors import ListedColormap

    num_classes = logits.shape[0]
    colours = ListedColormap(np.resize(group_colours(), (num_classes, 3)))
    im = ax.imshow(logits.argmax(dim=0).numpy(), cmap=colours, vmin=-0.5, vmax=num_classes - 0.5, interpolation="nearest")
    fig.colorbar(im, ax=ax, location="bottom", shrink=0.8, label="class (argmax)", format="%d")
    ax.set_title(title, fontsize=8)


def _panels(maps: GroupMaps) -> int:
    """How many panels :func:`merge_figure` draws for ``maps``."""
    return 1 + len(maps.blocks) + (maps.importance is not None) + 2 * len(maps.outputs)


def _draw_row(fig, axes: list, maps: GroupMaps, image: int, label: str) -> None:
    """Image ``image`` of ``maps`` into ``axes`` (at least :func:`_panels` of them), the input titled ``label``."""
    picture = maps.display[image].permute(1, 2, 0).numpy()
    axes[0].imshow(picture)
    axes[0].set_title(label, fontsize=8)
    for ax, block in zip(axes[1:], maps.blocks):
        _groups_panel(ax, picture, maps.groups[block][image], block)
    at = 1 + len(maps.blocks)
    if maps.importance is not None:
        _heatmap(fig, axes[at], maps.importance[image], "importance (head)\nat its first call", "importance", "magma")
        at += 1
    for name, reduced in maps.outputs.items():
        full = maps.full_outputs[name][image]
        if full.dim() == 3:
            _classes(fig, axes[at], full, f"{name}, unreduced")
            _classes(fig, axes[at + 1], reduced[image], f"{name}, reduced")
        else:
            both = torch.stack([full, reduced[image]]).double()
            limits = (float(both.min()), float(both.max())) if float(both.max()) > float(both.min()) else None
            _heatmap(fig, axes[at], full, f"{name}, unreduced", name, "viridis", limits)
            _heatmap(fig, axes[at + 1], reduced[image], f"{name}, reduced", name, "viridis", limits)
        at += 2


def comparison_figure(rows: Sequence[tuple], image: int = 0, title: str = ""):
    """One figure of image ``image`` under several reductions, a row each: ``rows`` of ``(label,
    maps)`` (:class:`GroupMaps` of the same images; ``label`` titles the row's input panel), each
    row drawn as :func:`merge_figure` draws its one. Returns the figure."""
    rows = list(rows)
    if not rows:
        raise PullbackError("rows: expected one or more (label, GroupMaps) pairs; got none")
    width = max(_panels(maps) for _, maps in rows)
    fig, axes = pyplot().subplots(len(rows), width, figsize=(3 * width, 3.9 * len(rows)), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    for (label, maps), row in zip(rows, axes):
        _draw_row(fig, list(row), maps, image, label)
    if title:
        fig.suptitle(title, fontsize=9)
        fig.get_layout_engine().set(h_pad=0.1)  # the default leaves the title touching two-line panel titles
    return fig


def merge_figure(maps: GroupMaps, image: int = 0, title: str = ""):
    """One figure of image ``image`` of ``maps``: the input; the groups after each block (merged
    groups painted, pruned positions hatched); the importance map, when there is one; each image
    output of the decoder unreduced and reduced, on one colour scale (class logits as their argmax
    map). Returns the figure."""
    return comparison_figure([("input", maps)], image, title or f"{maps.options.strategy} on {maps.model}: groups after blocks "
                                                                  f"{', '.join(map(str, maps.blocks))}")


def plot_merges(maps: GroupMaps, image: int, path: str | Path, title: str = "") -> Path:
    """:func:`merge_figure` written to ``path`` (atomically)."""
    return save_figure(merge_figure(maps, image, title), path)
