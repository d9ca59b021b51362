"""``study subspace`` (Geosubprobe): a per-token linear probe at every layer, and how much of its
quality survives when the features are projected onto the top-k right-singular subspace of its
weight ``W``, onto the complement, or onto a random k-subspace, for k = 1, 2, 4, … up to rank(W).

Quality is R² = 1 − MSE / Var(targets) of the probe's predictions against the per-token targets
(``studies.subspace.interventions`` gives the RMSE); without targets it is the fidelity
1 − output_change² (R² against the unprojected predictions). Closed form (the oracle of the
tests): for features that are centred and white (covariance I over the tokens), the fidelity of
a projector P is ‖W P‖²_F / ‖W‖²_F, i.e. Σ_{j≤k} σ_j² / Σ_j σ_j² for the top-k subspace, one
minus that for its complement, and k / D in expectation for a random subspace.

The probe: on the demo model (trained or ``demo:random``) without user targets, one of the
per-token probes fitted on rendered scenes (:data:`DEMO_PROBES`): ``depth``, the log-depth of each
patch's 2×2 quadrants (``studies.subspace.fit_depth_probe``, exactly what ``pullback subprobe
--probe fit`` does), or ``segmentation``, each patch's fraction of pixels of each of the 11 classes
(``studies.subspace.fit_class_probe``), judged on the study's images (their depth or per-pixel
classes where the image source knows them); with user targets ``[num_images, N, C]``, a ridge
probe fitted on the first half of the images and judged on the second half.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pullback_ext.errors import DataError
from pullback_ext.studies.subspace import (INTERVENTIONS, TRAINING_SEED, class_probe_targets, depth_probe_targets, fit_class_probe,
                                           fit_depth_probe, fit_linear_probe, interventions, probe_basis)

KEEP = 0.95  # the share of the unprojected quality that "k95" keeps
DEMO_PROBES = ("depth", "segmentation")  # the demo's probes fitted on rendered scenes (see the module's doc)


def power_ks(rank: int) -> tuple[int, ...]:
    """k = 1, 2, 4, … below ``rank``, then ``rank`` itself."""
    ks, k = [], 1
    while k < rank:
        ks.append(k)
        k *= 2
    return tuple(ks + [rank]) if rank >= 1 else (1,)


def _quality(result: dict, variance: Optional[float]) -> dict:
    """``{kind: [quality per k]}`` and the unprojected quality from an ``interventions`` result."""
    def q(row: dict) -> float:
        return 1.0 - row["rmse"] ** 2 / variance if variance is not None else 1.0 - row["output_change"] ** 2

    curves = {kind: [q(row) for row in result["results"][kind]] for kind in INTERVENTIONS}
    full = 1.0 - result["rmse_unchanged"] ** 2 / variance if variance is not None else 1.0
    return {"curves": curves, "quality": full}


def _variance(targets: Optional[torch.Tensor]) -> Optional[float]:
    if targets is None:
        return None
    t = targets.reshape(-1, targets.shape[-1]).double()
    return float((t - t.mean(0)).square().mean())


def probe_curves(tokens: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: Optional[torch.Tensor] = None,
                 ks: Optional[tuple] = None, seed: int = 0) -> dict:
    """Quality curves of the probe ``(weight [C, D], bias [C])`` on ``tokens [B, T, D]`` (with
    ``targets [B, T, C]`` where known), pooled over every token and per image; ``ks`` default
    :func:`power_ks` of rank(W). The random subspaces come from ``seed`` (the same for every image)."""
    _, sigma = probe_basis(weight.double())
    rank = int(torch.linalg.matrix_rank(weight.double()))
    ks = power_ks(rank) if ks is None else tuple(ks)
    pooled = interventions(tokens, weight, bias, ks=ks, targets=targets, seed=seed)
    out = {"ks": list(ks), "rank": rank, "sigma": sigma.double().tolist(), "interventions": pooled["results"],
           **_quality(pooled, _variance(targets))}
    if targets is not None:
        out["rmse_unchanged"] = pooled["rmse_unchanged"]
    images = []
    for b in range(tokens.shape[0]):
        t = None if targets is None else targets[b:b + 1]
        images.append(_quality(interventions(tokens[b:b + 1], weight, bias, ks=ks, targets=t, seed=seed), _variance(t)))
    out["images"] = images
    out["k95"] = next((k for k, q in zip(ks, out["curves"]["subspace"]) if q >= KEEP * out["quality"]), None)
    return out


def read_targets(path: str, count: int, num_patch: int, num_prefix: int, flag: str = "--probe-targets") -> torch.Tensor:
    """Per-token targets ``[count, num_patch, C]`` from a ``.npy`` file or a safetensors file with
    one tensor, ``[num_images, N, C]`` aligned with the sorted image list (N: the patch tokens, or
    every token, prefix first, whose prefix rows are dropped)."""
    if path.endswith(".npy"):
        import numpy as np

        try:
            targets = torch.from_numpy(np.load(path))
        except (OSError, ValueError) as exc:
            raise DataError(f"{flag}: {path} is not a readable .npy array ({exc})") from exc
    else:
        from pullback_ext.sources.weights import read_state_dict

        state = read_state_dict(path, flag=flag)
        if len(state) != 1:
            raise DataError(f"{flag}: {path} must hold exactly one tensor [num_images, N, C]; it holds {sorted(state)}")
        targets = next(iter(state.values()))
    if targets.dim() != 3 or targets.shape[0] < count or targets.shape[1] not in (num_patch, num_patch + num_prefix):
        raise DataError(f"{flag}: {path} must be [num_images >= {count}, N = {num_patch} (or {num_patch + num_prefix}), C]; "
                        f"got {tuple(targets.shape)}")
    return targets[:count, targets.shape[1] - num_patch:].double()


@dataclass
class SubspaceStudy:
    """One model's sweep of one probe: ``backbone`` and ``model`` (``comparison.backbones.load_backbone``),
    the images (``images [n, 3, H, W]``), per-token ``targets [n, T, C]`` or None, and ``probe``:
    the demo's probe of that name fitted on rendered scenes (a key of :data:`DEMO_PROBES`), or None
    for a probe fitted on the first half of the images (user targets)."""

    backbone: object
    model: object
    images: torch.Tensor
    targets: Optional[torch.Tensor]
    probe: Optional[str]
    seed: int = 0
    train_n: int = 128
    batch_size: int = 16
    train: Optional[dict] = None  # the rendered training scenes of the demo probe, once rendered

    def work(self) -> list[int]:
        return list(range(self.images.shape[0]))

    def measure(self, layer: int, indices: list) -> list[torch.Tensor]:
        """Patch tokens ``[T, D]`` after block ``layer`` of every image of ``indices``."""
        from pullback_ext.comparison.backbones import block_output_tokens

        out = []
        for start in range(0, len(indices), self.batch_size):
            chunk = self.images[indices[start:start + self.batch_size]]
            out.extend(block_output_tokens(self.backbone, chunk, layer))
        return out

    def finish(self, layer: int, tokens: list) -> dict:
        tokens = torch.stack(tokens)
        if self.probe is not None:
            if self.train is None:  # rendered once for every layer
                from pullback_ext.embedded.scenes import render

                self.train = render(self.train_n, seed=TRAINING_SEED, classes=self.probe == "segmentation")
            fit = fit_class_probe if self.probe == "segmentation" else fit_depth_probe
            weight, bias = fit(self.model, layer, self.train_n, self.train)
            return probe_curves(tokens, weight, bias, self.targets, seed=self.seed)
        half = max(1, tokens.shape[0] // 2)
        weight, bias = fit_linear_probe(tokens[:half].double(), self.targets[:half])
        unit = probe_curves(tokens[half:].double(), weight, bias, self.targets[half:], seed=self.seed)
        return unit | {"fitted_on": half}


def demo_targets(model, probe: str, data: dict) -> Optional[torch.Tensor]:
    """The per-token targets ``[n, T, C]`` of the demo's fitted ``probe`` on loaded images
    ``data``: from their depth maps ``depth [n, H, W]`` or per-pixel classes ``classes [n, H, W]``
    (None where the image source does not know them)."""
    from pullback_ext.embedded.scenes import SEGMENT_CLASS_NAMES
    from pullback_ext.studies.subspace import demo_grid

    if probe == "segmentation":
        classes = data.get("classes")
        return None if classes is None else class_probe_targets(classes, demo_grid(model), len(SEGMENT_CLASS_NAMES))
    depth = data.get("depth")
    return None if depth is None else depth_probe_targets(depth, demo_grid(model))


def summary(units: dict) -> dict:
    """Per model: the layer where the unprojected quality peaks, and k95 per layer."""
    layers = sorted(units, key=int)
    quality = [units[layer]["quality"] for layer in layers]
    best = max(range(len(layers)), key=lambda i: quality[i])
    return {"quality": quality, "peak_layer": int(layers[best]), "peak_quality": quality[best],
            "k95": [units[layer]["k95"] for layer in layers],
            "subspace_k1": [units[layer]["curves"]["subspace"][0] for layer in layers]}
