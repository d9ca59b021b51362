"""Deterministic, vectorised ray-cast renderer of small 3D scenes for the demo model.

A scene is a ground plane (y = 0), a back wall (a vertical plane a few metres behind the
objects, slightly rotated about the vertical axis) and 1–6 primitives standing on the ground:
spheres, boxes (rotated about the vertical axis) and vertical cylinders. A pinhole camera at
height ``h`` looks along +z, pitched down by ``pitch``, with a square field of view ``fov``.
Shading is Lambertian under one directional light plus ambient light, with cast shadows of the
objects. Every pixel hits the ground or the wall, so the depth map is finite everywhere.

Depth is the planar (camera-z) metric depth: the camera ray of a pixel is ``(u, v, 1)`` in the
camera frame, not normalised, so the ray parameter at the hit *is* the depth.

The class label is ``type * 3 + colour family`` of the object that covers the most pixels
(types: sphere, box, cylinder; colour families: red, green, blue) — 9 classes. Scenes are
generated with one "main" object of a uniformly drawn class that is clearly larger than the
distractors, so labels are close to balanced.

Everything is computed with torch on the CPU from a ``torch.Generator`` seeded per call, so
``render(n, seed)`` is bit-for-bit reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from pullback_ext.errors import PullbackError

TYPES = ("sphere", "box", "cylinder")
COLOURS = ("red", "green", "blue")
CLASS_NAMES = tuple(f"{colour} {kind}" for kind in TYPES for colour in COLOURS)
NUM_CLASSES = len(CLASS_NAMES)
MAX_OBJECTS = 6

# Segment ids in the returned ``segment`` map; object k has id OBJECT_ID0 + k.
GROUND_ID, WALL_ID, OBJECT_ID0 = 0, 1, 2
# Per-pixel semantic classes (``render(..., classes=True)``): ground, wall, then the class of the
# object hit (class_id = 2 + type * 3 + colour family, the image labels shifted by two).
SEGMENT_CLASS_NAMES = ("ground", "wall", *CLASS_NAMES)

_HUE_CENTRES = (0.0, 1.0 / 3.0, 0.62)
_AMBIENT = 0.3
_EPS = 1e-4
_DTYPE = torch.float32
# Held-out scenes use seeds from this offset on; training uses seeds below it.
HELDOUT_SEED_OFFSET = 1_000_000_000


@dataclass
class SceneBatch:
    """Parameters of ``n`` scenes (K = MAX_OBJECTS object slots, unused slots have kind -1).

    cam_height[n] (m), pitch[n] (rad, positive looks down), fov[n] (rad, full angle, square),
    wall_dist[n] (m, along the optical axis of a level camera), wall_angle[n] (rad about y),
    light[n,3] (unit vector towards the light), ground_rgb[n,2,3], wall_rgb[n,2,3],
    ground_scale[n], kind[n,K] (0 sphere, 1 box, 2 cylinder, -1 none),
    centre[n,K,3] (world centre of the bounding box; y = half height, so objects rest on the
    ground), half[n,K,3] (half extents: sphere r,r,r; box hx,hy,hz; cylinder r,h/2,r),
    angle[n,K] (rad about y), colour_family[n,K], rgb[n,K,3], stripe_freq[n,K].
    """

    cam_height: torch.Tensor
    pitch: torch.Tensor
    fov: torch.Tensor
    wall_dist: torch.Tensor
    wall_angle: torch.Tensor
    light: torch.Tensor
    ground_rgb: torch.Tensor
    wall_rgb: torch.Tensor
    ground_scale: torch.Tensor
    kind: torch.Tensor
    centre: torch.Tensor
    half: torch.Tensor
    angle: torch.Tensor
    colour_family: torch.Tensor
    rgb: torch.Tensor
    stripe_freq: torch.Tensor

    def __len__(self) -> int:
        return self.cam_height.shape[0]

    def slice(self, start: int, stop: int) -> "SceneBatch":
        return SceneBatch(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})


def _uniform(gen: torch.Generator, shape, low: float, high: float) -> torch.Tensor:
    return low + (high - low) * torch.rand(shape, generator=gen, dtype=_DTYPE)


def _hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HSV in [0,1] (any shape) -> RGB with a trailing dimension of 3."""
    k = torch.stack([(5 + h * 6) % 6, (3 + h * 6) % 6, (1 + h * 6) % 6], dim=-1)
    ramp = torch.clamp(torch.minimum(k, 4 - k), 0, 1)
    return v[..., None] * (1 - s[..., None] * ramp)


def sample_scenes(n: int, seed: int) -> SceneBatch:
    """Draw ``n`` random scenes from ``seed`` (deterministic)."""
    if not isinstance(n, int) or n < 1:
        raise PullbackError(f"n: expected a positive int, got {n!r}")
    gen = torch.Generator().manual_seed(int(seed))
    K = MAX_OBJECTS
    fov = _uniform(gen, n, math.radians(45), math.radians(65))
    pitch = _uniform(gen, n, math.radians(8), math.radians(28))
    cam_height = _uniform(gen, n, 1.2, 2.2)
    wall_dist = _uniform(gen, n, 11.0, 18.0)
    wall_angle = _uniform(gen, n, -0.3, 0.3)
    azimuth = _uniform(gen, n, 0, 2 * math.pi)
    elevation = _uniform(gen, n, math.radians(30), math.radians(70))
    light = torch.stack(
        [torch.cos(elevation) * torch.sin(azimuth), torch.sin(elevation), -torch.cos(elevation) * torch.cos(azimuth).abs()],
        dim=-1,
    )
    # Backgrounds: low saturation so that they never look like an object colour family.
    ground_rgb = _hsv_to_rgb(_uniform(gen, (n, 2), 0, 1), _uniform(gen, (n, 2), 0.0, 0.2), _uniform(gen, (n, 2), 0.35, 0.8))
    wall_rgb = _hsv_to_rgb(_uniform(gen, (n, 2), 0, 1), _uniform(gen, (n, 2), 0.0, 0.2), _uniform(gen, (n, 2), 0.5, 0.95))
    ground_scale = _uniform(gen, n, 0.5, 1.5)

    count = torch.randint(1, K + 1, (n,), generator=gen)
    present = torch.arange(K)[None, :] < count[:, None]
    main_class = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    kind = torch.randint(0, len(TYPES), (n, K), generator=gen)
    family = torch.randint(0, len(COLOURS), (n, K), generator=gen)
    kind[:, 0] = main_class // len(COLOURS)
    family[:, 0] = main_class % len(COLOURS)
    kind = torch.where(present, kind, torch.full_like(kind, -1))

    size = _uniform(gen, (n, K), 0.25, 0.5)
    size[:, 0] = _uniform(gen, n, 0.65, 1.05)
    aspect = _uniform(gen, (n, K, 3), 0.75, 1.3)
    half = size[..., None] * aspect
    sphere = kind == 0
    cylinder = kind == 2
    half = torch.where(sphere[..., None], size[..., None].expand(n, K, 3), half)
    half[..., 2] = torch.where(cylinder, half[..., 0], half[..., 2])

    # Ground distance of each object, measured along the level viewing direction.
    dist = _uniform(gen, (n, K), 3.5, 9.5)
    dist[:, 0] = _uniform(gen, n, 3.5, 6.5)
    tan_half = torch.tan(fov / 2)[:, None]
    lateral = _uniform(gen, (n, K), -0.75, 0.75) * dist * tan_half
    lateral[:, 0] = lateral[:, 0] * 0.6
    centre = torch.stack([lateral, half[..., 1], dist], dim=-1)
    angle = _uniform(gen, (n, K), 0, math.pi / 2)

    hue = torch.tensor(_HUE_CENTRES, dtype=_DTYPE)[family] + _uniform(gen, (n, K), -0.04, 0.04)
    rgb = _hsv_to_rgb(hue % 1.0, _uniform(gen, (n, K), 0.65, 0.95), _uniform(gen, (n, K), 0.7, 1.0))
    stripe_freq = _uniform(gen, (n, K), 6.0, 18.0)
    return SceneBatch(
        cam_height=cam_height, pitch=pitch, fov=fov, wall_dist=wall_dist, wall_angle=wall_angle, light=light,
        ground_rgb=ground_rgb, wall_rgb=wall_rgb, ground_scale=ground_scale, kind=kind, centre=centre,
        half=half, angle=angle, colour_family=family, rgb=rgb, stripe_freq=stripe_freq,
    )


def camera_rays(scenes: SceneBatch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """World-space ray origins [n,3] and unnormalised directions [n,size*size,3].

    The direction of pixel (i, j) is ``R (u, v, 1)`` with ``R`` the pitch rotation, so the ray
    parameter of a hit equals its camera-z depth.
    """
    n = len(scenes)
    tan_half = torch.tan(scenes.fov / 2)[:, None, None]
    centres = (torch.arange(size, dtype=_DTYPE) + 0.5) / size * 2 - 1
    v = (-centres)[None, :, None].expand(n, size, size) * tan_half
    u = centres[None, None, :].expand(n, size, size) * tan_half
    cos_p, sin_p = torch.cos(scenes.pitch)[:, None, None], torch.sin(scenes.pitch)[:, None, None]
    direction = torch.stack([u, v * cos_p - sin_p, v * sin_p + cos_p], dim=-1).reshape(n, size * size, 3)
    origin = torch.zeros(n, 3, dtype=_DTYPE)
    origin[:, 1] = scenes.cam_height
    return origin, direction


def _rotate_y(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Rotate vectors x[..., 3] about the y axis by angle (broadcast over x[..., 0])."""
    c, s = torch.cos(angle), torch.sin(angle)
    return torch.stack([c * x[..., 0] + s * x[..., 2], x[..., 1], -s * x[..., 0] + c * x[..., 2]], dim=-1)


def intersect_objects(origin: torch.Tensor, direction: torch.Tensor, scenes: SceneBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Nearest positive hit of rays with every object slot.

    origin, direction: [n,P,3] (origin may also be [n,1,3]). Returns t[n,P,K] (inf where
    missed or absent), the world normal at the hit [n,P,K,3] and the hit point in the object's
    local frame [n,P,K,3].
    """
    angle = scenes.angle[:, None, :]
    o = _rotate_y(origin[:, :, None, :] - scenes.centre[:, None, :, :], -angle)
    d = _rotate_y(direction[:, :, None, :].expand(-1, -1, scenes.kind.shape[1], -1), -angle)
    half = scenes.half[:, None, :, :]
    inf = torch.full(o.shape[:-1], math.inf, dtype=o.dtype)

    # Sphere |o + t d|^2 = r^2.
    r = half[..., 0]
    a = (d * d).sum(-1)
    b = (o * d).sum(-1)
    disc = b * b - a * ((o * o).sum(-1) - r * r)
    t_sphere = torch.where(disc >= 0, (-b - disc.clamp_min(0).sqrt()) / a, inf)
    t_sphere = torch.where(t_sphere > _EPS, t_sphere, inf)

    # Box: slab test; the entry face gives the normal.
    d_safe = torch.where(d.abs() < 1e-12, torch.full_like(d, 1e-12), d)
    t1, t2 = (-half - o) / d_safe, (half - o) / d_safe
    t_near, t_far = torch.minimum(t1, t2), torch.maximum(t1, t2)
    t_enter, face = t_near.max(dim=-1)
    t_exit = t_far.min(dim=-1).values
    t_box = torch.where((t_exit >= t_enter) & (t_enter > _EPS), t_enter, inf)

    # Vertical cylinder: side wall within |y| <= h, and the two caps within radius r.
    a_xz = d[..., 0] ** 2 + d[..., 2] ** 2
    b_xz = o[..., 0] * d[..., 0] + o[..., 2] * d[..., 2]
    disc_xz = b_xz * b_xz - a_xz * (o[..., 0] ** 2 + o[..., 2] ** 2 - r * r)
    t_side = (-b_xz - disc_xz.clamp_min(0).sqrt()) / a_xz.clamp_min(1e-12)
    y_side = o[..., 1] + t_side * d[..., 1]
    t_side = torch.where((disc_xz >= 0) & (y_side.abs() <= half[..., 1]) & (t_side > _EPS), t_side, inf)
    cap_y = torch.where(o[..., 1] > 0, half[..., 1], -half[..., 1])
    t_cap = (cap_y - o[..., 1]) / d_safe[..., 1]
    x_cap, z_cap = o[..., 0] + t_cap * d[..., 0], o[..., 2] + t_cap * d[..., 2]
    t_cap = torch.where((x_cap**2 + z_cap**2 <= r * r) & (t_cap > _EPS), t_cap, inf)
    t_cyl = torch.minimum(t_side, t_cap)

    kind = scenes.kind[:, None, :].expand_as(t_sphere)
    t = torch.where(kind == 0, t_sphere, torch.where(kind == 1, t_box, torch.where(kind == 2, t_cyl, inf)))
    local = o + t.clamp(max=1e6)[..., None] * d

    normal_sphere = local / r[..., None]
    normal_box = torch.nn.functional.one_hot(face, 3).to(o.dtype) * -torch.sign(torch.gather(d, -1, face[..., None]))
    zero = torch.zeros_like(t)
    normal_side = torch.stack([local[..., 0], zero, local[..., 2]], dim=-1) / r[..., None]
    normal_cap = torch.stack([zero, torch.sign(cap_y).expand_as(t), zero], dim=-1)
    normal_cyl = torch.where((t_cap <= t_side)[..., None], normal_cap, normal_side)
    normal = torch.where((kind == 0)[..., None], normal_sphere, torch.where((kind == 1)[..., None], normal_box, normal_cyl))
    return t, _rotate_y(normal, angle), local


def render_scenes(scenes: SceneBatch, size: int = 112, chunk: int = 32, classes: bool = False) -> dict:
    """Render a :class:`SceneBatch`; see :func:`render` for the returned dictionary."""
    if not isinstance(size, int) or size < 8:
        raise PullbackError(f"size: expected an int >= 8, got {size!r}")
    parts = [_render_chunk(scenes.slice(s, s + chunk), size) for s in range(0, len(scenes), chunk)]
    out = {key: torch.cat([p[key] for p in parts]) for key in parts[0]}
    out["class_names"] = CLASS_NAMES
    if classes:
        out["classes"] = pixel_classes(scenes, out["segment"])
    return out


def pixel_classes(scenes: SceneBatch, segment: torch.Tensor) -> torch.Tensor:
    """Semantic class of every pixel, int64 [n,H,W] in [0, len(SEGMENT_CLASS_NAMES)): 0 ground,
    1 wall, ``2 + type * 3 + colour family`` of the object whose id ``segment`` holds."""
    n = segment.shape[0]
    object_class = 2 + scenes.kind * len(COLOURS) + scenes.colour_family  # [n,K]; absent slots are never hit
    index = (segment - OBJECT_ID0).clamp(min=0).reshape(n, -1)
    per_pixel = torch.gather(object_class, 1, index).reshape(segment.shape)
    return torch.where(segment >= OBJECT_ID0, per_pixel, segment)


def _render_chunk(scenes: SceneBatch, size: int) -> dict:
    n, K = len(scenes), MAX_OBJECTS
    origin, direction = camera_rays(scenes, size)
    o = origin[:, None, :]
    inf = torch.full(direction.shape[:2], math.inf, dtype=_DTYPE)

    t_ground = torch.where(direction[..., 1] < 0, -o[..., 1] / direction[..., 1].clamp(max=-1e-12), inf)
    wall_normal = torch.stack([torch.sin(scenes.wall_angle), torch.zeros(n, dtype=_DTYPE), torch.cos(scenes.wall_angle)], -1)
    wall_point = torch.zeros(n, 3, dtype=_DTYPE)
    wall_point[:, 2] = scenes.wall_dist
    denom = (direction * wall_normal[:, None, :]).sum(-1)
    t_wall = ((wall_point - origin) * wall_normal).sum(-1)[:, None] / denom
    t_wall = torch.where((denom > 0) & (t_wall > 0), t_wall, inf)
    t_obj, n_obj, local = intersect_objects(o, direction, scenes)

    t_all = torch.cat([t_ground[..., None], t_wall[..., None], t_obj], dim=-1)
    depth, segment = t_all.min(dim=-1)
    point = o + depth[..., None] * direction

    # Surface normals and albedo per segment.
    normal = torch.zeros_like(point)
    normal[..., 1] = 1.0
    normal = torch.where((segment == WALL_ID)[..., None], -wall_normal[:, None, :].expand_as(normal), normal)
    obj_index = (segment - OBJECT_ID0).clamp(min=0)
    is_obj = segment >= OBJECT_ID0
    gather3 = obj_index[..., None, None].expand(n, -1, 1, 3)
    normal = torch.where(is_obj[..., None], torch.gather(n_obj, 2, gather3).squeeze(2), normal)

    checker = (torch.floor(point[..., 0] / scenes.ground_scale[:, None]) + torch.floor(point[..., 2] / scenes.ground_scale[:, None])) % 2
    albedo = torch.where(checker[..., None] > 0, scenes.ground_rgb[:, None, 0], scenes.ground_rgb[:, None, 1])
    along_wall = point[..., 0] * torch.cos(scenes.wall_angle)[:, None] - point[..., 2] * torch.sin(scenes.wall_angle)[:, None]
    stripes = 0.5 + 0.5 * torch.sin(2.0 * along_wall + 0.7 * point[..., 1])
    wall_albedo = scenes.wall_rgb[:, None, 0] * stripes[..., None] + scenes.wall_rgb[:, None, 1] * (1 - stripes[..., None])
    albedo = torch.where((segment == WALL_ID)[..., None], wall_albedo, albedo)
    obj_rgb = torch.gather(scenes.rgb[:, None].expand(n, direction.shape[1], K, 3), 2, gather3).squeeze(2)
    obj_local_y = torch.gather(local[..., 1], 2, obj_index[..., None]).squeeze(2)
    freq = torch.gather(scenes.stripe_freq, 1, obj_index)
    band = 0.88 + 0.12 * torch.sign(torch.sin(freq * obj_local_y))
    albedo = torch.where(is_obj[..., None], obj_rgb * band[..., None], albedo)

    # Shadows: a ray from the hit point towards the light, tested against every object.
    shadow_origin = point + 1e-3 * normal
    t_shadow, _, _ = intersect_objects(shadow_origin, scenes.light[:, None, :].expand_as(point), scenes)
    lit = ~torch.isfinite(t_shadow).any(dim=-1)
    lambert = (normal * scenes.light[:, None, :]).sum(-1).clamp_min(0) * lit
    image = (albedo * (_AMBIENT + (1 - _AMBIENT) * lambert[..., None])).clamp(0, 1)

    counts = torch.stack([(segment == OBJECT_ID0 + k).sum(-1) for k in range(K)], dim=-1)
    largest = counts.argmax(dim=-1)
    kind = torch.gather(scenes.kind, 1, largest[:, None]).squeeze(1)
    family = torch.gather(scenes.colour_family, 1, largest[:, None]).squeeze(1)
    return {
        "images": image.reshape(n, size, size, 3).permute(0, 3, 1, 2).float().contiguous(),
        "depth": depth.reshape(n, size, size).float(),
        "labels": kind * len(COLOURS) + family,
        "segment": segment.reshape(n, size, size),
        "object_pixels": counts,
        "cam_height": scenes.cam_height.float(),
        "pitch": scenes.pitch.float(),
        "fov": scenes.fov.float(),
    }


def render(n: int, seed: int, size: int = 112, classes: bool = False) -> dict:
    """Render ``n`` random scenes from ``seed``.

    Returns a dict with images[n,3,size,size] (float32 in [0,1]), depth[n,size,size] (float32,
    metres, camera-z), labels[n] (int64 in [0, NUM_CLASSES)), segment[n,size,size] (0 ground,
    1 wall, 2+k object k), object_pixels[n,K], cam_height[n], pitch[n], fov[n] (radians) and
    class_names; with ``classes``, also classes[n,size,size] (int64, :func:`pixel_classes`).
    """
    return render_scenes(sample_scenes(n, seed), size, classes=classes)
