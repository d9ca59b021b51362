"""The default size of an importance head (:mod:`pullback_ext.metric.head_size`): its FLOPs and
the backbone's in closed form against torch's flop counter, the rule's choice on the demo model
(the small head of docs/importance_tome_findings.md) and on ViT-B by hand, explicit sizes winning,
and what ``pullback train head`` records of it."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.prune import tiny_dinov2, tiny_vit
from pullback_ext.cli import main
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError
from pullback_ext.metric import head_size
from pullback_ext.metric.head import ImportanceHead, parameter_count
from pullback_ext.probes.base import Probe


@pytest.fixture(scope="module")
def demo_probe():
    from pullback_ext import embedded
    from pullback_ext.embedded.probes import demo_probe

    return demo_probe(embedded.load(), 1, "cls")


@pytest.mark.parametrize("dim, tokens, hidden, heads, mlp_hidden", [(192, 197, 64, 2, 64), (192, 197, 16, 2, 0),
                                                                    (32, 17, 96, 3, 96), (48, 65, 256, 4, 64)])
def test_head_flops_are_the_counters(dim, tokens, hidden, heads, mlp_hidden):
    head = ImportanceHead(dim, hidden, heads, mlp_hidden)
    assert head_size.head_flops(dim, tokens, hidden, mlp_hidden) == count_flops(head, torch.randn(1, tokens, dim))


def test_backbone_flops_are_the_counters_on_timm_blocks(demo_probe):
    model = tiny_vit(depth=4, dim=32)  # 17 tokens, MLP 128
    x = torch.randn(1, 17, 32)
    assert head_size.backbone_flops(17, 4, 32, 128) == count_flops(model.blocks, x)
    blocks = demo_probe.model.backbone.blocks
    assert head_size.backbone_flops(197, 8, 192, 768) == count_flops(blocks, torch.randn(1, 197, 192)) == 1_632_786_432


def test_the_demo_model_gets_the_small_head_of_the_findings(demo_probe):
    """The largest of the family within 1.5%: H = 64 (2 heads, MLP 64; 38,337 parameters, 1.2%);
    H = 96 would cost 2.2%. Asking for the MLP of 64 only gives the same head."""
    assert head_size.backbone_of(demo_probe) == (8, 192, 768)
    size = head_size.choose(demo_probe)
    assert (size.hidden, size.heads, size.mlp_hidden, size.sized) == (64, 2, 64, ("hidden", "heads", "mlp_hidden"))
    record = size.record(parameter_count(ImportanceHead(192, 64, 2, 64)))
    assert record["parameters"] == 38_337 and record["flops"] == 19_542_400
    assert record["flop_share"] == 19_542_400 / 1_632_786_432 and round(record["flop_share"], 4) == 0.0120
    assert round(head_size.head_flops(192, 197, 96, 96) / 1_632_786_432, 4) == 0.0224 > head_size.SHARE
    same = head_size.choose(demo_probe, mlp_hidden=64)
    assert (same.hidden, same.heads, same.mlp_hidden, same.sized) == (64, 2, 64, ("hidden", "heads"))


def test_the_rule_by_hand_on_vit_b():
    """ViT-B/16 at 224 px (12 blocks of 768, 197 tokens): 1.5% of 34.89 GFLOPs is 523.4 M; H = 384
    costs 197·(2·768·384 + 4·384 + 2·(2·384·288 + 2·96·384 + 4·384·384)) + 2·4·197²·96 = 494.9 M, H = 416 567.6 M (the family's next)."""
    budget = head_size.SHARE * head_size.backbone_flops(197, 12, 768, 3072)
    assert head_size.head_flops(768, 197, 384, 384) == 494_889_216 <= budget < head_size.head_flops(768, 197, 416, 416)
    assert head_size.largest_within(768, 197, budget) == (384, 12, 384)
    assert head_size.largest_within(768, 197, budget, heads=5)[1] == 5  # given heads: only widths whose H/4 they divide
    assert head_size.largest_within(768, 197, 1.0) == (32, 1, 32)  # none fits: the smallest


def test_given_sizes_win_and_an_unknown_backbone_needs_them(demo_probe):
    given = head_size.choose(demo_probe, hidden=16)
    assert (given.hidden, given.heads, given.mlp_hidden, given.sized) == (16, 4, 0, ())  # the fixed defaults of before
    assert head_size.choose(demo_probe, hidden=16, heads=2, mlp_hidden=8).mlp_hidden == 8

    class Bare(Probe):
        def outputs(self, F):
            return F.sum(1)

    bare = Bare(1, 17, 32, 1)
    with pytest.raises(PullbackError, match="--hidden: the default head is sized"):
        head_size.choose(bare)
    assert head_size.choose(bare, hidden=32).record(0)["flop_share"] is None


def test_the_backbone_is_found_through_every_kind_of_probe(demo_probe):
    from pullback_ext.probes import from_hf_vision, from_timm, linear_probe

    assert head_size.backbone_of(from_timm(tiny_vit(depth=3, dim=32), 1, "cls")) == (3, 32, 128)
    assert head_size.backbone_of(from_hf_vision(tiny_dinov2(), 1, "cls")) == (4, 32, 128)  # mlp_ratio 4
    read_out = linear_probe(torch.randn(3, 192), 197, None, demo_probe.features, 1, 1)
    assert head_size.backbone_of(read_out) == (8, 192, 768)


def test_train_head_sizes_its_head_and_records_it(tmp_path):
    argv = ["train", "head", "--model", "demo", "--layer", "1", "--task", "cls", "--num-images", "2", "--heldout", "2",
            "--rank", "2", "--power", "0", "--steps", "1", "--batch-size", "2", "--warmup", "0", "--quiet",
            "--out", str(tmp_path / "head")]
    assert main(argv) == 0
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    results = json.loads((tmp_path / "head" / "results.json").read_text())
    assert config["model"] == {"dim": 192, "hidden": 64, "heads": 2, "mlp_hidden": 64}
    assert config["head_size"] == results["head_size"] and results["parameters"] == results["head_size"]["parameters"] == 38_337
    assert results["head_size"]["flop_share"] == pytest.approx(0.01197, abs=1e-5) and results["head_size"]["share_limit"] == 0.015
