"""Where models and images come from: the model grammar and the image sources (folders, built-in sets)."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from pullback_ext.errors import DataError, PullbackError
from pullback_ext.sources.images import BUILTIN_SETS, BuiltinSet, builtin_help, open_images
from pullback_ext.sources.models import ModelSpec, parse_model
from pullback_ext.sources.preprocess import Preprocess, unit_range_preprocess
from pullback_ext.sources.scenes import HeldoutScenes, SceneSource, TrainingScenes


def write_png(path, seed=0, size=(20, 24)):
    from PIL import Image

    Image.fromarray((np.random.RandomState(seed).rand(*size, 3) * 255).astype("uint8")).save(path)


def test_model_grammar():
    assert parse_model("demo") == ModelSpec("demo") and str(parse_model("demo")) == "demo"
    assert parse_model("timm:vit_tiny_patch16_224") == ModelSpec("timm", "vit_tiny_patch16_224")
    assert str(parse_model("hf:/models/dinov2:v2")) == "hf:/models/dinov2:v2"  # everything after the first colon
    with pytest.warns(FutureWarning, match="write --model timm:vit_small"):
        assert parse_model("vit_small") == ModelSpec("timm", "vit_small")
    for bad in ("resnet:50", "timm:", "hf:", ""):
        with pytest.raises(PullbackError, match=r"--model: expected demo \| timm:NAME \| hf:DIR"):
            parse_model(bad)


def test_image_source_names(tmp_path):
    assert isinstance(open_images("builtin:scenes"), SceneSource) and open_images("builtin:scenes").spec == "builtin:scenes"
    with pytest.raises(PullbackError, match="no built-in image set 'builtin:nothing'; expected a folder or one of builtin:scenes, builtin:photos"):
        open_images("builtin:nothing")
    with pytest.raises(DataError, match=f"--images: folder '{tmp_path / 'nope'}' does not exist"):
        open_images(str(tmp_path / "nope"))
    (tmp_path / "file.png").write_text("x")
    with pytest.raises(DataError, match="is not a folder"):
        open_images(str(tmp_path / "file.png"))
    colon = tmp_path / "a:b"  # a plain path is a folder, colon or not
    colon.mkdir()
    assert open_images(str(colon)).path == colon


def test_a_builtin_set_is_one_registration(tmp_path, monkeypatch):
    from pullback_ext.sources.folders import FolderSource

    write_png(tmp_path / "0.png")

    class Photos(FolderSource):
        def __init__(self):
            super().__init__(tmp_path)

    monkeypatch.setitem(BUILTIN_SETS, "pictures", BuiltinSet("test pictures", Photos))
    images = open_images("builtin:pictures").heldout(unit_range_preprocess(16), 1)
    assert images.names() == ["0.png"] and images.load()["images"].shape == (1, 3, 16, 16)
    assert "builtin:pictures (test pictures)" in builtin_help()


def test_reading_the_registry_loads_no_source():
    """``pullback --help`` lists the sets from the registry: that must not import torch or a set."""
    code = ("import sys; from pullback_ext.sources.images import builtin_help; builtin_help(); "
            "assert not {'torch', 'pullback_ext.sources.scenes', 'pullback_ext.sources.photos'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_folder_training_heldout_and_seed_sets(tmp_path):
    for i in range(5):
        write_png(tmp_path / f"{i}.png", seed=i)
    source = open_images(str(tmp_path))
    pre = Preprocess(size=(16, 16), resize=16)
    train, held = source.training(pre, 3), source.heldout(pre, 2, after=3)
    assert train.names() == ["0.png", "1.png", "2.png"] and held.names() == ["3.png", "4.png"]
    assert held.describe() == {"folder": str(tmp_path.resolve()), "files": ["3.png", "4.png"]}
    torch.testing.assert_close(held.images([1]), source.heldout(pre, 5).images([4]))
    assert len(source.heldout(pre, 50, partial=True)) == 5
    with pytest.raises(DataError, match=r"expected at least 6 images in .* \(3 training \+ 3 held-out\), found 5"):
        source.heldout(pre, 3, after=3)
    for label in ("a", "b"):
        (tmp_path / "classes" / label).mkdir(parents=True)
        for i in range(3):
            write_png(tmp_path / "classes" / label / f"{i}.png", seed=10 + i)
    sets = open_images(str(tmp_path / "classes")).seed_sets(pre, 3, 2)
    loaded = [s.load() for s in sets]
    assert [len(s) for s in sets] == [3, 3] and not set(sets[0].paths) & set(sets[1].paths)
    assert sorted(torch.cat([d["labels"] for d in loaded]).tolist()) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(DataError, match="cannot fill 3 seeds"):
        source.seed_sets(pre, 1, 3)


def test_scenes_are_the_embedded_renders():
    from pullback_ext.embedded import heldout
    from pullback_ext.embedded.scenes import render

    pre = unit_range_preprocess(112)
    expected = heldout(3, 0)
    held = HeldoutScenes(3, 0, pre)
    for key in ("images", "labels", "depth"):
        assert torch.equal(held.load()[key], expected[key])
    assert torch.equal(held.images([2]), expected["images"][2:3])  # image i of the set whichever way it is asked for
    training = TrainingScenes(40, pre)
    blocks = torch.cat([render(32, 1_000)["images"], render(32, 1_001)["images"]])
    assert torch.equal(training.images(range(30, 36)), blocks[30:36])
    assert training.describe() == TrainingScenes(2, pre).describe()
    seeds = SceneSource().seed_sets(pre, 2, 2)
    assert torch.equal(seeds[1].load()["labels"], heldout(2, 1)["labels"])


def test_scenes_follow_the_models_preprocessing():
    from pullback_ext.embedded import heldout

    pre = Preprocess(size=(32, 32), resize=36, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    images = HeldoutScenes(2, 0, pre).images([0, 1])
    unit = heldout(2, 0, 36)["images"][:, :, 2:34, 2:34]
    torch.testing.assert_close(images, (unit - 0.5) / 0.25)
