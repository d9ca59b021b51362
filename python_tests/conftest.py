"""Shared fixtures and the ``slow`` marking of the test suite.

Fixtures (factories where a test may need several variants; every model has random weights
unless it is the shipped demo model):

- ``seeded``: torch, numpy and ``random`` seeded with 0 for the test, their states put back
  afterwards so that no test depends on another's draws (``seeded_rngs(seed)`` is the same as a
  context manager).
- ``tiny_vit(...)``: a timm ``VisionTransformer`` on 32-px images, patch 8 (16 patch tokens).
- ``timm_weights``: ``(model name, safetensors path)`` of a random ``vit_tiny_patch16_224`` at
  32 px, for command-line tests that take ``--model timm:NAME --weights FILE``.
- ``demo_model``: the shipped embedded demo model (trained weights), frozen; shared by the whole
  session, so tests must not modify it (patch a ``random_demo_model()`` instead).
- ``random_demo_model(seed=0)``: a fresh demo-architecture model with random weights, frozen.
- ``heldout_scenes(n, seed=0)``: held-out rendered scenes of the demo (cached per arguments).
- ``image_folder(count=3, size=(40, 48), seed=0)``: a folder of random RGB PNGs (cached).
- ``out_dir``: a not-yet-existing output folder inside the test's ``tmp_path``.

Slow tests: ``pytest -m "not slow"`` is the quick loop (about 2 minutes on 2 cores); CI runs
everything. The tests listed in ``SLOW`` below (measured with ``--durations``) get the marker here,
so no test file needs editing; an entry names a module (``test_x.py``), a test function (all its
parameters: ``test_x.py::test_f``) or one parametrization (``test_x.py::test_f[p]``).
"""

from __future__ import annotations

import contextlib
import functools
import random
import warnings

import numpy as np
import pytest
import torch

# Tests of 5 s or more in one measured run of the whole suite (2 cores, 2 threads).
SLOW: tuple[str, ...] = ()


def _slow_keys(item: pytest.Item) -> tuple[str, ...]:
    module = item.path.name
    function = getattr(item, "originalname", item.name)
    return module, f"{module}::{function}", f"{module}::{item.name}"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow, used = set(SLOW), set()
    for item in items:
        hits = slow.intersection(_slow_keys(item))
        if hits:
            item.add_marker(pytest.mark.slow)
            used |= hits
    if any("::" in str(arg) for arg in config.args):
        return  # single tests were asked for: the other entries were not collected
    collected = {item.path.name for item in items}
    stale = sorted(e for e in slow - used if e.split("::")[0] in collected)
    if stale:
        warnings.warn(pytest.PytestWarning("conftest.SLOW names tests that no longer exist: " + ", ".join(stale)))


@contextlib.contextmanager
def seeded_rngs(seed: int = 0):
    """torch, numpy and ``random`` seeded with ``seed`` inside the block; their states put back after."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    try:
        yield seed
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])


@pytest.fixture
def seeded():
    with seeded_rngs(0) as seed:
        yield seed


@pytest.fixture
def tiny_vit():
    """Factory: ``tiny_vit(seed=0, dtype=torch.float64, depth=3, embed_dim=32, img_size=32, **kwargs)``
    -> a timm VisionTransformer in eval mode (patch 8, 2 heads; ``kwargs`` go to the constructor,
    e.g. ``num_classes=0``, ``reg_tokens=4``)."""
    from timm.models.vision_transformer import VisionTransformer

    def make(seed: int = 0, dtype: torch.dtype = torch.float64, depth: int = 3, embed_dim: int = 32, img_size: int = 32, **kwargs):
        torch.manual_seed(seed)
        kwargs = {"patch_size": 8, "num_heads": 2, **kwargs}
        return VisionTransformer(img_size=img_size, embed_dim=embed_dim, depth=depth, **kwargs).to(dtype).eval()

    return make


@pytest.fixture(scope="session")
def timm_weights(tmp_path_factory):
    import timm
    from safetensors.torch import save_file

    name = "vit_tiny_patch16_224"
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32)
    path = tmp_path_factory.mktemp("weights") / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return name, path


@pytest.fixture(scope="session")
def demo_model():
    from pullback_ext.embedded import load

    return load()


@pytest.fixture
def random_demo_model():
    """Factory: ``random_demo_model(seed=0)`` -> DemoModel with random weights, eval, frozen."""
    from pullback_ext.embedded.model import DemoModel

    def make(seed: int = 0):
        torch.manual_seed(seed)
        return DemoModel().eval().requires_grad_(False)

    return make


@pytest.fixture(scope="session")
def heldout_scenes():
    """Factory: ``heldout_scenes(n, seed=0)`` -> ``pullback_ext.embedded.heldout(n, seed)`` (cached;
    treat the tensors as read-only)."""
    from pullback_ext.embedded import heldout

    return functools.lru_cache(maxsize=None)(heldout)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory):
    """Factory: ``image_folder(count=3, size=(40, 48), seed=0)`` -> folder of ``img{i}.png``
    (uint8 RGB noise, height × width ``size``); one folder per distinct arguments."""
    from PIL import Image

    @functools.lru_cache(maxsize=None)
    def make(count: int = 3, size: tuple[int, int] = (40, 48), seed: int = 0):
        folder = tmp_path_factory.mktemp("images")
        rng = np.random.default_rng(seed)
        for i in range(count):
            Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(folder / f"img{i}.png")
        return folder

    return make


@pytest.fixture
def out_dir(tmp_path):
    return tmp_path / "out"
