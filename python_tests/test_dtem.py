"""DTEM (strategy "dtem" and ``pullback train dtem``): inference against a float64 loop reference of
ToMe's rule on the learned metric (timm and a Hugging Face family), the relaxed training forward
against a loop reference of the authors' soft grouping and merging, each check shown to catch a
deliberately broken variant; zero reduction, options, checkpoints; training leaves the backbone
bit-identical, resumes to the uninterrupted losses and gives the single-process result under
torchrun."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import assert_zero_reduction_is_unpatched, embed, tokens_after_each_block
from helpers.broken_merges import merges_everywhere, no_proportional_attention, unweighted_averages
from helpers.dtem_reference import dtem_reference, linear_metric, relaxed_reference, soft_group_reference
from helpers.metric import Killed, kill_at
from helpers.prune import images, tiny_vit
from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.metric import checkpoint
from pullback_ext.metric.training import TrainConfig
from pullback_ext.prune import timm_vit
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.methods import dtem, merging
from pullback_ext.prune.reduction_options import ReductionOptions
from pullback_ext.prune.split_block import SplitBlock
from pullback_ext.dtem_training import relaxed
from pullback_ext.dtem_training.relaxed import Relaxation, RelaxedDTEM, soft_group
from pullback_ext.dtem_training.training import DTEMConfig, train

ROOT = Path(__file__).resolve().parents[1]


def model_and_embedding(depth: int = 5, reg_tokens: int = 1, seed: int = 1):
    """A tiny float64 ViT whose attention branch is large enough that a block's input and its
    attended tokens differ clearly (timm's initialisation makes it about 0.5% of the tokens), and
    an untrained embedding for it."""
    model = tiny_vit(reg_tokens=reg_tokens, depth=depth).double()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.mul_(30.0)
    torch.manual_seed(seed)
    return model, dtem.embedding_for(model).requires_grad_(False)


def reference_metric(model, embedding):
    """The authors' metric written from the model's own norms and the embedding's weights."""
    return linear_metric(model.blocks, [(layer.weight, layer.bias) for layer in embedding.layers])


# inference

def _keys_as_metric(monkeypatch):
    """ToMe's keys instead of the decoupled embedding."""
    monkeypatch.setattr(dtem.DTEM, "run", merging.MergingMethod.run)


def _metric_of_the_attended_tokens(monkeypatch):
    """The embedding of the tokens after the attention half instead of the block's input."""
    rank = dtem.DTEM.rank

    def rank_attended(self, step):
        metric = step.reduction.options.head.metric(step.block, step.state.x)
        return rank(self, step._replace(attended=step.attended._replace(k=metric[:, None])))

    monkeypatch.setattr(dtem.DTEM, "rank", rank_attended)


def _no_norm(monkeypatch):
    """The linear map on the raw tokens (the block's pre-attention norm left out)."""
    monkeypatch.setattr(dtem.DecoupledEmbedding, "metric", lambda self, block, x: self.layers[block](x))


BROKEN = {"keys_as_metric": _keys_as_metric, "metric_of_the_attended_tokens": _metric_of_the_attended_tokens,
          "no_norm": _no_norm, "merges_outside_the_range": merges_everywhere, "no_size_weights": unweighted_averages,
          "no_proportional_attention": no_proportional_attention}


def _matches(model, x, expected, expected_blocks) -> bool:
    _, blocks = model.forward_intermediates(x, indices=list(range(len(model.blocks))), output_fmt="NLC")
    p = model.num_prefix_tokens
    return torch.allclose(model.forward_features(x), expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(got, want[:, p:], rtol=1e-9, atol=1e-9) for got, want in zip(blocks, expected_blocks))


@pytest.mark.parametrize("broken", [None, *BROKEN])
def test_dtem_matches_the_reference_and_the_check_catches_broken_variants(broken, monkeypatch):
    model, embedding = model_and_embedding()
    x = images(2).double()
    expected, expected_blocks = dtem_reference(model, embed(model, x), reference_metric(model, embedding), merges=[0, 3, 3, 3, 0])
    if broken:
        BROKEN[broken](monkeypatch)
        monkeypatch.setattr(merging, "FUSED", False)  # the variants break the unfused path's pieces
    patch.timm(model, strategy="dtem", head=embedding, r=3, block_range=(1, 4))
    assert _matches(model, x, expected, expected_blocks) == (broken is None)


def test_schedules_and_no_proportional_attention_match_the_reference():
    model, embedding = model_and_embedding(depth=4, reg_tokens=0)
    x, metric = images(2).double(), reference_metric(model, embedding)
    patch.timm(model, strategy="dtem", head=embedding, r=2, schedule="decreasing")
    expected, blocks = dtem_reference(model, embed(model, x), metric, merges=merging.merges_per_block(2, "decreasing", 4))
    assert _matches(model, x, expected, blocks)
    patch.timm(model, strategy="dtem", head=embedding, r=4, prop_attn=False)
    expected, blocks = dtem_reference(model, embed(model, x), metric, merges=[4] * 4, prop_attn=False)
    assert _matches(model, x, expected, blocks)


def test_a_hugging_face_vit_matches_the_reference_on_timm_blocks_with_the_same_weights():
    """Every layer output (transformers' full-length hidden states) is the timm reference's, whose
    metric reads the timm blocks' copies of the layers' own norms (not the embedding's copies)."""
    from helpers.hf_stand_ins import hidden_states, timm_stand_in, tiny

    model, x = tiny("vit"), images(1).double()
    plain = hidden_states(model, x)
    torch.manual_seed(2)
    embedding = dtem.embedding_for(model).requires_grad_(False)
    patch.hf_vit(model, strategy="dtem", head=embedding, r=2, schedule="decreasing")
    stand_in = timm_stand_in(model, "vit")
    final, per_layer = dtem_reference(stand_in, plain[0], reference_metric(stand_in, embedding),
                                      merges=merging.merges_per_block(2, "decreasing", 4))
    hidden = hidden_states(model, x)
    for got, want in zip(hidden[1:], per_layer):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(hidden[-1], final, rtol=1e-9, atol=1e-9)
    patch.hf_vit(model, strategy="tome", r=2, schedule="decreasing")
    assert not torch.allclose(hidden_states(model, x)[-1], final, atol=1e-6)  # the metric is not the keys


def test_zero_reduction_is_the_unpatched_model_and_counts_are_tomes():
    model, embedding = model_and_embedding(depth=3)
    x = images(2).double()
    plain = assert_zero_reduction_is_unpatched(model, x, patch.timm, strategy="dtem", head=embedding, r=0)
    patch.timm(model, strategy="dtem", head=embedding, r=3)
    options = patch.config(model)
    counts = patch_tokens_per_block(options, model)
    assert [c - 2 for c in tokens_after_each_block(model, images(2).double())] == counts == [13, 10, 7]
    assert eta(options, model) == eta(ReductionOptions(strategy="tome", r=3), model) == 9 / 16
    patch.unpatch(model)
    assert torch.equal(model.forward_features(x), plain)


def test_the_patched_forward_compiles_whole():
    model, embedding = model_and_embedding(depth=3)
    model, embedding = model.float(), embedding.float()
    patch.timm(model, strategy="dtem", head=embedding, r=3)
    x = images(2)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
            compiled = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, model.forward_features(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(r=2, head=None), r"strategy 'dtem' needs head= \(a DTEM checkpoint folder"),
        (dict(r=2, head=lambda F: F.norm(dim=-1)), r"strategy 'dtem' needs head="),
        (dict(), r"needs r= \(tokens merged per block\)"),
        (dict(r=-1), "r must be None or an int >= 0"),
        (dict(r=2, schedule="increasing"), "schedule must be one of constant, decreasing"),
        (dict(r=2, block_range=(1, 5)), "block_range must end at or before block 4"),
        (dict(r=2, ratio=0.5), "strategy 'dtem' does not take ratio"),
        (dict(r=2, mode="prune"), "has no prune mode"),
        (dict(r=2, margin=0.5), "margin is an option of strategy 'pitome'"),
    ],
)
def test_invalid_options_name_the_field(kwargs, match):
    model = tiny_vit()
    with pytest.raises(PullbackError, match=match):
        patch.timm(model, strategy="dtem", **{"head": dtem.embedding_for(model), **kwargs})


def test_an_embedding_serves_the_model_it_was_trained_on():
    with pytest.raises(PullbackError, match="head: the DTEM embedding has 4 blocks but this model has 3"):
        patch.timm(tiny_vit(depth=3), strategy="dtem", head=dtem.embedding_for(tiny_vit()), r=2)
    with pytest.raises(PullbackError, match="the DTEM embedding is 32-wide but this model's tokens are 48-wide"):
        patch.timm(tiny_vit(dim=48), strategy="dtem", head=dtem.DecoupledEmbedding(32, 8, 4), r=2)


def test_a_missing_or_corrupt_checkpoint_is_one_error_naming_the_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"none: checkpoint file not found"):
        patch.timm(tiny_vit(), strategy="dtem", head=tmp_path / "none", r=2)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"bad/model\.safetensors: corrupt or unreadable"):
        dtem.load_embedding(tmp_path / "bad")


# the relaxation

def test_soft_grouping_matches_the_loop_reference_of_the_authors_formula():
    scores = torch.rand(3, 6, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2 - 1
    for r, relax in ((1, Relaxation()), (4, Relaxation()), (3, Relaxation(k2=2, tau1=0.5, tau2=0.3)), (5, Relaxation(k2=9))):
        got = soft_group(scores, r, relax)
        for b in range(3):
            want = soft_group_reference(scores[b].tolist(), r, relax.k2, relax.tau1, relax.tau2)
            torch.testing.assert_close(got[b], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-14)
        assert bool((got.sum(-1) <= 1 + 1e-12).all()) and bool((got.sum(dim=(1, 2)) <= r + 1e-9).all())


def _relaxed_forward(model, embedding, x, r, take=()):
    from pullback_ext.prune.methods.base import BlockLoop

    loop = BlockLoop(model.blocks, timm_vit.call_block, timm_vit.attention_probs, timm_vit.SPLIT)
    h = embed(model, x)
    final, taken = relaxed.run_relaxed(embedding, h, loop, model.num_prefix_tokens, r, Relaxation(), take)
    return model.norm(final), taken


def _tau1_ignored(monkeypatch):
    group = relaxed.soft_group
    monkeypatch.setattr(relaxed, "soft_group", lambda s, count, relax: group(s, count, Relaxation(relax.k2, 1.0, relax.tau2)))


def _every_candidate(monkeypatch):
    group = relaxed.soft_group
    monkeypatch.setattr(relaxed, "soft_group", lambda s, count, relax: group(s, count, Relaxation(99, relax.tau1, relax.tau2)))


def _one_round(monkeypatch):
    group = relaxed.soft_group
    monkeypatch.setattr(relaxed, "soft_group", lambda s, count, relax: group(s, min(count, 1), relax))


def _inference_parity(monkeypatch):
    """A the odd positions after the prefix (the inference split) instead of the authors' training split."""
    window = relaxed._window
    monkeypatch.setattr(relaxed, "_window", lambda tokens, scores, p, count, relax, tome_split=False:
                        window(tokens, scores, p + 1, count, relax))


def _no_soft_restore(monkeypatch):
    monkeypatch.setattr(relaxed.SoftTokens, "full", lambda self: self.x)


def _no_relaxed_proportional_attention(monkeypatch):
    monkeypatch.setattr(timm_vit, "SPLIT", SplitBlock(lambda block, state, bias: timm_vit.attend(block, state, None),
                                                      timm_vit.feed_forward))


RELAXED_BROKEN = {"tau1_ignored": _tau1_ignored, "every_candidate": _every_candidate, "one_round": _one_round,
                  "inference_parity": _inference_parity, "no_soft_restore": _no_soft_restore,
                  "no_proportional_attention": _no_relaxed_proportional_attention}


@pytest.mark.parametrize("broken", [None, *RELAXED_BROKEN])
def test_the_relaxed_forward_matches_the_loop_reference_and_catches_broken_variants(broken, monkeypatch):
    """Every block's full-length output (restored through the soft source matrix) and the final
    features equal the reference's; its scores are shrunk so that the soft grouping is really soft."""
    model, embedding = model_and_embedding(depth=3, reg_tokens=1)
    with torch.no_grad():
        for layer in embedding.layers:
            layer.weight.mul_(0.05)
    x = images(2).double()
    expected, expected_blocks = relaxed_reference(model, embed(model, x), reference_metric(model, embedding), r=3)
    if broken:
        RELAXED_BROKEN[broken](monkeypatch)
    final, taken = _relaxed_forward(model, embedding, x, 3, take=range(3))
    matches = torch.allclose(final, expected, rtol=1e-9, atol=1e-9) and all(
        torch.allclose(taken[i], expected_blocks[i], rtol=1e-9, atol=1e-9) for i in range(3))
    assert matches == (broken is None)


class _Constant:
    """An embedding whose metric of block i is a fixed tensor (recorded from another forward)."""

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def metric(self, block: int, x):
        return self.outputs[block]


def test_the_relaxed_forward_reaches_every_embedding_and_reads_its_input_detached():
    """Every block's embedding gets a gradient from a full-length read (a class-token read gives
    the last block's none: its merge never reaches the class token); the metric reads its input
    detached (the authors' ``metric_layer(input.detach())``): the tokens' gradient is the one with
    every metric held constant."""
    from pullback_ext.prune.methods.base import BlockLoop

    model, embedding = model_and_embedding(depth=3)
    embedding.requires_grad_(True)
    with torch.no_grad():
        for layer in embedding.layers:
            layer.weight.mul_(0.05)
    loop = BlockLoop(model.blocks, timm_vit.call_block, timm_vit.attention_probs, timm_vit.SPLIT)
    h = embed(model, images(2).double()).requires_grad_(True)
    recorded, metric = {}, embedding.metric
    embedding.metric = lambda i, x: recorded.setdefault(i, metric(i, x))
    final, _ = relaxed.run_relaxed(embedding, h, loop, 2, 3, Relaxation())
    final.square().sum().backward()
    assert all(float(layer.weight.grad.abs().sum()) > 0 for layer in embedding.layers)
    through_the_metric, h.grad = h.grad.clone(), None
    final, _ = relaxed.run_relaxed(_Constant({i: m.detach() for i, m in recorded.items()}), h, loop, 2, 3, Relaxation())
    final.square().sum().backward()
    torch.testing.assert_close(h.grad, through_the_metric, rtol=1e-12, atol=1e-15)
    embedding.zero_grad()
    del embedding.metric
    relaxed.run_relaxed(embedding, h, loop, 2, 3, Relaxation())[0][:, 0].sum().backward()
    assert float(embedding.layers[-1].weight.grad.abs().sum()) == 0 < float(embedding.layers[0].weight.grad.abs().sum())


def test_relaxation_settings_are_checked():
    with pytest.raises(PullbackError, match="k2: expected an int >= 1"):
        Relaxation(k2=0)
    with pytest.raises(PullbackError, match="tau2: expected a positive finite temperature"):
        Relaxation(tau2=0.0)
    with pytest.raises(PullbackError, match="--r: expected an int >= 1"):
        DTEMConfig("cls", TrainConfig(), r=0)
    with pytest.raises(PullbackError, match="--task: a DTEM embedding is trained for cls or depth"):
        DTEMConfig("tokens", TrainConfig())


# training

def demo_and_images(n: int = 4):
    from pullback_ext.embedded.model import DemoModel

    torch.manual_seed(0)
    return DemoModel().eval(), torch.rand(n, 3, 112, 112)


def settings(task: str = "cls", steps: int = 3, relax: Relaxation = Relaxation()) -> DTEMConfig:
    return DTEMConfig(task, TrainConfig(steps=steps, batch_size=2, lr=1e-2, seed=3, checkpoint_every=1, log_every=1), r=8,
                      relax=relax)


# At the authors' temperatures (τ1 = τ2 = 0.1) a picked row's mass comes within float32's eps of 1,
# where the row mask's floor log(max(1 − mass, ε)) switches its gradient between 1/ε and 0: the
# rounding of a batch of 1 and of 2 then decides it, so one rank's slice and the whole batch
# differ there. Softer temperatures keep every row away from the floor.
SOFT = Relaxation(tau1=0.3, tau2=0.3)


def _losses(folder: Path) -> list:
    return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("task", ["cls", "depth"])
def test_training_leaves_the_frozen_backbone_bit_identical_and_stores_its_config(tmp_path, task):
    model, x = demo_and_images()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    initial = dtem.embedding_for(model.backbone)
    embedding = train(model, x, settings(task, steps=2), tmp_path, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not torch.equal(embedding.layers[0].weight, initial.layers[0].weight)  # it learned
    assert torch.equal(embedding.norm_weight[3], model.backbone.blocks[3].norm1.weight)
    stored = checkpoint.read_config(tmp_path)
    assert stored["kind"] == "dtem" and stored["dtem"] == {"task": task, "r": 8, "k2": 3, "tau1": 0.1, "tau2": 0.1, "feat_dim": 64}
    assert (stored["train"]["grad_clip"], stored["train"]["min_lr_ratio"]) == (5.0, 0.01)
    loaded = dtem.load_embedding(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), embedding.state_dict().values()))
    assert len(_losses(tmp_path)) == 2


def test_killed_run_resumes_to_the_uninterrupted_losses_and_weights(tmp_path):
    model, x = demo_and_images()
    full = train(model, x, settings(steps=4), tmp_path / "full", progress=False)
    with pytest.raises(Killed):
        train(model, x, settings(steps=4), tmp_path / "cut", progress=False, on_step=kill_at(3))
    resumed = train(model, x, settings(steps=4), tmp_path / "cut", resume=True, progress=False)
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "full")
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_deployed_checkpoint_merges_as_the_module_does(tmp_path):
    """``head=OUT`` (the folder) deploys what training returned; the hard merge differs from ToMe's."""
    model, x = demo_and_images(2)
    embedding = train(model, x, settings(steps=1), tmp_path, progress=False)
    bb = model.backbone
    patch.timm(bb, strategy="dtem", head=tmp_path, r=8)
    from_folder = bb.forward_features(x)
    patch.timm(bb, strategy="dtem", head=embedding, r=8)
    assert torch.equal(bb.forward_features(x), from_folder)
    patch.timm(bb, strategy="tome", r=8)
    assert not torch.allclose(bb.forward_features(x), from_folder)


def test_training_refuses_a_budget_that_leaves_a_block_without_merges(tmp_path):
    from pullback_ext.comparison.backbones import timm_backbone

    model = tiny_vit(depth=6)  # 16 patch tokens: 8, 4, 2, 1, then none merge
    with pytest.raises(PullbackError, match="--r: with r = 8 block 4 of 6 has no tokens left to merge"):
        train(model, images(2), DTEMConfig("cls", TrainConfig(steps=1, batch_size=2), r=8), tmp_path, progress=False,
              backbone=timm_backbone(model))


WORKER = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {tests!r})
    from test_dtem import SOFT, demo_and_images, settings
    from pullback_ext.dtem_training.training import train
    dist.init_process_group("gloo")
    model, images = demo_and_images()
    train(model.double(), images.double(), settings("depth", steps=2, relax=SOFT), sys.argv[1], progress=False)
    dist.destroy_process_group()
    """
)


@pytest.mark.distributed
def test_two_process_ddp_matches_single_process(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "python_tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, x = demo_and_images()
    single = train(model.double(), x.double(), settings("depth", steps=2, relax=SOFT), tmp_path / "single", progress=False)
    ddp = dtem.load_embedding(tmp_path / "ddp")
    for (name, a), (_, b) in zip(single.state_dict().items(), ddp.state_dict().items()):
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-9), name
    assert _losses(tmp_path / "ddp") == pytest.approx(_losses(tmp_path / "single"), rel=1e-9)


def test_a_hugging_face_vit_trains_with_its_backbone_frozen(tmp_path):
    from helpers.prune import tiny_hf
    from pullback_ext.comparison.backbones import hf_backbone

    model = tiny_hf("vit", "sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = DTEMConfig("cls", TrainConfig(steps=2, batch_size=2, lr=1e-2, seed=0, log_every=1), r=2)
    embedding = train(model, images(2), config, tmp_path, progress=False, backbone=hf_backbone(model))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert embedding.feat_dim == 16 and len(_losses(tmp_path)) == 2
    patch.hf_vit(model, strategy="dtem", head=tmp_path, r=2)
    assert model(pixel_values=images(2)).last_hidden_state.shape == (2, 17, 32)


def test_train_dtem_command_reports_the_deployed_merge_on_the_eval_images(tmp_path):
    """The held-out rows equal the distortion of the deployed checkpoint computed here."""
    from pullback_ext.cli import main
    from pullback_ext.comparison import quality
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.prune.reduction_options import BackboneShape
    from pullback_ext.sources.images import open_images
    from pullback_ext.sources.models import load_model, parse_model
    from pullback_ext.sources.preprocess import unit_range_preprocess

    out = tmp_path / "dtem"
    assert main(["train", "dtem", "--model", "demo", "--images", "builtin:scenes", "--eval-images", "builtin:photos",
                 "--num-images", "2", "--heldout", "2", "--steps", "1", "--batch-size", "2", "--r", "8", "--quiet",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["heldout"]
    assert [(row["strategy"], row["r"]) for row in rows] == [("dtem", 4), ("tome", 4), ("dtem", 8), ("tome", 8)]
    model = load_model(parse_model("demo"), headless=True)[0]
    photos = open_images("builtin:photos", "--eval-images").heldout(unit_range_preprocess(model.image_size), 2).load()["images"]
    backbone = demo_backbone(model)
    full, reduced = backbone.forwards("cls")
    shape = BackboneShape(depth=backbone.depth, num_prefix=backbone.num_prefix, has_cls=True)
    deployed = reduced(ReductionOptions(strategy="dtem", head=out, r=8).resolve(shape), photos)["embedding"]
    want = float(quality.cosine_x100(deployed, full(photos)["embedding"]).mean())
    assert rows[2]["value"] == pytest.approx(want, rel=1e-5, abs=1e-9) and want > 0
    again = ["train", "dtem", "--model", "demo", "--num-images", "2", "--steps", "1", "--batch-size", "2", "--out", str(out)]
    assert main(again) == 2  # a folder holding a run is refused without --resume
