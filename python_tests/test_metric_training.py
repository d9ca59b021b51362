"""Training loop: schedule, deterministic batches, resume after a kill, 2-process DDP equivalence."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers.metric import Killed, kill_at
from pullback_ext.errors import CheckpointError
from pullback_ext.metric import ImportanceHead, SPN, TrainConfig, fit, load_model
from pullback_ext.metric.tasks import HeadTask, SPNTask, VAETask
from pullback_ext.metric.targets import TargetConfig
from pullback_ext.metric.training import METRICS_FILE, batch_indices, learning_rate
from pullback_ext.metric.vae import FeatureVAE

ROOT = Path(__file__).resolve().parents[1]


def test_learning_rate_warmup_then_cosine():
    cfg = TrainConfig(steps=110, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(0, cfg) == pytest.approx(0.1)
    assert learning_rate(9, cfg) == pytest.approx(1.0)
    assert learning_rate(10, cfg) == pytest.approx(1.0)
    assert learning_rate(60, cfg) == pytest.approx(0.55)
    assert learning_rate(110, cfg) == pytest.approx(0.1)


def test_batches_cover_each_epoch_once():
    cfg = TrainConfig(batch_size=4, seed=3)
    epoch0 = torch.cat([batch_indices(s, 12, cfg) for s in range(3)])
    epoch1 = torch.cat([batch_indices(s, 12, cfg) for s in range(3, 6)])
    assert sorted(epoch0.tolist()) == list(range(12)) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)
    assert torch.equal(batch_indices(4, 12, cfg), batch_indices(4, 12, cfg))


def _head_data(n=12, N=6, D=8):
    g = torch.Generator().manual_seed(0)
    F = torch.randn(n, N, D, generator=g, dtype=torch.float64)
    return {"features": F, "importance": F.norm(dim=-1) + 0.1}


def _spn_data(n=8, N=5, D=4, r=2):
    g = torch.Generator().manual_seed(1)
    V = torch.linalg.qr(torch.randn(n, N * D, r, generator=g, dtype=torch.float64)).Q
    sigma = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64).expand(n, 3).contiguous()
    return {"features": torch.randn(n, N, D, generator=g, dtype=torch.float64), "V": V, "sigma": sigma}


CASES = {
    "head": (lambda: ImportanceHead(8, hidden=16, heads=2), HeadTask(w_rank=0.5), _head_data),
    "spn": (lambda: SPN(4, 2, hidden=16, heads=2), SPNTask(TargetConfig(rank=2)), _spn_data),
    "vae": (lambda: FeatureVAE(8, 3, hidden=8), VAETask(beta=0.1), _head_data),
}


def fresh(build):
    """A new float64 model with the same initial weights each time."""
    torch.manual_seed(0)
    return build().double()


@pytest.mark.parametrize("kind", sorted(CASES))
def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path, kind):
    build, task, make_data = CASES[kind]
    data = make_data()
    cfg = TrainConfig(steps=9, batch_size=4, lr=3e-3, warmup_steps=2, seed=5, checkpoint_every=3, log_every=1)
    full = fresh(build)
    fit(task, full, data, cfg, tmp_path / "full", progress=False)
    with pytest.raises(Killed):
        fit(task, fresh(build), data, cfg, tmp_path / "cut", progress=False, on_step=kill_at(7))
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["step"] == 6
    resumed = fresh(build)
    fit(task, resumed, data, cfg, tmp_path / "cut", resume=True, progress=False)
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    stored, _ = load_model(tmp_path / "cut", kind=kind)
    assert all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), stored.state_dict().values()))
    lines = lambda d: [json.loads(l) for l in (d / METRICS_FILE).read_text().splitlines()]
    assert [l["step"] for l in lines(tmp_path / "cut")] == list(range(1, 10))
    assert lines(tmp_path / "cut") == lines(tmp_path / "full")


def test_weight_average_follows_the_trajectory_and_resumes_exactly(tmp_path):
    build, task, make_data = CASES["head"]
    data = make_data()
    cfg = TrainConfig(steps=7, batch_size=4, lr=3e-3, seed=3, checkpoint_every=3, log_every=1, ema_decay=0.8)
    expected = [p.detach().clone() for p in fresh(build).parameters()]
    weights = []
    traced = fresh(build)
    fit(task, traced, data, cfg, tmp_path / "full", progress=False,
        on_step=lambda step: weights.append([p.detach().clone() for p in traced.parameters()]))
    for step, params in enumerate(weights):  # the average the docstring promises, from the raw weights
        d = min(0.8, (1 + step) / (10 + step))
        expected = [d * e + (1 - d) * p for e, p in zip(expected, params)]
    for e, p in zip(expected, traced.parameters()):
        torch.testing.assert_close(p, e, rtol=1e-12, atol=1e-14)
    stored, _ = load_model(tmp_path / "full", kind="head")
    assert all(torch.equal(a, b) for a, b in zip(traced.state_dict().values(), stored.state_dict().values()))

    with pytest.raises(Killed):
        fit(task, fresh(build), data, cfg, tmp_path / "cut", progress=False, on_step=kill_at(5))
    resumed = fresh(build)
    fit(task, resumed, data, cfg, tmp_path / "cut", resume=True, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(traced.state_dict().values(), resumed.state_dict().values()))
    with pytest.raises(CheckpointError, match="weight average"):
        fit(task, fresh(build), data, TrainConfig(steps=2, batch_size=4), tmp_path / "plain", progress=False)
        fit(task, fresh(build), data, TrainConfig(steps=4, batch_size=4, ema_decay=0.8), tmp_path / "plain", resume=True, progress=False)


def test_resume_with_another_model_is_a_clear_error(tmp_path):
    data = _head_data()
    cfg = TrainConfig(steps=2, batch_size=4, checkpoint_every=1)
    fit(HeadTask(), ImportanceHead(8, hidden=16, heads=2).double(), data, cfg, tmp_path, progress=False)
    with pytest.raises(CheckpointError, match="does not fit"):
        fit(HeadTask(), ImportanceHead(8, hidden=32, heads=2).double(), data, TrainConfig(steps=4, batch_size=4), tmp_path, resume=True, progress=False)


def test_bad_training_settings():
    with pytest.raises(ValueError, match="batch_size: expected <= the number of training samples"):
        fit(HeadTask(), ImportanceHead(8, hidden=16, heads=2), _head_data(n=3), TrainConfig(batch_size=4), "/nonexistent/x", progress=False)
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)


WORKER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from pullback_ext import distributed
    from test_metric_training import CASES
    from pullback_ext.metric import TrainConfig, fit
    info = distributed.init_from_env("gloo")
    try:
        build, task, make_data = CASES[sys.argv[1]]
        torch.manual_seed(0)
        model = build().double()
        fit(task, model, make_data(), TrainConfig(steps=5, batch_size=4, lr=3e-3, seed=2, checkpoint_every=5, log_every=1), sys.argv[2], progress=False)
    finally:
        distributed.shutdown(info)
    distributed.leave(0)
    """
)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["head", "vae"])
def test_two_process_ddp_matches_single_process_on_the_global_batch(tmp_path, kind):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=str(ROOT / "python_tests")))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), kind, str(tmp_path / "ddp")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    build, task, make_data = CASES[kind]
    torch.manual_seed(0)
    single = build().double()
    fit(task, single, make_data(), TrainConfig(steps=5, batch_size=4, lr=3e-3, seed=2, checkpoint_every=5, log_every=1), tmp_path / "single", progress=False)
    ddp, _ = load_model(tmp_path / "ddp", kind=kind)
    for (name, a), (_, b) in zip(single.state_dict().items(), ddp.state_dict().items()):
        # float64; all-reduce sums in another order, Adam amplifies those 1e-16 differences a little
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-8), name
    losses = lambda d: [json.loads(l)["loss"] for l in (d / METRICS_FILE).read_text().splitlines()]
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "single"), rel=1e-9)


@pytest.mark.parametrize("kind", ["head", "spn"])
def test_mixed_precision_trains_with_finite_losses(tmp_path, kind):
    build, task, make_data = CASES[kind]
    data = {k: v.float() for k, v in make_data().items()}
    torch.manual_seed(0)
    model = build()
    before = [p.detach().clone() for p in model.parameters()]
    logged = fit(task, model, data, TrainConfig(steps=3, batch_size=4, amp=True, log_every=1), tmp_path, progress=False)
    assert torch.isfinite(torch.tensor(logged["loss"]))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


KILLED_WORKER = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {tests!r})
    import safetensors.torch
    from test_metric_training import CASES
    from pullback_ext.metric import TrainConfig, fit

    real_save, calls = safetensors.torch.save_file, []

    def save_then_die(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 5:  # the state file of the third checkpoint (step 9): half written, then SIGKILL
            real_save(tensors, filename, metadata=metadata)
            with open(filename, "r+b") as fh:
                fh.truncate(os.path.getsize(filename) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(tensors, filename, metadata=metadata)

    safetensors.torch.save_file = save_then_die
    build, task, make_data = CASES["head"]
    torch.manual_seed(0)
    fit(task, build().double(), make_data(), TrainConfig(**{cfg!r}), sys.argv[1], progress=False)
    """
)


def test_sigkill_while_writing_a_checkpoint_resumes_to_the_uninterrupted_result(tmp_path):
    settings = dict(steps=12, batch_size=4, lr=3e-3, seed=1, checkpoint_every=3, log_every=1)
    script = tmp_path / "worker.py"
    script.write_text(KILLED_WORKER.format(tests=str(ROOT / "python_tests"), cfg=settings))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "cut")], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert list((tmp_path / "cut").glob(".*.tmp-*")), "the kill should have left a half-written temporary file"
    build, task, make_data = CASES["head"]
    # Same thread count as the killed worker: float64 reductions are only bit-identical for a fixed one.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        resumed = build().double()
        fit(task, resumed, make_data(), TrainConfig(**settings), tmp_path / "cut", resume=True, progress=False)
        torch.manual_seed(0)
        full = build().double()
        fit(task, full, make_data(), TrainConfig(**settings), tmp_path / "full", progress=False)
    finally:
        torch.set_num_threads(threads)
    for (name, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert not list((tmp_path / "cut").glob(".*.tmp-*"))
