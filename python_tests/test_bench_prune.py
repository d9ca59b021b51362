"""The end-to-end pruning benchmark (benchmarks/bench_prune.py) on a tiny timm ViT."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import pullback_ext.patch as patch
from prune_bench import models as prune_models
from prune_bench import report as prune_report
from prune_bench.matrix import Sweep, kernel_share, run_sweep
from prune_bench.models import MODELS, Method, ModelCase, stage_layers
from pullback_ext.comparison.cost import count_flops
from pullback_ext.errors import PullbackError

REPO = Path(__file__).resolve().parents[1]
TINY = ModelCase("tiny", "tiny timm ViT", prune_models._timm("vit_tiny_patch16_224", patch_size=8, depth=6, embed_dim=48, num_heads=2),
                 embed_dim=48, depth=6, head_hidden=16)  # a head small next to the model, as the default is next to ViT-B


@pytest.fixture()
def tiny(monkeypatch):
    monkeypatch.setitem(MODELS, "tiny", TINY)
    return TINY


def test_sweep_rows_cover_every_method_with_consistent_ratios(tiny):
    rows = run_sweep(Sweep("tiny", sizes=(64,), batches=(2,), dtypes=("float32",), matched_r=2), etas=(0.5,), tome_rs=(2,),
                     device=torch.device("cpu"), repeats=1, progress=False)
    names = [r["method"] for r in rows]
    assert names[0] == "unpruned" and rows[0]["speedup"] == 1.0 and rows[0]["flop_ratio"] == 1.0
    assert rows[0]["kernel_share"] is None  # the unpruned forward calls none of our ops
    assert {"importance merge η=0.5 @2", "importance prune+LLF η=0.5 @2", "importance merge η=0.5 3 stages [1, 3, 4]",
            "importance merge η=0.5 @2 folded prop-attn", "ToMe r=2 constant"} <= set(names)
    matched = next(r for r in rows if r["method"].startswith("importance merge @2 at ToMe r=2 constant's FLOPs"))
    tome = next(r for r in rows if r["method"] == "ToMe r=2 constant")
    assert abs(matched["gflops_per_image"] / tome["gflops_per_image"] - 1) <= 0.03  # one of 64 tokens is ~1% of the FLOPs
    for r in rows[1:]:
        assert r["flop_ratio"] > 1.0 and r["speedup"] > 0 and r["images_per_s"] == pytest.approx(2 / r["median_s"])
        assert r["speedup_over_flop_ratio"] == pytest.approx(r["speedup"] / r["flop_ratio"])
        assert r["kernel_share"] is None or 0 < r["kernel_share"] < 1
    assert all(isinstance(r["aten_ops"], int) and r["aten_ops"] > 0 for r in rows)  # every row, the unpruned one too
    checks = prune_report.headline_checks(rows)
    assert [c["target"] for c in checks] == [0.9, 0.9, 1.0, 0.9, 1.0]  # prune, merge, matched merge, importance_tome ×2
    bulk = prune_report.headline_checks([dict(r, batch=16) for r in rows])  # the bulk targets from batch 16 on
    assert [c["target"] for c in bulk] == [0.95, 0.95, 1.0, 0.95, 1.0]
    assert checks[1]["check"].startswith("importance merge η=0.5 @2: ")
    assert checks[2]["value"] == pytest.approx(matched["images_per_s"] / tome["images_per_s"])
    every = next(r for r in rows if r["method"].startswith("importance_tome r=2"))
    assert checks[3]["value"] == every["speedup_over_flop_ratio"] and checks[3]["check"].startswith("importance_tome r=2")
    ratios = [t / e for t, e in zip(tome["times_s"], every["times_s"])]  # one round: the interval is the point
    assert checks[4]["check"].startswith("importance_tome r=2 (ToMe r=2's token counts) over ToMe r=2 constant")
    assert checks[4]["value"] == pytest.approx(ratios[0]) and checks[4]["interval"] == pytest.approx([ratios[0]] * 2)


def test_flop_ratio_of_a_single_prune_matches_the_token_counts(tiny):
    """Blocks after the stage see half the patch tokens: the FLOP ratio sits between the counts'."""
    model = tiny.build(64)
    x = torch.rand(1, 3, 64, 64)
    pruned = Method("p", dict(strategy="norm", mode="prune", llf=False, ratio=0.5, layers=(3,))).apply(model, tiny)
    ratio = count_flops(model, x) / count_flops(pruned, x)
    assert 1.3 < ratio < 2.0  # 3 of 6 blocks on 33 instead of 65 tokens, attention quadratic


def test_kernel_share_sees_our_ops():
    case = TINY
    model = Method("m", dict(strategy="norm", mode="merge", ratio=0.5, layers=(1,))).apply(case.build(64), case)
    share = kernel_share(model, torch.rand(2, 3, 64, 64), torch.device("cpu"))
    assert share is not None and 0 < share < 1


def test_method_filter_and_bad_sweeps(tiny):
    rows = run_sweep(Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float32",), methods=("ToMe r=2 ",), matched_r=None),
                     etas=(0.5,), tome_rs=(2,), device=torch.device("cpu"), repeats=1, progress=False)
    assert [r["method"] for r in rows] == ["unpruned", "ToMe r=2 constant"]
    with pytest.raises(PullbackError, match="--methods"):
        run_sweep(Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float32",), methods=("nope",)), etas=(0.5,), tome_rs=(2,),
                  device=torch.device("cpu"), repeats=1, progress=False)
    with pytest.raises(PullbackError, match="--models"):
        Sweep("nope", sizes=(64,), batches=(1,), dtypes=("float32",))
    with pytest.raises(PullbackError, match="--dtypes"):
        Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float8",))


def test_stage_layers_follow_the_paper_for_vit_b():
    assert stage_layers(12, 1) == (4,) and stage_layers(12, 3) == (3, 6, 9)


def _script():
    spec = importlib.util.spec_from_file_location("bench_prune", REPO / "benchmarks" / "bench_prune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_presets_and_overrides_resolve_to_sweeps():
    script = _script()
    plan, preset = script.sweeps(script.parse_args(["--device", "cuda"]))
    assert preset == "headline" and [(s.model, s.sizes, s.batches, s.dtypes) for s in plan] == [
        ("vit_b16", (448,), (64,), ("bfloat16",)), ("vit_b16", (224,), (256,), ("bfloat16",))]
    assert all(s.compiled == (False, True) for s in plan)
    plan, preset = script.sweeps(script.parse_args(["--models", "vit_b16,dinov2_b14_reg", "--batches", "1,4", "--compile", "on"]))
    assert preset == "cpu" and [s.model for s in plan] == ["vit_b16", "dinov2_b14_reg"]
    assert all(s.batches == (1, 4) and s.compiled == (True,) for s in plan)
    full, _ = script.sweeps(script.parse_args(["--preset", "full"]))
    assert {s.model for s in full} == {"vit_b16", "dinov2_b14_reg", "depth_anything_s"}


def test_the_page_renders_its_json(tiny, tmp_path):
    rows = run_sweep(Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float32",), methods=("importance prune+LLF",), matched_r=None),
                     etas=(0.5,), tome_rs=(2,), device=torch.device("cpu"), repeats=1, progress=False)
    result = json.loads(json.dumps({"device": "CPU", "settings": {"repeats": 1}, "rows": rows,
                                    "checks": prune_report.headline_checks(rows)}))
    page = prune_report.render(result)
    assert "## tiny timm ViT, 64 px, batch 1, float32, eager" in page and "| importance prune+LLF η=0.5 @2 |" in page
    assert "| unpruned | " in page and " | 1.00× [1.00, 1.00] | " in page  # every speed-up with its interval
    assert "## Headline checks" in page and "≥ 0.9" in page
    assert "importance prune+LLF η=0.5 @2" in prune_report.format_rows(rows)
    table = _section(page, "## tiny timm ViT, 64 px, batch 1, float32, eager")
    header = next(line for line in table if line.startswith("| method |"))
    assert header.endswith("| our ops | aten ops per forward | aten ops ÷ unpruned |")
    body = [line for line in table if line.startswith("| unpruned |") or line.startswith("| importance prune+LLF")]
    assert len(body) == 3 and all(line.split("|")[-3].strip().replace(",", "").isdigit() for line in body)
    assert body[0].endswith("| 1.00× |") and all(line.split("|")[-2].strip().endswith("×") for line in body)
    older = prune_report.render(dict(result, rows=[{k: v for k, v in r.items() if k not in ("aten_ops", "aten_ops_ratio")}
                                                   for r in rows]))
    assert "| importance prune+LLF η=0.5 @2 |" in older  # rows recorded before the columns render with dashes there
    assert all(line.endswith("| – | – |") for line in _section(older, "## tiny timm ViT, 64 px, batch 1, float32, eager")
               if line.startswith("| importance prune+LLF"))


def _section(page: str, heading: str) -> list[str]:
    """The lines of the page's section under ``heading`` (to the next heading of any level)."""
    lines = page.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines))
    return lines[start:end]


def test_the_aten_op_column_counts_the_eager_forward(tiny):
    """The column is the count of :func:`count_aten_ops` at the cell's batch, positive, and the
    single-stage merge dispatches more than the unpruned forward (its scoring and matching)."""
    from pullback_ext.bench.dispatch import count_aten_ops

    rows = run_sweep(Sweep("tiny", sizes=(64,), batches=(2,), dtypes=("float32",), methods=("importance merge η=0.5 @",),
                           matched_r=None), etas=(0.5,), tome_rs=(2,), device=torch.device("cpu"), repeats=1, progress=False)
    by_name = {r["method"]: r for r in rows}
    model = tiny.build(64)
    assert by_name["unpruned"]["aten_ops"] == count_aten_ops(model, torch.rand(2, 3, 64, 64))
    assert by_name["importance merge η=0.5 @2"]["aten_ops"] > by_name["unpruned"]["aten_ops"] > 0


def test_the_clustering_rows_run_one_agglomeration_per_clustering_block(tiny):
    """ATC's and importance_cluster's rows cluster at ATC's blocks scaled to the model (three of the
    tiny model's six) with one ``agglomerate`` dispatch each, and keep the same token counts."""
    from pullback_ext import ops
    from pullback_ext.bench.dispatch import dispatched_ops

    if not ops._HAS_AGGLOMERATE:
        pytest.skip("the compiled extension is not built")
    methods = prune_models.method_grid(tiny, etas=(0.5,), tome_rs=(2,))
    rate = prune_models.CLUSTER_KEEP_RATE
    rows = [m for m in methods if m.name.startswith(("ATC keep_rate=", "importance_cluster keep_rate="))]
    assert [m.options["strategy"] for m in rows] == ["atc", "importance_cluster"]
    assert all(m.options["keep_rate"] == rate and m.heads == 0 for m in rows)
    model, x = tiny.build(64), torch.rand(2, 3, 64, 64)
    flops = []
    for method in rows:
        patched = method.apply(model, tiny)
        assert dispatched_ops(patched, x)["pullback_ext::agglomerate"] == 3, method.name
        flops.append(count_flops(patched, x[:1]))
    assert flops[0] == flops[1] < count_flops(model, x[:1])  # the same token counts after every block


def test_the_latency_figures_set_importance_cluster_beside_atc():
    """The eager cell's figures give both clusterings' operator counts and speed-up ÷ FLOP ratio, and
    importance_cluster's speed over ATC's at the same keep rate (one round: the ratio of the times)."""
    cell = dict(model="m", title="m", size=64, batch=1, dtype="float32", compiled=False)

    def row(method, seconds, ops, flop_ratio):
        return dict(cell, method=method, times_s=[seconds], median_s=seconds, aten_ops=ops, aten_ops_ratio=ops / 100,
                    speedup=1.0 / seconds, flop_ratio=flop_ratio, speedup_over_flop_ratio=1.0 / seconds / flop_ratio)

    rows = [row("unpruned", 1.0, 100, 1.0), row("ATC keep_rate=0.7 average linkage", 0.8, 130, 1.5),
            row("importance_cluster keep_rate=0.7 (ATC's blocks, no head)", 0.5, 140, 1.5)]
    figures = prune_report._figures(rows)
    assert figures["aten ops per forward: ATC keep_rate=0.7 average linkage (÷ unpruned)"] == "130 (1.30×)"
    assert figures["aten ops per forward: importance_cluster keep_rate=0.7 (ATC's blocks, no head) (÷ unpruned)"] == "140 (1.40×)"
    assert figures["speed-up ÷ FLOP ratio: importance_cluster keep_rate=0.7 (ATC's blocks, no head)"] == "1.333 (×2.00 ÷ 1.50)"
    assert figures["importance_cluster over ATC at keep_rate=0.7 (images/s ratio)"] == "1.600 [1.600, 1.600]: faster"


def test_dropped_tokens_run_tomes_token_counts_without_merging(tiny):
    """The bound row's MLPs see exactly the token counts of ToMe's at the same r, block by block, on a
    forward of the same output shape and of no more FLOPs than ToMe's (which also ranks and merges)."""
    from prune_bench.dropped_tokens import dropped_tokens, kept_tokens

    model, x = tiny.build(64), torch.rand(2, 3, 64, 64)
    grid = {m.name: m for m in prune_models.method_grid(tiny, etas=(0.5,), tome_rs=(5,))}
    tome = grid["ToMe r=5 constant"].apply(model, tiny)
    bound = grid[f"{prune_models.DROPPED} r=5's counts, no merging (the bound)"].apply(model, tiny)

    def mlp_tokens(m):
        seen = []
        hooks = [b.mlp.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1])) for b in m.blocks]
        with torch.no_grad():
            out = m(x)
        for h in hooks:
            h.remove()
        return seen, out.shape

    counts, shape = mlp_tokens(tome)
    assert mlp_tokens(bound) == (counts, shape) and counts[:2] == [60, 55]  # 64 patches and the class token, 5 fewer a block
    assert count_flops(bound, x[:1]) <= count_flops(tome, x[:1]) < count_flops(model, x[:1])
    assert mlp_tokens(dropped_tokens(model, 0))[0] == [65] * len(counts)
    # two registers besides the class token: at r = 20 the split clips the third block's merges by the prefix
    registers = prune_models._timm("vit_tiny_patch16_224", patch_size=8, depth=3, embed_dim=48, num_heads=2, reg_tokens=2)(64)
    tome = patch.timm(copy.deepcopy(registers), strategy="tome", r=20, schedule="constant")
    assert mlp_tokens(dropped_tokens(registers, 20)) == mlp_tokens(tome)
    assert mlp_tokens(tome)[0] == [47, 27, 15] and kept_tokens(27, 20, num_prefix=1) == 14
