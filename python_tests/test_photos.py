"""``builtin:photos`` (crops of the photographs bundled with scikit-image and scikit-learn), its
shipped manifest, the commands taking it, and the near-duplicate fraction it exists to lower."""

import json
import sys
from collections import Counter

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.errors import DataError, PullbackError
from pullback_ext.prune.redundancy import near_duplicate_fraction
from pullback_ext.sources.images import open_images
from pullback_ext.sources.photos import MANIFEST, PHOTOS, SCALES, PhotoSource, build_manifest, manifest_text, photo_path
from pullback_ext.sources.preprocess import Preprocess, unit_range_preprocess

NORMALISED = Preprocess(size=(24, 24), resize=28, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def test_the_shipped_manifest_is_the_regenerated_one():
    assert manifest_text(build_manifest()) == MANIFEST.read_text()


def test_the_manifest_describes_every_crop():
    manifest = json.loads(MANIFEST.read_text())
    sizes = {p["name"]: p["size"] for p in manifest["photos"]}
    assert [p["name"] for p in manifest["photos"]] == [p.name for p in PHOTOS]
    per_photo = sum(count for _, count in SCALES)
    assert Counter(c["photo"] for c in manifest["crops"]) == {p.name: per_photo for p in PHOTOS}
    by_name = {p.name: p for p in PHOTOS}
    for crop in manifest["crops"]:
        left, top, right, bottom = crop["box"]
        width, height = sizes[crop["photo"]]
        photo = by_name[crop["photo"]]
        assert (crop["package"], crop["file"], crop["licence"]) == (photo.package, photo.file, photo.licence)
        assert right - left == bottom - top == round(crop["scale"] * min(width, height))
        assert 0 <= left and right <= width and 0 <= top and bottom <= height
    assert len({(c["photo"], tuple(c["box"])) for c in manifest["crops"]}) == len(manifest["crops"])
    rounds = [manifest["crops"][i : i + len(PHOTOS)] for i in range(0, len(manifest["crops"]), len(PHOTOS))]
    assert all(sorted(c["photo"] for c in part) == sorted(p.name for p in PHOTOS) for part in rounds)
    assert len({c["scale"] for c in manifest["crops"][:2 * len(PHOTOS)]}) > 1


def test_crops_are_deterministic_and_prepared_like_a_file():
    from PIL import Image

    first = open_images("builtin:photos").heldout(NORMALISED, 5).load()
    again = PhotoSource().heldout(NORMALISED, 5)
    assert first["labels"] is None and first["images"].dtype == torch.float32 and first["images"].shape == (5, 3, 24, 24)
    assert torch.equal(first["images"], again.load()["images"])
    assert torch.equal(again.images([3, 1]), first["images"][[3, 1]])
    crop = again.crops[3]
    with Image.open(photo_path(next(p for p in PHOTOS if p.name == crop["photo"]))) as image:
        expected = NORMALISED(image.convert("RGB").crop(tuple(crop["box"])))
    torch.testing.assert_close(first["images"][3], expected)
    unit = PhotoSource().heldout(unit_range_preprocess(16), 20).images(range(20))
    assert unit.min() >= 0 and unit.max() <= 1 and unit.std(dim=(1, 2, 3)).min() > 0.01


def test_training_heldout_and_seed_sets_are_ranges_of_one_order():
    source, pre = PhotoSource(), unit_range_preprocess(16)
    names = source.heldout(pre, 12).names()
    assert source.training(pre, 5).names() == names[:5] and source.heldout(pre, 4, after=5).names() == names[5:9]
    assert source.training(pre, 5).describe() == source.training(pre, 9).describe() != source.heldout(pre, 4, after=5).describe()
    sets = source.seed_sets(pre, 4, 3)
    assert [s.names() for s in sets] == [names[0:4], names[4:8], names[8:12]]
    total = len(source.crops)
    assert [len(s) for s in source.seed_sets(pre, total, 2)] == [total // 2] * 2
    assert len(source.heldout(pre, 10, after=total - 3, partial=True)) == 3
    with pytest.raises(DataError, match=rf"expected at least {total + 1} images in builtin:photos \(1 training \+ {total} held-out\)"):
        source.heldout(pre, total, after=1)
    with pytest.raises(DataError, match=f"cannot fill {total} seeds of at least 2 images"):
        source.seed_sets(pre, 4, total)


@pytest.mark.parametrize("module", ["skimage", "sklearn"])
def test_a_missing_package_names_the_install_command(monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to the import system
    with pytest.raises(DataError, match=r"builtin:photos: needs scikit-(image|learn) .*: pip install 'pullback_ext\[photos\]'"):
        open_images("builtin:photos")


def test_a_photograph_that_changed_is_refused():
    source = PhotoSource()
    source.photos = {name: dict(entry, sha256="0" * 64) for name, entry in source.photos.items()}
    with pytest.raises(DataError, match="differs from the photograph the crops were drawn from"):
        source.heldout(unit_range_preprocess(16), 1).load()


def test_evaluate_takes_builtin_photos(tmp_path):
    assert main(["evaluate", "--model", "demo", "--images", "builtin:photos", "--num-images", "2", "--seeds", "1",
                 "--ratios", "0.5", "--strategies", "tome_score", "--no-timing", "--quiet", "--out", str(tmp_path)]) == 0
    assert "tome_score" in (tmp_path / "table.md").read_text()


def test_train_head_evaluates_on_separate_eval_images(tmp_path):
    argv = ["train", "head", "--model", "timm:vit_tiny_patch16_224", "--img-size", "32", "--layer", "10",
            "--images", "builtin:scenes", "--eval-images", "builtin:photos", "--num-images", "4", "--heldout", "3", "--rank", "4",
            "--steps", "2", "--batch-size", "2", "--hidden", "16", "--heads", "2", "--warmup", "1", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "head")]) == 0
    results = json.loads((tmp_path / "head" / "results.json").read_text())
    assert results["heldout"]["count"] == 3 and results["heldout_images"]["builtin"] == "photos"
    assert main([*argv, "--eval-images", "builtin:nothing", "--out", str(tmp_path / "bad")]) == 2


def _reference_fraction(tokens, threshold):
    """Per image: count the tokens whose nearest other token has cosine > threshold, pair by pair."""
    out = []
    for image in tokens.double():
        hits = 0
        for i in range(len(image)):
            best = max(float(torch.dot(image[i], image[j]) / (image[i].norm() * image[j].norm())) for j in range(len(image)) if j != i)
            hits += best > threshold
        out.append(hits / len(image))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("threshold", [0.999, 0.5, 0.0])
def test_near_duplicate_fraction_matches_a_pairwise_loop(threshold):
    torch.manual_seed(0)
    tokens = torch.randn(3, 9, 5)
    tokens[0, 4] = 2.5 * tokens[0, 1] + 1e-4  # a near-copy, at another scale: both have a near-duplicate
    tokens[1, :3] = tokens[1, 7]  # four identical tokens
    got = near_duplicate_fraction(tokens, threshold)
    torch.testing.assert_close(got, _reference_fraction(tokens, threshold))
    if threshold == 0.999:
        assert got.tolist() == pytest.approx([2 / 9, 4 / 9, 0.0])


def test_near_duplicate_fraction_rejects_bad_input():
    with pytest.raises(PullbackError, match=r"tokens: expected a tensor \[B, n, D\] with n >= 2, got \(4, 3\)"):
        near_duplicate_fraction(torch.zeros(4, 3))
    with pytest.raises(PullbackError, match=r"threshold: expected a cosine in \[-1, 1\), got 1.0"):
        near_duplicate_fraction(torch.zeros(1, 3, 2), 1.0)
