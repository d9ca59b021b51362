"""The latency instrument of the pruning benchmark: the launch counter and the time split of
``pullback_ext.bench`` (on traces and op trees whose contents are known), and the rows of
``benchmarks/bench_prune.py`` (presets, compiled cells, ONNX Runtime rows, the page's sections)
on a tiny timm ViT."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from prune_bench import matrix
from prune_bench import models as prune_models
from prune_bench import report as prune_report
from prune_bench.matrix import Sweep, run_sweep
from prune_bench.models import MODELS, ModelCase
from pullback_ext import ops
from pullback_ext.bench.forward_profile import forward_profile, op_category, profile_call, time_split
from pullback_ext.bench.kernel_breakdown import count_launches, trace_events
from pullback_ext.errors import PullbackError

REPO = Path(__file__).resolve().parents[1]
TINY = ModelCase("tiny", "tiny timm ViT", prune_models._timm("vit_tiny_patch16_224", patch_size=8, depth=6, embed_dim=48, num_heads=2),
                 embed_dim=48, depth=6, head_hidden=16)
CPU = torch.device("cpu")


# ---- the launch counter ---------------------------------------------------------------------------


def _event(cat: str, name: str, ph: str = "X") -> dict:
    return {"cat": cat, "name": name, "ph": ph, "ts": 0.0, "dur": 1.0}


def test_launches_count_host_launch_calls_and_device_kernels():
    """Three kernels launched one by one (runtime and driver API), then a CUDA graph of five kernels
    replayed once: 8 kernels ran, 4 launches, 1 of them a graph; a memcpy, a sync, an op and a flow
    marker are none."""
    events = [_event("cpu_op", "aten::add"), _event("cuda_runtime", "cudaLaunchKernel"), _event("kernel", "add_kernel"),
              _event("cuda_runtime", "cudaLaunchKernelExC"), _event("kernel", "gemm"),
              _event("cuda_driver", "cuLaunchKernel"), _event("kernel", "triton_poi_fused_0"),
              _event("cuda_runtime", "cudaMemcpyAsync"), _event("gpu_memcpy", "Memcpy DtoH"),
              _event("cuda_runtime", "cudaDeviceSynchronize"), _event("ac2g", "cudaLaunchKernel", ph="s"),
              _event("cuda_runtime", "cudaGraphLaunch")] + [_event("kernel", f"graph_kernel_{i}") for i in range(5)]
    assert count_launches(events) == {"kernels": 8, "launches": 4, "graph_launches": 1}
    assert count_launches(events + events, calls=2) == {"kernels": 8, "launches": 4, "graph_launches": 1}
    with pytest.raises(ValueError, match="calls"):
        count_launches(events, calls=0)


def test_a_cpu_profile_launches_nothing():
    x = torch.rand(8, 8)
    prof, wall_us = profile_call(lambda: (x @ x).relu().sum())
    events = trace_events(prof)
    assert any(e.get("name") == "aten::mm" for e in events) and wall_us > 0
    assert count_launches(events) == {"kernels": 0, "launches": 0, "graph_launches": 0}
    assert forward_profile(lambda: x.exp())["launches"] is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counting CUDA launches needs a CUDA device")
def test_cuda_launches_of_an_eager_call_and_of_a_graph_replay():
    from pullback_ext.bench.forward_profile import cuda_launches

    a = torch.rand(1024, device="cuda")
    eager = cuda_launches(lambda: (a + 1).mul(2).sum())
    assert eager["kernels"] >= 3 and eager["launches"] >= 3 and eager["graph_launches"] == 0
    graph, out = torch.cuda.CUDAGraph(), None
    (a + 1).mul(2)  # warm-up on the capture stream's allocator
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out = (a + 1).mul(2)
    replay = cuda_launches(graph.replay)
    assert replay["launches"] == 1 and replay["graph_launches"] == 1 and replay["kernels"] >= 2 and out is not None


# ---- the time split -------------------------------------------------------------------------------


def _op(name: str, self_us: float, parent=None):
    return SimpleNamespace(name=name, self_cpu_time_total=self_us, self_device_time_total=self_us / 10, cpu_parent=parent,
                           device_type=SimpleNamespace(name="CPU"))


def test_time_goes_to_the_outermost_classified_caller():
    """A tree with known self times: linear (its t and addmm), SDPA's math path (a bmm and a softmax
    inside), one of our ops with an aten op inside, and unclassified ops (layer norm with its
    native kernel, an add): every µs lands once, in its outermost caller's category."""
    linear = _op("aten::linear", 1.0)
    sdpa = _op("aten::scaled_dot_product_attention", 2.0)
    math = _op("aten::_scaled_dot_product_attention_math", 1.0, sdpa)
    ours = _op("pullback_ext::merge_tokens", 7.0)
    norm = _op("aten::layer_norm", 1.0)
    events = [linear, _op("aten::t", 2.0, linear), _op("aten::addmm", 30.0, linear), sdpa, math,
              _op("aten::bmm", 10.0, math), _op("aten::_softmax", 4.0, math), ours, _op("aten::index_select", 3.0, ours),
              norm, _op("aten::native_layer_norm", 5.0, norm), _op("aten::add", 6.5),
              SimpleNamespace(name="gemm_kernel", self_cpu_time_total=99.0, self_device_time_total=99.0, cpu_parent=None,
                              device_type=SimpleNamespace(name="CUDA"))]  # a device record: not counted again
    split = time_split(events, wall_us=100.0, top=2)
    assert split["us"] == {"matmul": 33.0, "attention": 17.0, "ours": 10.0, "other": 12.5}
    assert split["ops_us"] == 72.5 and split["outside_us"] == 27.5 and split["wall_us"] == 100.0
    assert split["top_other"] == [["aten::add", 6.5], ["aten::layer_norm", 6.0]]
    device = time_split(events, device_time=True)
    assert device["us"]["matmul"] == pytest.approx(3.3) and device["outside_us"] is None


def test_categories_by_name():
    assert op_category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert op_category("aten::_efficient_attention_forward") == "attention"
    assert op_category("pullback_ext::gather_tokens") == "ours"
    assert op_category("aten::addmm") == "matmul" and op_category("aten::conv2d") == "matmul"
    assert op_category("aten::softmax") is None and op_category("aten::add") is None


class _KnownMix(torch.nn.Module):
    """A linear layer, one SDPA call, one gather of this extension and elementwise ops."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape[0], x.shape[1], 32)
        idx = torch.arange(0, x.shape[1], 2).expand(x.shape[0], -1)
        return (ops.gather_tokens(a, idx, check_values=False) * 2).tanh() + 1


def test_a_profiled_forward_splits_its_known_op_mix():
    model, x = _KnownMix(), torch.rand(4, 64, 32)
    with torch.no_grad():
        model(x)
    got = forward_profile(model, x)
    split = got["split"]
    assert split["us"]["matmul"] > 0 and split["us"]["attention"] > 0 and split["us"]["other"] > 0
    assert (split["us"]["ours"] > 0) == ops.uses_compiled(x)  # the reference fallback dispatches aten ops instead
    assert split["ops_us"] == pytest.approx(sum(split["us"].values())) and split["ops_us"] <= split["wall_us"]
    assert {name for name, _ in split["top_other"]} >= {"aten::tanh"}
    assert (got["kernel_share"] is None) == (not ops.uses_compiled(x))
    only_elementwise = forward_profile(lambda t: (t * 2).tanh() + 1, x)["split"]["us"]
    assert only_elementwise["matmul"] == only_elementwise["attention"] == only_elementwise["ours"] == 0
    assert only_elementwise["other"] > 0


# ---- the rows -------------------------------------------------------------------------------------


def _script():
    spec = importlib.util.spec_from_file_location("bench_prune", REPO / "benchmarks" / "bench_prune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_and_latency_presets():
    script = _script()
    plan, preset = script.sweeps(script.parse_args([]))
    assert preset == "cpu" and [(s.model, s.sizes, s.batches, s.dtypes, s.compiled) for s in plan] == [
        ("vit_s16", (224,), (1, 16, 64), ("float32",), (False, True)), ("vit_b16", (224,), (1, 16, 64), ("float32",), (False, True))]
    assert all(s.onnx_batches == (1,) and s.matched_r is None for s in plan)
    only, _ = script.sweeps(script.parse_args(["--models", "vit_s16", "--no-onnx", "--compile", "off"]))
    assert [(s.model, s.onnx_batches, s.compiled) for s in only] == [("vit_s16", (), (False,))]
    latency, preset = script.sweeps(script.parse_args(["--device", "cuda", "--preset", "latency"]))
    assert [(s.model, s.batches, s.compiled) for s in latency] == [
        ("vit_s16", (1,), (False, "reduce-overhead")), ("vit_b16", (1,), (False,))]
    with pytest.raises(PullbackError, match="--compile"):
        Sweep("vit_s16", sizes=(224,), batches=(1,), dtypes=("float32",), compiled=("max-autotune",))


@pytest.fixture()
def tiny(monkeypatch):
    monkeypatch.setitem(MODELS, "tiny", TINY)
    return TINY


def test_the_cpu_preset_method_set(tiny):
    """The preset's filters keep the unpruned model, ToMe, its counts without merging and
    importance_tome at every r, the two clusterings and the default single-stage merge and prune +
    LLF; not their variants, three stages or the matched merge."""
    spec = dict(_script().PRESETS["cpu"][0], model="tiny")
    methods = matrix._methods(tiny, tiny.build(64), Sweep(**spec), (0.5,), (8, 16), torch.rand(1, 3, 64, 64))
    assert [m.name for m in methods] == [
        "unpruned", "importance merge η=0.5 @2", "importance prune+LLF η=0.5 @2", "ToMe r=8 constant", "ToMe r=16 constant",
        "tokens dropped at ToMe r=8's counts, no merging (the bound)", "tokens dropped at ToMe r=16's counts, no merging (the bound)",
        "importance_tome r=8 (ToMe r=8's token counts)", "importance_tome r=16 (ToMe r=16's token counts)",
        "ATC keep_rate=0.7 average linkage", "importance_cluster keep_rate=0.7 (ATC's blocks, no head)"]
    latency = dict(_script().PRESETS["latency"][0], model="tiny")  # a short GPU slot: not the never-run clustering kernel
    kept = matrix._methods(tiny, tiny.build(64), Sweep(**latency), (0.5,), (8, 16), torch.rand(1, 3, 64, 64))
    assert [m.name for m in kept] == [m.name for m in methods][:-2]


@pytest.fixture()
def fake_compile(monkeypatch):
    """torch.compile stood in by the eager model (compiling a ViT takes a minute on this CPU); a
    model marked ``_bench_fails`` 'fails to compile'. Returns the modes it was called with."""
    seen = []

    def fake(fn, mode):
        seen.append(mode)
        if getattr(fn, "_bench_fails", False):
            raise RuntimeError("graph break\nmore lines")
        return fn

    monkeypatch.setattr(matrix, "compile_model", fake)
    return seen


def test_compiled_cells_keep_their_methods_and_record_what_failed(tiny, fake_compile, monkeypatch):
    monkeypatch.setattr(matrix, "BIG_BATCH", 2)
    original = prune_models.Method.apply

    def apply(self, model, case):
        out = original(self, model, case)
        out._bench_fails = self.name.startswith("importance_tome")
        return out

    monkeypatch.setattr(prune_models.Method, "apply", apply)
    skipped = []
    sweep = Sweep("tiny", sizes=(64,), batches=(1, 2), dtypes=("float32",), compiled=(False, True), matched_r=None,
                  methods=("ToMe r=", "importance_tome r=", "importance merge η="), exclude=("folded", "stages"),
                  compiled_methods=("ToMe r=8 ", "importance_tome r=8 ", "importance merge η="))
    rows = run_sweep(sweep, etas=(0.5,), tome_rs=(8,), device=CPU, repeats=3, progress=False, big_batch_repeats=1,
                     skipped=skipped)
    cells = prune_report.cells(rows)
    assert [(c["batch"], c["compiled"]) for c, _ in cells] == [(1, False), (1, True), (2, False), (2, True)]
    eager, compiled = cells[0][1], cells[1][1]
    assert [r["method"] for r in compiled] == ["unpruned", "importance merge η=0.5 @2", "ToMe r=8 constant"]
    assert [(s["batch"], s["method"]) for s in skipped] == [(1, "importance_tome r=8 (ToMe r=8's token counts)"),
                                                           (2, "importance_tome r=8 (ToMe r=8's token counts)")]
    assert skipped[0]["reason"] == "torch.compile failed: RuntimeError: graph break"
    assert fake_compile == [True] * (3 + 2)  # each model compiled once for both batches; the failing one tried at each
    assert all(r["compile_s"] > 0 and r["time_split"] is None and r["launches"] is None for r in compiled)
    assert all(r["compile_s"] is None and r["time_split"]["wall_us"] > 0 for r in eager)
    assert [len(r["times_s"]) for r in eager] == [3] * len(eager)  # batch 1: every round
    assert all(len(r["times_s"]) == 1 for r in cells[2][1])  # batch 2 ≥ BIG_BATCH: big_batch_repeats
    unpruned = eager[0]
    assert unpruned["aten_ops_ratio"] == 1.0 and all(
        r["aten_ops_ratio"] == pytest.approx(r["aten_ops"] / unpruned["aten_ops"]) for r in eager)
    assert all(c["aten_ops"] == e["aten_ops"] for c, e in zip(compiled, eager))  # a compiled row repeats its eager count
    page = prune_report.render(json.loads(json.dumps({"device": "CPU", "settings": {"repeats": 3}, "rows": rows,
                                                      "checks": prune_report.headline_checks(rows), "skipped": skipped})))
    assert "## tiny timm ViT, 64 px, batch 1, float32, torch.compile" in page and "| first two calls (s) |" in page
    assert "## Left out" in page and "torch.compile failed: RuntimeError: graph break |" in page
    assert "## Where batch-1 eager time goes" in page and "## Latency figures (eager)" in page
    figures = page[page.index("## Latency figures"):page.index("\n## tiny timm ViT")]
    assert "| figure | batch 1 | batch 2 |" in figures
    assert "| aten ops per forward: ToMe r=8 constant (÷ unpruned) |" in figures
    assert "| importance_tome r=8 over ToMe r=8 (images/s ratio) |" in figures
    profile = page[page.index("## Where batch-1"):page.index("## Left out")]
    assert sum(line.startswith("| ") and "---" not in line for line in profile.splitlines()) == 1 + len(eager)
    with pytest.raises(PullbackError, match="torch.compile failed"):
        run_sweep(sweep, etas=(0.5,), tome_rs=(8,), device=CPU, repeats=1, progress=False)


def test_onnx_runtime_rows_beside_eager(tiny):
    rows = run_sweep(Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float32",), methods=("ToMe r=",), matched_r=None,
                           onnx_batches=(1,)), etas=(0.5,), tome_rs=(4,), device=CPU, repeats=2, progress=False)
    by = {r["method"]: r for r in rows}
    assert list(by) == ["unpruned", "ToMe r=4 constant", "ONNX Runtime: unpruned", "ONNX Runtime: ToMe r=4 constant"]
    ort = by["ONNX Runtime: ToMe r=4 constant"]
    assert ort["runtime"] == "onnxruntime" and ort["eager_method"] == "ToMe r=4 constant" and ort["max_abs_diff"] < 1e-4
    assert ort["flop_ratio"] == by["ToMe r=4 constant"]["flop_ratio"] and ort["aten_ops"] is None and len(ort["times_s"]) == 2
    ratios = sorted(e / o for e, o in zip(by["ToMe r=4 constant"]["times_s"], ort["times_s"]))
    assert ort["over_eager"] == pytest.approx(sum(ratios) / 2)  # the median of two rounds' eager ÷ ONNX Runtime times
    assert [c["check"].startswith("ONNX") for c in prune_report.headline_checks(rows)] == []  # no check reads ORT rows
    page = prune_report.render({"device": "CPU", "settings": {"repeats": 2}, "rows": rows})
    section = page[page.index("## ONNX Runtime beside eager"):]
    assert "| ToMe r=4 constant | " in section and "| unpruned | " in section


def test_onnx_rows_are_left_out_with_the_reason_when_the_packages_are_missing(tiny, monkeypatch):
    import pullback_ext.export as export

    def missing(runtime=True):
        raise PullbackError("ONNX export needs onnxruntime (not installed)")

    monkeypatch.setattr(export, "require_onnx", missing)
    sweep = Sweep("tiny", sizes=(64,), batches=(1,), dtypes=("float32",), methods=("ToMe r=",), matched_r=None, onnx_batches=(1,))
    skipped = []
    rows = run_sweep(sweep, etas=(0.5,), tome_rs=(4,), device=CPU, repeats=1, progress=False, skipped=skipped)
    assert [r["method"] for r in rows] == ["unpruned", "ToMe r=4 constant"]
    assert [(s["method"], s["reason"]) for s in skipped] == [("ONNX Runtime rows", "ONNX export needs onnxruntime (not installed)")]
    assert matrix.unavailable(torch.device("cuda"), torch.float32).startswith("the ONNX Runtime rows run float32 models on the CPU")


def test_the_script_writes_its_json_end_to_end(tiny, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert _script().main(["--models", "tiny", "--sizes", "64", "--batches", "1", "--compile", "off", "--no-onnx",
                           "--no-overhead", "--repeats", "1", "--tome-r", "2", "--quiet", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["etas"] == [0.5] and result["settings"]["big_batch_repeats"] == 3 and result["skipped"] == []
    assert [r["method"] for r in result["rows"]] == [
        "unpruned", "importance merge η=0.5 @2", "importance prune+LLF η=0.5 @2", "ToMe r=2 constant",
        "tokens dropped at ToMe r=2's counts, no merging (the bound)", "importance_tome r=2 (ToMe r=2's token counts)",
        "ATC keep_rate=0.7 average linkage", "importance_cluster keep_rate=0.7 (ATC's blocks, no head)"]
    assert "check: tiny timm ViT, 64 px, batch 1, float32, eager: importance merge η=0.5 @2" in capsys.readouterr().out
