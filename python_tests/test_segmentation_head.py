"""The demo's segmentation head: the shared DPT trunk, the per-pixel classes of the renderer, the
shipped head (record, held-out quality) and its loader's errors on bad files."""

import hashlib
import json

import pytest
import torch

from pullback_ext.embedded import load_segmentation_head
from pullback_ext.embedded.model import DepthHead, DPTDecoder, SegmentationHead
from pullback_ext.embedded.scenes import GROUND_ID, OBJECT_ID0, SEGMENT_CLASS_NAMES, WALL_ID, render
from pullback_ext.embedded.weights_io import CARD_JSON, SEGMENTATION_FILE, WEIGHTS_FILE, save_weights
from pullback_ext.errors import CheckpointError


@pytest.fixture(scope="module")
def shipped_head():
    return load_segmentation_head()


def test_pixel_classes_follow_the_segment_map_and_the_labels():
    out = render(12, seed=4, size=48, classes=True)
    classes, segment = out["classes"], out["segment"]
    assert classes.shape == segment.shape and classes.dtype == torch.int64
    assert len(SEGMENT_CLASS_NAMES) == 11 and SEGMENT_CLASS_NAMES[:2] == ("ground", "wall")
    background = segment < OBJECT_ID0
    assert torch.equal(classes[background], segment[background])
    assert bool((classes[~background] >= 2).all()) and int(classes.max()) < 11
    for i in range(12):  # the largest object's pixels carry the image label, shifted past ground and wall
        largest = OBJECT_ID0 + int(out["object_pixels"][i].argmax())
        if (segment[i] == largest).any():
            assert bool((classes[i][segment[i] == largest] == out["labels"][i] + 2).all())
    assert "classes" not in render(2, seed=4, size=16)
    assert torch.equal(render(2, seed=4, size=16)["images"], render(2, seed=4, size=16, classes=True)["images"])
    assert GROUND_ID == 0 and WALL_ID == 1


def test_heads_share_the_dpt_trunk_and_the_depth_keys_are_those_of_the_shipped_file(random_demo_model):
    from safetensors import safe_open

    model = random_demo_model()
    assert isinstance(model.depth_head, DPTDecoder) and issubclass(SegmentationHead, DPTDecoder)
    with safe_open(str(WEIGHTS_FILE), framework="pt") as handle:
        shipped_keys = set(handle.keys())
    assert set(model.state_dict()) == shipped_keys
    depth_keys = {k.split(".", 1)[1] for k in shipped_keys if k.startswith("depth_head.")}
    assert {k for k in SegmentationHead().state_dict()} == depth_keys
    assert not any("segmentation" in k for k in shipped_keys)


def test_depth_head_is_the_trunk_then_its_head():
    torch.manual_seed(0)
    head = DepthHead(16, 4, 1, features=8, channels=(8, 8, 8, 8)).double().eval()
    hooked = [torch.randn(2, 17, 16, dtype=torch.float64) for _ in range(4)]
    fused = head.fuse(hooked)
    assert fused.shape == (2, 8, 16, 16)
    expected = torch.nn.functional.interpolate(head.head(fused) + 1.8, size=(32, 32), mode="bilinear", align_corners=False)
    torch.testing.assert_close(head(hooked, 32), expected.squeeze(1).exp(), rtol=0, atol=0)


def test_segmentation_logits_shape(random_demo_model):
    model = random_demo_model()
    torch.manual_seed(0)
    head = SegmentationHead().eval()
    with torch.no_grad():
        logits = model.segment(torch.rand(2, 3, 112, 112), head)
    assert logits.shape == (2, 11, 112, 112) and torch.isfinite(logits).all()


def test_shipped_head_file_and_record():
    assert SEGMENTATION_FILE.stat().st_size < 1024 * 1024
    record = json.loads(CARD_JSON.read_text())["segmentation"]
    assert record["weights"] == SEGMENTATION_FILE.name
    assert record["sha256"] == hashlib.sha256(SEGMENTATION_FILE.read_bytes()).hexdigest()
    assert record["command"].startswith("python -m pullback_ext.demo.train_segmentation ")
    assert record["classes"] == list(SEGMENT_CLASS_NAMES)
    held = record["heldout"]
    assert held["pixel_accuracy"] >= 0.8 and 0 < held["miou"] <= 1 and held["num_images"] >= 256
    assert set(held["class_iou"]) == set(SEGMENT_CLASS_NAMES)


def test_shipped_head_fits_the_shipped_model_and_keeps_its_heldout_quality(demo_model, shipped_head):
    from pullback_ext.demo.metrics import evaluate_segmentation
    from pullback_ext.embedded import heldout

    assert not shipped_head.training and not any(p.requires_grad for p in shipped_head.parameters())
    assert load_segmentation_head(model=demo_model) is not None
    reported = json.loads(CARD_JSON.read_text())["segmentation"]["heldout"]
    measured = evaluate_segmentation(demo_model, shipped_head, heldout(48, seed=7, classes=True))  # a seed the record did not use
    assert measured["pixel_accuracy"] >= 0.95 * reported["pixel_accuracy"]
    assert measured["miou"] >= 0.8 * reported["miou"]


def test_missing_file_names_it():
    with pytest.raises(CheckpointError, match=r"nowhere\.safetensors.*segmentation head \(11 classes\)"):
        load_segmentation_head("/nonexistent/nowhere.safetensors")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file_names_it(tmp_path, damage):
    path = tmp_path / f"{damage}.safetensors"
    data = SEGMENTATION_FILE.read_bytes()
    path.write_bytes({"garbage": b"\x00not a safetensors file" * 10, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=rf"{damage}\.safetensors.*not a readable.*segmentation head") as caught:
        load_segmentation_head(path)
    assert str(caught.value).count("\n") == 0


def test_wrong_shapes_and_other_modules_are_refused(tmp_path):
    path = tmp_path / "five.safetensors"
    save_weights(SegmentationHead(num_classes=5), path)
    with pytest.raises(CheckpointError, match=r"five\.safetensors: tensor head\.2\.\w+ has shape \(5\b.*expected \(11\b.* for the demo segmentation head"):
        load_segmentation_head(path)
    other = tmp_path / "other.safetensors"
    save_weights(torch.nn.Linear(3, 4), other)
    with pytest.raises(CheckpointError, match=r"other\.safetensors does not fit the demo segmentation head"):
        load_segmentation_head(other)


def test_head_for_other_backbone_weights_is_refused(random_demo_model):
    with pytest.raises(CheckpointError, match=r"demo_segmentation\.safetensors.*trained for demo weights [0-9a-f]{16}"):
        load_segmentation_head(model=random_demo_model())


def test_training_entry_point_writes_a_loadable_head_and_its_record(tmp_path):
    from pullback_ext.demo.train_segmentation import main
    from pullback_ext.embedded import load

    (tmp_path / "model_card.json").write_text(CARD_JSON.read_text())
    argv = ["--steps", "2", "--batch-size", "2", "--train-images", "4", "--eval-images", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    first = (tmp_path / "demo_segmentation.safetensors").read_bytes()
    card = json.loads((tmp_path / "model_card.json").read_text())
    assert card["heldout"] == json.loads(CARD_JSON.read_text())["heldout"]  # the backbone's record is kept
    record = card["segmentation"]
    assert record["command"] == ("python -m pullback_ext.demo.train_segmentation --steps 2 --batch-size 2 --train-images 4 "
                                 "--lr 0.002 --warmup 1 --weight-decay 0.0001 --class-power 0.5 --seed 0 --threads 1 --eval-images 2")
    assert record["sha256"] == hashlib.sha256(first).hexdigest() and record["heldout"]["num_images"] == 2
    assert "## Segmentation head" in (tmp_path / "MODEL_CARD.md").read_text()
    load_segmentation_head(tmp_path / "demo_segmentation.safetensors", model=load())
    assert main(argv) == 0
    assert (tmp_path / "demo_segmentation.safetensors").read_bytes() == first  # seeded: the same command, the same file
