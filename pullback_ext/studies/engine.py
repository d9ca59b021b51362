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

Measure = Callable[[int, list], list]  # (layer, this rank's work items) -> one record per item
Finish = Callable[[int, list], dict]  # (layer, every record in work-item order) -> the layer's unit


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


def finished_layers(store: UnitStore, layers: Sequence[int], resume: bool) -> dict[int, dict]:
    """``{layer: unit}`` of the layers already finished (``resume``); without ``resume`` a folder
    that already holds units is refused, so that a new sweep never mixes with an old one."""
    if not resume:
        if store.existing():
            raise PullbackError(f"--out: {store.folder} already holds finished layers of a study; pass --resume to "
                                "continue it, or choose an empty folder")
        return {}
    units = {layer: store.read(layer) for layer in layers}
    return {layer: unit for layer, unit in units.items() if unit is not None}


def run_sweep(store: UnitStore, layers: Sequence[int], work: Sequence, measure: Measure, finish: Finish, *,
              resume: bool = False, progress: bool = True, desc: str = "study") -> Optional[dict[int, dict]]:
    """Measure every layer of ``layers`` not finished yet and write its unit.

    ``work``: the items a layer's measurement is split into (image indices, batches), shared over
    torchrun ranks; ``measure(layer, items)`` returns one record per item; ``finish(layer,
    records)`` (rank 0) turns all records, in ``work`` order, into the layer's unit (JSON-able).
    Returns ``{layer: unit}`` for every layer on rank 0, None on the other ranks.
    """
    from pullback_ext.progress import progress_bar

    info = distributed.init_from_env()
    try:
        done = finished_layers(store, layers, resume) if info.is_main else {}
        skip = distributed.gather_objects(sorted(done), info)[0]
        todo = [layer for layer in layers if layer not in skip]
        mine = distributed.shard(list(work), info.rank, info.world_size)
        label = f"{desc}[rank {info.rank}/{info.world_size}]" if info.world_size > 1 else desc
        with progress_bar(total=len(layers), initial=len(layers) - len(todo), desc=label, unit="layer",
                          enabled=progress and info.is_main) as bar:
            for layer in todo:
                records = measure(layer, mine)
                if len(records) != len(mine):
                    raise PullbackError(f"measure: expected one record per work item ({len(mine)}), got {len(records)}")
                parts = distributed.gather_objects(records, info)
                if info.is_main:
                    done[layer] = finish(layer, distributed.unshard(parts))
                    store.write(layer, done[layer])
                bar.update(1)
    finally:
        distributed.shutdown(info)
    return {layer: done[layer] for layer in layers} if info.is_main else None
