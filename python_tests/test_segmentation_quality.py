"""The segmentation measures of a reduced model against the unreduced one (per-pixel KL ×100 of the
class distributions, argmax-map mIoU), each against a float64 loop written here (scipy's entropy
for the KL), and the demo backbone's segmentation task (full and reduced forwards, the reduced one
against a hand-written reduction of the hooked layers)."""

from __future__ import annotations

import math

import pytest
import torch

from pullback_ext.comparison import quality
from pullback_ext.comparison.backbones import demo_backbone
from pullback_ext.embedded.model import SegmentationHead
from pullback_ext.errors import PullbackError


def logits(seed: int, shape=(3, 4, 5, 6), scale: float = 2.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def kl_loop(reduced: torch.Tensor, full: torch.Tensor) -> list[float]:
    """100 · mean over pixels of KL(softmax(full) ‖ softmax(reduced)), one pixel and class at a time."""
    from scipy.stats import entropy

    b, c, h, w = full.shape
    out = []
    for i in range(b):
        total = 0.0
        for y in range(h):
            for x in range(w):
                zp = [math.exp(float(full[i, k, y, x])) for k in range(c)]
                zq = [math.exp(float(reduced[i, k, y, x])) for k in range(c)]
                p = [v / sum(zp) for v in zp]
                q = [v / sum(zq) for v in zq]
                by_hand = sum(pk * math.log(pk / qk) for pk, qk in zip(p, q))
                assert by_hand == pytest.approx(float(entropy(p, q)), rel=1e-9, abs=1e-15)
                total += by_hand
        out.append(100.0 * total / (h * w))
    return out


def miou_loop(pred: torch.Tensor, target: torch.Tensor) -> list[float]:
    """Per-image mIoU over the classes present in either map, from sets of pixel positions."""
    out = []
    for a, b in zip(pred.tolist(), target.tolist()):
        cells_a = {(y, x, v) for y, row in enumerate(a) for x, v in enumerate(row)}
        cells_b = {(y, x, v) for y, row in enumerate(b) for x, v in enumerate(row)}
        classes = {v for *_, v in cells_a | cells_b}
        ious = []
        for c in sorted(classes):
            sa = {(y, x) for y, x, v in cells_a if v == c}
            sb = {(y, x) for y, x, v in cells_b if v == c}
            ious.append(len(sa & sb) / len(sa | sb))
        out.append(sum(ious) / len(ious))
    return out


def test_pixel_kl_matches_the_loop_and_is_zero_for_equal_logits():
    full, reduced = logits(0), logits(1)
    got = quality.pixel_kl_x100(reduced, full)
    assert got.dtype == torch.float64 and got.shape == (3,)
    torch.testing.assert_close(got, torch.tensor(kl_loop(reduced, full), dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert torch.equal(quality.pixel_kl_x100(full, full), torch.zeros(3, dtype=torch.float64))
    # a shift of every logit of a pixel does not change its distribution
    torch.testing.assert_close(quality.pixel_kl_x100(reduced + 3.0, full), got, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(quality.pixel_kl_x100(full, reduced), got)  # KL is not symmetric: full is the reference


def test_pixel_kl_of_float32_logits_is_computed_in_float64():
    full, reduced = logits(2).float(), logits(3).float()
    expected = torch.tensor(kl_loop(reduced.double(), full.double()), dtype=torch.float64)
    torch.testing.assert_close(quality.pixel_kl_x100(reduced, full), expected, rtol=1e-10, atol=1e-12)


def test_confusion_matrices_count_pixels():
    pred = torch.randint(0, 4, (2, 5, 7), generator=torch.Generator().manual_seed(4))
    target = torch.randint(0, 4, (2, 5, 7), generator=torch.Generator().manual_seed(5))
    got = quality.confusion_matrices(pred, target, 4)
    expected = torch.zeros(2, 4, 4, dtype=torch.int64)
    for i in range(2):
        for y in range(5):
            for x in range(7):
                expected[i, int(target[i, y, x]), int(pred[i, y, x])] += 1
    assert torch.equal(got, expected)


def test_argmax_miou_matches_the_loop():
    full, reduced = logits(6, (4, 5, 6, 7)), logits(7, (4, 5, 6, 7))
    # make image 1 agree with the full model exactly and image 2 mostly
    reduced[1] = full[1] * 0.5
    reduced[2, :, :3] = full[2, :, :3]
    expected = miou_loop(reduced.argmax(1), full.argmax(1))
    got = quality.argmax_miou(reduced, full)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert float(got[1]) == 1.0 and float(got[2]) > float(got[0])
    torch.testing.assert_close(quality.miou_gap_x100(reduced, full), 100.0 * (1.0 - got), rtol=0, atol=1e-12)


def test_miou_skips_classes_absent_from_both_maps():
    pred = torch.tensor([[[0, 0, 2, 2]]])
    target = torch.tensor([[[0, 2, 2, 2]]])
    # class 0: 1/2, class 2: 2/3, class 1 absent from both (not counted), class 3 absent too
    confusion = quality.confusion_matrices(pred, target, 4)
    iou = quality.class_iou(confusion)[0]
    assert iou[0] == 0.5 and iou[2] == pytest.approx(2 / 3) and math.isnan(iou[1]) and math.isnan(iou[3])
    assert float(quality.mean_iou(confusion)[0]) == pytest.approx((0.5 + 2 / 3) / 2)
    disjoint = quality.confusion_matrices(torch.zeros(1, 2, 2, dtype=torch.long), torch.ones(1, 2, 2, dtype=torch.long), 2)
    assert float(quality.mean_iou(disjoint)[0]) == 0.0


@pytest.mark.parametrize("call", [
    lambda: quality.pixel_kl_x100(torch.zeros(1, 3, 2, 2), torch.zeros(1, 3, 2, 3)),
    lambda: quality.pixel_kl_x100(torch.zeros(3, 2, 2), torch.zeros(3, 2, 2)),
    lambda: quality.argmax_miou(torch.zeros(1, 3, 2, 2), torch.zeros(2, 3, 2, 2)),
    lambda: quality.confusion_matrices(torch.full((1, 2, 2), 3), torch.zeros(1, 2, 2, dtype=torch.long), 3),
    lambda: quality.confusion_matrices(torch.zeros(1, 2, 2, dtype=torch.long), torch.full((1, 2, 2), -1), 3),
])
def test_bad_inputs_are_one_clear_error(call):
    with pytest.raises(PullbackError):
        call()


@pytest.fixture
def model_and_head(random_demo_model):
    model = random_demo_model().double()
    torch.manual_seed(1)
    return model, SegmentationHead().double().eval().requires_grad_(False)


def test_demo_backbone_segmentation_task_full_forward(model_and_head, random_demo_model):
    model, head = model_and_head
    images = torch.rand(2, 3, 112, 112, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    backbone = demo_backbone(model, head)
    assert backbone.tasks == ("cls", "depth", "segmentation")
    assert demo_backbone(model).tasks == ("cls", "depth")
    with pytest.raises(PullbackError, match="segmentation"):
        demo_backbone(model).forwards("segmentation")
    full, _ = backbone.forwards("segmentation")
    with torch.no_grad():
        alone, everything, plain = full(images), backbone.full(images), model(images)
        expected = model.segment(images, head)
    assert set(alone) == {"segmentation"} and alone["segmentation"].shape == (2, 11, 112, 112)
    assert torch.equal(alone["segmentation"], expected) and torch.equal(everything["segmentation"], expected)
    for key in ("logits", "embedding", "depth"):  # the other outputs are those of the model's own forward
        assert torch.equal(everything[key], plain[key])


def test_demo_backbone_reduced_segmentation_reads_restored_hooks(model_and_head):
    """Expedite at block 2 (7×7 clusters): the head reads every hooked layer at full length, each
    rebuilt from the clusters as the reference (one token and centre at a time) does."""
    from helpers.blocks import attention_half, mlp_half
    from helpers.originals_reference import cluster_reference, rebuild, reconstruction_reference
    from pullback_ext.prune.reduction_options import BackboneShape, ReductionOptions

    model, head = model_and_head
    images = torch.rand(1, 3, 112, 112, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    backbone = demo_backbone(model, head)
    shape = BackboneShape(depth=8, num_prefix=1, has_cls=True, dense_neck=True)
    reduction = ReductionOptions(strategy="expedite", cluster_grid=(7, 7), cluster_layer=2, cluster_tau=20.0).resolve(shape)
    _, reduced = backbone.forwards("segmentation")
    with torch.no_grad():
        got = reduced(reduction, images)["segmentation"]
        x, recorded, hooked = model.embed(images)[0], None, {}
        for i, block in enumerate(model.backbone.blocks):
            if i == 2:
                centres = cluster_reference(x[1:], (7, 7), 5, 5, 20.0)
                recorded = reconstruction_reference(x[1:], centres, 20, 20.0)
                x = torch.cat([x[:1], torch.stack(centres)])
            x = mlp_half(block, attention_half(block, x)[0])
            if i in model.hook_layers:
                hooked[i] = rebuild(x, 1, recorded)[None]
        expected = head([model.backbone.norm(hooked[i]) for i in model.hook_layers], 112)
        everything = backbone.reduced(reduction, images)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(everything["segmentation"], expected, rtol=1e-9, atol=1e-9)
    assert float(quality.pixel_kl_x100(got, model.segment(images, head))[0]) > 0
