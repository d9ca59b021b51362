"""The demo scene renderer: determinism and physical sanity against closed forms."""

import math

import pytest
import torch
from scipy import stats

from pullback_ext.embedded import heldout
from pullback_ext.embedded.scenes import (
    GROUND_ID, MAX_OBJECTS, NUM_CLASSES, OBJECT_ID0, WALL_ID, SceneBatch, render, render_scenes, sample_scenes,
)


@pytest.fixture(scope="module")
def batch():
    return render(24, seed=11, size=64)


def test_render_is_deterministic_and_seeded():
    a, b, c = render(3, seed=5, size=32), render(3, seed=5, size=32), render(3, seed=6, size=32)
    for key in ("images", "depth", "labels", "segment"):
        assert torch.equal(a[key], b[key])
    assert not torch.equal(a["images"], c["images"])


def test_heldout_scenes_differ_from_training_seeds():
    assert not torch.equal(heldout(2, seed=0, size=32)["images"], render(2, seed=0, size=32)["images"])


def test_shapes_and_ranges(batch):
    n = 24
    assert batch["images"].shape == (n, 3, 64, 64) and batch["images"].dtype == torch.float32
    assert batch["depth"].shape == (n, 64, 64) and batch["segment"].shape == (n, 64, 64)
    assert 0 <= batch["images"].min() and batch["images"].max() <= 1
    assert torch.isfinite(batch["depth"]).all() and batch["depth"].min() > 0.5
    assert batch["labels"].min() >= 0 and batch["labels"].max() < NUM_CLASSES
    assert len(batch["class_names"]) == NUM_CLASSES >= 8


def test_ground_depth_follows_camera_geometry(batch):
    # Pixel row i looks at elevation angle atan(v) relative to the optical axis, v = (1 - 2(i+½)/S)·tan(fov/2);
    # a camera at height h pitched down by p meets the ground at camera-z depth h / (sin p - v cos p).
    size = 64
    v = (1 - 2 * (torch.arange(size) + 0.5) / size)[None, :, None] * torch.tan(batch["fov"] / 2)[:, None, None]
    p = batch["pitch"][:, None, None]
    expected = batch["cam_height"][:, None, None] / (torch.sin(p) - v * torch.cos(p))
    ground = batch["segment"] == GROUND_ID
    assert ground.float().mean() > 0.2
    torch.testing.assert_close(batch["depth"][ground], expected.expand_as(ground)[ground], rtol=1e-4, atol=1e-4)
    # Rows above the horizon (sin p - v cos p <= 0) never see the ground.
    assert not (ground & (torch.sin(p) - v * torch.cos(p) <= 0).expand_as(ground)).any()
    # On a ground-only column the depth grows towards the horizon (upwards in the image).
    rows = torch.where(ground[:, :, :1].all(dim=1).squeeze(1))[0]
    for b in rows:
        col = batch["depth"][b, :, 0]
        assert (col[:-1] > col[1:]).all()


def _two_object_scene(order: tuple[int, int], with_near: bool = True) -> SceneBatch:
    """Level camera at height 1, fov 60°: a far sphere (r = 1, centre z = 8) and a near box in front
    of it (half extents 0.3, 0.6, 0.3 at z = 4, so its front face is at z = 3.7)."""
    K = MAX_OBJECTS
    s = sample_scenes(1, seed=0)
    s.cam_height[:] = 1.0
    s.pitch[:] = 0.0
    s.fov[:] = math.radians(60)
    s.wall_dist[:] = 20.0
    s.wall_angle[:] = 0.0
    s.kind[:] = -1
    s.angle[:] = 0.0
    far, near = order
    s.kind[0, far], s.centre[0, far], s.half[0, far] = 0, torch.tensor([0.0, 1.0, 8.0]), torch.tensor([1.0, 1.0, 1.0])
    s.colour_family[0, far] = 2
    if with_near:
        s.kind[0, near], s.centre[0, near], s.half[0, near] = 1, torch.tensor([0.0, 0.6, 4.0]), torch.tensor([0.3, 0.6, 0.3])
        s.colour_family[0, near] = 0
    assert s.kind.shape == (1, K)
    return s


@pytest.mark.parametrize("order", [(0, 1), (1, 0), (4, 2)])
def test_occlusion_order(order):
    size = 64
    far, near = order
    both = render_scenes(_two_object_scene(order), size)
    alone = render_scenes(_two_object_scene(order, with_near=False), size)
    # The pixel next to the optical axis (ray (u, v, 1) with u, v = ±tan(30°)/64).
    c = size // 2
    assert int(alone["segment"][0, c, c]) == OBJECT_ID0 + far
    assert abs(float(alone["depth"][0, c, c]) - 7.0) < 0.01  # front of the sphere
    assert int(both["segment"][0, c, c]) == OBJECT_ID0 + near
    assert abs(float(both["depth"][0, c, c]) - 3.7) < 1e-3  # front face of the box hides the sphere
    # The sphere stays visible above the box (its top at y = 2 is above the box top at y = 1.2).
    row_above = c - 6  # v = (5.5/32)·tan 30° ≈ 0.099: above the box top at z = 3.7 (y ≈ 1.37), through the sphere
    assert int(both["segment"][0, row_above, c]) == OBJECT_ID0 + far
    # Occlusion only removes pixels of the far object, never adds any; depth never increases.
    assert both["object_pixels"][0, far] < alone["object_pixels"][0, far]
    assert (both["depth"] <= alone["depth"] + 1e-5).all()
    # The wall (at z = 20) is only visible where no object is.
    wall = both["segment"] == WALL_ID
    torch.testing.assert_close(both["depth"][wall], torch.full_like(both["depth"][wall], 20.0))


def test_shadow_falls_on_the_side_away_from_the_light():
    # Light from the upper right (+x): the box's shadow lies on the ground to its left (-x), where the
    # empty scene's ground is lit; nothing on the right of the image gets darker.
    s = _two_object_scene((0, 1))
    s.kind[0, 0] = -1
    s.cam_height[:] = 3.0
    s.pitch[:] = math.radians(35)
    s.light[:] = torch.tensor([1.0, 1.0, 0.0]) / math.sqrt(2)
    s.ground_rgb[:] = 0.6
    with_box = render_scenes(s, 64)
    s.kind[0, 1] = -1
    empty = render_scenes(s, 64)
    ground_both = (with_box["segment"] == GROUND_ID) & (empty["segment"] == GROUND_ID)
    darker = (with_box["images"][0].mean(0) < empty["images"][0].mean(0) - 0.1) & ground_both[0]
    assert darker.sum() > 5
    columns = torch.nonzero(darker)[:, 1]
    assert (columns < 32).all()  # pixel columns left of the optical axis see x < 0


def test_labels_are_balanced_and_name_the_largest_object():
    out = render(450, seed=3, size=48)
    counts = torch.bincount(out["labels"], minlength=NUM_CLASSES)
    assert stats.chisquare(counts.numpy()).pvalue > 1e-3, counts
    assert counts.min() >= 0.5 * 450 / NUM_CLASSES
    # The label's colour family is the dominant channel of the labelled object's pixels (red, green, blue).
    largest = out["object_pixels"].argmax(dim=1)
    mask = out["segment"] == (OBJECT_ID0 + largest)[:, None, None]
    mean_rgb = (out["images"] * mask[:, None]).sum((2, 3)) / mask.sum((1, 2))[:, None]
    assert (mean_rgb.argmax(dim=1) == out["labels"] % 3).float().mean() > 0.97


def test_bad_arguments():
    with pytest.raises(ValueError, match="n"):
        render(0, seed=1)
    with pytest.raises(ValueError, match="size"):
        render(1, seed=1, size=4)
    with pytest.raises(ValueError, match="seed"):
        heldout(1, seed=-1)
