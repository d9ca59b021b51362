"""The op benchmark: its eager baselines compute what the ops compute, its outputs and CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.ops import merge_inputs, reinsert_inputs
from pullback_ext import cli, ops
from pullback_ext.bench import baselines, kernel_breakdown, report, timing
from pullback_ext.bench.ops import Row


def test_no_library_module_uses_the_bench_application():
    package = Path(__file__).resolve().parents[1] / "pullback_ext"
    applications = ("bench", "commands", "demo")
    library = [p for p in package.rglob("*.py") if p.relative_to(package).parts[0] not in applications
               and p.name not in ("cli.py", "__main__.py")]
    assert library and not [p for p in library if "pullback_ext.bench" in p.read_text()]


def test_tome_baselines_match_the_ops():
    x, w, src, dst = merge_inputs(3, 11, 5, 4, torch.float64, "cpu")
    for a, b in zip(baselines.tome_merge(x, w, src, dst), ops.merge_tokens(x, w, src, dst)):
        torch.testing.assert_close(a, b)
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(3, 7, 4, 5, torch.float64, "cpu")
    assert torch.equal(baselines.tome_reinsert(kept, kept_idx, pruned, pruned_idx),
                       ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx))


def test_outputs_are_written(tmp_path):
    row = Row("token_importance", "B=1", 2.0, 6.0, 3.0, 4_000_000, {}, fresh_output_ms=1.25)
    result = {
        "device": "cpu", "device_name": "x", "threads": 2, "torch": torch.__version__, "compiled_ops": True,
        "cpu_isa": "avx2", "quick": True, "repeats": 3, "read_bandwidth_gbps": 4.0,
        "rows": [{**row.__dict__, "speedup_vs_eager": row.speedup_eager, "speedup_vs_compiled": 1.5,
                  "effective_gbps": row.gbps(), "share_of_read_bandwidth": row.gbps() / 4.0}],
    }
    table = report.format_table(result)
    assert "token_importance" in table and "3.00" in table and "50%" in table  # 2 GB/s of 4
    assert "1.250" in table  # the fresh-output floor
    paths = report.write_outputs(result, str(tmp_path / "sub" / "bench.json"))
    assert json.loads((tmp_path / "sub" / "bench.json").read_text())["rows"][0]["fused_ms"] == 2.0
    assert (tmp_path / "sub" / "bench.png").stat().st_size > 0 and len(paths) == 2
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_timing_helpers_call_each_function_warmup_plus_repeats():
    calls = []
    assert timing.timed_medians_ms([lambda: calls.append(1)], 5, "cpu")[0] >= 0
    assert len(calls) == 6  # one warm-up, five timed
    a, b = [], []
    slow = lambda: (b.append(1), sum(range(20000)))  # noqa: E731
    fast_ms, slow_ms = timing.interleaved_medians_ms([lambda: a.append(1), slow], 4, "cpu")
    assert len(a) == len(b) == 5 and 0 <= fast_ms < slow_ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_rejects_missing_cuda(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_cli_rejects_bad_repeats(capsys):
    assert cli.main(["bench", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_cli_rejects_kernel_breakdown_off_cuda(capsys):
    assert cli.main(["bench", "--kernels"]) == 2
    assert "--kernels" in capsys.readouterr().err


@pytest.mark.parametrize("raw, short", [
    ("void pullback::cuda::detail::single_column_products_kernel<float, float, 16>(float const*, float const*, "
     "float*, long, int, long, int, int)", "single_column_products_kernel<float, float, 16>"),
    ("void pullback::cuda::(anonymous namespace)::quadform_from_chunks_kernel<c10::Half, float>"
     "(float const*, c10::Half const*, c10::Half*, int, int, float)", "quadform_from_chunks_kernel<c10::Half, float>"),
    ("at::cuda::(anonymous namespace)::spin_kernel(long)", "spin_kernel"),
    ("Memcpy DtoH (Device -> Pinned)", "Memcpy DtoH (Device -> Pinned)"),
])
def test_kernel_names_are_shortened_to_the_template(raw, short):
    assert kernel_breakdown.short_kernel_name(raw) == short


def _trace(calls: list[list[tuple[str, float, float]]]) -> list[dict]:
    """A chrome trace of the profiled pattern: per call a lead spin, the flush, a marker and the call's
    activities (name, start offset after the marker, duration), then a closing spin; plus host events."""
    events, t = [], 1000.0
    for acts in calls:
        events.append({"cat": "kernel", "ph": "X", "name": "spin_kernel(long)", "ts": t, "dur": 1000.0})
        events.append({"cat": "kernel", "ph": "X", "name": "void at::native::reduce_kernel<512, 1>(float)",
                       "ts": t + 1001.0, "dur": 70.0})
        marker_end = t + 1073.0 + 1.0
        events.append({"cat": "kernel", "ph": "X", "name": "spin_kernel(long)", "ts": t + 1073.0, "dur": 1.0})
        events.append({"cat": "cpu_op", "ph": "X", "name": "aten::sum", "ts": t + 1073.5, "dur": 30.0})
        events += [{"cat": "gpu_memcpy" if name.startswith("Memcpy") else "kernel", "ph": "X", "name": name,
                    "ts": marker_end + start, "dur": dur} for name, start, dur in acts]
        t += 2000.0
    events.append({"cat": "kernel", "ph": "X", "name": "spin_kernel(long)", "ts": t, "dur": 1.0})
    return events[::-1]  # the trace's order is not the device's


def test_breakdown_splits_calls_at_the_markers_and_takes_medians():
    product, epilogue = "void ns::product_kernel<float>(float const*)", "void ns::epilogue_kernel<float>(float*)"
    calls = [[(product, 2.0, 40.0), (epilogue, 43.0, 3.0)],   # span 44, busy 43, gap 1, lead-in 2
             [(product, 3.0, 42.0), (epilogue, 47.0, 4.0)],   # span 48, busy 46, gap 2, lead-in 3
             [(product, 2.0, 41.0), (epilogue, 45.0, 5.0)],   # span 48, busy 46, gap 2, lead-in 2
             [(product, 2.0, 41.0), ("Memcpy DtoH (Device -> Pinned)", 44.0, 2.0), (epilogue, 47.0, 3.0)]]
    result = kernel_breakdown.summarize(kernel_breakdown.split_calls(kernel_breakdown.device_activities(_trace(calls))))
    assert (result.calls, result.profiled) == (3, 4)  # the one call with a copy has another sequence
    assert result.span_us == 48.0 and result.busy_us == 46.0 and result.gaps_us == 2.0 and result.lead_in_us == 2.0
    assert result.kernels == [("product_kernel<float>", 41.0), ("epilogue_kernel<float>", 4.0)]
    text = result.describe()
    assert "span 48.0 us = kernels 46.0 + gaps 2.0" in text and "epilogue_kernel<float> 4.0" in text


def test_breakdown_rejects_a_trace_without_the_marker_pattern():
    events = _trace([[("void k()", 1.0, 2.0)]])
    lost = [e for e in events if not (e["name"].startswith("spin") and e["dur"] == 1000.0)]  # lead spin dropped
    with pytest.raises(ValueError, match="spin kernels"):
        kernel_breakdown.split_calls(kernel_breakdown.device_activities(lost))
    empty = kernel_breakdown.split_calls(kernel_breakdown.device_activities(_trace([[], []])))
    with pytest.raises(ValueError, match="no device activity"):
        kernel_breakdown.summarize(empty)


def test_table_prints_the_breakdown_of_profiled_rows():
    breakdown = kernel_breakdown.Breakdown(48.0, 46.0, 2.0, 1.5, [("product<float>", 42.0), ("epilogue", 4.0)], 3, 4)
    row = Row("lowrank_metric_quadform", "B=8", 0.05, 0.2, None, 133_000_000, {}, 0.048, 0.01,
                           json.loads(json.dumps(breakdown.to_dict())))
    result = {"device": "cuda", "device_name": "x", "threads": 2, "compiled_ops": True, "cpu_isa": None,
              "read_bandwidth_gbps": 4000.0, "copy_bandwidth_gbps": 4200.0,
              "rows": [{**row.__dict__, "speedup_vs_eager": row.speedup_eager, "speedup_vs_compiled": None,
                        "effective_gbps": row.gbps(), "share_of_read_bandwidth": row.gbps() / 4000.0,
                        "unchecked_share_of_read_bandwidth": 0.69}]}
    profiled_line = report.format_table(result).split("profiled")[1].splitlines()[-1]
    assert profiled_line.startswith("lowrank_metric_quadform ") and profiled_line.endswith(
        "span 48.0 us = kernels 46.0 + gaps 2.0 (lead-in 1.5): product<float> 42.0, epilogue 4.0")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_breakdown_of_a_compiled_op_names_its_kernels():
    U = torch.randn(2, 257 * 64, 20, device="cuda")
    lam, v = torch.rand(2, 20, device="cuda"), torch.randn(2, 257 * 64, 1, device="cuda")
    result = kernel_breakdown.cuda_kernel_breakdown(
        lambda: ops.lowrank_metric_quadform(U, lam, v, 0.1, check_values=False), repeats=5)
    names = [name for name, _ in result.kernels]
    if ops.uses_compiled(U):
        assert any(name.startswith("single_column_products_kernel<float, float,") for name in names), names
    assert result.calls == result.profiled == 5
    assert result.span_us >= result.busy_us > 0 and result.gaps_us >= 0 and len(names) >= 1


def test_out_is_a_folder_and_a_json_file_is_the_old_spelling(tmp_path):
    import warnings

    import pytest

    from pullback_ext.commands.arguments import result_file
    from pullback_ext.errors import PullbackError

    assert result_file(str(tmp_path / "run")) == tmp_path / "run" / "results.json"
    with pytest.warns(FutureWarning, match="name a folder"):
        assert result_file(str(tmp_path / "old.json")) == tmp_path / "old.json"
    (tmp_path / "taken").write_text("x")
    with warnings.catch_warnings(), pytest.raises(PullbackError, match="existing file"):
        warnings.simplefilter("error")
        result_file(str(tmp_path / "taken"))
