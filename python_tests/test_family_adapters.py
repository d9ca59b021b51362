"""pullback_ext.families: one adapter per family, the table found by walking the package, detect,
the traits the reduction methods read, and the transformers range stated once."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import torch

import pullback_ext.families as families
import pullback_ext.patch as patch
from helpers.blocks import small_timm
from helpers.diagnose import tiny_depth_anything
from helpers.prune import tiny_dinov2, tiny_dpt, tiny_eva, tiny_hf
from pullback_ext.errors import PullbackError
from pullback_ext.families import HFFamily, TimmFamily, detect, table

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("prune", "probes", "tap", "tap_training", "comparison", "sources", "metric", "commands", "demo", "bench", "cli")


def test_every_family_has_one_module_and_one_adapter():
    assert list(table()) == ["timm_eva", "timm_vit", "dpt", "depth_anything", "dinov2", "vit", "clip", "siglip", "dinov3"]
    for name, adapter in table().items():
        assert isinstance(adapter, (HFFamily, TimmFamily)) and adapter.name == name
        assert adapter.lora_targets and isinstance(adapter.splittable, bool) and isinstance(adapter.rotary, bool)
        assert isinstance(adapter.takes_extra_token, bool)


def test_the_families_package_imports_no_higher_layer():
    for path in (ROOT / "pullback_ext" / "families").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(tuple(f"pullback_ext.{p}" for p in FORBIDDEN)), (path.name, node.module)


@pytest.mark.parametrize("build, name, has_cls, rotary, extra", [
    (lambda: small_timm("vit_tiny_patch16_224", 32), "timm_vit", True, False, True),
    (lambda: tiny_eva(img_size=28), "timm_eva", True, True, False),
    (lambda: tiny_dinov2(), "dinov2", True, False, True),
    (lambda: tiny_dpt(), "dpt", True, False, True),
    (lambda: tiny_depth_anything(), "depth_anything", True, False, True),
    (lambda: tiny_hf("siglip"), "siglip", False, False, True),
    (lambda: tiny_hf("dinov3"), "dinov3", True, True, True),
    (lambda: tiny_hf("clip_projection"), "clip", True, False, True),
])
def test_detect_names_the_family_and_its_traits(build, name, has_cls, rotary, extra):
    model = build()
    family = detect(model)
    assert (family.name, family.has_cls(model), family.rotary, family.takes_extra_token) == (name, has_cls, rotary, extra)
    assert family.splittable
    assert len(family.layers(model)) > 0


def test_detect_refuses_anything_else_naming_the_families():
    with pytest.raises(PullbackError, match=r"model: Linear is none of the supported families: a timm VisionTransformer "
                                            r"or Eva; .*Depth Anything.*SiglipVisionModel"):
        detect(torch.nn.Linear(2, 2))
    with pytest.raises(PullbackError, match=r"model: SiglipVisionModel is none of the expected families: a Hugging Face CLIP"):
        detect(tiny_hf("siglip"), ("clip",))


SCRATCH = '''
from pullback_ext.families import clip
from pullback_ext.families.adapter import HFFamily

ADAPTER = HFFamily(name="scratch", title="a scratch family", loops=("Scratch",), attention=clip.ATTENTION,
                   branches=clip.BRANCHES, lora_targets=("fc",), priority=5, rotate=None)
'''


class Scratch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
        self.config = type("Config", (), {"num_register_tokens": 2})()


def test_a_new_family_is_one_new_module(tmp_path, monkeypatch):
    (tmp_path / "scratch.py").write_text(SCRATCH)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    family = detect(Scratch())
    assert family.name == "scratch" and list(table())[2] == "scratch"
    assert family.num_prefix(Scratch()) == 3 and family.layers(Scratch()) is not None
    assert "a scratch family" in families.supported()
    with pytest.raises(PullbackError, match="patch.auto: Linear is none of the supported families: .*a scratch family"):
        patch.auto(torch.nn.Linear(2, 2), strategy="norm")


def test_pyproject_states_the_transformers_range_of_the_families():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    low, high = families.CHECKED_TRANSFORMERS
    assert f"transformers>={low},<{high}" in extra
