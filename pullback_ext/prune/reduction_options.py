"""The options of a token reduction: one frozen, validated :class:`ReductionOptions`.

Every field is checked, and brought to one representation, when the object is built (``llf=True``
becomes ``"masked"``, a ratio list a tuple, one layer index a 1-tuple); the checks that need the
model (layer range, class token) and the ``"auto"`` choices run in :meth:`ReductionOptions.resolve`,
which returns the :class:`Reduction` the block loop runs. A bad value raises
:class:`~pullback_ext.errors.PullbackError` naming the option and what it expects.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from pullback_ext.errors import PullbackError
from pullback_ext.prune import evit, expedite
from pullback_ext.prune.matching import MATCHINGS
from pullback_ext.prune.strategies import (
    NEEDS_CLS, NEEDS_SCORER, ORIGINALS, STRATEGIES, OriginalName, Strategy, StrategyName, attention_needed, check_scorer,
    make_strategy,
)
from pullback_ext.prune.tome import SCHEDULES

MODES = ("merge", "prune")
LLF_MODES = ("masked", "full")
WEIGHTS = ("size", "importance")
SELECTIONS = ("lowest", "bound")
PRESETS = ("recommended", "paper")
CALLABLES = ("head", "spn")  # fields that hold models or functions: never in :meth:`ReductionOptions.to_dict`
METHOD_FIELDS = {"tome": ("r", "schedule", "block_range"), "evit": ("keep_rate", "evit_layers"), "asap": ("rings",),
                 "pitome": ("r", "schedule", "block_range", "margin", "energy_alpha"),
                 "expedite": ("cluster_grid", "cluster_layer", "cluster_iters", "cluster_window", "cluster_tau",
                              "reconstruct_k"), "tap": ()}  # besides strategy
ORIGINAL_TITLES = {"tome": "ToMe (r tokens merged in every block)", "evit": "EViT (inattentive tokens fused at 3 blocks)",
                   "asap": "ASAP (the sink-anchored method of its abstract, reconstructed: background pooled per ring or pruned in one shot)",
                   "pitome": "PiToMe (r high-energy tokens merged in every block)",
                   "expedite": "Expedite (tokens clustered after layer alpha, reconstructed for the dense head)",
                   "tap": "TAP (a trained task register ranks tokens and splits an exact budget over depth)"}
ASAP_TAKES = ("ratio", "layers", "mode", "llf", "prop_attn", "rings")  # one stage of the single-stage path
SINGLE_STAGE_FIELDS = ("ratio", "layers", "head", "spn", "matching", "eps", "weights", "selection", "llf", "preset", "recovery")


@dataclass(frozen=True)
class ReductionOptions:
    """How to reduce tokens (defaults in the signature; ``auto`` is resolved per model).

    - ``head``: importance head ``F [B, K, D] -> [B, K]`` (or an SPN) for ``importance``, a callable
      giving imp* for ``oracle``; a sequence gives one per stage of ``layers`` (kept as a tuple).
    - ``ratio``: fraction of patch tokens removed in [0, 1): the total, split evenly over the stages,
      or one fraction per stage (adding up to less than 1).
    - ``layers``: 0-based blocks whose *input* is reduced, strictly increasing.
    - ``mode``: ``merge`` (CLS decoders), ``prune`` (dense decoders) or ``auto``: prune when the
      backbone feeds a dense decoder, merge otherwise.
    - ``strategy``: which tokens go: a single-stage criterion of
      :data:`~pullback_ext.prune.strategies.STRATEGIES`, or an original method of
      :data:`~pullback_ext.prune.strategies.ORIGINALS` (below).
    - ``llf``: Last-Layer Fusion of prune mode: ``"masked"`` (or ``True``), ``"full"``, ``False`` or
      ``auto`` (the preset's: masked for ``recommended``, full for ``paper``).
    - ``spn``: returns ``(U [B, K*D, r], lam [B, r])`` for the pullback matching of merge mode.
    - ``matching``: ``pullback`` or ``cosine`` (``auto``: pullback with ``spn``, else cosine).
    - ``eps``: isotropic floor of the pullback distance (None: the SPN's ``eps``).
    - ``prop_attn``: add ``log(size)`` to attention logits after merges (``auto``: in merge mode; a
      merged token keeps the attention mass of every token it absorbed, as in ToMe). ``folded``:
      the same, folded into the dot product instead of an additive mask, and in prune mode masked
      LLF as two maskless attention calls, so that SDPA keeps its fast kernels (single-stage
      strategies on timm ``VisionTransformer`` blocks; :mod:`pullback_ext.prune.folded_attention`).
    - ``weights``: merged averages by ``size`` or ``importance`` (``auto``: size; importance for the
      ``importance``/``oracle`` strategies under ``preset="paper"``, whose literal rule it is).
    - ``selection``: which tokens a scorer strategy merges away: ``lowest`` importance, or the lowest
      first-order error ``bound`` ``imp(s) · ‖x_t − x_s‖`` with ``t`` the token it would merge into
      (the pullback distance when matching in the pullback metric); ``auto``: ``bound`` for merges
      with ``importance``/``oracle``, ``lowest`` otherwise (``lowest`` always under ``preset="paper"``).
    - ``seed``: of the ``random`` strategy.
    - ``recovery``: prune mode: α in [0, 1] of the recovered features ``α·x_t + (1 − α)·m_t`` that
      replace each pruned token's frozen copy at the stage that prunes it (``m_t``: the mean of its
      kept 8-neighbours there, :mod:`pullback_ext.prune.recovery`; a square patch grid); they are
      what every later read and Last-Layer Fusion re-insert. None (default): the frozen copy, as α = 1.
    - ``preset``: how ``auto`` values are chosen. ``recommended`` (default): the choices above.
      ``paper``: the paper's literal pipeline — lowest-importance selection, importance-weighted
      averages (the default ``recommended`` averages by size: see docs/prune.md, "Defaults"), pullback (Eq. 19) matching when an SPN is given (``spn=``), full LLF in prune mode.
      Values given explicitly always win over the preset.

    The originals (``strategy`` ``tome``, ``evit`` or ``pitome``, see :mod:`pullback_ext.prune.tome`,
    :mod:`pullback_ext.prune.evit` and :mod:`pullback_ext.prune.pitome`) reduce inside the blocks and
    take only their own fields (and ``prop_attn`` for ToMe and PiToMe); the single-stage fields above
    keep their defaults:

    - ``r``: ToMe: tokens merged per block (required); ``schedule``: ``constant`` or ``decreasing``
      (from 2r to 0, see :func:`~pullback_ext.prune.tome.merges_per_block`); ``block_range``:
      ``(start, stop)``, the blocks that merge (0-based, ``stop`` excluded; None: all).
    - ``keep_rate``: EViT: fraction of patch tokens each stage keeps, in (0, 1] (required);
      ``evit_layers``: the blocks that reorganise (0-based; None: EViT's 4th/7th/10th of 12, scaled).
    - PiToMe takes ToMe's ``r`` (required), ``schedule`` and ``block_range``, and ``margin``: the
      energy margin of the first block, in [0, 1] (block ``i`` of ``L`` uses ``margin · (1 − i/L)``);
      ``energy_alpha``: ``α >= 0`` of the energy below the margin (see :mod:`pullback_ext.prune.pitome`).
    - ``cluster_grid``: Expedite (:mod:`pullback_ext.prune.expedite`): the ``(h, w)`` grid of cluster
      tokens, or their count (a square number; required); ``cluster_layer``: α, the block whose input
      is clustered (0-based; None: layer 10 of 24, scaled); ``cluster_iters``: κ (>= 0);
      ``cluster_window``: λ, odd, the λ×λ centres a token considers; ``cluster_tau``: τ (> 0) of the
      assignment and the reconstruction; ``reconstruct_k``: centres each token is rebuilt from.

    ASAP (``strategy="asap"``, :mod:`pullback_ext.prune.asap`, a reconstruction) reduces once, at
    the input of block ``layers`` (one block, 1 or later), and takes ``ratio`` (one float: the
    fraction of patch tokens removed, net), ``mode`` (merge: background pooled per ring; prune:
    background pruned, with ``llf``), ``prop_attn`` and its own field:

    - ``rings``: ASAP: how many rings of background tokens merge mode pools into one token each
      (an int >= 1; no effect in prune mode).
    """

    head: Optional[Callable | tuple[Callable, ...]] = None
    ratio: float | tuple[float, ...] = 0.3
    layers: tuple[int, ...] = (4,)
    mode: Literal["merge", "prune", "auto"] = "auto"
    strategy: StrategyName | OriginalName = "importance"
    llf: Literal["masked", "full", False, "auto"] = "auto"
    spn: Optional[Callable] = None
    matching: Literal["pullback", "cosine", "auto"] = "auto"
    eps: Optional[float] = None
    prop_attn: bool | Literal["auto", "folded"] = "auto"
    weights: Literal["size", "importance", "auto"] = "auto"
    selection: Literal["lowest", "bound", "auto"] = "auto"
    seed: Optional[int] = 0
    recovery: Optional[float] = None
    r: Optional[int] = None
    schedule: Literal["constant", "decreasing"] = "constant"
    block_range: Optional[tuple[int, int]] = None
    keep_rate: Optional[float] = None
    evit_layers: Optional[tuple[int, ...]] = None
    margin: float = 0.9
    energy_alpha: float = 1.0
    cluster_grid: Optional[int | tuple[int, int]] = None
    cluster_layer: Optional[int] = None
    cluster_iters: int = 5
    cluster_window: int = 5
    cluster_tau: float = 10.0
    reconstruct_k: int = 20
    rings: int = 4
    preset: Literal["recommended", "paper"] = "recommended"

    def __post_init__(self):
        for name, value in _normalised(self).items():
            object.__setattr__(self, name, value)

    def resolve(self, backbone: BackboneShape) -> Reduction:
        """Check the options against ``backbone``, choose every ``auto`` value and build the strategy."""
        if self.strategy in NEEDS_CLS and not backbone.has_cls:
            raise PullbackError(f"strategy {self.strategy!r} needs a class token; this model has none")
        if self.strategy == "asap":
            resolved = dataclasses.replace(self, **_asap_choices(self, backbone))
        elif self.strategy in ORIGINALS:
            resolved = dataclasses.replace(self, **_original_choices(self, backbone.depth))
        else:
            mode = self.mode if self.mode != "auto" else ("prune" if backbone.dense_neck else "merge")
            if self.recovery is not None and mode != "prune":
                raise PullbackError("recovery applies to mode='prune' (merged tokens are not re-inserted); this reduction merges")
            _check_layer_range(self.layers, backbone.depth, mode == "prune" and bool(self.llf))
            resolved = dataclasses.replace(self, mode=mode, **_auto_choices(self, mode))
            if resolved.prop_attn == "folded" and mode == "prune" and resolved.llf != "masked":
                raise PullbackError(f"prop_attn='folded' in prune mode runs masked LLF as two maskless attention calls; "
                                    f"it needs llf='masked', got llf={resolved.llf!r}")
        return Reduction(resolved, backbone, make_strategy(resolved.strategy, resolved.head))

    def to_dict(self) -> dict:
        """The options as JSON-ready values (lists for tuples); ``head`` and ``spn`` are left out."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in CALLABLES}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in out.items()}

    @classmethod
    def from_dict(cls, data: dict, head=None, spn=None) -> ReductionOptions:
        """Inverse of :meth:`to_dict` (``head`` and ``spn`` given separately)."""
        held = sorted(set(data) & set(CALLABLES))
        if held:
            raise PullbackError(f"from_dict: give {', '.join(held)} as keyword arguments, not in the data")
        return with_overrides(None, **data, head=head, spn=spn)


def with_overrides(options: Optional[ReductionOptions] = None, /, **overrides) -> ReductionOptions:
    """``options`` (default: :class:`ReductionOptions`) with the fields named in ``overrides`` replaced."""
    if options is not None and not isinstance(options, ReductionOptions):
        raise PullbackError(f"options must be a ReductionOptions or None (give head=, ratio=, ... as keywords); "
                            f"got {type(options).__name__}")
    names = [f.name for f in dataclasses.fields(ReductionOptions)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise PullbackError(f"unknown reduction option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
    return dataclasses.replace(options, **overrides) if options is not None else ReductionOptions(**overrides)


@dataclass(frozen=True)
class BackboneShape:
    """What resolving options needs to know of a backbone: ``depth`` blocks, ``num_prefix`` tokens
    before the patches (CLS, registers), whether it ``has_cls``, and whether its features feed a
    dense decoder (``dense_neck``: ``mode="auto"`` prunes)."""

    depth: int
    num_prefix: int
    has_cls: bool
    dense_neck: bool = False


@dataclass(frozen=True)
class Reduction:
    """What the block loop runs: ``options`` with every ``auto`` chosen and checked against
    ``backbone``, and the ``strategy`` built from them."""

    options: ReductionOptions
    backbone: BackboneShape
    strategy: Strategy


def _normalised(o: ReductionOptions) -> dict:
    """Every field checked and in its one representation; rules between fields apply to the values
    already chosen (an ``auto`` is checked again once :meth:`ReductionOptions.resolve` chose it)."""
    mode = _one_of("mode", o.mode, MODES)
    strategy = _one_of("strategy", o.strategy, STRATEGIES + ORIGINALS, auto=False)
    llf, layers = _llf(o.llf), _layers(o.layers)
    fields = dict(
        mode=mode, strategy=strategy, llf=llf, layers=layers, ratio=_ratio(o.ratio, len(layers)),
        head=_head(o.head, strategy, layers), spn=_spn(o.spn), matching=_one_of("matching", o.matching, MATCHINGS),
        eps=_eps(o.eps), prop_attn=_prop_attn(o.prop_attn), weights=_one_of("weights", o.weights, WEIGHTS),
        selection=_one_of("selection", o.selection, SELECTIONS), seed=_seed(o.seed), recovery=_recovery(o.recovery), r=_r(o.r),
        schedule=_one_of("schedule", o.schedule, SCHEDULES, auto=False), block_range=_block_range(o.block_range),
        keep_rate=_keep_rate(o.keep_rate), evit_layers=None if o.evit_layers is None else _layers(o.evit_layers, "evit_layers"),
        margin=_margin(o.margin), energy_alpha=_energy_alpha(o.energy_alpha),
        preset=_one_of("preset", o.preset, PRESETS, auto=False),
        **_expedite_fields(o),
        rings=_rings(o.rings),
    )
    _check_method_fields(fields)
    if strategy in ("tome", "evit", "asap"):
        _note_new_meaning(strategy)
    else:
        _check_combinations(**fields)
    return fields


def _check_method_fields(fields: dict) -> None:
    """The fields of one original method need that method; the originals take no single-stage field."""
    strategy = fields["strategy"]
    changed = {f.name for f in dataclasses.fields(ReductionOptions) if fields[f.name] != f.default}
    for name in dict.fromkeys(name for names in METHOD_FIELDS.values() for name in names):
        methods = [method for method, names in METHOD_FIELDS.items() if name in names]
        if name in changed and strategy not in methods:
            raise PullbackError(f"{name} is an option of strategy {' or '.join(map(repr, methods))}; got strategy {strategy!r}")
    if fields["prop_attn"] == "folded" and strategy in ORIGINALS:
        raise PullbackError(f"prop_attn='folded' applies to the single-stage strategies; got strategy {strategy!r} (use prop_attn=True)")
    if strategy not in ORIGINALS:
        return
    if strategy == "asap":
        return _check_asap(fields, changed)
    if strategy == "tap":
        return _check_tap(fields, changed)
    for name in SINGLE_STAGE_FIELDS:
        if name in changed:
            raise PullbackError(f"strategy {strategy!r} does not take {name} (an option of the single-stage strategies); "
                                f"it takes {', '.join(METHOD_FIELDS[strategy])}{' and prop_attn' if strategy in ('tome', 'pitome') else ''}")
    if fields["mode"] == "prune":
        raise PullbackError(f"strategy {strategy!r} has no prune mode (full-length features always give reduced tokens "
                            f"back at their source positions); leave mode at 'auto'")
    if strategy == "evit" and fields["prop_attn"] is True:
        raise PullbackError("prop_attn applies to ToMe and the single-stage merges; EViT runs its attention unchanged")
    if strategy == "expedite" and fields["prop_attn"] is True:
        raise PullbackError("prop_attn applies to ToMe and the single-stage merges; Expedite runs its attention unchanged")
    required, what = {"tome": ("r", "tokens merged per block"), "evit": ("keep_rate", "fraction of patch tokens kept"),
                      "pitome": ("r", "tokens merged per block"),
                      "expedite": ("cluster_grid", "the (h, w) grid of cluster tokens, or their count")}[strategy]
    if fields[required] is None:
        raise PullbackError(f"strategy {strategy!r} needs {required}= ({what})")


def _check_asap(fields: dict, changed: set) -> None:
    """ASAP takes the fields of one single-stage stage (:data:`ASAP_TAKES`), at a layer whose walk
    has blocks before it."""
    refused = sorted(changed & (set(SINGLE_STAGE_FIELDS) - set(ASAP_TAKES)))
    if refused:
        raise PullbackError(f"strategy 'asap' does not take {refused[0]}; it takes {', '.join(ASAP_TAKES)}")
    layers = fields["layers"]
    if len(layers) != 1:
        raise PullbackError(f"strategy 'asap' reduces in a single shot: layers must name one block; got {layers}")
    if layers[0] == 0:
        raise PullbackError("strategy 'asap' walks the attention of the blocks before its stage, so layers must be 1 or later; got 0")


def _check_tap(fields: dict, changed: set) -> None:
    """TAP takes ``head`` (its trained task register, or the checkpoint folder) and one float
    ``ratio`` (η = 1 − ρ); its register knows its eligible layers and its task (dense: prune + LLF)."""
    refused = sorted(changed & (set(SINGLE_STAGE_FIELDS) - {"ratio", "head"}))
    if refused or fields["mode"] not in ("auto", "prune"):
        raise PullbackError(f"strategy 'tap' does not take {refused[0] if refused else 'mode'}; it takes head= (a TAP checkpoint "
                            f"folder or TaskRegister) and ratio= (the fraction of patch tokens removed)")
    if not isinstance(fields["ratio"], float):
        raise PullbackError(f"strategy 'tap' takes one float ratio (its register splits it over depth); got {fields['ratio']}")


@functools.lru_cache(maxsize=None)
def _note_new_meaning(strategy: str) -> None:
    """Say once per process that ``tome`` / ``evit`` / ``asap`` changed meaning in this release."""
    warnings.warn(
        f"strategy {strategy!r} now means {ORIGINAL_TITLES[strategy]} as its authors run it (new in this release); the "
        f"single-stage score that {strategy!r} named before is strategy '{strategy}_score'",
        FutureWarning, stacklevel=5,
    )


def _original_choices(o: ReductionOptions, depth: int) -> dict:
    """The ``auto`` values of ToMe / EViT / PiToMe chosen, and their blocks checked, for a ``depth``-block model."""
    if o.strategy in ("tome", "pitome"):
        start, stop = o.block_range if o.block_range is not None else (0, depth)
        if stop > depth:
            raise PullbackError(f"block_range must end at or before block {depth} of this {depth}-block model; got {o.block_range}")
        return {"mode": "merge", "prop_attn": o.prop_attn if isinstance(o.prop_attn, bool) else True, "block_range": (start, stop)}
    if o.strategy == "tap":
        from pullback_ext.tap.run import check_fits

        check_fits(o.head, depth)
        return {"mode": "prune", "prop_attn": False}
    if o.strategy == "expedite":
        layer = expedite.default_layer(depth) if o.cluster_layer is None else o.cluster_layer
        _check_layer_range((layer,), depth, False, "cluster_layer")
        return {"mode": "merge", "prop_attn": False, "cluster_layer": layer}
    layers = o.evit_layers
    if layers is None:
        try:
            layers = evit.default_layers(depth)
        except PullbackError as exc:
            raise PullbackError(f"evit_layers: EViT's blocks 3, 6, 9 of 12 do not scale to this {depth}-block model ({exc}); "
                                f"give evit_layers=") from None
    _check_layer_range(layers, depth, False, "evit_layers")
    return {"mode": "merge", "prop_attn": False, "evit_layers": layers}


def _asap_choices(o: ReductionOptions, backbone: BackboneShape) -> dict:
    """ASAP's ``mode`` (``auto``: prune for a dense neck) and ``prop_attn`` (``auto``: in merge mode),
    its layer checked for the ``backbone``."""
    mode = o.mode if o.mode != "auto" else ("prune" if backbone.dense_neck else "merge")
    _check_layer_range(o.layers, backbone.depth, mode == "prune" and bool(o.llf))
    return {"mode": mode, "prop_attn": o.prop_attn if isinstance(o.prop_attn, bool) else mode == "merge",
            "llf": "masked" if o.llf == "auto" else o.llf}


def _check_combinations(mode, strategy, layers, spn, matching, weights, selection, **_) -> None:
    if attention_needed(strategy) != "none" and layers[0] == 0:
        raise PullbackError(f"strategy {strategy!r} reads attention of earlier blocks, so layers must start at 1 or later; got 0")
    if matching == "pullback" and spn is None:
        raise PullbackError("matching='pullback' needs spn= (an SPN returning U and lam)")
    if weights == "importance" and strategy not in NEEDS_SCORER:
        raise PullbackError(f"weights='importance' needs strategy 'importance' or 'oracle'; got {strategy!r}")
    if selection == "bound" and (mode == "prune" or strategy not in NEEDS_SCORER):
        raise PullbackError(f"selection='bound' needs mode='merge' and strategy 'importance' or 'oracle'; got {mode!r}, {strategy!r}")


def _auto_choices(o: ReductionOptions, mode: str) -> dict:
    """The value of every field left at ``auto`` (besides ``mode``), for the chosen ``mode``."""
    scorer, paper = o.strategy in NEEDS_SCORER, o.preset == "paper"
    choices = {
        "matching": "pullback" if o.spn is not None else "cosine",
        "weights": "importance" if (scorer and paper) else "size",
        "prop_attn": mode == "merge",
        "selection": "bound" if (mode == "merge" and scorer and not paper) else "lowest",
        "llf": "full" if paper else "masked",
    }
    return {name: value for name, value in choices.items() if isinstance(getattr(o, name), str) and getattr(o, name) == "auto"}


def _one_of(name: str, value, choices: tuple, auto: bool = True):
    allowed = ("auto",) + choices if auto else choices
    if not isinstance(value, str) or value not in allowed:
        raise PullbackError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ratio(ratio, num_layers: int) -> float | tuple[float, ...]:
    if not (_is_real(ratio) or isinstance(ratio, (list, tuple))):
        raise PullbackError(f"ratio must be a float in [0, 1) or one float per layer; got {ratio!r}")
    values = [ratio] if _is_real(ratio) else list(ratio)
    if not _is_real(ratio) and len(values) != num_layers:
        raise PullbackError(f"ratio has {len(values)} entries but layers has {num_layers}")
    for v in values:
        if not _is_real(v) or not (0.0 <= float(v) < 1.0) or v != v:
            raise PullbackError(f"ratio must lie in [0, 1); got {v!r}")
    if not _is_real(ratio) and sum(float(v) for v in values) >= 1.0:
        raise PullbackError(f"per-layer ratios must add up to less than 1; got {values}")
    return float(ratio) if _is_real(ratio) else tuple(float(v) for v in values)


def _llf(llf):
    """``True`` is the ``masked`` fusion; returns ``masked``, ``full``, ``auto`` or False."""
    if llf is True:
        return "masked"
    if llf is False or (isinstance(llf, str) and llf in LLF_MODES + ("auto",)):
        return llf
    raise PullbackError(f"llf must be True, False, 'masked', 'full' or 'auto'; got {llf!r}")


def _layers(layers, name: str = "layers") -> tuple[int, ...]:
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    try:
        values = [int(layer) for layer in layers]
        if any(isinstance(layer, bool) or int(layer) != layer for layer in layers):
            raise TypeError
    except (TypeError, ValueError):
        raise PullbackError(f"{name} must be block indices (ints); got {layers!r}") from None
    if not values:
        raise PullbackError(f"{name} must name at least one block index")
    if sorted(set(values)) != values:
        raise PullbackError(f"{name} must be strictly increasing; got {values}")
    return tuple(values)


def _check_layer_range(layers: tuple, depth: int, llf_in_prune: bool, name: str = "layers") -> None:
    last = depth - 2 if llf_in_prune else depth - 1
    for layer in layers:
        if not 0 <= layer <= last:
            why = " (with LLF the last block always runs on the full sequence)" if llf_in_prune else ""
            raise PullbackError(f"{name} must lie in [0, {last}] for this {depth}-block model{why}; got {layer}")


def _head(head, strategy: str, layers: tuple):
    if strategy == "tap":
        from pullback_ext.tap.checkpoint import as_register

        return as_register(head)
    check_scorer(strategy, head)
    if isinstance(head, (list, tuple)):
        if not head or not all(callable(h) for h in head):
            raise PullbackError(f"head must be a callable or a non-empty sequence of callables (one per stage); got {head!r}")
        if strategy in NEEDS_SCORER and len(head) not in (1, len(layers)):
            raise PullbackError(f"head: give one scorer or one per stage; got {len(head)} for {len(layers)} stages {layers}")
        return tuple(head)
    if head is not None and not callable(head):
        raise PullbackError(f"head must be a callable or a non-empty sequence of callables (one per stage); got {head!r}")
    return head


def _spn(spn):
    if spn is not None and not callable(spn):
        raise PullbackError(f"spn must be None or a callable returning (U, lam); got {type(spn).__name__}")
    return spn


def _eps(eps) -> Optional[float]:
    if eps is None:
        return None
    if not _is_real(eps) or not float(eps) >= 0.0 or float(eps) == float("inf"):
        raise PullbackError(f"eps must be None or a finite float >= 0; got {eps!r}")
    return float(eps)


def _prop_attn(prop_attn):
    if not isinstance(prop_attn, bool) and prop_attn not in ("auto", "folded"):
        raise PullbackError(f"prop_attn must be True, False, 'auto' or 'folded'; got {prop_attn!r}")
    return prop_attn


def _r(r) -> Optional[int]:
    if r is not None and (not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0):
        raise PullbackError(f"r must be None or an int >= 0 (tokens ToMe merges per block); got {r!r}")
    return None if r is None else int(r)


def _block_range(block_range) -> Optional[tuple[int, int]]:
    if block_range is None:
        return None
    values = tuple(block_range) if isinstance(block_range, (list, tuple)) else ()
    if (len(values) != 2 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values)
            or not 0 <= values[0] < values[1]):
        raise PullbackError(f"block_range must be None or (start, stop) block indices with 0 <= start < stop; got {block_range!r}")
    return int(values[0]), int(values[1])


def _margin(margin) -> float:
    if not _is_real(margin) or not 0.0 <= float(margin) <= 1.0:
        raise PullbackError(f"margin must be a float in [0, 1] (PiToMe's energy margin of the first block); got {margin!r}")
    return float(margin)


def _energy_alpha(alpha) -> float:
    if not _is_real(alpha) or not 0.0 <= float(alpha) < float("inf"):
        raise PullbackError(f"energy_alpha must be a finite float >= 0 (PiToMe's α below the margin); got {alpha!r}")
    return float(alpha)


def _keep_rate(keep_rate) -> Optional[float]:
    if keep_rate is not None and (not _is_real(keep_rate) or not 0.0 < float(keep_rate) <= 1.0):
        raise PullbackError(f"keep_rate must be None or a float in (0, 1]; got {keep_rate!r}")
    return None if keep_rate is None else float(keep_rate)


def _expedite_fields(o: ReductionOptions) -> dict:
    """Expedite's fields checked; a cluster count becomes its square grid."""
    return dict(cluster_grid=_cluster_grid(o.cluster_grid), cluster_layer=_count("cluster_layer", o.cluster_layer, 0, True),
                cluster_iters=_count("cluster_iters", o.cluster_iters, 0), cluster_window=_cluster_window(o.cluster_window),
                cluster_tau=_cluster_tau(o.cluster_tau), reconstruct_k=_count("reconstruct_k", o.reconstruct_k, 1))


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(name: str, value, least: int, optional: bool = False) -> Optional[int]:
    if optional and value is None:
        return None
    if not _is_int(value) or value < least:
        raise PullbackError(f"{name} must be {'None or ' if optional else ''}an int >= {least}; got {value!r}")
    return int(value)


def _cluster_grid(grid) -> Optional[tuple[int, int]]:
    if grid is None:
        return None
    if _is_int(grid) and grid >= 1 and math.isqrt(grid) ** 2 == grid:
        return math.isqrt(grid), math.isqrt(grid)
    values = tuple(grid) if isinstance(grid, (list, tuple)) else ()
    if len(values) != 2 or not all(_is_int(v) and v >= 1 for v in values):
        raise PullbackError(f"cluster_grid must be None, (h, w) ints >= 1, or a square number of clusters; got {grid!r}")
    return int(values[0]), int(values[1])


def _cluster_window(window) -> int:
    if not _is_int(window) or window < 1 or window % 2 == 0:
        raise PullbackError(f"cluster_window must be an odd int >= 1 (the λ×λ centres a token considers); got {window!r}")
    return int(window)


def _cluster_tau(tau) -> float:
    if not _is_real(tau) or not 0.0 < float(tau) < float("inf"):
        raise PullbackError(f"cluster_tau must be a finite float > 0; got {tau!r}")
    return float(tau)


def _rings(rings) -> int:
    if not isinstance(rings, numbers.Integral) or isinstance(rings, bool) or rings < 1:
        raise PullbackError(f"rings must be an int >= 1 (rings of background tokens ASAP pools); got {rings!r}")
    return int(rings)


def _recovery(alpha) -> Optional[float]:
    if alpha is not None and (not _is_real(alpha) or not 0.0 <= float(alpha) <= 1.0):
        raise PullbackError(f"recovery must be None or a float α in [0, 1] (1: the frozen copy, 0: the kept neighbours' mean); got {alpha!r}")
    return None if alpha is None else float(alpha)


def _seed(seed) -> Optional[int]:
    if seed is None:
        return None
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise PullbackError(f"seed must be an int or None; got {seed!r}")
    return int(seed)
