"""The reduction options of ``pullback evaluate`` as the parts of a plan: stage layers, the scorer
checkpoints (importance head, SPN, head schedule folder, oracle) and the strategies."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Optional

from pullback_ext.comparison.backbones import Backbone
from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.metric.schedule import is_schedule, read_schedule
from pullback_ext.prune.schedules import parse_layers, scale_layers
from pullback_ext.prune.strategies import STRATEGIES, TRAINING_FREE

DEFAULT_STAGES = "4"


def schedule_folder(head: Optional[str]) -> Optional[str]:
    """``head`` when it names a head-schedule folder (one holding schedule.json), else None."""
    paths = [h.strip() for h in (head or "").split(",") if h.strip()]
    if any(is_schedule(p) for p in paths) and len(paths) > 1:
        raise PullbackError(f"--head: a schedule folder holds one head per stage and must be the only --head; got {head!r}")
    return paths[0] if paths and is_schedule(paths[0]) else None


def stage_layers(text: Optional[str], depth: int, absolute: bool = False, head: Optional[str] = None,
                 flag: str = "--stages") -> tuple:
    """Stage layers from ``text`` (ViT-B numbering scaled to ``depth`` unless ``absolute``;
    default 4). With ``head`` a schedule folder they are its layers, as given, and ``text``
    (when given) must resolve to the same; ``flag`` names the option in errors."""
    folder = schedule_folder(head)
    scheduled = None if folder is None else read_schedule(folder)[1]
    if scheduled is not None and text is None:
        return scheduled
    layers = parse_layers(DEFAULT_STAGES if text is None else text)
    if not layers:
        raise PullbackError(f"{flag} must name at least one layer")
    layers = tuple(layers) if absolute else scale_layers(layers, depth)
    if scheduled is not None and layers != scheduled:
        how = "" if absolute else f" (scaled to this {depth}-block model; --layers takes them as given)"
        raise PullbackError(f"{flag} {text} gives layers {list(layers)}{how}, but the head schedule {folder} has stages "
                            f"{list(scheduled)}; leave {flag} out to use the schedule's")
    return layers


def reduction_layers(args: argparse.Namespace, depth: int) -> tuple:
    """The blocks whose input is reduced: ``--layers`` (0-based blocks of the model at hand), the
    deprecated ``--stages`` (ViT-B numbering, scaled unless ``--absolute-layers``; a FutureWarning
    gives the ``--layers`` spelling), else block depth/3 or a ``--head`` schedule's layers."""
    if args.layers is not None:
        if args.stages is not None:
            raise PullbackError(f"--layers: conflicts with --stages {args.stages!r}; write --layers only")
        from pullback_ext.studies.layers import parse_layers as layer_list

        layers = layer_list(args.layers, 0, depth - 1)
        return stage_layers(",".join(map(str, layers)), depth, True, args.head, flag="--layers")
    layers = stage_layers(args.stages, depth, args.absolute_layers, args.head)
    if args.stages is not None or args.absolute_layers:
        warnings.warn(f"--stages/--absolute-layers are deprecated and will be removed in the next release; write --layers "
                      f"{','.join(map(str, layers))} (0-based blocks of this {depth}-block model)", FutureWarning, stacklevel=2)
    return layers


def load_metric(path: str, expected_dim: int):
    """``(model, config)`` of an importance head or SPN checkpoint, checked against the backbone."""
    from pullback_ext.tap.checkpoint import load_model

    model, config = load_model(path)
    if config.get("kind") not in ("head", "spn"):
        raise CheckpointError(f"{path}: expected an importance head or SPN checkpoint, got kind {config.get('kind')!r}")
    dim = config.get("model", {}).get("dim")
    if dim != expected_dim:
        raise CheckpointError(f"{path}: the {config['kind']} expects features of width {dim}, the backbone has {expected_dim}")
    return model.eval().requires_grad_(False), config


def load_scorers(head: Optional[str], spn: Optional[str], model, backbone: Backbone, layers: tuple, task: str, oracle: bool):
    """``({strategy: scorer}, spn or None)`` from the checkpoint options."""
    scorers: dict = {}
    spn_model = None
    if head is not None:
        folder = schedule_folder(head)
        paths = [h.strip() for h in head.split(",") if h.strip()] if folder is None else \
            [str(p) for p in read_schedule(folder)[0]]
        if len(paths) not in (1, len(layers)):
            raise PullbackError(f"--head: give one checkpoint or one per stage ({len(layers)} for layers {list(layers)}); got {len(paths)}")
        loaded = [load_metric(path, backbone.features_dim) for path in paths]
        for stage, (path, (_, config)) in enumerate(zip(paths, loaded)):
            trained_on = config.get("probe", {}).get("layer")
            if isinstance(trained_on, int) and layers[stage] != trained_on + 1:
                print(f"warning: --head {path} was trained on the output of block {trained_on}, i.e. stage layer {trained_on + 1}, "
                      f"but stage {stage} is at layer {layers[stage]} (use matching --layers)", file=sys.stderr)
        scorers["importance"] = loaded[0][0] if len(loaded) == 1 else [scorer for scorer, _ in loaded]
        if len(loaded) == 1 and loaded[0][1]["kind"] == "spn":
            spn_model = loaded[0][0]
    if spn is not None:
        spn_model, config = load_metric(spn, backbone.features_dim)
        if config["kind"] != "spn":
            raise CheckpointError(f"--spn: {spn} holds an importance head, not an SPN")
    if oracle:
        if backbone.name != "demo":
            raise PullbackError("--oracle needs --model demo (a probe map of the model's decoder)")
        if len(layers) != 1 or layers[0] < 1:
            raise PullbackError(f"--oracle scores the full token set: use a single stage at layer >= 1; got {layers}")
        from pullback_ext.comparison.tasks import get
        from pullback_ext.embedded.probes import demo_probe
        from pullback_ext.prune.oracle import OracleScorer

        dense = get(task).dense  # a dense output is probed pooled to 16×16 (per class for segmentation)
        scorers["oracle"] = OracleScorer(demo_probe(model, layers[0] - 1, task if dense else "embedding", output_size=16 if dense else None))
    return scorers, spn_model


def strategy_list(text: Optional[str], scorers: dict) -> tuple:
    """Strategies from a comma list, or the default: scorer-based ones available, then the rest."""
    if text is None:
        return tuple(s for s in ("importance", "oracle") if s in scorers) + TRAINING_FREE
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    for name in names:
        if name not in STRATEGIES:
            raise PullbackError(f"--strategies: unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
        if name in ("importance", "oracle") and name not in scorers:
            raise PullbackError(f"--strategies: {name!r} needs {'--head CKPT' if name == 'importance' else '--oracle'}")
    return names
