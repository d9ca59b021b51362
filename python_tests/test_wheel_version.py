"""Wheels named for their torch: the local version setup.py derives (PULLBACK_LOCAL_VERSION), the
requirement on the building torch's release in the package metadata, and the import-time error when the
running torch is not the one the extension was built for."""

from __future__ import annotations

import importlib
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_version():
    """setup.py's ``local_version`` (the file run under another name than __main__: nothing is built)."""
    return runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")["local_version"]


@pytest.mark.parametrize("setting,torch_version,cuda,hip,expected", [
    ("auto", "2.14.1+cu130", "13.0", None, "pt2.14cu130"),
    ("auto", "2.13.0+cpu", None, None, "pt2.13cpu"),
    ("auto", "2.14.1", "12.8", None, "pt2.14cu128"),  # PyPI's CUDA wheels carry no local tag of their own
    ("auto", "2.12.0+rocm6.3", None, "6.3.42131", "pt2.12rocm6.3"),
    ("", "2.14.1+cu130", "13.0", None, ""),  # unset: no local version, as before
    ("pt2.14cu130", "2.13.0+cpu", None, None, "pt2.14cu130"),  # given: used as given
    ("+build.7", "2.13.0+cpu", None, None, "build.7"),
])
def test_the_local_version_names_the_building_torch(local_version, setting, torch_version, cuda, hip, expected):
    assert local_version(setting, torch_version, cuda, hip) == expected


@pytest.mark.parametrize("setting", ["pt 2.14", "cu130!", "a..b"])
def test_a_label_pep_440_rejects_is_refused(local_version, setting):
    with pytest.raises(SystemExit, match=f"PULLBACK_LOCAL_VERSION: expected 'auto' or a local version label.*{setting!r}"):
        local_version(setting, "2.14.1+cu130", "13.0")


def fake_build_info(torch_version: str, cuda: str | None, with_cuda: bool) -> types.ModuleType:
    fake = types.ModuleType("pullback_ext._build_info")
    fake.TORCH_VERSION, fake.CUDA_VERSION, fake.WITH_CUDA, fake.CUDA_ARCHS = torch_version, cuda, with_cuda, "9.0"
    return fake


def load_with(monkeypatch, info: types.ModuleType, import_error: bool = False) -> str:
    """The BuildMismatchError message of loading the extension with build info ``info``."""
    from pullback_ext import _loader

    monkeypatch.setitem(sys.modules, "pullback_ext._build_info", info)
    if import_error:
        real = importlib.import_module

        def fail(name, *args):
            if name == "pullback_ext._C":
                raise ImportError("undefined symbol: _ZN3c10")
            return real(name, *args)

        monkeypatch.setattr(_loader.importlib, "import_module", fail)
    _loader.load_compiled.cache_clear()
    try:
        with pytest.raises(_loader.BuildMismatchError) as caught:
            _loader.load_compiled()
        return str(caught.value)
    finally:
        monkeypatch.undo()
        _loader.load_compiled.cache_clear()


@pytest.mark.parametrize("built,cuda,with_cuda,import_error", [
    ("2.13.0+cpu", None, False, False),  # another torch release
    (torch.__version__, "11.8", True, False),  # the same release built for another CUDA
    (torch.__version__, torch.version.cuda, bool(torch.version.cuda), True),  # versions agree, the library does not load
])
def test_a_torch_mismatch_names_both_versions(monkeypatch, built, cuda, with_cuda, import_error):
    message = load_with(monkeypatch, fake_build_info(built, cuda, with_cuda), import_error)
    assert f"torch {built}" in message and f"torch {torch.__version__}" in message
    assert "wheel whose local version names the running torch" in message
    if import_error:
        assert "undefined symbol" in message
    assert importlib.import_module("pullback_ext._loader").load_compiled() is not None  # restored


@pytest.mark.parametrize("torch_version,expected", [
    ("2.13.0+cpu", "torch==2.13.*"),
    ("2.14.1+cu130", "torch==2.14.*"),
    ("2.14.1", "torch==2.14.*"),
    ("2.15.0.dev20260101+cu130", "torch==2.15.*"),
])
def test_the_torch_requirement_is_the_building_release(torch_version, expected):
    requirement = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_under_test")["torch_requirement"](torch_version)
    assert requirement == expected
    release = torch_version.split("+")[0]
    major, minor = (int(part) for part in release.split(".")[:2])
    accepts = SpecifierSet(requirement.removeprefix("torch"))
    assert accepts.contains(torch_version, prereleases=True)
    assert not accepts.contains(f"{major}.{minor + 1}.0") and not accepts.contains(f"{major}.{minor - 1}.9")


def test_the_package_metadata_pins_the_torch_it_is_built_with(tmp_path):
    """setup.py's metadata (what a wheel's METADATA says): Requires-Dist names this torch's release,
    so installing a wheel alone never pulls in a torch the extension cannot load with."""
    env = dict(os.environ, PULLBACK_SKIP_EXTENSION="1", PULLBACK_LOCAL_VERSION="auto")
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT, env=env,
                   check=True, capture_output=True)
    (info,) = tmp_path.glob("*.egg-info")
    requires = [line for line in (info / "PKG-INFO").read_text().splitlines() if line.startswith("Requires-Dist: torch")]
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert requires == [f"Requires-Dist: torch=={major}.{minor}.*"]
    assert SpecifierSet(requires[0].split("torch", 1)[1]).contains(torch.__version__, prereleases=True)
