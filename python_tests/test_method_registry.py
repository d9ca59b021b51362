"""The method registry: a method is one module, seen everywhere methods are listed, with no other
file edited (the recipe of docs/architecture.md, "Adding a method", run as written there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pullback_ext.patch as patch
from helpers.blocks import embed, small_timm
from pullback_ext.cli import main
from pullback_ext.errors import PullbackError
from pullback_ext.prune import methods
from pullback_ext.prune.eta import eta, patch_tokens_per_block
from pullback_ext.prune.methods.base import Traits, refusal
from pullback_ext.prune.reduction_options import ReductionOptions, option_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def recipe(section: str) -> str:
    """The python block of docs/architecture.md under the heading ``section``."""
    text = DOC.read_text().split(f"## {section}\n", 1)[1]
    return text.split("```python\n", 1)[1].split("```\n", 1)[0]


@pytest.fixture
def scratch_method(tmp_path, monkeypatch):
    """The scratch module in a folder of its own, appended to the methods package's path."""
    folder = tmp_path / "more_methods"
    folder.mkdir()
    (folder / "scratch_tail.py").write_text(recipe("Adding a method"))
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(folder)])
    yield methods.get("scratch_tail")


def test_a_new_module_is_a_new_method_everywhere(scratch_method):
    assert "scratch_tail" in methods.names() and "drop" in option_names()
    options = ReductionOptions(strategy="scratch_tail", drop=5)
    assert options.drop == 5 and options.to_dict()["drop"] == 5
    assert ReductionOptions.from_dict(options.to_dict()) == options
    with pytest.raises(PullbackError, match="drop is an option of strategy 'scratch_tail'; got strategy 'tome'"):
        ReductionOptions(strategy="tome", r=2, drop=3)
    with pytest.raises(PullbackError, match="strategy 'scratch_tail' does not take ratio"):
        ReductionOptions(strategy="scratch_tail", ratio=0.5)
    with pytest.raises(PullbackError, match="drop must be an int >= 0"):
        ReductionOptions(strategy="scratch_tail", drop=-1)
    assert "scratch_tail" in methods.supported(Traits(has_cls=False, rotary=True, splittable=False, takes_extra_token=False))


def test_the_scratch_method_patches_a_timm_model_as_its_hand_written_loop(scratch_method):
    model = small_timm("vit_tiny_patch16_224", 32, depth=3)
    images = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    x = embed(model, images)
    x = model.blocks[0](x)
    frozen = x[:, -3:]
    kept = model.blocks[2](model.blocks[1](x[:, :-3]))
    expected = model.norm(torch.cat([kept, frozen], dim=1))
    patch.timm(model, strategy="scratch_tail", drop=3, at=1)
    assert patch.config(model).drop == 3
    torch.testing.assert_close(model.forward_features(images), expected, rtol=1e-12, atol=1e-12)
    patch.unpatch(model)
    assert patch_tokens_per_block(ReductionOptions(strategy="scratch_tail", drop=3, at=1), model) == [4, 1, 1]
    assert eta(ReductionOptions(strategy="scratch_tail", drop=3, at=1), model) == pytest.approx(3 / 4)


def test_the_scratch_method_is_a_row_of_evaluate_pareto(scratch_method, tmp_path):
    out = tmp_path / "pareto"
    code = main(["evaluate", "--model", "demo", "--pareto", "--methods", "scratch_tail", "--num-images", "2", "--seeds", "1",
                 "--no-timing", "--out", str(out), "--quiet"])
    assert code == 0
    points = json.loads((out / "pareto.json").read_text())["points"]
    assert [p["knob"] for p in points] == [{"drop": 8}, {"drop": 16}]
    assert points[1]["cost"]["flop_ratio"] > points[0]["cost"]["flop_ratio"] > 1.0


def test_duplicate_names_and_unknown_strategies_are_refused(tmp_path, monkeypatch):
    folder = tmp_path / "twice"
    folder.mkdir()
    (folder / "again.py").write_text("from pullback_ext.prune.methods.tome import ToMe\nMETHODS = (ToMe(),)\n")
    monkeypatch.setattr(methods, "__path__", [*methods.__path__, str(folder)])
    with pytest.raises(PullbackError, match="two token-reduction methods are named 'tome'"):
        methods.all_methods()
    monkeypatch.undo()
    with pytest.raises(PullbackError, match="strategy must be one of importance, .*tome"):
        ReductionOptions(strategy="tomee")


def test_needs_against_traits_give_each_refusal():
    no_cls = Traits(has_cls=False)
    assert "needs a class token" in refusal(methods.get("evit"), no_cls)
    assert "needs a class token" in refusal(methods.get("cls_sim"), no_cls)
    assert refusal(methods.get("tome"), no_cls) is None
    assert "no rotary position" in refusal(methods.get("expedite"), Traits(has_cls=True, rotary=True))
    assert "in two halves" in refusal(methods.get("tome"), Traits(has_cls=True, splittable=False))
    assert refusal(methods.get("tap"), Traits(has_cls=True, takes_extra_token=False)) is not None


def test_the_support_table_of_docs_families_is_the_generated_one():
    from pullback_ext.prune.methods import support_table

    text = (Path(__file__).resolve().parents[1] / "docs" / "families.md").read_text()
    start = text.index("<!-- support table: generated by pullback_ext.prune.methods.support_table(); do not edit -->\n")
    block = text[start:].split("\n", 1)[1].split("<!-- end of the generated support table -->", 1)[0]
    assert block == support_table(), "regenerate the table of docs/families.md (see the text above it)"


def test_the_support_table_names_a_new_method(scratch_method):
    from pullback_ext.prune.methods import support_table

    assert "| scratch_tail |" in support_table().splitlines()[0] + "|"


def test_each_regime_recommends_a_registered_method_that_takes_what_it_is_given():
    import re

    from pullback_ext.diagnostics import REDUCTION, REGIMES

    assert set(REDUCTION) == set(REGIMES)
    for regime, text in REDUCTION.items():
        named = [methods.get(name) for name in re.findall(r"strategy='(\w+)'", text)]
        assert named, regime
        if "head=None" in text:
            assert all(method.head_optional for method in named), regime
