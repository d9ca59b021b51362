"""The importance head fine-tuned through importance_tome's relaxed merging (``pullback train
finetune``): the relaxed forward against the deployed one where the grouping is hard, its costs
against a loop of the formula, what the soft merges conserve, the gradient's path, and the command."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers.blocks import embed
from helpers.prune import images, tiny_vit
from pullback_ext.dtem_training import importance
from pullback_ext.dtem_training.importance import RelaxedImportanceToMe, guarded_costs
from pullback_ext.dtem_training.relaxed import Relaxation
from pullback_ext.errors import PullbackError
from pullback_ext.metric.head import ImportanceHead
from pullback_ext.prune import timm_vit
from pullback_ext.prune.methods.base import BackboneShape, BlockLoop
from pullback_ext.prune.methods.importance_tome import pair_costs
from pullback_ext.prune.reduction_options import ReductionOptions

HARD = Relaxation(k2=3, tau1=1.0, tau2=1e-7)  # every softmax round one-hot in float64


def _head(dim: int = 32, seed: int = 3, spread: float = 3.0) -> ImportanceHead:
    """A random importance head whose scores vary enough over the tokens that the guard changes merges."""
    torch.manual_seed(seed)
    head = ImportanceHead(dim, hidden=16, heads=2).double()
    with torch.no_grad():
        head.score.weight.mul_(spread)
    return head.eval()


def _forward(model, head, x, method=None, **options):
    shape = BackboneShape(depth=len(model.blocks), num_prefix=int(model.num_prefix_tokens), has_cls=True,
                          num_patch=int(model.patch_embed.num_patches))
    reduction = ReductionOptions(strategy="importance_tome", head=head, **options).resolve(shape)
    if method is not None:
        reduction = dataclasses.replace(reduction, method=method)
    loop = BlockLoop(model.blocks, timm_vit.call_block, timm_vit.attention_probs, timm_vit.SPLIT)
    return reduction.method.run(reduction, embed(model, x), loop, take=range(len(model.blocks)))


def test_guarded_costs_are_the_formula_of_every_pair_and_their_minimum_the_deployed_cost():
    g = torch.Generator().manual_seed(0)
    unit = torch.nn.functional.normalize(torch.randn(2, 9, 4, generator=g, dtype=torch.float64), dim=-1)
    e, s = torch.rand(2, 9, generator=g, dtype=torch.float64) + 0.1, torch.randint(1, 4, (2, 9), generator=g).double()
    a, b = slice(0, 5), slice(5, 9)
    for guard, partner in ((1.0, "bound"), (2.0, "bound"), (1.0, "cosine"), (3.0, "cosine")):
        got = guarded_costs(unit[:, a], unit[:, b], e[:, a], e[:, b], s[:, a], s[:, b], guard, partner)
        for n in range(2):
            for i in range(5):
                for j in range(4):
                    ua, ub = unit[n, i].tolist(), unit[n, 5 + j].tolist()
                    cos = sum(p * q for p, q in zip(ua, ub))
                    ea, eb, sa, sb = float(e[n, i]), float(e[n, 5 + j]), float(s[n, i]), float(s[n, 5 + j])
                    if partner == "cosine":
                        want = ea ** (guard / 2) * (1 - cos)
                    else:
                        moved = (ea * sb ** 2 + eb * sa ** 2) / (sa + sb) ** 2
                        want = moved ** (guard / 2) * max(2 - 2 * cos, 0.0) ** 0.5
                    assert got[n, i, j].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
        deployed, match = pair_costs(unit[:, a], unit[:, b], e[:, a], e[:, b], s[:, a], s[:, b], guard, partner)
        if partner == "bound":
            torch.testing.assert_close(got.min(dim=-1).values, deployed, rtol=1e-12, atol=1e-15)
        assert torch.equal(got.argmin(dim=-1), match)


@pytest.mark.parametrize("options", [dict(r=3, block_range=(1, 2), score_layer=0),
                                     dict(r=3, block_range=(0, 3), score_layer=1)],
                         ids=["one-guarded-merge", "ToMe-before-the-score"])
def test_with_a_hard_grouping_the_relaxed_forward_is_the_deployed_one(options):
    """One guarded merge (after hard ToMe merges before the score, in the second case): at a
    temperature where every round is one-hot, the relaxed forward's full-length features of every
    block equal the deployed forward's."""
    model, head, x = tiny_vit(depth=4).double(), _head(), images(2).double()
    with torch.no_grad():
        want_final, want = _forward(model, head, x, **options)
        got_final, got = _forward(model, head, x, RelaxedImportanceToMe(HARD), **options)
    torch.testing.assert_close(got_final, want_final, rtol=1e-9, atol=1e-9)
    for i in want:
        torch.testing.assert_close(got[i], want[i], rtol=1e-9, atol=1e-9)


def test_the_hard_check_catches_a_relaxation_without_the_energies(monkeypatch):
    """The check above can fail: scores with every energy 1 (the head ignored) merge other tokens."""
    model, head, x = tiny_vit(depth=4).double(), _head(), images(2).double()
    options = dict(r=3, block_range=(1, 2), score_layer=0)
    scores = importance.log_cost_scores

    def unguarded(keys, guard, partner):
        inner = scores(keys, guard, partner)
        return lambda tokens, a, b: inner(tokens._replace(energy=torch.ones_like(tokens.energy)), a, b)

    with torch.no_grad():
        want_final, _ = _forward(model, head, x, **options)
        monkeypatch.setattr(importance, "log_cost_scores", unguarded)
        got_final, _ = _forward(model, head, x, RelaxedImportanceToMe(HARD), **options)
    assert not torch.allclose(got_final, want_final, rtol=1e-6, atol=1e-6)


def test_soft_merges_conserve_sizes_and_energies_and_the_head_alone_learns():
    """At the default (soft) temperatures: the soft source matrix's column sums are the sizes, the
    sizes add up to the token count and the energies to their total at the score, every block;
    the head's parameters get a gradient and the backbone's none."""
    model, head, x = tiny_vit(depth=4).double(), _head().requires_grad_(True), images(2).double()
    method, seen = RelaxedImportanceToMe(), []
    soft_merge = importance.soft_merge

    def recording(tokens, *args, **kwargs):
        out = soft_merge(tokens, *args, **kwargs)
        seen.append((tokens, out))
        return out

    importance.soft_merge = recording
    try:
        final, _ = _forward(model, head, x, method, r=3, score_layer=0, schedule="constant", early_merges=False)
    finally:
        importance.soft_merge = soft_merge
    assert len(seen) == 3
    for before, after in seen:
        torch.testing.assert_close(after.source.sum(1), after.sizes, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(after.sizes.sum(1), torch.full((2,), float(final.shape[1]), dtype=torch.float64))
        torch.testing.assert_close(after.energy.sum(1), before.energy.sum(1), rtol=1e-12, atol=1e-12)
        assert 0 < float(after.source.clamp(0, 1).ne(after.source.round()).double().mean())  # really soft
    final[:, 0].square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters() if p.dim() > 1)
    assert all(p.grad is None for p in model.parameters())


def test_the_relaxed_forward_refuses_what_it_cannot_train():
    model, x = tiny_vit(depth=4).double(), images(1).double()
    with pytest.raises(PullbackError, match="trains a head: give head="):
        _forward(model, None, x, RelaxedImportanceToMe(), r=2)
    with pytest.raises(PullbackError, match="prop_attn=True"):
        _forward(model, _head(), x, RelaxedImportanceToMe(), r=2, prop_attn=False)


@pytest.fixture(scope="module")
def start_head(tmp_path_factory):
    """A small head checkpoint of the demo model (pullback train head, a few steps)."""
    from pullback_ext.cli import main

    out = tmp_path_factory.mktemp("head")
    assert main(["train", "head", "--model", "demo", "--layer", "1", "--num-images", "4", "--heldout", "2", "--steps", "2",
                 "--batch-size", "2", "--quiet", "--out", str(out)]) == 0
    return out


def test_the_command_writes_a_head_checkpoint_that_the_method_takes(start_head, tmp_path, capsys):
    from pullback_ext.cli import main
    from pullback_ext.metric import checkpoint

    out = tmp_path / "tuned"
    args = ["train", "finetune", "--model", "demo", "--init-head", str(start_head), "--num-images", "4", "--heldout", "2",
            "--steps", "2", "--batch-size", "2", "--budgets", "8,16", "--lr", "0.01", "--quiet", "--out", str(out)]
    assert main(args) == 0
    tuned, config = checkpoint.load_model(out, kind="head")
    start, start_config = checkpoint.load_model(start_head, kind="head")
    assert config["probe"] == start_config["probe"] and config["finetune"]["budgets"] == [8, 16]
    assert config["finetune"]["init_head"] == str(start_head)
    assert any(not torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), start.state_dict().values()))
    results = json.loads((out / "results.json").read_text())
    assert {row["strategy"] for row in results["heldout"]} == {"importance_tome (start head)", "importance_tome (fine-tuned)", "tome"}
    capsys.readouterr()
    assert main(args) != 0  # an earlier run's results are not replaced silently
    assert "--out" in capsys.readouterr().err


def test_the_command_refuses_a_missing_or_wrong_start(tmp_path, capsys):
    from pullback_ext.cli import main

    base = ["train", "finetune", "--model", "demo", "--num-images", "2", "--steps", "1", "--batch-size", "2", "--quiet"]
    for flags, message in [([], "--init-head: train finetune starts from an importance head checkpoint"),
                           (["--init-head", str(tmp_path / "nothing")], str(tmp_path / "nothing")),
                           (["--init-head", str(tmp_path), "--budgets", "0,8"], "--budgets must be positive integers")]:
        capsys.readouterr()
        assert main([*base, *flags, "--out", str(tmp_path / "out")]) != 0
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_a_head_scores_the_block_it_was_trained_on_unless_told(start_head, tmp_path):
    """importance_tome's score_layer defaults to the head checkpoint's probe layer (a block-0 head
    guards every block after block 0), else block 1; an explicit value wins."""
    from pullback_ext.metric import checkpoint

    shape = BackboneShape(depth=8, num_prefix=1, has_cls=True, num_patch=196)
    head, config = checkpoint.load_model(start_head, kind="head")
    assert head.probe_layer == config["probe"]["layer"] == 1
    head.probe_layer = 0
    resolved = ReductionOptions(strategy="importance_tome", head=head, r=4).resolve(shape).options
    assert (resolved.score_layer, resolved.block_range) == (0, (1, 8))
    assert ReductionOptions(strategy="importance_tome", head=head, r=4, score_layer=2).resolve(shape).options.score_layer == 2
    assert ReductionOptions(strategy="importance_tome", head=_head(), r=4).resolve(shape).options.score_layer == 1
    assert ReductionOptions(strategy="importance_tome", r=4).resolve(shape).options.score_layer == 1
    head.probe_layer = 7
    with pytest.raises(PullbackError, match=r"score_layer must be a block index in \[0, 6\].*got 7 \(the layer the head was trained on\)"):
        ReductionOptions(strategy="importance_tome", head=head, r=4).resolve(shape)
