"""Probe maps of the Hugging Face ViT families: DINOv2 (with or without registers), ViT, CLIP and
SigLIP vision models, DINOv3 ViT: the families of :mod:`pullback_ext.families` with a probe
read-out (:class:`~pullback_ext.families.adapter.ProbeReadout`).

F = tokens after encoder layer ℓ (prefix tokens — CLS, registers — first, then the patches);
ψ runs layers ℓ+1.., then what the model does after its layer loop, and reads out

- ``cls``: the model's image embedding, as its family defines it (:func:`embedding` on the model's
  own forward is the same map of the images): DINOv2, DINOv3: ``pooler_output`` (the final-norm
  CLS row); ViT: the final-norm CLS row that ``ViTForImageClassification`` classifies (not the
  pooler, a dense + tanh layer no ViT classifier reads); CLIP: ``pooler_output`` (the
  post-LayerNorm CLS row), and for a model with a projection (``CLIPVisionModelWithProjection``)
  ``image_embeds``, the projected embedding compared with the text embeddings; SigLIP (no CLS
  token): ``pooler_output``, the output of the attention-pooling head over all tokens;
- ``tokens``: the model's ``last_hidden_state``, M = N·D (CLIP applies no norm to it);
- ``pooled``: the mean of the patch rows of ``last_hidden_state``, M = D.

DINOv3 layers also read the rotary position table of the patch grid: a constant of the image size,
computed once and kept as a buffer.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from pullback_ext.errors import PullbackError
from pullback_ext.families import HFFamily, detect, table
from pullback_ext.probes.base import Probe
from pullback_ext.probes.features import Features
from pullback_ext.probes.modes import evaluation, jvp_friendly

OUTPUTS = ("cls", "tokens", "pooled")


def _resolve(model: torch.nn.Module, families: Optional[Sequence[str]] = None) -> tuple[HFFamily, torch.nn.Module]:
    """``(family, base model)`` of ``model`` (a base model of ``families``, default every family
    with a probe read-out, or a model around one)."""
    try:
        family = detect(model, families)
    except PullbackError:
        family = None
    readout = getattr(family, "probe", None)
    if readout is not None:
        inner = getattr(model, readout.wrapper, None) if readout.wrapper else None
        for base in (model, inner):
            if type(base).__name__ in readout.bases:
                return family, base
    names = [base for f in table().values() if getattr(f, "probe", None) is not None
             and (families is None or f.name in families) for base in f.probe.bases]
    raise TypeError(f"model: expected transformers' {', '.join(names)} or a model around one (an image classifier, "
                    f"a model with a projection), got {type(model).__name__}")


def _attribute(module: torch.nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def embedding(model: torch.nn.Module, images: Tensor) -> Tensor:
    """The ``cls`` output of the family's model, from its base model's own forward (then the
    wrapper's projection, if any): images[B,3,H,W] -> [B,E]."""
    family, base = _resolve(model)
    readout = family.probe
    out = base(pixel_values=images)
    pooled = out.pooler_output if readout.pooler else out.last_hidden_state[:, 0]
    if pooled is None:
        raise PullbackError(f"model: this {type(base).__name__} has no pooled output (its config leaves out the "
                            f"pooling head), so no image embedding")
    projection = getattr(model, readout.projection, None) if readout.projection else None
    return pooled if projection is None else projection(pooled)


@contextlib.contextmanager
def captured_output(layer: torch.nn.Module, store: dict) -> Iterator[None]:
    """Within the block, ``store["out"]`` is set to what ``layer`` returns each time it runs."""
    handle = layer.register_forward_hook(lambda _m, _inp, out: store.__setitem__("out", out))
    try:
        yield
    finally:
        handle.remove()


class HFVisionProbe(Probe):
    """Probe of a Hugging Face ViT-family model at encoder layer ``layer`` (see module docstring)."""

    def __init__(self, model: torch.nn.Module, layer: int, output: str = "cls", image_size: Optional[Sequence[int]] = None,
                 output_transform: Optional[Tensor] = None, families: Optional[Sequence[str]] = None) -> None:
        family, base = _resolve(model, families)
        readout = family.probe
        layers = _attribute(base, readout.layers)
        if output == "cls" and readout.head is not None and getattr(base, readout.head, None) is None:
            raise PullbackError(f"output: 'cls' of a {readout.bases[0]} is its attention-pooling head's output; this model "
                                f"has none (config.vision_use_head is False): use 'pooled' or 'tokens'")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(layers):
            raise PullbackError(f"layer: expected an int in [0, {len(layers) - 1}] (the encoder has {len(layers)} layers), "
                                f"got {layer!r}")
        if output not in OUTPUTS:
            raise PullbackError(f"output: expected one of {', '.join(OUTPUTS)}, got {output!r}")
        config = base.config
        size = config.image_size if image_size is None else image_size
        image_size = (size, size) if isinstance(size, int) else tuple(size)
        if len(image_size) != 2 or min(image_size) < 1:
            raise PullbackError(f"image_size: expected (H, W), got {tuple(image_size)!r}")
        grid = (int(image_size[0]) // config.patch_size, int(image_size[1]) // config.patch_size)
        prefix = int(family.has_cls(base)) + int(getattr(config, "num_register_tokens", 0) or 0)
        super().__init__(layer, grid[0] * grid[1] + prefix, config.hidden_size, prefix, output_transform)
        self.family = family.name
        self.model = base
        self.projection = getattr(model, readout.projection, None) if readout.projection else None
        self.output = output
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.grid_size = grid
        self._readout = readout
        self.register_buffer("rotary", self._rotary_table(), persistent=False)

    @property
    def layers(self) -> torch.nn.ModuleList:
        """The encoder layers of the model."""
        return _attribute(self.model, self._readout.layers)

    def _rotary_table(self) -> Optional[Tensor]:
        """DINOv3: the (cos, sin) tables of the patch grid stacked, [2, n, d]; else None."""
        if not self._readout.rotary:
            return None
        weight = self.model.embeddings.patch_embeddings.weight
        with torch.no_grad(), evaluation(self.model):
            cos, sin = self.model.rope_embeddings(weight.new_zeros(1, 3, *self.image_size))
        return torch.stack([cos, sin]).to(weight.dtype)

    @torch.no_grad()
    def features(self, images: Tensor) -> Features:
        """images[B,3,H,W] -> F[B,N,D], the output of encoder layer ℓ (no context)."""
        if not isinstance(images, Tensor) or images.dim() != 4 or images.shape[1] != 3:
            raise PullbackError("images: expected a tensor [B,3,H,W], got "
                                + (str(tuple(images.shape)) if isinstance(images, Tensor) else type(images).__name__))
        if tuple(images.shape[-2:]) != self.image_size:
            raise PullbackError(f"images: expected spatial size {self.image_size} (the probe's image_size), "
                                f"got {tuple(images.shape[-2:])}")
        store: dict = {}
        with evaluation(self.model), captured_output(self.layers[self.layer], store):
            self.model(pixel_values=images)
        return Features(store["out"])

    def outputs(self, F: Tensor) -> Tensor:
        readout = self._readout
        extra = {} if self.rotary is None else {"position_embeddings": (self.rotary[0], self.rotary[1])}
        with jvp_friendly(self.model):
            h = F
            for layer in self.layers[self.layer + 1:]:
                h = layer(h, None, **extra)
            if readout.norm is not None:
                h = getattr(self.model, readout.norm)(h)
            if self.output == "tokens":
                return h.reshape(h.shape[0], -1)
            if self.output == "pooled":
                return h[:, self.num_prefix_tokens:].mean(dim=1)
            y = h[:, 0] if readout.pool is None else readout.pool(self.model, h)
            return y if self.projection is None else self.projection(y)


def from_hf_vision(model: torch.nn.Module, layer: int, output: str = "cls", image_size: Optional[Sequence[int]] = None,
                   output_transform: Optional[Tensor] = None) -> HFVisionProbe:
    """Probe ψ_ℓ of a Hugging Face DINOv2, ViT, CLIP or SigLIP vision, or DINOv3 ViT model (or a model
    around one): F after encoder layer ``layer`` -> ``output`` (``cls``, ``tokens`` or ``pooled``; see
    the module docstring); ``image_size`` (H, W) defaults to the config's."""
    return HFVisionProbe(model, layer, output, image_size, output_transform)
