"""Patched models export to ONNX (:func:`pullback_ext.export.export_onnx`) and ONNX Runtime on the
CPU reproduces the eager float32 forward to 1e-5: ToMe, PiToMe, importance_tome, the single-stage
merge and prune with LLF, on a tiny random timm ViT, and the unpatched model.

Without the optional ONNX packages those tests skip; the rest run everywhere: the export forms of
the extension's ops against the compiled ops, the layout a merge's sizes give the attention (the
cause of a failed re-trace of every per-block merge), and the error that names the install command.
"""

from __future__ import annotations

import sys

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import images, tiny_vit
from pullback_ext import export, ops, reference
from pullback_ext.errors import PullbackError

compiled = pytest.mark.skipif(ops._C is None, reason="needs the compiled extension (its ops are what is decomposed)")


class Head(torch.nn.Module):
    """A stand-in importance head: ``softplus(F w) [B, K]`` for ``F [B, K, D]``."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(dim, generator=torch.Generator().manual_seed(5)))

    def forward(self, F: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(F @ self.w)


SINGLE_STAGE = dict(strategy="importance", ratio=0.5, layers=(2,))
CASES = {
    "unpatched": None,
    "tome": dict(strategy="tome", r=2),
    "pitome": dict(strategy="pitome", r=2),
    "importance_tome": dict(strategy="importance_tome", r=2, with_head=True),
    "merge": dict(SINGLE_STAGE, mode="merge", with_head=True),
    "prune_llf": dict(SINGLE_STAGE, mode="prune", llf=True, with_head=True),
    "atc": dict(strategy="atc", keep_rate=0.7, atc_layers=(1, 2)),
    "importance_cluster": dict(strategy="importance_cluster", keep_rate=0.7, cluster_layers=(1, 2)),
}


def patched(case: str):
    """A tiny timm ViT (4 blocks, 16 patch tokens + CLS, width 32) patched as ``case`` says, its
    parameters requiring gradients as a freshly built timm model's do."""
    model = tiny_vit(depth=4).requires_grad_(True)
    options = dict(CASES[case] or {})
    if options.pop("with_head", False):
        options["head"] = Head()
    return patch.timm(model, **options) if options else model


@pytest.fixture
def onnxruntime():
    for name in ("onnx", "onnxscript"):
        pytest.importorskip(name)
    return pytest.importorskip("onnxruntime")


# --- with ONNX Runtime ------------------------------------------------------------------------


@compiled
@pytest.mark.parametrize("case", CASES)
def test_the_exported_model_reproduces_the_eager_forward(case, onnxruntime, tmp_path):
    model, x = patched(case), images(2)
    result = export.export_onnx(model, x, tmp_path / "model.onnx")
    assert result.path == tmp_path / "model.onnx" and result.max_abs_diff <= 1e-5
    with torch.no_grad():
        expected = model(x)
    session = onnxruntime.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert got.shape == tuple(expected.shape)
    assert float((torch.from_numpy(got) - expected).abs().max()) <= 1e-5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]  # no temporary file left


@compiled
def test_no_op_of_the_extension_is_left_in_the_file(onnxruntime, tmp_path):
    import onnx

    path = export.export_onnx(patched("tome"), images(2), tmp_path / "tome.onnx", check=False).path
    model = onnx.load(str(path))
    domains = {node.domain for node in model.graph.node} | {f.domain for f in model.functions}
    assert domains <= {"", "ai.onnx", "pkg.onnxscript.torch_lib", "pkg.onnxscript.torch_lib.common"}
    kinds = {node.op_type for node in model.graph.node}
    assert {"ScatterElements", "GatherElements", "TopK"} <= kinds


def test_the_stable_sort_keeps_ties_in_index_order(onnxruntime, tmp_path):
    class Sorts(torch.nn.Module):
        def forward(self, x, flags):
            return (torch.argsort(x, dim=1, stable=True), torch.argsort(x, dim=1, descending=True, stable=True),
                    torch.argsort(flags, dim=-1, stable=True), torch.sort(x, dim=0, stable=True).values)

    x = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0, 3.0], [0.0, 0.0, 0.0, 5.0, 5.0, 0.0]])
    flags = torch.tensor([[1, 0, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=torch.int8)
    program = torch.onnx.export(Sorts().eval(), (x, flags), dynamo=True, custom_translation_table=export.translation_table())
    path = tmp_path / "sorts.onnx"
    program.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x.numpy(), "flags": flags.numpy()})
    for g, e in zip(got, Sorts()(x, flags)):
        assert torch.equal(torch.from_numpy(g), e)


# --- without ONNX ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["onnx", "onnxscript", "onnxruntime"])
def test_a_missing_package_is_named_with_the_install_command(module, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    with pytest.raises(PullbackError, match=rf"needs .*{module}.*pip install 'pullback_ext\[onnx\]'"):
        export.export_onnx(tiny_vit(), images(2), tmp_path / "model.onnx")
    assert not (tmp_path / "model.onnx").exists()


def test_a_model_in_training_mode_is_refused(monkeypatch, tmp_path):
    monkeypatch.setattr(export, "require_onnx", lambda runtime=True: None)
    with pytest.raises(PullbackError, match=r"model\.eval\(\)"):
        export.export_onnx(tiny_vit().train(), images(2), tmp_path / "model.onnx")


def _token_case(seed: int, b: int = 3, n: int = 9, d: int = 5, r: int = 4):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g)
    w = torch.rand(b, n, generator=g) + 0.1
    perm = torch.stack([torch.randperm(n, generator=g) for _ in range(b)])
    src, rest = perm[:, :r], perm[:, r:]
    dst = torch.gather(rest, 1, torch.randint(0, n - r, (b, r), generator=g))
    return x, w, src, dst, perm


@compiled
def test_merged_weights_need_a_gradient_only_when_the_weights_do():
    x, w, src, dst, _ = _token_case(0)
    merged, weights = ops.merge_tokens(x.requires_grad_(), w, src, dst)
    assert merged.requires_grad and not weights.requires_grad  # w' = w_d + Σ w_s: no path from x
    merged, weights = ops.merge_tokens(x, w.requires_grad_(), src, dst)
    assert merged.requires_grad and weights.requires_grad
    weights.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w)) and torch.equal(x.grad, torch.zeros_like(x))


@compiled
def test_a_per_block_merge_re_traced_runs_with_gradients():
    """The cause of the failed re-trace: the sizes that the merge returned required grad with the
    tokens, so the log-size attention mask did, and the CPU's fused attention, which takes no such
    mask, gave its output another layout than in the trace the program was recorded from; a
    ``reshape`` recorded as a ``view`` there then failed. Re-traced (``run_decompositions``) and run
    with parameters that require grad, the program equals the eager forward."""
    model, x = patched("tome"), images(2)
    program = torch.export.export(model, (x,), strict=False).run_decompositions({})
    torch.testing.assert_close(program.module()(x), model(x), rtol=0, atol=1e-6)


@compiled
@pytest.mark.parametrize("seed", range(4))
def test_the_reference_forms_the_export_uses_equal_the_compiled_ops(seed):
    x, w, src, dst, perm = _token_case(seed)
    group = dst[0] == dst[0, 0]
    w[0, dst[0, 0]] = 0.0
    w[0, src[0][group]] = 0.0  # a zero-weight group: its destination stays unchanged
    for got, expected in zip(reference.merge_tokens(x, w, src, dst), ops.merge_tokens(x, w, src, dst)):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    kept_idx, pruned_idx = perm[:, 3:], perm[:, :3]
    kept, pruned = torch.randn(3, 6, 5), torch.randn(3, 3, 5)
    assert torch.equal(reference.reinsert_tokens(kept, kept_idx, pruned, pruned_idx),
                       ops.reinsert_tokens(kept, kept_idx, pruned, pruned_idx))
    g = torch.Generator().manual_seed(seed)
    for n, count in ((9, 0), (9, 3), (9, 5), (9, 9), (2, 1)):
        order = torch.stack([torch.randperm(n, generator=g) for _ in range(3)])
        partner = torch.randint(0, n, (3, n), generator=g)
        assert torch.equal(reference.select_with_partners(order, partner, count),
                           ops.select_with_partners(order, partner, count)), (n, count)


@compiled
def test_a_model_calling_the_qr_is_refused(monkeypatch, tmp_path):
    class Orthonormal(torch.nn.Module):
        def forward(self, X):
            return ops.block_orthonormalize(X)

    monkeypatch.setattr(export, "require_onnx", lambda runtime=True: None)
    with torch.no_grad(), pytest.raises(PullbackError, match="block_orthonormalize has no ONNX form"):
        export.export_onnx(Orthonormal().eval(), torch.randn(1, 8, 2), tmp_path / "qr.onnx")
    assert not (tmp_path / "qr.onnx").exists()


@compiled
def test_a_file_that_fails_the_check_is_not_written(onnxruntime, monkeypatch, tmp_path):
    monkeypatch.setattr(export, "max_abs_diff", lambda model, path, example_input: 0.5)
    with pytest.raises(PullbackError, match=r"differ from the eager forward by up to 0\.5 .*was not written"):
        export.export_onnx(tiny_vit(depth=1), images(2), tmp_path / "model.onnx")
    assert list(tmp_path.iterdir()) == []
