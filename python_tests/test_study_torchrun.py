"""``pullback study`` under torchrun: 2 gloo processes share every layer's work and give the
single-process result (the sweep engine with a cheap measurement, and study diagnose / criteria
end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from pullback_ext.cli import main

REPO = Path(__file__).resolve().parents[1]

ENGINE_WORKER = textwrap.dedent(
    """
    import os
    import sys
    import torch.distributed as dist
    from pullback_ext.studies.engine import UnitStore, run_sweep

    def measure(layer, items):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return [{"value": layer * 100 + item * item, "rank": rank} for item in items]

    def finish(layer, records):
        return {"values": [r["value"] for r in records], "ranks": sorted({r["rank"] for r in records})}

    units = run_sweep(UnitStore(sys.argv[1], "toy", {"a": 1}), [0, 2, 3], list(range(5)), measure, finish, progress=False)
    rank = int(os.environ.get("RANK", 0))  # the process group may be gone after the sweep
    with open(f"{sys.argv[1]}.rank{rank}", "w") as fh:  # one file per rank: two ranks' prints interleave
        fh.write(f"units {units is not None}")
    """
)


def _torchrun(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _units(folder: Path) -> dict:
    return {p.name: json.loads(p.read_text())["unit"] for p in sorted((folder / "layers").glob("layer-*.json"))}


@pytest.mark.distributed
def test_sweep_engine_shards_work_over_two_ranks_and_gathers_it_in_order(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(ENGINE_WORKER)
    _torchrun([str(script), str(tmp_path / "multi")], timeout=120)
    said = [(tmp_path / f"multi.rank{r}").read_text() for r in (0, 1)]
    assert said == ["units True", "units False"]  # rank 0 alone returns the units
    subprocess.run([sys.executable, str(script), str(tmp_path / "single")], cwd=REPO, check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")))
    multi, single = _units(tmp_path / "multi"), _units(tmp_path / "single")
    assert list(multi) == ["layer-00.json", "layer-02.json", "layer-03.json"]
    for name, unit in multi.items():
        assert unit["values"] == single[name]["values"]  # work-item order, whatever rank measured it
        assert unit["ranks"] == [0, 1] and single[name]["ranks"] == [0]


STUDIES = {
    "diagnose": ["diagnose", "--model", "demo", "--layers", "1,4", "--decoders", "cls,depth", "--num-images", "3",
                 "--output-size", "4", "--rank", "4", "--probes", "4", "--slq-steps", "4", "--dtype", "float64",
                 "--batch-size", "1"],
    "criteria": ["criteria", "--model", "demo", "--layers", "0,3", "--tasks", "cls,depth", "--criteria", "random,norm",
                 "--num-images", "4", "--batch-size", "1", "--alphas", "0,1"],
}


def _numbers(value, path=""):
    """``{path: number}`` of every number in a JSON value (the figures two runs must share)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _numbers(item, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _numbers(item, f"{path}/{i}").items()}
    return {path: value} if isinstance(value, (int, float)) and not isinstance(value, bool) else {}


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind", sorted(STUDIES))
def test_study_over_two_processes_equals_the_single_process_study(kind, tmp_path):
    argv = ["study", *STUDIES[kind], "--quiet"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun's workers run (OMP_NUM_THREADS=1): float32 sums then add in one order
    try:
        assert main([*argv, "--out", str(tmp_path / "single")]) == 0
    finally:
        torch.set_num_threads(threads)
    _torchrun(["-m", "pullback_ext", *argv, "--out", str(tmp_path / "multi")], timeout=360)
    single, multi = _units(tmp_path / "single"), _units(tmp_path / "multi")
    assert list(multi) == list(single) == ["layer-00.json" if kind == "criteria" else "layer-01.json",
                                           "layer-03.json" if kind == "criteria" else "layer-04.json"]
    for name in single:
        _assert_same_numbers(single[name], multi[name], name)
    summaries = [json.loads((tmp_path / run / "study.json").read_text())["summary"] for run in ("single", "multi")]
    _assert_same_numbers(*summaries, "summary")


def _assert_same_numbers(a: dict, b: dict, where: str) -> None:
    a, b = _numbers(a), _numbers(b)
    assert a and a.keys() == b.keys(), where
    for key, value in a.items():
        if not key.endswith("/world_size"):  # the one figure that says how the run went
            assert b[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (where, key)
