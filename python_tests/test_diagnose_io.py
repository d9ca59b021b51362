"""Image folders, preprocessing, torchrun helpers and plots used by `pullback diagnose`."""

import numpy as np
import pytest
import torch

from pullback_ext.distributed import gather_objects, init_from_env, shard, shard_indices, unshard
from pullback_ext.errors import PullbackError
from pullback_ext.sources.image_files import check_readable, list_images, load_images
from pullback_ext.sources.preprocess import Preprocess, hf_preprocess, timm_preprocess
from pullback_ext.grids import grid_shape
from pullback_ext.plots import plot_spectrum, plot_token_energy


def write_png(path, h=30, w=50, seed=0):
    from PIL import Image

    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(path)


def test_list_and_load_images(tmp_path):
    for i, name in enumerate(["b.png", "a.jpg", "c.PNG"]):
        write_png(tmp_path / name, seed=i)
    (tmp_path / "notes.txt").write_text("skip me")
    files = list_images(tmp_path)
    assert [f.name for f in files] == ["a.jpg", "b.png", "c.PNG"]
    assert [f.name for f in list_images(tmp_path, 2)] == ["a.jpg", "b.png"]
    pre = Preprocess(size=(16, 24), resize=16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    x = load_images(files, pre)
    assert x.shape == (3, 3, 16, 24) and x.dtype == torch.float32
    raw = load_images(files[1:2], Preprocess(size=(30, 50), resize=30, mean=None, std=None))
    from PIL import Image

    expected = torch.from_numpy(np.array(Image.open(files[1]).convert("RGB"))).permute(2, 0, 1).float() / 255
    torch.testing.assert_close(raw[0], expected)
    torch.testing.assert_close(load_images(files[1:2], Preprocess((30, 50), 30, (0.5,) * 3, (0.25,) * 3))[0], (expected - 0.5) / 0.25)


def test_image_folder_errors(tmp_path):
    with pytest.raises(PullbackError, match="does not exist"):
        list_images(tmp_path / "missing")
    (tmp_path / "file.png").write_text("x")
    with pytest.raises(PullbackError, match="not a folder"):
        list_images(tmp_path / "file.png")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PullbackError, match="no image files"):
        list_images(empty)
    with pytest.raises(PullbackError, match="file.png"):
        check_readable([tmp_path / "file.png"])
    with pytest.raises(PullbackError, match="file.png"):
        load_images([tmp_path / "file.png"], Preprocess((8, 8), 8))


def test_model_preprocessing_sizes(tmp_path):
    import timm

    model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=56)
    pre = timm_preprocess(model)
    crop_pct = model.pretrained_cfg["crop_pct"]
    assert pre.size == (56, 56) and pre.resize == round(56 / crop_pct) and pre.mean == pytest.approx(model.pretrained_cfg["mean"])
    deit = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64)
    assert timm_preprocess(deit).resize == round(64 / deit.pretrained_cfg["crop_pct"]) > 64
    (tmp_path / "preprocessor_config.json").write_text('{"image_mean": [0.1, 0.2, 0.3], "image_std": [1, 1, 1]}')
    assert hf_preprocess((32, 48), tmp_path).mean == (0.1, 0.2, 0.3)
    assert hf_preprocess((32, 48)).mean == (0.5, 0.5, 0.5)


def test_shard_and_unshard_roundtrip():
    items = list(range(11))
    for world in (1, 2, 3, 5):
        parts = [shard(items, r, world) for r in range(world)]
        assert sorted(sum(parts, [])) == items and unshard(parts) == items
    assert shard_indices(5, 1, 2) == [1, 3]
    with pytest.raises(ValueError, match="rank"):
        shard(items, 2, 2)


def test_single_process_defaults(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = init_from_env()
    assert (info.rank, info.world_size, info.is_main) == (0, 1, True)
    assert gather_objects({"a": 1}, info) == [{"a": 1}]


def test_plots_are_written_atomically(tmp_path):
    sigmas = [torch.tensor([3.0, 2.0, 1.0]), torch.tensor([2.0, 1.5, 0.5])]
    path = plot_spectrum(sigmas, [20.0, 10.0], tmp_path / "s.png")
    assert path.stat().st_size > 0
    energies = [torch.rand(1 + 12), torch.rand(1 + 12), torch.full((13,), 0.25, dtype=torch.float64) + 1e-17 * torch.rand(13, dtype=torch.float64)]
    assert plot_token_energy(energies, 1, tmp_path / "e.png", grid_size=(3, 4)).stat().st_size > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.png", "s.png"]
    assert grid_shape(16) == (4, 4)
    with pytest.raises(ValueError, match="grid_size"):
        grid_shape(12)
    with pytest.raises(ValueError, match="sigmas"):
        plot_spectrum(sigmas, [1.0], tmp_path / "x.png")
    with pytest.raises(ValueError, match="energies"):
        plot_token_energy([], 1, tmp_path / "x.png")
