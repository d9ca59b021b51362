"""Turning evaluation options into objects: model, stage layers, scorers, strategies, images."""

from __future__ import annotations

import sys
from typing import Optional

from pullback_ext.errors import CheckpointError, PullbackError
from pullback_ext.prune.backbones import Backbone, block_output_tokens, demo_backbone, hf_backbone, timm_backbone
from pullback_ext.prune.schedules import parse_layers, scale_layers
from pullback_ext.prune.strategies import STRATEGIES, TRAINING_FREE


def load_backbone(demo: bool, model_name: Optional[str] = None, weights: Optional[str] = None):
    """``(Backbone, model)`` for the demo model, a timm model by name (``NAME`` or ``timm:NAME``;
    random weights unless ``weights`` is given) or a local transformers folder (``hf:DIR``: DINOv2,
    DPT or Depth Anything; weights from ``weights`` or the folder)."""
    if demo:
        from pullback_ext.embedded import load

        model = load(weights)
        return demo_backbone(model), model
    if model_name.startswith("hf:"):
        from pullback_ext.model_loading import HF_CLS_MODELS, HF_DEPTH_MODELS, load_hf_model

        folder = model_name[len("hf:"):]
        model, _ = load_hf_model(folder, weights, {**HF_CLS_MODELS, **HF_DEPTH_MODELS})
        return hf_backbone(model, folder), model
    import timm

    name = model_name[len("timm:"):] if model_name.startswith("timm:") else model_name
    try:
        model = timm.create_model(name, pretrained=False, num_classes=0)
    except RuntimeError as exc:
        raise PullbackError(f"--model: timm does not know {name!r} ({exc})") from exc
    if weights is not None:
        from pullback_ext.model_loading import load_into

        load_into(model, weights)
    return timm_backbone(model.eval().requires_grad_(False)), model


def stage_layers(text: str, depth: int, absolute: bool = False) -> tuple:
    """Stage layers from ``--stages`` (ViT-B numbering scaled to ``depth`` unless ``absolute``)."""
    layers = parse_layers(text)
    if not layers:
        raise PullbackError("--stages must name at least one layer")
    return tuple(layers) if absolute else scale_layers(layers, depth)


def load_metric(path: str, expected_dim: int):
    """``(model, config)`` of an importance head or SPN checkpoint, checked against the backbone."""
    from pullback_ext.metric.checkpoint import load_model

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
        paths = [h.strip() for h in head.split(",") if h.strip()]
        if len(paths) not in (1, len(layers)):
            raise PullbackError(f"--head: give one checkpoint or one per stage ({len(layers)} for layers {list(layers)}); got {len(paths)}")
        loaded = [load_metric(path, backbone.features_dim) for path in paths]
        for stage, (path, (_, config)) in enumerate(zip(paths, loaded)):
            trained_on = config.get("probe", {}).get("layer")
            if isinstance(trained_on, int) and layers[stage] != trained_on + 1:
                print(f"warning: --head {path} was trained on the output of block {trained_on}, i.e. stage layer {trained_on + 1}, "
                      f"but stage {stage} is at layer {layers[stage]} (use --absolute-layers with matching --stages)", file=sys.stderr)
        scorers["importance"] = loaded[0][0] if len(loaded) == 1 else [scorer for scorer, _ in loaded]
        if len(loaded) == 1 and loaded[0][1]["kind"] == "spn":
            spn_model = loaded[0][0]
    if spn is not None:
        spn_model, config = load_metric(spn, backbone.features_dim)
        if config["kind"] != "spn":
            raise CheckpointError(f"--spn: {spn} holds an importance head, not an SPN")
    if oracle:
        if backbone.name != "demo":
            raise PullbackError("--oracle needs --demo (a probe map of the model's decoder)")
        if len(layers) != 1 or layers[0] < 1:
            raise PullbackError(f"--oracle scores the full token set: use a single stage at layer >= 1; got {layers}")
        from pullback_ext.embedded.probes import demo_probe
        from pullback_ext.prune.oracle import OracleScorer

        decoder = "embedding" if task == "cls" else "depth"
        scorers["oracle"] = OracleScorer(demo_probe(model, layers[0] - 1, decoder, output_size=16 if task == "depth" else None))
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


def image_sets(images: Optional[str], backbone: Backbone, demo: bool, num_images: int, seeds: int) -> list:
    """One image set per seed: demo scenes of seeds 0..seeds-1, or the folder split into
    ``seeds`` disjoint sets of up to ``num_images`` (preprocessed as the model expects)."""
    from pullback_ext.images import unit_range_preprocess
    from pullback_ext.prune.images import demo_scenes, load_folder

    size = backbone.image_size
    if images is None:
        if not demo:
            raise PullbackError("--images DIR is required with --model")
        return [demo_scenes(num_images, seed, size) for seed in range(seeds)]
    preprocess = backbone.preprocess or unit_range_preprocess(size)
    data = load_folder(images, preprocess, limit=num_images * seeds)
    n = data["images"].shape[0]
    per = n // seeds
    if per < 2:
        raise PullbackError(f"--images: {n} images cannot fill {seeds} seeds of at least 2 images")
    sets = []
    for s in range(seeds):
        sl = slice(s * per, (s + 1) * per)
        sets.append({"images": data["images"][sl], "labels": None if data["labels"] is None else data["labels"][sl]})
    return sets


def subspace_report(probe: str, model, backbone: Backbone, layer: int, ks: tuple, data: dict, demo: bool) -> dict:
    """Interventions on a linear token probe read at the output of block ``layer``."""
    from pullback_ext.prune.subspace import interventions

    if not 0 <= layer < backbone.depth:
        raise PullbackError(f"--layer must lie in [0, {backbone.depth - 1}]; got {layer}")
    if probe == "fit":
        if not demo:
            raise PullbackError("--probe fit needs --demo (depth targets of rendered scenes); give a probe file otherwise")
        from pullback_ext.prune.subspace import subspace_analysis

        return subspace_analysis(model, layer, 128, _with_depth(data), quick=False, ks=ks)
    from pullback_ext.model_loading import read_state_dict

    state = read_state_dict(probe)
    weight, bias = state.get("weight"), state.get("bias")
    if weight is None or weight.dim() != 2 or weight.shape[1] != backbone.features_dim:
        got = None if weight is None else tuple(weight.shape)
        raise CheckpointError(f"--probe: {probe} needs 'weight' of shape [C, {backbone.features_dim}]; got {got}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise CheckpointError(f"--probe: 'bias' must have shape [{weight.shape[0]}]; got {tuple(bias.shape)}")
    tokens = block_output_tokens(backbone, data["images"], layer)
    result = interventions(tokens, weight.to(tokens.dtype), None if bias is None else bias.to(tokens.dtype), ks=ks)
    result["layer"] = layer
    return result


def _with_depth(data: dict) -> dict:
    if data.get("depth") is not None:
        return data
    from pullback_ext.embedded import heldout

    return heldout(data["images"].shape[0], 0)

