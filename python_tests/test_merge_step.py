"""The fused merge step (``ops.merge_step``, one op per merging block) against the unfused path it
replaces (rank, then ``apply_matching``: the reference), on the op and on whole patched models.

The compiled op must equal the unfused path bitwise in float64 (its merge adds up as
``merge_tokens``'s kernel does; only the ranking's decisions, taken as the unfused path takes them,
reach its outputs) and to 1e-6 in float32; its pure-torch reference (``reference.merge_step``, what
ONNX export decomposes it into) to rounding. With the op, a patched ViT-S/16 or ViT-B/16 dispatches
at most 1.5× the operators of the unpatched one at r = 8.
"""

from __future__ import annotations

import pytest
import torch

import pullback_ext.patch as patch
from helpers.prune import images, norm_scorer, tiny_dinov2, tiny_vit
from pullback_ext import ops, reference
from pullback_ext.bench.dispatch import OpCounter, count_aten_ops, dispatched_ops
from pullback_ext.prune.merged_tokens import MergedTokens
from pullback_ext.prune.methods import dtem, importance_tome, merging, pitome, tome

compiled = pytest.mark.skipif(not ops.merge_step_compiled(torch.zeros(1, 1, 1)), reason="needs the compiled merge_step")
RULES = ("tome", "cosine", "bound", "pitome", "pitome_protected")


def step_inputs(b=2, k=17, h=3, hd=8, d=6, dtype=torch.float64, seed=0, sizes="random", tied=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, k, d, generator=g, dtype=dtype)
    keys = torch.randn(b, h, k, hd, generator=g, dtype=dtype)
    if tied:  # keys from a few exact unit vectors, the same in every head: every score is exact, and
        # the many equal ones tie in both paths alike (ties go by position)
        table = torch.zeros(4, hd, dtype=dtype)
        table[0, 0] = table[1, 1] = 1.0
        table[2, :4] = table[3, 2:6] = 0.5
        keys = table[torch.randint(0, 4, (b, k), generator=g)][:, None].expand(b, h, k, hd)
    w = {"random": torch.randint(1, 5, (b, k), generator=g).to(dtype), "ones": torch.ones(b, k, dtype=dtype), "none": None}[sizes]
    energy = torch.rand(b, k, generator=g, dtype=dtype) + 0.1
    owner = torch.randint(0, k, (b, 2 * k), generator=g)
    positions = torch.stack([torch.randperm(k, generator=g) for _ in range(b)])
    return x, keys, w, energy, owner, positions


def unfused(rule, x, keys, sizes, energy, owner, positions, num_prefix, r, guard=1.0, margin=0.0, alpha=0.7):
    """The methods' unfused step: the rule's Matching, then apply_matching (and merge_values)."""
    state = MergedTokens(x=x, num_prefix=num_prefix, owner=owner, sizes=sizes, positions=positions)
    if rule == "tome":
        matching = tome.bipartite_matching(keys, num_prefix, r)
    elif rule in ("cosine", "bound"):
        g = importance_tome.Guard(None, 0, guard, rule)
        matching = importance_tome.guarded_matching(state, energy, keys, r, g)
    else:
        matching = pitome.energy_matching(keys, num_prefix, r, margin, alpha, rule == "pitome_protected")
    if matching is None:
        return None
    after = merging.apply_matching(state, matching)
    merged = merging.merge_values(energy, matching) if rule in ("cosine", "bound") else None
    return after.x, after.sizes, merged, after.owner, after.positions


def fused(rule, x, keys, sizes, energy, owner, positions, num_prefix, r, guard=1.0, margin=0.0, alpha=0.7, fn=None):
    fn = fn or (lambda *a, **kw: ops.merge_step(*a, **kw))
    e = energy if rule in ("cosine", "bound") else None
    out = fn(x, keys, sizes, e, owner, positions, num_prefix=num_prefix, r=r, rule=rule, guard=guard, margin=margin,
             alpha=alpha)
    return out[0], out[1], out[2] if e is not None else None, out[3], out[4]


def assert_same(got, want, exact: bool, rtol=1e-6):
    names = ("x", "sizes", "energy", "owner", "positions")
    for name, g, w in zip(names, got, want):
        if w is None:
            assert g is None
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        if exact or not g.is_floating_point():
            assert torch.equal(g, w), f"{name} differs: {(g.double() - w.double()).abs().max()}"
        else:
            torch.testing.assert_close(g, w, rtol=rtol, atol=rtol, msg=name)


CASES = [(rule, p, r, sizes, tied) for rule in RULES for p, r, sizes, tied in
         ((0, 3, "random", False), (1, 4, "ones", False), (5, 2, "none", False), (1, 100, "random", False),
          (1, 5, "random", True), (0, 3, "none", True))]


@compiled
@pytest.mark.parametrize("rule,num_prefix,r,sizes,tied", CASES)
def test_fused_step_is_the_unfused_step_bitwise_in_float64(rule, num_prefix, r, sizes, tied):
    inputs = step_inputs(sizes=sizes, tied=tied, seed=num_prefix + r)
    want = unfused(rule, *inputs, num_prefix, r)
    got = fused(rule, *inputs, num_prefix, r)
    assert_same(got, want, exact=True)


@compiled
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("k", (4, 5, 9, 61))
def test_ties_go_to_the_first_partner_at_every_row_length(rule, k):
    """Each row's best partner is scanned in strided lanes and merged: with many exact ties, at row
    lengths below, at and past the lane count, the first of the equal partners still wins."""
    inputs = step_inputs(k=k, sizes="ones", tied=True, seed=k)
    assert_same(fused(rule, *inputs, 1, k), unfused(rule, *inputs, 1, k), exact=True)


@compiled
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("seed", (0, 1))
def test_fused_step_is_the_unfused_step_in_float32(rule, seed):
    inputs = step_inputs(b=3, k=50, h=4, hd=16, d=12, dtype=torch.float32, seed=seed)
    assert_same(fused(rule, *inputs, 1, 8), unfused(rule, *inputs, 1, 8), exact=False)


@compiled
def test_a_step_without_owner_and_positions_starts_the_maps():
    x, keys, sizes, energy, _, _ = step_inputs()
    assert_same(fused("bound", x, keys, sizes, energy, None, None, 1, 4),
                unfused("bound", x, keys, sizes, energy, None, None, 1, 4), exact=True)


@pytest.mark.parametrize("rule", RULES)
def test_the_reference_is_the_unfused_step_to_rounding(rule):
    inputs = step_inputs()
    got = fused(rule, *inputs, 1, 5, fn=reference_step)
    assert_same(got, unfused(rule, *inputs, 1, 5), exact=False, rtol=1e-12)


def reference_step(x, keys, sizes, energy, owner, positions, **kw):
    return reference.merge_step(x, keys, sizes, energy, owner, positions, kw["num_prefix"], kw["r"], kw["rule"],
                                kw["guard"], kw["margin"], kw["alpha"])


@pytest.mark.parametrize("rule", ("tome", "pitome"))
def test_nothing_to_merge_leaves_the_tokens(rule):
    x, keys, sizes, *_ = step_inputs(k=2)
    out = ops.merge_step(x[:, :1], keys[:, :, :1], sizes[:, :1], num_prefix=0, r=3, rule=rule)
    assert torch.equal(out[0], x[:, :1]) and torch.equal(out[3], torch.zeros(2, 1, dtype=torch.int64))


@compiled
@pytest.mark.parametrize("rule", RULES)
def test_opcheck(rule):
    x, keys, sizes, energy, owner, positions = step_inputs()
    e = energy if rule in ("cosine", "bound") else None
    op = torch.ops.pullback_ext.merge_step.default
    torch.library.opcheck(op, (x, keys, sizes, e, owner, positions, 1, 4, rule, 1.5, 0.4, 0.7))
    torch.library.opcheck(op, (x, keys, None, e, None, None, 0, 3, rule, 1.0, 0.5, 1.0))


@compiled
def test_the_op_has_a_kernel_per_device_and_no_gradient():
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_kernel("pullback_ext::merge_step", "CPU") and has_kernel("pullback_ext::merge_step", "Meta")
    x, keys, sizes, *_ = step_inputs()
    out = ops.merge_step(x.requires_grad_(), keys, sizes, num_prefix=1, r=3)
    with pytest.raises(RuntimeError, match="merge_step is forward-only"):
        out[0].sum().backward()


@pytest.mark.parametrize("change,error,match", [
    (dict(x=torch.zeros(2, 17)), Exception, "x must have 3 dimensions"),
    (dict(keys=torch.zeros(2, 3, 16, 8, dtype=torch.float64)), Exception, "keys must have shape"),
    (dict(keys=torch.zeros(2, 3, 17, 8)), TypeError, "keys must have the dtype of x"),
    (dict(sizes=torch.ones(2, 16, dtype=torch.float64)), Exception, "sizes must have shape"),
    (dict(energy=torch.ones(2, 17)), TypeError, "energy must be torch.float64"),
    (dict(owner=torch.zeros(2, 5, dtype=torch.int32)), TypeError, "owner must be an int64"),
    (dict(positions=torch.zeros(2, 9, dtype=torch.int64)), Exception, "positions must have shape"),
    (dict(num_prefix=18), Exception, "num_prefix must be an int in"),
    (dict(r=-1), Exception, "r must be an int >= 0"),
    (dict(rule="nope"), Exception, "rule must be one of"),
    (dict(rule="bound", energy=None), Exception, "rule 'bound'.*needs energy"),
])
def test_bad_inputs_are_named(change, error, match):
    x, keys, sizes, energy, owner, positions = step_inputs()
    args = dict(x=x, keys=keys, sizes=sizes, energy=energy, owner=owner, positions=positions, num_prefix=1, r=3,
                rule="cosine")
    args.update(change)
    with pytest.raises(error, match=match):
        ops.merge_step(**args)


# --- whole models --------------------------------------------------------------------------------

METHODS = {
    "tome": dict(strategy="tome", r=3),
    "pitome": dict(strategy="pitome", r=3),
    "importance_tome": dict(strategy="importance_tome", r=3, head=norm_scorer, score_layer=0),
    "importance_tome_cosine": dict(strategy="importance_tome", r=3, head=norm_scorer, score_layer=0, partner="cosine",
                                   early_merges=True),
    "importance_tome_no_head": dict(strategy="importance_tome", r=2, head=None, guard=2.0),
    "dtem": dict(strategy="dtem", r=3),  # its embedding (the head) made per test, in the model's dtype
}


def options_of(method: str, dtype: torch.dtype = torch.float32, depth: int = 4, dim: int = 32) -> dict:
    """``METHODS[method]``, DTEM's with a random embedding of the model's ``dtype``, depth and width."""
    options = dict(METHODS[method])
    if method == "dtem":
        torch.manual_seed(3)
        options["head"] = dtem.DecoupledEmbedding(dim, 8, depth).to(dtype)
    return options


def both_paths(forward, x, monkeypatch):
    """``(fused, unfused)`` outputs of ``forward(x)`` and the merge_step calls of the fused run."""
    calls = dispatched_ops(forward, x)["pullback_ext::merge_step"]
    with torch.no_grad():
        fused_out = forward(x)
        monkeypatch.setattr(merging, "FUSED", False)
        unfused_out = forward(x)
        monkeypatch.setattr(merging, "FUSED", True)
    return fused_out, unfused_out, calls


@compiled
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_patched_timm_forward_is_the_unfused_one(method, dtype, monkeypatch):
    model = patch.timm(tiny_vit(reg_tokens=1, depth=4).to(dtype), **options_of(method, dtype))
    fused_out, unfused_out, calls = both_paths(model.forward_features, images(3).to(dtype), monkeypatch)
    assert calls > 0
    if dtype == torch.float64:
        assert torch.equal(fused_out, unfused_out)
    else:
        torch.testing.assert_close(fused_out, unfused_out, rtol=1e-6, atol=1e-6)


@compiled
@pytest.mark.parametrize("method", ("tome", "pitome", "importance_tome", "dtem"))
def test_patched_hugging_face_forward_is_the_unfused_one(method, monkeypatch):
    model = patch.hf_dinov2(tiny_dinov2(registers=2).double(), **options_of(method, torch.float64))
    forward = lambda x: model(pixel_values=x).last_hidden_state  # noqa: E731
    fused_out, unfused_out, calls = both_paths(forward, images(2).double(), monkeypatch)
    assert calls > 0 and torch.equal(fused_out, unfused_out)


@compiled
def test_a_gradient_takes_the_unfused_path():
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3).double(), strategy="tome", r=3)
    x = images(2).double().requires_grad_()
    with torch.enable_grad(), OpCounter() as counter:
        out = model.forward_features(x)
    assert counter.counts["pullback_ext::merge_step"] == 0
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@compiled
@pytest.mark.parametrize("method", ("tome", "importance_tome"))
def test_fullgraph_compile_with_the_fused_step_equals_eager(method):
    model = patch.timm(tiny_vit(reg_tokens=1, depth=3), **METHODS[method])
    x = images(2)
    with torch.no_grad():
        eager = model.forward_features(x)
        torch._dynamo.reset()
        graph = torch.compile(model.forward_features, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)


@compiled
@pytest.mark.parametrize("name", ("vit_small_patch16_224", "vit_base_patch16_224"))
def test_merging_vits_dispatch_at_most_one_and_a_half_times_the_unpatched_ops(name):
    """The acceptance of the fused step: ToMe and importance_tome (with a head) at r = 8 on a
    224-px ViT-S/16 and ViT-B/16 at batch 1 dispatch at most 1.5× the unpatched model's operators."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).eval()
    x = torch.rand(1, 3, 224, 224)
    base = count_aten_ops(model, x)
    for options in (dict(strategy="tome", r=8), dict(strategy="importance_tome", r=8, head=norm_scorer)):
        patch.timm(model, **options)
        count = count_aten_ops(model, x)
        assert count <= 1.5 * base, f"{options['strategy']}: {count} ops, unpatched {base}"
        patch.unpatch(model)
