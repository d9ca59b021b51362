"""The ONNX Runtime rows of the pruning benchmark: the patched models exported with
:func:`pullback_ext.export.export_onnx` and run by ONNX Runtime on the CPU, timed in the same
interleaved rounds as their eager forwards (so the two latencies share the machine's load).

Each model is exported at the cell's input shape (the file takes that shape only), float32, and
run by one ``InferenceSession`` (CPU provider, all graph optimisations) with as many intra-op
threads as torch uses and one inter-op thread. Its threads do not spin-wait between calls
(``session.intra_op.allow_spinning = 0``): a spinning pool would take the cores from the torch
forward timed next in the round. Every row records the largest absolute difference between the
session's output and the eager forward's.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

PREFIX = "ONNX Runtime: "


@dataclass
class OnnxRunners:
    """``fns``: ``{PREFIX + method: one session call}``; ``diffs``: the largest absolute difference
    per row; ``skipped``: ``[(method, reason)]`` of the methods that did not export or run."""

    fns: dict[str, Callable[[], object]] = field(default_factory=dict)
    diffs: dict[str, float] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    folder: tempfile.TemporaryDirectory | None = None

    def close(self) -> None:
        self.fns.clear()
        if self.folder is not None:
            self.folder.cleanup()
            self.folder = None


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why no ONNX Runtime row can run here (None: they can)."""
    from pullback_ext.errors import PullbackError
    from pullback_ext.export import require_onnx

    if device.type != "cpu" or dtype != torch.float32:
        return "the ONNX Runtime rows run float32 models on the CPU only"
    try:
        require_onnx(runtime=True)
    except PullbackError as err:
        return str(err)
    return None


def session(path: Path, threads: int):
    """An ONNX Runtime CPU session of the file at ``path`` with ``threads`` intra-op threads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def onnx_runners(models: dict[str, torch.nn.Module], names: Sequence[str], x: torch.Tensor, threads: int) -> OnnxRunners:
    """Export ``models[name]`` for each of ``names`` at ``x``'s shape and open its session; a method
    whose export or run fails is skipped with the error as its reason (the others still run)."""
    from pullback_ext.export import export_onnx

    out = OnnxRunners(folder=tempfile.TemporaryDirectory(prefix="bench-prune-onnx-"))
    feed = x.detach().cpu().numpy()
    for i, name in enumerate(names):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress lines
                path = export_onnx(models[name], x, Path(out.folder.name) / f"{i}.onnx", check=False).path
            run = session(path, threads)
            feeds = {run.get_inputs()[0].name: feed}
            got = torch.from_numpy(run.run(None, feeds)[0])
            with torch.no_grad():
                expected = models[name](x)
            out.diffs[PREFIX + name] = float((expected.double() - got.double()).abs().max())
        except Exception as err:  # noqa: BLE001 - one method that does not export must not end the benchmark
            out.skipped.append((name, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"))
            continue
        out.fns[PREFIX + name] = lambda run=run, feeds=feeds: run.run(None, feeds)
    return out
