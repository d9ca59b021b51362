"""ReductionOptions: frozen, validated field by field, JSON round trip, one options object for
every patch function."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

import pullback_ext.patch as patch
from helpers.prune import norm_scorer, tiny_dinov2, tiny_dpt, tiny_vit
from pullback_ext.errors import PullbackError
from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions, common_names, option_names, with_overrides

NAMES = list(option_names())


def test_options_are_frozen_and_normalised():
    options = ReductionOptions(strategy="norm", ratio=[0.2, 0.3], layers=[1, 2], llf=True, eps=1)
    assert options.ratio == (0.2, 0.3) and options.layers == (1, 2) and options.llf == "masked" and options.eps == 1.0
    assert ReductionOptions(strategy="norm", layers=3).layers == (3,)
    assert ReductionOptions(head=[norm_scorer, norm_scorer], layers=(1, 2)).head == (norm_scorer, norm_scorer)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.ratio = 0.5
    assert hash(options) == hash(ReductionOptions(strategy="norm", ratio=(0.2, 0.3), layers=(1, 2), llf="masked", eps=1.0))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("head", "not a scorer", "head must be a callable"),
        ("head", [norm_scorer, 3], "head must be a callable"),
        ("ratio", 1.5, r"ratio must lie in \[0, 1\)"),
        ("ratio", True, "ratio must be a float"),
        ("layers", "1", "layers must be block indices"),
        ("mode", "drop", "mode must be one of auto, merge, prune"),
        ("strategy", 3, "strategy must be one of importance"),
        ("llf", "partial", "llf must be True, False, 'masked', 'full' or 'auto'"),
        ("preset", "fast", "preset must be one of recommended, paper"),
        ("spn", 3, "spn must be None or a callable"),
        ("matching", "euclid", "matching must be one of auto, pullback, cosine"),
        ("eps", -1.0, "eps must be None or a finite float >= 0"),
        ("eps", float("nan"), "eps must be None or a finite float >= 0"),
        ("prop_attn", "sometimes", "prop_attn must be True, False, 'auto' or 'folded'"),
        ("weights", "mass", "weights must be one of auto, size, importance"),
        ("selection", "best", "selection must be one of auto, lowest, bound"),
        ("seed", 1.5, "seed must be an int or None"),
    ],
)
def test_each_field_is_validated_with_a_message_naming_it(field, value, match):
    with pytest.raises(PullbackError, match=match):
        ReductionOptions(**{"strategy": "norm", "layers": (1,), field: value})


def test_checks_that_need_the_model_run_when_options_are_resolved():
    options = ReductionOptions(strategy="evit_score", layers=(3,), mode="prune")
    with pytest.raises(PullbackError, match=r"layers must lie in \[0, 2\] for this 4-block model \(with LLF"):
        options.resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True))
    with pytest.raises(PullbackError, match="needs a class token"):
        options.resolve(BackboneShape(depth=5, num_prefix=0, has_cls=False))
    bound = ReductionOptions(head=norm_scorer, layers=(1,), selection="bound")  # mode "auto": checked once chosen
    assert bound.resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True)).options.mode == "merge"
    with pytest.raises(PullbackError, match="selection='bound' needs mode='merge'"):
        bound.resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True, dense_neck=True))


def test_resolve_chooses_every_auto_and_leaves_the_options_unchanged():
    options = ReductionOptions(head=norm_scorer, layers=(1,))
    resolved = options.resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True, dense_neck=True)).options
    assert (resolved.mode, resolved.matching, resolved.weights, resolved.prop_attn, resolved.selection) == (
        "prune", "cosine", "size", False, "lowest")
    assert options.mode == "auto" and options.matching == "auto"


def test_options_round_trip_through_a_json_dict():
    options = ReductionOptions(head=norm_scorer, ratio=(0.1, 0.2), layers=(1, 3), mode="prune", llf=False, eps=0.5, seed=None)
    data = json.loads(json.dumps(options.to_dict()))
    assert set(data) == set(common_names()) - {"head", "spn"}
    assert data["ratio"] == [0.1, 0.2] and data["llf"] is False
    assert ReductionOptions.from_dict(data, head=norm_scorer) == options
    with pytest.raises(PullbackError, match="give head as keyword"):
        ReductionOptions.from_dict({**data, "head": None})
    with pytest.raises(PullbackError, match="unknown reduction option.*ratios"):
        ReductionOptions.from_dict({**data, "ratios": [0.1]}, head=norm_scorer)


def test_with_overrides_replaces_fields_and_rejects_what_is_not_an_option():
    base = ReductionOptions(strategy="norm", layers=(1,))
    assert with_overrides(base, ratio=0.5) == ReductionOptions(strategy="norm", layers=(1,), ratio=0.5)
    assert with_overrides(None, strategy="norm", layers=(1,)) == base
    with pytest.raises(PullbackError, match="options must be a ReductionOptions"):
        with_overrides(norm_scorer)
    with pytest.raises(PullbackError, match="unknown reduction option.*stages"):
        with_overrides(base, stages=(1,))


def test_the_patch_functions_build_equal_options_for_equal_keywords():
    keywords = dict(ratio=0.25, layers=(1, 2), mode="prune", strategy="norm", llf="full", seed=3)
    models = {"timm": tiny_vit(), "hf_dpt": tiny_dpt(), "hf_dinov2": tiny_dinov2()}
    configs = {name: patch.config(getattr(patch, name)(model, **keywords)) for name, model in models.items()}
    assert configs["timm"] == configs["hf_dpt"] == configs["hf_dinov2"]
    assert configs["timm"] == ReductionOptions(**keywords).resolve(BackboneShape(depth=4, num_prefix=1, has_cls=True)).options
    options = ReductionOptions(**keywords)
    for name, model in models.items():  # an options object, with keywords overriding its fields
        assert patch.config(getattr(patch, name)(model, options)) == configs[name]
        assert patch.config(getattr(patch, name)(model, options, ratio=0.5)) == dataclasses.replace(configs[name], ratio=0.5)


def test_the_patch_functions_show_every_option_in_their_signature():
    for fn in (patch.timm, patch.hf_dpt, patch.hf_dinov2):
        parameters = inspect.signature(fn).parameters
        assert list(parameters) == ["model", "options"] + NAMES
        assert parameters["ratio"].default == 0.3 and parameters["mode"].default == "auto"
        assert parameters["strategy"].kind is inspect.Parameter.KEYWORD_ONLY


def test_patch_functions_reject_unknown_keywords_and_positional_heads():
    model = tiny_vit()
    with pytest.raises(PullbackError, match="unknown reduction option.*ratios"):
        patch.timm(model, strategy="norm", ratios=0.3)
    with pytest.raises(PullbackError, match="options must be a ReductionOptions"):
        patch.timm(model, norm_scorer)
    assert patch.config(model) is None


SHAPE = BackboneShape(depth=6, num_prefix=1, has_cls=True)


@pytest.mark.parametrize("preset,mode,selection,llf,weights", [
    ("recommended", "merge", "bound", "masked", "size"), ("recommended", "prune", "lowest", "masked", "size"),
    ("paper", "merge", "lowest", "full", "importance"), ("paper", "prune", "lowest", "full", "importance"),
])
def test_preset_chooses_the_auto_values(preset, mode, selection, llf, weights):
    o = ReductionOptions(head=norm_scorer, mode=mode, preset=preset, layers=(2,)).resolve(SHAPE).options
    assert (o.selection, o.llf, o.weights) == (selection, llf, weights)


def test_explicit_values_win_over_the_preset():
    o = ReductionOptions(head=norm_scorer, mode="merge", preset="paper", selection="bound", layers=(2,)).resolve(SHAPE).options
    assert o.selection == "bound"
    o = ReductionOptions(head=norm_scorer, mode="prune", preset="paper", llf="masked", layers=(2,)).resolve(SHAPE).options
    assert o.llf == "masked"


def test_the_originals_take_no_preset():
    with pytest.raises(PullbackError, match="does not take preset"):
        ReductionOptions(strategy="tome", r=2, preset="paper")
