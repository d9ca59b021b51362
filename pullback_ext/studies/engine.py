"""The sweep engine: one measurement at every layer of a list, one JSON unit per finished layer.

A sweep's folder holds ``layers/layer-NN.json``, one *unit* per finished layer, each written
atomically (it appears whole or not at all) with the study's kind and settings. A sweep that was
killed resumes with ``resume=True``: finished units whose kind and settings match are read back,
never recomputed; a unit made with other settings is an error (it would mix two studies).

Under torchrun every layer's work items (images, or batches of images) are shared round-robin over
the ranks; each rank measures its share, rank 0 gathers the records in work-item order, finishes
the unit and writes it. Rank 0 alone decides which layers are finished, so every rank skips the
same ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from pullback_ext import distributed
from pullback_ext.errors import DataError, PullbackError
from pullback_ext.fileio import atomic_write_json

Measure = Callable[..., list]  # (layer, this rank's work items[, LayerProgress]) -> one record per item
Finish = Callable[[int, list], dict]  # (layer, every record in work-item order) -> the layer's unit
HEARTBEAT = 30.0  # seconds: off a terminal, a line at least this often while a layer reports progress


@dataclass
class UnitStore:
    """The per-layer units of one study in ``folder/layers/``; ``settings`` (JSON-able) identify it."""

    folder: Path
    kind: str
    settings: dict = field(default_factory=dict)

    def path(self, layer: int) -> Path:
        return Path(self.folder) / "layers" / f"layer-{layer:02d}.json"

    def existing(self) -> list[Path]:
        return sorted((Path(self.folder) / "layers").glob("layer-*.json"))

    def read(self, layer: int) -> Optional[dict]:
        """The unit of ``layer``, or None when it is not finished; PullbackError when it belongs
        to another study (kind or settings differ)."""
        path = self.path(layer)
        if not path.exists():
            return None
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"--resume: {path} is not valid JSON ({exc}); delete it to recompute that layer") from exc
        mine = json.loads(json.dumps(self.settings))  # as JSON would store them (tuples -> lists)
        if stored.get("kind") != self.kind or stored.get("settings") != mine:
            differ = sorted(k for k in set(mine) | set(stored.get("settings", {}))
                            if mine.get(k) != stored.get("settings", {}).get(k))
            raise PullbackError(f"--resume: {path} was made by another study (kind {stored.get('kind')!r}, settings "
                                f"differing in {differ or ['kind']}); use a fresh --out")
        return stored["unit"]

    def write(self, layer: int, unit: dict) -> None:
        atomic_write_json(self.path(layer), {"kind": self.kind, "settings": self.settings, "layer": layer, "unit": unit}, indent=1)


def finished_layers(store: UnitStore, layers: Sequence[int], resume: bool, overwrite: bool = False) -> dict[int, dict]:
    """``{layer: unit}`` of the layers already finished (``resume``); without ``resume`` a folder
    that already holds units is refused, so that a new sweep never mixes with an old one, unless
    ``overwrite`` (every layer is measured again and its unit replaced)."""
    if not resume:
        if store.existing() and not overwrite:
            raise PullbackError(f"--out: {store.folder} already holds finished layers of a study; pass --resume to "
                                "continue it, --overwrite to replace it, or choose an empty folder")
        return {}
    units = {layer: store.read(layer) for layer in layers}
    return {layer: unit for layer, unit in units.items() if unit is not None}


class LayerProgress:
    """What a ``measure`` given ``steps`` reports inside one layer: ``advance(n)`` moves the sweep's
    bar by ``n`` of the layer's ``steps``; ``status(**values)`` shows what runs now (the layer
    first), e.g. the decoder and image."""

    def __init__(self, bar, layer: int, steps: int, position: str):
        self.bar, self.layer, self.steps, self.position, self.done = bar, layer, steps, position, 0
        self.status()

    def advance(self, n: int = 1) -> None:
        n = min(n, self.steps - self.done)
        if n > 0:
            self.done += n
            self.bar.update(n)

    def status(self, **values) -> None:
        self.bar.set_postfix(layer=f"{self.layer} ({self.position})", **values)

    def finish(self) -> None:
        """The layer's steps not reported yet (every one of a ``measure`` that reports none)."""
        self.advance(self.steps - self.done)


def run_sweep(store: UnitStore, layers: Sequence[int], work: Sequence, measure: Measure, finish: Finish, *,
              resume: bool = False, overwrite: bool = False, progress: bool = True, desc: str = "study",
              steps: Optional[Callable[[list], int]] = None, unit: str = "layer") -> Optional[dict[int, dict]]:
    """Measure every layer of ``layers`` not finished yet and write its unit.

    ``work``: the items a layer's measurement is split into (image indices, batches), shared over
    torchrun ranks; ``measure(layer, items)`` returns one record per item; ``finish(layer,
    records)`` (rank 0) turns all records, in ``work`` order, into the layer's unit (JSON-able).
    Progress counts layers; with ``steps``, ``steps(items)`` of ``unit`` per layer instead,
    reported by ``measure(layer, items, progress)`` through its :class:`LayerProgress` (and a
    line at least every :data:`HEARTBEAT` seconds off a terminal while it reports). ``overwrite``:
    units of an earlier sweep are replaced (see :func:`finished_layers`).
    Returns ``{layer: unit}`` for every layer on rank 0, None on the other ranks.
    """
    from pullback_ext.progress import progress_bar

    info = distributed.init_from_env()
    try:
        done = finished_layers(store, layers, resume, overwrite) if info.is_main else {}
        skip = distributed.gather_objects(sorted(done), info)[0]
        todo = [layer for layer in layers if layer not in skip]
        mine = distributed.shard(list(work), info.rank, info.world_size)
        per_layer = 1 if steps is None else steps(mine)
        label = f"{desc}[rank {info.rank}/{info.world_size}]" if info.world_size > 1 else desc
        with progress_bar(total=len(layers) * per_layer, initial=(len(layers) - len(todo)) * per_layer, desc=label,
                          unit=unit if steps is not None else "layer", enabled=progress and info.is_main,
                          heartbeat=HEARTBEAT) as bar:
            for layer in todo:
                inside = LayerProgress(bar, layer, per_layer, f"{layers.index(layer) + 1}/{len(layers)}")
                records = measure(layer, mine) if steps is None else measure(layer, mine, inside)
                if len(records) != len(mine):
                    raise PullbackError(f"measure: expected one record per work item ({len(mine)}), got {len(records)}")
                parts = distributed.gather_objects(records, info)
                if info.is_main:
                    done[layer] = finish(layer, distributed.unshard(parts))
                    store.write(layer, done[layer])
                inside.finish()
    finally:
        distributed.shutdown(info)
    return {layer: done[layer] for layer in layers} if info.is_main else None
