"""Geosubprobe-style subspace interventions for linear probes on token features.

A linear probe ``y_t = W x_t + b`` (``W ∈ R^{C×D}``) applied to every token has a block-diagonal
Jacobian, so its pullback metric is exactly ``g = I_N ⊗ WᵀW``: the probe's geometric subspace is
spanned by the top right singular vectors of ``W``. Interventions replace every token by its
projection onto the top-k subspace, onto its complement, or onto a random k-dimensional subspace,
and measure how much of the probe's output survives. Closed forms (the oracle): projecting onto
the top-k subspace with ``k >= rank(W)`` leaves the output unchanged; its complement leaves only
``b``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from pullback_ext.errors import PullbackError

INTERVENTIONS = ("subspace", "complement", "random")
TRAINING_SEED = 12345  # the rendered scenes the demo's probes are fitted on


def fit_linear_probe(features: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-3) -> tuple:
    """Ridge regression per token: ``features [B, T, D]``, ``targets [B, T, C]`` -> ``(W [C, D], b [C])``.

    ``ridge`` is relative to the mean feature variance, so it is scale-free.
    """
    if features.dim() != 3 or targets.dim() != 3 or features.shape[:2] != targets.shape[:2]:
        raise PullbackError(f"fit_linear_probe: need features [B, T, D] and targets [B, T, C]; got {tuple(features.shape)} and {tuple(targets.shape)}")
    x = features.reshape(-1, features.shape[-1]).double()
    y = targets.reshape(-1, targets.shape[-1]).double()
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    gram = xc.T @ xc
    reg = ridge * gram.diagonal().mean().clamp_min(1e-12)
    w = torch.linalg.solve(gram + reg * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc).T  # [C, D]
    return w.to(features.dtype), (my - w @ mx).to(features.dtype)


def probe_basis(weight: torch.Tensor) -> tuple:
    """Right singular vectors ``V [D, min(C, D)]`` and singular values of ``W [C, D]``."""
    _, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    return vh.T.to(weight.dtype), s.to(weight.dtype)


def projector(kind: str, basis: torch.Tensor, k: int, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """The ``D × D`` projection matrix of an intervention with ``k`` dimensions."""
    d = basis.shape[0]
    if kind not in INTERVENTIONS:
        raise PullbackError(f"intervention must be one of {', '.join(INTERVENTIONS)}; got {kind!r}")
    if not 0 <= k <= d:
        raise PullbackError(f"k must lie in [0, {d}]; got {k}")
    if kind == "random":
        q = torch.linalg.qr(torch.randn(d, max(k, 1), generator=generator, dtype=torch.float64)).Q[:, :k]
        return (q @ q.T).to(basis.dtype)
    if k > basis.shape[1]:
        raise PullbackError(f"k must be at most the probe's {basis.shape[1]} singular directions for {kind!r}; got {k}")
    v = basis[:, :k].double()
    p = v @ v.T
    return (p if kind == "subspace" else torch.eye(d, dtype=p.dtype) - p).to(basis.dtype)


def interventions(
    features: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    targets: Optional[torch.Tensor] = None,
    seed: int = 0,
) -> dict:
    """Relative change of the probe's output under each intervention and ``k``.

    ``features [B, T, D]`` (patch tokens), ``weight [C, D]``, ``bias [C]``. For each kind and k:
    ``output_change`` = ‖ψ(P x) − ψ(x)‖ / ‖ψ(x) − mean ψ(x)‖ over all tokens, ``energy`` = the share
    of ‖W‖_F² the projected directions carry, and with ``targets [B, T, C]`` the probe's RMSE.
    """
    if features.shape[-1] != weight.shape[1]:
        raise PullbackError(f"features have width {features.shape[-1]} but the probe expects {weight.shape[1]}")
    b = torch.zeros(weight.shape[0], dtype=features.dtype) if bias is None else bias
    x = features.reshape(-1, features.shape[-1]).double()
    w, bb = weight.double(), b.double()
    y = x @ w.T + bb
    scale = (y - y.mean(0)).norm().clamp_min(1e-30)
    basis, _ = probe_basis(weight.double())
    generator = torch.Generator().manual_seed(seed)
    out: dict = {"ks": list(ks), "rank": int(torch.linalg.matrix_rank(w)), "results": {}}
    if targets is not None:
        t = targets.reshape(-1, targets.shape[-1]).double()
        out["rmse_unchanged"] = float((y - t).square().mean().sqrt())
    for kind in INTERVENTIONS:
        rows = []
        for k in ks:
            p = projector(kind, basis, min(k, basis.shape[1]) if kind != "random" else k, generator).double()
            yp = x @ p @ w.T + bb
            row = {"k": k, "output_change": float((yp - y).norm() / scale), "energy": float((w @ p).square().sum() / w.square().sum())}
            if targets is not None:
                row["rmse"] = float((yp - t).square().mean().sqrt())
            rows.append(row)
        out["results"][kind] = rows
    return out


def depth_probe_targets(depth: torch.Tensor, grid: int) -> torch.Tensor:
    """Per-token targets ``[B, grid², 4]`` from depth maps ``[B, H, W]``: the log-depth of the
    2×2 quadrants of each patch of a ``grid × grid`` patch grid."""
    pooled = torch.nn.functional.adaptive_avg_pool2d(depth.log()[:, None], 2 * grid)  # [B,1,2g,2g]
    q = pooled.view(depth.shape[0], grid, 2, grid, 2).permute(0, 1, 3, 2, 4)
    return q.reshape(depth.shape[0], grid * grid, 4)


def class_probe_targets(classes: torch.Tensor, grid: int, num_classes: int) -> torch.Tensor:
    """Per-token targets ``[B, grid², num_classes]`` (float64) from per-pixel classes ``[B, H, W]``
    (ints in ``[0, num_classes)``, H and W multiples of ``grid``): the fraction of each patch's
    pixels that show each class, patches in row-major order."""
    if classes.dim() != 3 or classes.shape[1] % grid or classes.shape[2] % grid:
        raise PullbackError(f"classes: expected [B, H, W] with H and W multiples of the {grid}-patch grid; got {tuple(classes.shape)}")
    onehot = torch.nn.functional.one_hot(classes.long(), num_classes).permute(0, 3, 1, 2).double()  # [B, C, H, W]
    return torch.nn.functional.adaptive_avg_pool2d(onehot, grid).flatten(2).transpose(1, 2)


def subspace_analysis(model, layer: int, train_n: int, test: dict, quick: bool, ks=None) -> dict:
    """Fit a linear per-token depth probe on block ``layer`` outputs of ``train_n`` rendered
    scenes of the embedded model ``model``, then intervene on the held-out ``test`` scenes
    (``images``, ``depth``)."""
    from pullback_ext.comparison.backbones import block_output_tokens, demo_backbone

    weight, bias = fit_depth_probe(model, layer, train_n)
    depth = test.get("depth")
    ks = ((1, 2, 4) if quick else (1, 2, 3, 4)) if ks is None else ks
    targets = None if depth is None else depth_probe_targets(depth, demo_grid(model))
    result = interventions(block_output_tokens(demo_backbone(model), test["images"], layer), weight, bias, ks=ks, targets=targets)
    result["layer"] = layer
    return result


def demo_grid(model) -> int:
    """Patch-grid side of the embedded model ``model`` (14 for the shipped one)."""
    return model.image_size // model.backbone.patch_embed.patch_size[0]


def fit_depth_probe(model, layer: int, train_n: int, train: Optional[dict] = None) -> tuple:
    """``(W [4, D], b [4])``: the per-token log-depth probe of :func:`depth_probe_targets`, fitted
    on block ``layer`` outputs of ``train_n`` rendered training scenes of the embedded ``model``
    (``train``: those scenes, ``render(train_n, seed=TRAINING_SEED)``, when already rendered)."""
    from pullback_ext.comparison.backbones import block_output_tokens, demo_backbone
    from pullback_ext.embedded.scenes import render

    train = render(train_n, seed=TRAINING_SEED) if train is None else train
    tokens = block_output_tokens(demo_backbone(model), train["images"], layer)
    return fit_linear_probe(tokens, depth_probe_targets(train["depth"], demo_grid(model)))


def fit_class_probe(model, layer: int, train_n: int, train: Optional[dict] = None) -> tuple:
    """``(W [C, D], b [C])``, C = 11 (ground, wall, the nine object classes): the per-token linear
    segmentation probe, a ridge fit of :func:`class_probe_targets` on block ``layer`` outputs of
    ``train_n`` rendered training scenes of the embedded ``model`` (``train``: those scenes,
    ``render(train_n, seed=TRAINING_SEED, classes=True)``, when already rendered). The fractions
    of a patch sum to one, so in exact arithmetic the rows of W sum to zero and rank(W) ≤ C − 1;
    W is float64 with its class mean removed, so that the solve's rounding does not add a spurious
    C-th singular value."""
    from pullback_ext.comparison.backbones import block_output_tokens, demo_backbone
    from pullback_ext.embedded.scenes import SEGMENT_CLASS_NAMES, render

    train = render(train_n, seed=TRAINING_SEED, classes=True) if train is None else train
    tokens = block_output_tokens(demo_backbone(model), train["images"], layer)
    weight, bias = fit_linear_probe(tokens.double(), class_probe_targets(train["classes"], demo_grid(model), len(SEGMENT_CLASS_NAMES)))
    return weight - weight.mean(dim=0), bias
