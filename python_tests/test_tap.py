"""TAP: exact budget, the one active register, recovery α where features are read, deployment."""

from __future__ import annotations

import math

import pytest
import torch

import pullback_ext.patch as patch
from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.prune import timm_vit
from pullback_ext.prune.pipeline import run_blocks
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.methods import tap as tap_run
from pullback_ext.tap.budget import BudgetPlan, keep_count, largest_remainder
from pullback_ext.tap.register import TaskRegister
from pullback_ext.tap_training.relaxed import run_relaxed

GRID = 5  # 40 px, patch 8: N = 25 patch tokens, so most keep rates do not divide N


def small_vit(depth: int, registers: int = 0):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=8 * GRID, patch_size=8, embed_dim=32, depth=depth, num_heads=2, num_classes=0,
                              reg_tokens=registers)
    return model.double().eval().requires_grad_(False)


def register_for(task: str, layers: tuple, seed: int = 1) -> TaskRegister:
    torch.manual_seed(seed)
    register = TaskRegister(32, layers, task, key_dim=8).double()
    with torch.no_grad():  # uneven, image-dependent shares, so that every layer's count is exercised
        register.shares.weight.normal_(0.0, 2.0)
        register.shares.bias.normal_(0.0, 1.0)
    return register.eval()


def entering_lengths(model, images) -> list[int]:
    """Sequence length entering each block of ``model`` on ``images``."""
    lengths, hooks = [], [b.register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1])) for b in model.blocks]
    try:
        model.forward_features(images)
    finally:
        for h in hooks:
            h.remove()
    return lengths


def test_largest_remainder_is_exact_and_proportional():
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainder(7, [0.5, 0.25, 0.25]) == [3, 2, 2]  # 3.5, 1.75, 1.75: the .75s first
    assert largest_remainder(0, [0.2, 0.8]) == [0, 0]
    torch.manual_seed(0)
    for total in (1, 13, 98, 197):
        shares = torch.rand(6).tolist()
        counts = largest_remainder(total, shares)
        assert sum(counts) == total
        assert all(abs(c - total * s / sum(shares)) < 1 for c, s in zip(counts, shares))
    with pytest.raises(PullbackError, match="shares"):
        largest_remainder(3, [0.0, 0.0])


def test_budget_plan_hands_out_the_whole_budget():
    plan = BudgetPlan(25, 0.37, 3)
    taken = [plan.take(0, [0.2, 0.3, 0.5]), plan.take(1, [0.9, 0.1]), plan.take(2, [1.0])]
    assert sum(taken) == 25 - keep_count(0.37, 25) == 16
    assert keep_count(0.5, 25) == 13 and keep_count(0.1, 196) == 20  # floor(ρN + 0.5)


@pytest.mark.parametrize("depth, registers", [(4, 0), (6, 1)])
@pytest.mark.parametrize("task", ["cls", "depth"])
@pytest.mark.parametrize("rho", [0.5, 0.37, 0.81, 0.13, 0.96])
def test_budget_is_exact_for_every_image(depth, registers, task, rho):
    model = small_vit(depth, registers)
    stop = depth if task == "cls" else depth - 1
    register = register_for(task, (1, stop))
    images = torch.randn(5, 3, 8 * GRID, 8 * GRID, dtype=torch.float64)
    base = entering_lengths(model, images)
    patch.timm(model, strategy="tap", head=register, ratio=1.0 - rho)
    lengths = entering_lengths(model, images)
    prefix = 1 + registers + 1  # CLS, the model's registers, the task register
    keep = math.floor(rho * GRID * GRID + 0.5)
    assert lengths[0] == base[0] + 1  # only the active task register is added
    assert lengths[stop - 1] - prefix == keep  # after the last reduction: exactly floor(ρN + 0.5), every image
    assert all(a >= b for a, b in zip(lengths[:stop], lengths[1:stop]))
    if task == "depth":
        assert lengths[-1] == base[-1] + 1  # Last-Layer Fusion: the last block runs on everything
    final = model.forward_features(images)
    assert final.shape == (5, base[0], 32)


@pytest.mark.parametrize("task, layers", [("cls", (1, 4)), ("depth", (1, 3)), ("cls", (2, 3))])
@pytest.mark.parametrize("rho", [0.37, 0.81, 1.0])
def test_patch_tokens_per_block_is_exact_where_the_batch_does_not_decide(task, layers, rho):
    from pullback_ext.prune.eta import patch_tokens_per_block

    model, register = small_vit(4), register_for(task, layers)
    options = ReductionOptions(strategy="tap", head=register, ratio=1.0 - rho)
    counts = patch_tokens_per_block(options, model)
    patch.timm(model, strategy="tap", head=register, ratio=1.0 - rho)
    seen = [[n - 2 for n in entering_lengths(model, torch.randn(b, 3, 8 * GRID, 8 * GRID, dtype=torch.float64))] for b in (1, 5)]
    keep, start, stop = math.floor(rho * GRID * GRID + 0.5), *layers
    for i, count in enumerate(counts):
        unknown = start <= i < stop - 1 and keep < GRID * GRID
        assert (count is None) == unknown and all(count in (None, s[i]) for s in seen)  # each batch its own split
    assert counts[stop - 1] == keep  # exactly floor(ρN + 0.5) after the last eligible layer
    assert counts[-1] == (GRID * GRID if task == "depth" else keep)  # dense: Last-Layer Fusion runs the last block on all


def test_the_register_is_the_active_one_and_sits_after_the_prefix():
    model = small_vit(4, registers=1)
    register = register_for("cls", (1, 4))
    seen = []
    hook = model.blocks[0].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    patch.timm(model, strategy="tap", head=register, ratio=0.5)
    model.forward_features(torch.randn(2, 3, 40, 40, dtype=torch.float64))
    hook.remove()
    assert torch.equal(seen[0][:, 2], register.register[0].expand(2, -1))  # after CLS and the model's register


@pytest.mark.parametrize("task", ["cls", "depth"])
def test_training_forward_equals_the_deployed_one(task):
    model = small_vit(5)
    register = register_for(task, (1, 5 if task == "cls" else 4))
    images = torch.randn(3, 3, 40, 40, dtype=torch.float64)
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))
    reduction = ReductionOptions(strategy="tap", head=register, ratio=0.55).resolve(timm_vit.backbone_shape(model))
    hard, hard_taken = run_blocks(reduction, x, model.blocks, timm_vit.call_block, timm_vit.attention_probs, take={1, 2, 4})
    soft, soft_taken = run_relaxed(register, x, model.blocks, timm_vit.call_block, 1, 0.45, take={1, 2, 4})
    assert torch.allclose(hard, soft, atol=1e-8)
    assert all(torch.allclose(hard_taken[i], soft_taken[i], atol=1e-8) for i in hard_taken)


def neighbour_reference(x: torch.Tensor, kept: torch.Tensor, alpha: float) -> torch.Tensor:
    """Loop reference of one image's recovered features ``[N, D]`` on the GRID×GRID grid."""
    out = x.clone()
    for t in range(GRID * GRID):
        if kept[t]:
            continue
        r, c = divmod(t, GRID)
        around = [(r + dr) * GRID + c + dc for dr in (-1, 0, 1) for dc in (-1, 0, 1)
                  if (dr or dc) and 0 <= r + dr < GRID and 0 <= c + dc < GRID and kept[(r + dr) * GRID + c + dc]]
        m = torch.stack([x[s] for s in around]).mean(0) if around else x[kept].mean(0)
        out[t] = alpha * x[t] + (1 - alpha) * m
    return out


@pytest.mark.parametrize("broken", [False, True])
def test_recovery_alpha_is_applied_where_features_are_read(monkeypatch, broken):
    model = small_vit(4)
    register = register_for("depth", (1, 2))  # one stage, at the input of block 1
    with torch.no_grad():
        register.alpha.bias.fill_(math.log(0.3 / 0.7))  # α = 0.3 for every image
    if broken:  # a deliberately broken α: the frozen copy instead of the learned scale
        real = tap_run.recover_pruned
        monkeypatch.setattr(tap_run, "recover_pruned", lambda state, grid, alpha, newest=None: real(state, grid, torch.ones_like(alpha), newest))
    images = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(images))))
    x1 = model.blocks[0](register.insert(x, 1))  # the features at the read-out layer
    read = register.read(0, x1[:, 1], x1[:, 2:], 0.6)
    removed = torch.topk(read.scores, 25 - keep_count(0.6, 25), dim=1, largest=False).indices
    patch.timm(model, strategy="tap", head=register, ratio=0.4)
    hooked = model.forward_intermediates(images, indices=[1, 2], output_fmt="NLC", intermediates_only=True)
    for b in range(2):
        kept = torch.ones(25, dtype=torch.bool).scatter(0, removed[b], False)
        expected = neighbour_reference(x1[b, 2:], kept, 0.3)[~kept]
        for features in hooked:  # every read after the stage sees the recovered feature
            assert torch.allclose(features[b][~kept], expected, atol=1e-10) != broken


def test_checkpoint_folder_deploys_and_bad_options_are_refused(tmp_path):
    from pullback_ext.metric import checkpoint
    from pullback_ext.tap.checkpoint import model_classes

    model = small_vit(4)
    register = register_for("cls", (1, 4))
    checkpoint.save_model(tmp_path / "tap", "tap", register, classes=model_classes())
    with pytest.raises(CheckpointError, match="expected a 'head' checkpoint, got a 'tap' checkpoint"):
        checkpoint.load_model(tmp_path / "tap", kind="head")  # the metric loader knows only its own kinds
    with pytest.raises(CheckpointError, match=r"unknown model kind 'tap' \(expected one of \['head', 'spn', 'vae'\]\)"):
        checkpoint.load_model(tmp_path / "tap")
    images = torch.randn(2, 3, 40, 40, dtype=torch.float64)
    expected = patch.timm(model, strategy="tap", head=register, ratio=0.3).forward_features(images)
    assert torch.equal(patch.timm(model, strategy="tap", head=str(tmp_path / "tap"), ratio=0.3).forward_features(images), expected)
    assert not torch.equal(patch.timm(model, strategy="tap", head=register, ratio=0.6).forward_features(images), expected)
    with pytest.raises(PullbackError, match="needs head="):
        patch.timm(model, strategy="tap", ratio=0.3)
    with pytest.raises(PullbackError, match="does not take layers"):
        patch.timm(model, strategy="tap", head=register, layers=(2,))
    with pytest.raises(PullbackError, match="do not fit"):
        patch.timm(small_vit(3), strategy="tap", head=register, ratio=0.3)
    with pytest.raises(PullbackError, match="one float ratio"):
        patch.timm(model, strategy="tap", head=register, ratio=(0.1,))
