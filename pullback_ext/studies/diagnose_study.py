"""``study diagnose``: the tractability diagnostic (``pullback_ext.diagnostics``) at every layer,
per decoder: κ_cap(r) for several r, CV, r_eff^trunc, r_eff^SLQ, r₀.₉₀ and the regime.

Each layer and decoder is exactly what ``pullback diagnose --layer L --decoder NAME`` computes on
the same images with the same settings: the same probe (``build_probe_setup``), the same per-image
random streams (seed, global image index), the same aggregate.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from pullback_ext.diagnostics import REGIMES, DiagnoseConfig, Diagnosis, RankCappedWarning, diagnose, r90_note
from pullback_ext.probes.features import as_features
from pullback_ext.sources.image_sets import ImageSet

KAPPA_RANKS = (1, 2, 5, 10, 20)
FIT_DECODER = "probe"  # the demo's per-token depth probe, fitted at each layer
QUANTITIES = ("kappa_cap", "cv", "r_eff_trunc", "r_eff_slq", "r90")


def fitted_probe_file(model, layer: int, folder: Path, train_n: int = 128) -> Path:
    """The demo's per-token log-depth probe at block ``layer`` (``studies.subspace.fit_depth_probe``)
    as ``folder/probe-layer-NN.safetensors`` (weight [4, D], bias [4]), for ``--decoder linear:FILE``."""
    from safetensors.torch import save_file

    from pullback_ext.fileio import atomic_path
    from pullback_ext.studies.subspace import fit_depth_probe

    weight, bias = fit_depth_probe(model, layer, train_n)
    path = Path(folder) / f"probe-layer-{layer:02d}.safetensors"
    with atomic_path(path) as tmp:
        save_file({"weight": weight.contiguous(), "bias": bias.contiguous()}, str(tmp))
    return path


class _Counted:
    """``probe`` whose bound map calls ``tick(n)`` at its n-th call: ψ runs once per batch of
    Jacobian products, so a diagnosis that takes minutes can show that it moves."""

    def __init__(self, probe, tick: Callable[[int], None]):
        self._probe, self._tick, self._calls = probe, tick, 0

    def __getattr__(self, name: str):
        return getattr(self._probe, name)

    def bind(self, context):
        bound = self._probe.bind(context)

        def counted(F):
            self._calls += 1
            self._tick(self._calls)
            return bound(F)

        return counted


def _watched(probe, progress, **status):
    """``probe`` whose passes through ψ show in the status of ``progress`` (``probe`` itself without)."""
    return probe if progress is None else _Counted(probe, lambda n: progress.status(**status, passes=n))


@dataclass
class DiagnoseStudy:
    """What to diagnose: ``setup(layer, decoder)`` -> a ``ProbeSetup`` (its ``probe``), on
    ``image_set`` in batches of ``batch_size``, with ``config``; κ_cap is also reported at every
    r of ``kappa_ranks`` up to the rank used."""

    setup: Callable
    image_set: ImageSet
    decoders: Sequence[str]
    config: DiagnoseConfig
    dtype: torch.dtype = torch.float32
    batch_size: int = 8
    kappa_ranks: Sequence[int] = KAPPA_RANKS

    step_unit = "diagnosis"  # the progress of a layer: one image under one decoder

    def work(self) -> list[int]:
        return list(range(len(self.image_set)))

    def steps(self, indices: list) -> int:
        return len(self.decoders) * len(indices)

    def measure(self, layer: int, indices: list, progress=None) -> list[dict]:
        """One record per image of ``indices``: ``{decoder: ImageDiagnosis}``. ``progress`` (a
        ``LayerProgress``) advances by one per image and decoder; its status names the decoder and
        the image in hand and counts that image's passes through ψ (one per batch of Jacobian
        products), so that it moves within an image too."""
        records = [dict() for _ in indices]
        for decoder in self.decoders:
            if progress is not None:
                progress.status(decoder=decoder)
            probe = self.setup(layer, decoder).probe
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                F = as_features(probe.features(self.image_set.images(chunk).to(self.dtype)))
                for offset, index in enumerate(chunk):
                    watched = _watched(probe, progress, decoder=decoder, image=f"{start + offset + 1}/{len(indices)}")
                    records[start + offset][decoder] = self._one(watched, F.image(offset), index)
                    if progress is not None:
                        progress.advance()
        return records

    def _one(self, probe, F, index: int):
        """The ``ImageDiagnosis`` of one image (``F``: its ``Features``), global index ``index``."""
        with warnings.catch_warnings():  # one rank for every decoder: the table notes where it is capped at M
            warnings.simplefilter("ignore", RankCappedWarning)
            return diagnose(probe, F, self.config, indices=[index], keep_vectors=False).images[0]

    def finish(self, layer: int, records: list) -> dict:
        """The layer's unit: per decoder the ``Diagnosis`` as JSON (every image) plus κ_cap(r)."""
        unit = {}
        for decoder in self.decoders:
            images = [record[decoder] for record in records]
            full = Diagnosis.from_images(images, self.config).to_dict()
            ranks = [r for r in self.kappa_ranks if r <= images[0].rank]
            per_image = torch.stack([d.kappa_curve[[r - 1 for r in ranks]] for d in images]).double()
            full["kappa_at"] = {str(r): {"mean": float(per_image[:, i].mean()),
                                         "std": float(per_image[:, i].std()) if len(images) > 1 else 0.0}
                                for i, r in enumerate(ranks)}
            for image, values in zip(full["images"], per_image.tolist()):
                image["kappa_at"] = dict(zip(map(str, ranks), values))
            unit[decoder] = full
        return unit


def summary(units: dict, decoders: Sequence[str]) -> dict:
    """``{decoder: {quantity: [mean per layer]}, regime: [...]}`` over the layers of ``units``."""
    layers = sorted(units)
    out = {}
    for decoder in decoders:
        agg = [units[layer][decoder]["aggregate"] for layer in layers]
        row = {name: [a[name]["mean"] if name in a else None for a in agg] for name in QUANTITIES}
        row["regime"] = [units[layer][decoder]["regime"] for layer in layers]
        row["kappa_at"] = {r: [units[layer][decoder]["kappa_at"].get(r, {}).get("mean") for layer in layers]
                           for r in units[layers[0]][decoder]["kappa_at"]}
        out[decoder] = row
    return out


def table(result: dict) -> str:
    """One row per layer and decoder: M, κ_cap(r), CV, r_eff^trunc, r_eff^SLQ, r90, regime
    (the digits ``pullback diagnose`` prints), then a list of notes: where r was capped at M, and
    what an r90 cell leaves out (:func:`~pullback_ext.diagnostics.r90_note`)."""
    from pullback_ext.results_pages import markdown_table

    rows, notes = [], {}
    for layer in result["layers"]:
        for decoder, d in result["units"][str(layer)].items():
            agg = d["aggregate"]
            settings = d["settings"]
            if settings["rank"] < settings["rank_requested"]:
                notes.setdefault(f"{decoder} r", f"{decoder}: r = {settings['rank_requested']} exceeds M = "
                                 f"{d['images'][0]['M']}, so r = {settings['rank']} (every direction) is used")
            note = r90_note(agg, len(d["images"]), settings["rank"])
            if note is not None:
                notes[f"layer {layer}, {decoder}"] = f"layer {layer}, {decoder}: {note}"

            def cell(name, fmt=".3f"):
                return f"{agg[name]['mean']:{fmt}} ± {agg[name]['std']:{fmt}}" if name in agg else "n/a"

            rows.append((layer, decoder, d["images"][0]["M"], d["settings"]["rank"], cell("kappa_cap"), cell("cv"),
                         cell("r_eff_trunc", ".2f"), cell("r_eff_slq", ".2f"), cell("r90", ".1f"),
                         f"({d['regime']}) {REGIMES[d['regime']][0]}"))
    text = markdown_table(["layer", "decoder", "M", "r", "κ_cap(r)", "CV", "r_eff^trunc", "r_eff^SLQ", "r90", "regime"], rows)
    return text + "".join(f"\n\n- {line}" if i == 0 else f"\n- {line}" for i, line in enumerate(notes.values()))
