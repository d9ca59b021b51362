"""The shared fixtures of conftest.py, and its slow marking as pytest applies it."""

import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def test_tiny_vit_and_timm_weights(tiny_vit, timm_weights):
    from safetensors.torch import load_file

    model = tiny_vit(depth=2, num_classes=0)
    assert len(model.blocks) == 2 and next(model.parameters()).dtype == torch.float64 and not model.training
    assert model.forward_features(torch.zeros(1, 3, 32, 32, dtype=torch.float64)).shape == (1, 17, 32)
    assert torch.equal(tiny_vit(depth=2, num_classes=0).pos_embed, model.pos_embed)  # same seed, same weights
    name, path = timm_weights
    assert name == "vit_tiny_patch16_224" and "cls_token" in load_file(str(path))


def test_demo_models_and_scenes(demo_model, random_demo_model, heldout_scenes):
    assert not demo_model.training and not any(p.requires_grad for p in demo_model.parameters())
    a, b = random_demo_model(), random_demo_model()
    assert a is not b and all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not any(torch.equal(p, q) for p, q in zip(a.parameters(), demo_model.parameters()) if p.numel() > 8)
    scenes = heldout_scenes(2)
    assert scenes is heldout_scenes(2) and scenes["images"].shape == (2, 3, 112, 112)


def test_image_folder_and_out_dir(image_folder, out_dir):
    from PIL import Image

    folder = image_folder(count=2, size=(24, 30))
    assert folder == image_folder(count=2, size=(24, 30)) and folder != image_folder()
    assert sorted(p.name for p in folder.iterdir()) == ["img0.png", "img1.png"]
    assert Image.open(folder / "img0.png").size == (30, 24)
    assert not out_dir.exists() and out_dir.parent.is_dir()


def test_seeded_seeds_every_generator(seeded):
    import random

    import numpy as np

    assert seeded == 0
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    assert np.random.rand() == np.random.RandomState(0).rand() and random.random() == random.Random(0).random()


def test_seeded_rngs_puts_the_states_back():
    from conftest import seeded_rngs

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with seeded_rngs(7):
        torch.rand(5)
    assert torch.equal(torch.rand(3), expected)


def test_slow_list_marks_modules_tests_and_parametrizations(tmp_path):
    conftest = (HERE / "conftest.py").read_text()
    assert "\nSLOW: tuple[str, ...] = " in conftest
    start = conftest.index("\nSLOW: tuple[str, ...] = ")
    end = conftest.index("\n", conftest.index(")", start))
    entries = '("test_a.py::test_slow", "test_a.py::test_param[2]", "test_b.py", "test_a.py::test_gone")'
    (tmp_path / "conftest.py").write_text(conftest[:start] + f"\nSLOW: tuple[str, ...] = {entries}" + conftest[end:])
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    pass\n\n"
        "@pytest.mark.parametrize('p', [1, 2])\ndef test_param(p):\n    pass\n")
    (tmp_path / "test_b.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-rA", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "2 passed, 4 deselected" in out, out
    assert "PASSED test_a.py::test_fast" in out and "PASSED test_a.py::test_param[1]" in out
    assert "conftest.SLOW names tests that no longer exist: test_a.py::test_gone" in out
