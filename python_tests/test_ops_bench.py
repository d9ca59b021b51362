"""The op benchmark: its eager baselines compute what the ops compute, its outputs and CLI errors."""

from __future__ import annotations

import json

import pytest
import torch

from ops_helpers import merge_inputs, reinsert_inputs
from pullback_ext import cli, op_benchmark, ops


def test_tome_baselines_match_the_ops():
    x, w, src, dst = merge_inputs(3, 11, 5, 4, torch.float64, "cpu")
    for a, b in zip(op_benchmark.tome_merge(x, w, src, dst), ops.merge_tokens(x, w, src, dst)):
        torch.testing.assert_close(a, b)
    kept, kept_idx, pruned, pruned_idx = reinsert_inputs(3, 7, 4, 5, torch.float64, "cpu")
    assert torch.equal(op_benchmark.tome_reinsert(kept, kept_idx, pruned, pruned_idx),
                       ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx))


def test_outputs_are_written(tmp_path):
    row = op_benchmark.Row("token_importance", "B=1", 2.0, 6.0, 3.0, 4_000_000, {}, fresh_output_ms=1.25)
    result = {
        "device": "cpu", "device_name": "x", "threads": 2, "torch": torch.__version__, "compiled_ops": True,
        "cpu_isa": "avx2", "quick": True, "repeats": 3, "read_bandwidth_gbps": 4.0,
        "rows": [{**row.__dict__, "speedup_vs_eager": row.speedup_eager, "speedup_vs_compiled": 1.5,
                  "effective_gbps": row.gbps(), "share_of_read_bandwidth": row.gbps() / 4.0}],
    }
    table = op_benchmark.format_table(result)
    assert "token_importance" in table and "3.00" in table and "50%" in table  # 2 GB/s of 4
    assert "1.250" in table  # the fresh-output floor
    paths = op_benchmark.write_outputs(result, str(tmp_path / "sub" / "bench.json"))
    assert json.loads((tmp_path / "sub" / "bench.json").read_text())["rows"][0]["fused_ms"] == 2.0
    assert (tmp_path / "sub" / "bench.png").stat().st_size > 0 and len(paths) == 2
    assert not list((tmp_path / "sub").glob("*.tmp"))


def test_timing_helpers_call_each_function_warmup_plus_repeats():
    calls = []
    assert op_benchmark.timed_medians_ms([lambda: calls.append(1)], 5, "cpu")[0] >= 0
    assert len(calls) == 6  # one warm-up, five timed
    a, b = [], []
    slow = lambda: (b.append(1), sum(range(20000)))  # noqa: E731
    fast_ms, slow_ms = op_benchmark.interleaved_medians_ms([lambda: a.append(1), slow], 4, "cpu")
    assert len(a) == len(b) == 5 and 0 <= fast_ms < slow_ms


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_rejects_missing_cuda(capsys):
    assert cli.main(["bench", "--device", "cuda"]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_cli_rejects_bad_repeats(capsys):
    assert cli.main(["bench", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err
