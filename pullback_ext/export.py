"""Export to ONNX: a patched (or unpatched) model as one ``.onnx`` file that ONNX Runtime runs.

    import pullback_ext.patch as patch
    from pullback_ext.export import export_onnx

    patch.timm(model, strategy="tome", r=8)
    export_onnx(model.eval(), images, "model.onnx")     # images [B, 3, H, W] float32

The model is traced by ``torch.export`` (non-strict) on the example input, the extension's ops are
rewritten into standard torch ops (:func:`decompositions`), and ``torch.onnx.export(...,
dynamo=True)`` translates the program, with the ONNX forms of the ops torch's table lacks
(:func:`translation_table`: the stable sort that the patched forwards' ``argsort(stable=True)``
becomes). With ``check=True`` (the default) ONNX Runtime runs the file on the CPU and the largest
absolute difference from the eager forward must be at most ``atol``, else nothing is written.

What the extension's ops become (indices are int64; B batch, N tokens, D channels):

- ``gather_tokens``: ``GatherElements`` on the token axis;
- ``merge_tokens``: ``ScatterElements(reduction="add")`` of the weighted sources into their
  destinations, the kept tokens gathered in order (a ``CumSum`` ranks them, a ``ScatterElements``
  inverts the ranks), then ``Div`` / ``Where``;
- ``reinsert_tokens``: one ``ScatterElements`` of kept and pruned tokens to their positions;
- ``select_with_partners``: the greedy unrolled, one small step (``GatherElements``,
  ``ScatterElements``) per candidate, at most ``2·count`` steps (the graph grows with the budget);
- ``merge_step``: its reference, the unfused merge (``Gather``/``MatMul``/``ReduceMax`` for the
  ranking, ``TopK`` for its stable sort, then the ``merge_tokens`` form above);
- ``agglomerate``: its reference unrolled, one step (``ArgMin`` over the flattened matrix, a row
  update by ``GatherElements``/``ScatterElements``) per merge, ``n - count`` steps;
- ``token_importance``, ``lowrank_metric_apply``, ``lowrank_metric_quadform``: their reference
  formulas (``MatMul``, ``ReduceSum``, ``Sqrt``);
- ``aten.sort.stable``: ``TopK`` over the whole axis (ONNX orders ties by index, so it is stable).

``block_orthonormalize`` (QR) has no ONNX form: a model that calls it (an SPN importance head run
without gradients) is refused with a :class:`~pullback_ext.errors.PullbackError`; a head that
returns importance scores exports.

Supported: patched timm ``VisionTransformer`` models — tested: ToMe, PiToMe, importance_tome, the
single-stage merge and prune with LLF — and unpatched models, float32 on the CPU (docs/export.md
lists what else was seen to export). Shapes are static: the file takes inputs of the example's
shape only (the token counts after each reduction follow from that shape and the options).

Needs the optional packages ``onnx``, ``onnxscript`` (and ``onnxruntime`` for ``check=True``):
``pip install 'pullback_ext[onnx]'``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import Tensor

from pullback_ext import reference
from pullback_ext.errors import PullbackError
from pullback_ext.fileio import atomic_path

__all__ = ["INSTALL", "OnnxExport", "decompositions", "export_onnx", "max_abs_diff", "require_onnx", "translation_table"]

INSTALL = "pip install 'pullback_ext[onnx]'"
# ONNX's own limit on one protobuf file; larger models keep their weights in NAME.data beside it.
_PROTOBUF_LIMIT = 2**31 - 2**20


class OnnxExport(NamedTuple):
    """What :func:`export_onnx` wrote: ``path`` and, when checked, the largest absolute difference
    between ONNX Runtime's outputs and the eager forward's (None with ``check=False``)."""

    path: Path
    max_abs_diff: Optional[float]


def require_onnx(runtime: bool = True) -> None:
    """Raise one :class:`PullbackError` naming the install command unless ``onnx`` and
    ``onnxscript`` (and, with ``runtime``, ``onnxruntime``) import."""
    missing = []
    for name in ("onnx", "onnxscript") + (("onnxruntime",) if runtime else ()):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise PullbackError(f"ONNX export needs {', '.join(missing)} (not installed); install the optional "
                            f"dependencies with `{INSTALL}`")


# --- the extension's ops in standard torch ops -------------------------------------------------


_NO_QR = ("block_orthonormalize has no ONNX form (ONNX has no QR); a model that calls it (an SPN importance head run "
          "without gradients) cannot be exported: give the patch a head that returns importance scores")


def decompositions() -> dict:
    """The extension's ops in standard torch ops, the table :func:`export_onnx` passes to
    ``ExportedProgram.run_decompositions`` (needs the compiled extension, which defines the ops)."""
    pe = torch.ops.pullback_ext
    return {
        pe.gather_tokens.default: reference.gather_tokens,
        pe.merge_tokens.default: reference.merge_tokens,
        pe.reinsert_tokens.default: reference.reinsert_tokens,
        pe.select_with_partners.default: reference.select_with_partners,
        pe.token_importance.default: reference.token_importance,
        pe.lowrank_metric_apply.default: reference.lowrank_metric_apply,
        pe.lowrank_metric_quadform.default: reference.lowrank_metric_quadform,
        **({pe.merge_step.default: reference.merge_step} if hasattr(pe, "merge_step") else {}),
        **({pe.agglomerate.default: reference.agglomerate} if hasattr(pe, "agglomerate") else {}),
    }


# --- ONNX forms of aten ops torch's translation table lacks ------------------------------------


def _sort_stable(self, stable: Optional[bool] = None, dim: int = -1, descending: bool = False):
    """``aten.sort.stable`` as ``TopK`` over the whole axis (ties in index order, as a stable sort
    keeps them); ONNX Runtime's ``TopK`` takes float, double, int32 and int64, so other dtypes are
    sorted as float32 (floating) or int64 (integer, bool), which keeps their order."""
    import onnx_ir as ir
    from onnxscript import opset18 as op

    k = op.Shape(self, start=dim) if dim == -1 else op.Shape(self, start=dim, end=dim + 1)
    native = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.INT32, ir.DataType.INT64)
    work = self
    if self.dtype not in native:
        work = op.Cast(self, to=ir.DataType.FLOAT if self.dtype.is_floating_point() else ir.DataType.INT64)
    values, indices = op.TopK(work, k, axis=dim, largest=int(bool(descending)), sorted=1)
    return (values if work is self else op.CastLike(values, self)), indices


def translation_table() -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)``: the ONNX forms of the
    aten ops that the patched forwards use and torch's own table lacks."""
    return {torch.ops.aten.sort.stable: _sort_stable}


# --- export ------------------------------------------------------------------------------------


def _refuse_unsupported(program: torch.export.ExportedProgram) -> None:
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.pullback_ext.block_orthonormalize.default:
            raise PullbackError(_NO_QR)


def _as_args(example_input) -> tuple:
    return tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)


def _save(onnx_program, path: Path, accept: Callable[[Path], None]) -> None:
    """Write the model whole or not at all: to a temporary file beside ``path``, which replaces
    ``path`` once ``accept(temporary path)`` returned. A model over ONNX's 2 GB file limit keeps its
    weights in ``NAME.data`` beside ``path`` (written first; the model file names it)."""
    import onnx_ir as ir

    model = onnx_program.model
    size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    with atomic_path(path) as tmp:
        if size <= _PROTOBUF_LIMIT:
            ir.save(model, tmp, format="protobuf")
        else:  # the data's path is relative to the model file's folder: beside path
            ir.save(model, tmp, format="protobuf", external_data=f"{path.name}.data")
        accept(tmp)


def _leaves(out) -> list:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor)]


def _run_onnxruntime(path: Path, args: tuple) -> list:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    tensors = [a for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, Tensor)]
    feeds = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), tensors)}
    return [torch.from_numpy(o) for o in session.run(None, feeds)]


def max_abs_diff(model: torch.nn.Module, path: Path, example_input) -> float:
    """Largest absolute difference between ONNX Runtime's (CPU) outputs of the file at ``path`` and
    ``model``'s eager outputs on ``example_input``."""
    args = _as_args(example_input)
    with torch.no_grad():
        expected = _leaves(model(*args))
    got = _run_onnxruntime(Path(path), args)
    if len(got) != len(expected):
        raise PullbackError(f"the ONNX model returns {len(got)} outputs, the eager model {len(expected)}")
    diffs = []
    for e, g in zip(expected, got):
        if tuple(e.shape) != tuple(g.shape):
            raise PullbackError(f"an ONNX output has shape {tuple(g.shape)}, the eager one {tuple(e.shape)}")
        diffs.append(float((e.detach().cpu().double() - g.double()).abs().max()) if e.numel() else 0.0)
    return max(diffs, default=0.0)


def export_onnx(model: torch.nn.Module, example_input: Any, path, *, check: bool = True, atol: float = 1e-5,
                opset_version: Optional[int] = None) -> OnnxExport:
    """Export ``model`` (patched or not, in eval mode) to the ONNX file ``path``.

    ``example_input``: the forward's input, e.g. images ``[B, 3, H, W]`` float32 on the CPU (a tuple
    for several positional inputs); the file takes inputs of exactly these shapes. ``check``: run
    the file in ONNX Runtime on the CPU and raise a :class:`PullbackError` when its outputs differ
    from the eager forward's by more than ``atol``. ``opset_version``: the ONNX opset (default:
    torch's). Returns an :class:`OnnxExport`. The file is written whole or not at all.
    """
    require_onnx(runtime=check)
    if model.training:
        raise PullbackError("export_onnx exports inference graphs: call model.eval() first (dropout and "
                            "stochastic depth would be traced in training mode)")
    from pullback_ext import ops, patch

    if ops._C is None and patch.config(model) is not None:
        raise PullbackError("exporting a patched model needs the compiled extension (its ops have export forms; "
                            "the pure-torch fallback has data-dependent shapes): build it, see docs/install.md")
    args = _as_args(example_input)
    path = Path(path)
    program = torch.export.export(model, args, strict=False)
    if ops._C is not None:
        _refuse_unsupported(program)
        program = program.run_decompositions(decompositions())
    onnx_program = torch.onnx.export(program, args, dynamo=True, custom_translation_table=translation_table(),
                                     opset_version=opset_version)
    diff = None

    def accept(written: Path) -> None:
        nonlocal diff
        if check:
            diff = max_abs_diff(model, written, args)
            if not diff <= atol:
                raise PullbackError(f"ONNX Runtime's outputs of the exported model differ from the eager forward by up "
                                    f"to {diff:.3g} (atol {atol:g}); {path} was not written")

    _save(onnx_program, path, accept)
    return OnnxExport(path, diff)
