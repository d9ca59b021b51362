"""``builtin:photos``: square crops of every photograph that ships inside the scikit-image and
scikit-learn wheels (read from the installed packages' folders; nothing is downloaded, skimage's
fetchers are never called): colour and grayscale (read as RGB), natural, microscopy, medical and
telescope images alike; the synthetic images and the non-image files are not photographs.

The photographs are :data:`PHOTOS`. From each one, :func:`build_manifest` draws crops at every
scale of :data:`SCALES` (a square whose side is that fraction of the photograph's shorter side,
at a uniformly drawn position; distinct boxes) with the fixed seed :data:`CROP_SEED`, then puts
all crops in one fixed order: rounds of one crop of each photograph (the photographs shuffled in
every round, each photograph's crops in a shuffled order of their scales), so that crops
``Pk .. Pk + P - 1`` are the ``P`` photographs and any range of crops mixes photographs and scales.
The result is shipped as ``photos_manifest.json`` (every crop's package, file, licence, box and
scale, and each photograph's size and sha256), regenerated with ``python -m
pullback_ext.sources.photos``; the source reads the shipped file, so the crops are the same in
every run, and a photograph whose bytes differ from the manifest's is a DataError.

Like a folder's files: training crops are the first ones of that order, held-out crops the ones
after them, and seed sets consecutive disjoint ranges from the start. Crops of one photograph
overlap, so the training and held-out crops are disjoint as crops, not as photographs. A crop is
passed through the preprocessing like a decoded file (shorter side resized, centre crop). No
class labels, no depth.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from pullback_ext.errors import DataError
from pullback_ext.sources.image_sets import ImageSet, ImageSource
from pullback_ext.sources.preprocess import Preprocess

SPEC = "builtin:photos"
INSTALL = "pip install 'pullback_ext[photos]'"
MANIFEST = Path(__file__).with_name("photos_manifest.json")
CROP_SEED = 0
# (side as a fraction of the photograph's shorter side, crops per photograph)
SCALES = ((1.0, 1), (0.7, 4), (0.5, 8), (0.35, 12))


@dataclass(frozen=True)
class Photo:
    """One bundled photograph: ``file`` inside the folder of the import package ``module`` of the
    distribution ``package``; ``licence`` as the package states it, ``credit`` where and by whom."""

    name: str
    package: str
    module: str
    file: str
    licence: str
    credit: str


_SKIMAGE, _SKLEARN = ("scikit-image", "skimage"), ("scikit-learn", "sklearn")
# (name, (package, import package), file inside it, licence, credit): one photograph each
_TABLE = (
    ("astronaut", _SKIMAGE, "data/astronaut.png", "public domain",
     "NASA Great Images database; 'No known copyright restrictions, released into the public domain.' (scikit-image, skimage.data.astronaut() docstring)"),
    ("chelsea", _SKIMAGE, "data/chelsea.png", "CC0",
     "Stefan van der Walt; 'No copyright restrictions. CC0 by the photographer' (scikit-image, skimage.data.chelsea() docstring)"),
    ("coffee", _SKIMAGE, "data/coffee.png", "CC0",
     "Rachel Michetti, courtesy of Pikolo Espresso Bar; 'No copyright restrictions. CC0 by the photographer' (scikit-image, skimage.data.coffee() docstring)"),
    ("rocket", _SKIMAGE, "data/rocket.jpg", "public domain",
     "SpaceX (DSCOVR launch on Falcon 9), 'released in the public domain' (scikit-image, skimage.data.rocket() docstring)"),
    ("motorcycle_left", _SKIMAGE, "data/motorcycle_left.png", "not stated",
     "Middlebury 2014 stereo benchmark (Scharstein et al., GCPR 2014), left view downsampled 4x; scikit-image states no licence (scikit-image, skimage.data.stereo_motorcycle() docstring)"),
    ("motorcycle_right", _SKIMAGE, "data/motorcycle_right.png", "not stated",
     "Middlebury 2014 stereo benchmark (Scharstein et al., GCPR 2014), right view downsampled 4x; scikit-image states no licence (scikit-image, skimage.data.stereo_motorcycle() docstring)"),
    ("hubble_deep_field", _SKIMAGE, "data/hubble_deep_field.jpg", "public domain",
     "NASA, HubbleSite 2012/37; 'may be freely used in the public domain' (scikit-image, skimage.data.hubble_deep_field() docstring)"),
    ("ihc", _SKIMAGE, "data/ihc.png", "no known copyright restrictions",
     "Center for Microscopy And Molecular Imaging (CMMI), colonic glands, IHC staining; 'No known copyright restrictions.' (scikit-image, skimage.data.immunohistochemistry() docstring)"),
    ("retina", _SKIMAGE, "data/retina.jpg", "CC0",
     "Mikael Häggström, wikimedia 'Fundus photograph of normal left eye'; 'Creative Commons CC0 1.0 Universal Public Domain Dedication' (scikit-image, skimage.data.retina() docstring)"),
    ("camera", _SKIMAGE, "data/camera.png", "CC0",
     "Lav Varshney; 'No copyright restrictions. CC0 by the photographer' (scikit-image, skimage.data.camera() docstring)"),
    ("brick", _SKIMAGE, "data/brick.png", "CC0",
     "CC0Textures 'Bricks25', perspective-corrected, rotated and cropped by scikit-image (scikit-image, skimage.data.brick() docstring)"),
    ("grass", _SKIMAGE, "data/grass.png", "CC0",
     "DeviantArt user linolafett 'Grass-01', cropped and made grayscale by scikit-image (scikit-image, skimage.data.grass() docstring)"),
    ("gravel", _SKIMAGE, "data/gravel.png", "CC0",
     "CC0Textures 'Gravel04', rescaled, cropped and made grayscale by scikit-image (scikit-image, skimage.data.gravel() docstring)"),
    ("moon", _SKIMAGE, "data/moon.png", "not stated",
     "the surface of the moon, low contrast; scikit-image states no source or licence (scikit-image, skimage.data.moon() docstring)"),
    ("coins", _SKIMAGE, "data/coins.png", "no known copyright restrictions",
     "Greek coins from Pompeii, Brooklyn Museum Collection; 'No known copyright restrictions.' (scikit-image, skimage.data.coins() docstring)"),
    ("cell", _SKIMAGE, "data/cell.png", "CC0",
     "Paul Müller et al., Optics Express 26(8) 2018, a quantitative phase image of a cell; 'This image is CC0' (scikit-image, skimage.data.cell() docstring)"),
    ("clock_motion", _SKIMAGE, "data/clock_motion.png", "public domain",
     "Stefan van der Walt, a motion-blurred wall clock; 'Released into the public domain by the photographer' (scikit-image, skimage.data.clock() docstring)"),
    ("page", _SKIMAGE, "data/page.png", "not stated",
     "a scanned page of printed text; scikit-image states no source or licence (scikit-image, skimage.data.page() docstring)"),
    ("text", _SKIMAGE, "data/text.png", "public domain",
     "Wikipedia 'File:Corner.png'; 'No known copyright restrictions, released into the public domain.' (scikit-image, skimage.data.text() docstring)"),
    ("microaneurysms", _SKIMAGE, "data/microaneurysms.png", "CC0",
     "Andreas Maier, a detail of image 07_dr of the High-Resolution Fundus database (green channel); 'No copyright restrictions. CC0 given by owner' (scikit-image, skimage.data.microaneurysms() docstring)"),
    ("china", _SKLEARN, "datasets/images/china.jpg", "CC BY 2.0",
     "'Some rights reserved by danielbuechele', flickr.com/photos/danielbuechele/6061409035 (scikit-learn, sklearn/datasets/images/README.txt)"),
    ("flower", _SKLEARN, "datasets/images/flower.jpg", "CC BY 2.0",
     "'Some rights reserved by danielbuechele' (as written; the links name flickr user vultilion), flickr.com/photos/vultilion/6056698931 (scikit-learn, sklearn/datasets/images/README.txt)"),
)
PHOTOS = tuple(Photo(name, *package, file, licence, credit) for name, package, file, licence, credit in _TABLE)
PHOTO_NAMED = {photo.name: photo for photo in PHOTOS}


def photo_path(photo: Photo) -> Path:
    """Where ``photo`` is in the installed package (found without importing it); DataError with
    the install command when the package is missing, naming the file when it lacks it."""
    spec = importlib.util.find_spec(photo.module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"{SPEC}: needs {photo.package} (its bundled photographs), which is not installed: {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / photo.file
    if not path.is_file():
        raise DataError(f"{SPEC}: the installed {photo.package} has no {photo.file} ({str(path)!r})")
    return path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _boxes(width: int, height: int, generator: torch.Generator) -> list[tuple[float, list[int]]]:
    """``(scale, [left, top, right, bottom])`` for every crop of one photograph, :data:`SCALES` in order."""
    out = []
    for scale, count in SCALES:
        side = round(scale * min(width, height))
        boxes: list[list[int]] = []
        while len(boxes) < count:
            left, top = (int(torch.randint(0, extent - side + 1, (1,), generator=generator)) for extent in (width, height))
            box = [left, top, left + side, top + side]
            if box not in boxes:
                boxes.append(box)
        out += [(scale, box) for box in boxes]
    return out


def build_manifest() -> dict:
    """The crop set from the installed photographs: ``{"seed", "scales", "photos": [...], "crops":
    [{"photo", "package", "file", "licence", "scale", "box"}, ...]}`` (crops in their fixed order)."""
    from PIL import Image

    generator = torch.Generator().manual_seed(CROP_SEED)
    photos, per_photo = [], []
    for photo in PHOTOS:
        path = photo_path(photo)
        with Image.open(path) as image:
            width, height = image.size
        photos.append({**asdict(photo), "size": [width, height], "sha256": _sha256(path)})
        crops = [{"photo": photo.name, "package": photo.package, "file": photo.file, "licence": photo.licence,
                  "scale": scale, "box": box} for scale, box in _boxes(width, height, generator)]
        per_photo.append([crops[i] for i in torch.randperm(len(crops), generator=generator).tolist()])
    # rounds of one crop per photograph, the photographs in a fresh order every round
    rounds = [[per_photo[p][r] for p in torch.randperm(len(PHOTOS), generator=generator).tolist()] for r in range(len(per_photo[0]))]
    return {"seed": CROP_SEED, "scales": [list(s) for s in SCALES], "photos": photos, "crops": [c for part in rounds for c in part]}


def manifest_text(manifest: dict) -> str:
    """The manifest as shipped: JSON with one photograph and one crop per line."""
    def rows(key: str) -> str:
        return ",\n".join("    " + json.dumps(item) for item in manifest[key])

    head = ", ".join(f"{json.dumps(k)}: {json.dumps(manifest[k])}" for k in ("seed", "scales"))
    return "{\n  " + head + f',\n  "photos": [\n{rows("photos")}\n  ],\n  "crops": [\n{rows("crops")}\n  ]\n}}\n'


def write_manifest(path: Path = MANIFEST) -> Path:
    """Regenerate the manifest into ``path`` (default: the shipped one)."""
    Path(path).write_text(manifest_text(build_manifest()))
    return Path(path)


@functools.lru_cache(maxsize=1)
def read_manifest() -> dict:
    """The shipped manifest (see :func:`build_manifest`)."""
    return json.loads(MANIFEST.read_text())


class PhotoCrops(ImageSet):
    """Crops ``start .. start + len(crops) - 1`` of the manifest through ``preprocess``."""

    def __init__(self, crops: Sequence[dict], start: int, preprocess: Preprocess, photos: dict[str, dict]) -> None:
        self.crops, self.start, self.preprocess, self.photos = list(crops), start, preprocess, photos
        self._decoded: dict = {}

    def __len__(self) -> int:
        return len(self.crops)

    def _photo(self, name: str):
        """The decoded photograph ``name`` (RGB), checked against the manifest's sha256."""
        from PIL import Image

        if name not in self._decoded:
            entry = self.photos[name]
            path = photo_path(PHOTO_NAMED[name])
            if _sha256(path) != entry["sha256"]:
                raise DataError(f"{SPEC}: {str(path)!r} differs from the photograph the crops were drawn from "
                                f"(sha256 {entry['sha256'][:12]}...); install the {entry['package']} pinned in .ci/requirements.txt")
            with Image.open(path) as image:
                self._decoded[name] = image.convert("RGB")
        return self._decoded[name]

    def load(self, indices: Optional[Sequence[int]] = None) -> dict:
        chosen = [self.crops[i] for i in (range(len(self.crops)) if indices is None else indices)]
        images = [self.preprocess(self._photo(crop["photo"]).crop(tuple(crop["box"]))) for crop in chosen]
        return {"images": torch.stack(images).float(), "labels": None}

    def names(self) -> list[str]:
        return [f"{c['photo']}@{c['scale']}:{','.join(map(str, c['box']))}" for c in self.crops]

    def describe(self) -> dict:
        # crop i is crop start + i of the fixed order whatever the count, so a larger run reuses
        # the target shards of a smaller one
        return {"builtin": "photos", "manifest": hashlib.sha256(MANIFEST.read_bytes()).hexdigest()[:16], "start": self.start}


class PhotoSource(ImageSource):
    """The crops of the shipped manifest; DataError with the install command when scikit-image or
    scikit-learn is missing."""

    spec = SPEC

    def __init__(self) -> None:
        for photo in PHOTOS:
            photo_path(photo)
        manifest = read_manifest()
        self.crops, self.photos = manifest["crops"], {p["name"]: p for p in manifest["photos"]}

    def training(self, preprocess: Preprocess, count: int) -> PhotoCrops:
        return self._crops(preprocess, count, 0, False, f"{count} training")

    def heldout(self, preprocess: Preprocess, count: int, after: int = 0, partial: bool = False) -> PhotoCrops:
        return self._crops(preprocess, count, after, partial, f"{after} training + {count} held-out" if after else f"{count} held-out")

    def _crops(self, preprocess: Preprocess, count: int, after: int, partial: bool, wanted: str) -> PhotoCrops:
        chosen = self.crops[after : after + count]
        if not chosen or (not partial and len(chosen) < count):
            raise DataError(f"--images: expected at least {after + count} images in {SPEC} ({wanted}), it has {len(self.crops)} crops")
        return PhotoCrops(chosen, after, preprocess, self.photos)

    def seed_sets(self, preprocess: Preprocess, per_seed: int, seeds: int) -> list[PhotoCrops]:
        """Consecutive disjoint ranges of ``min(per_seed, crops // seeds)`` crops from the start."""
        per = min(per_seed, len(self.crops) // seeds)
        if per < 2:
            raise DataError(f"--images: the {len(self.crops)} crops of {SPEC} cannot fill {seeds} seeds of at least 2 images")
        return [PhotoCrops(self.crops[s * per : (s + 1) * per], s * per, preprocess, self.photos) for s in range(seeds)]


if __name__ == "__main__":
    print(f"wrote {write_manifest()}")
