"""The options of a token reduction: one frozen, validated :class:`ReductionOptions`.

Every field is checked, and brought to one representation, when the object is built (``llf=True``
becomes ``"masked"``, a ratio list a tuple, one layer index a 1-tuple); the method named by
``strategy`` checks its own fields and the rules between fields. The checks that need the model
(layer range, class token) and the ``"auto"`` choices run in :meth:`ReductionOptions.resolve`,
which returns the :class:`Reduction` the block loop runs. A bad value raises
:class:`~pullback_ext.errors.PullbackError` naming the option and what it expects.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
from dataclasses import dataclass
from typing import Callable, Literal, Optional

from pullback_ext.errors import PullbackError
from pullback_ext.prune import methods
from pullback_ext.prune.matching import MATCHINGS
from pullback_ext.prune.methods.base import BackboneShape, Method, Reduction
from pullback_ext.prune.option_checks import is_real, layer_list, one_of

MODES = ("merge", "prune")
LLF_MODES = ("masked", "full")
WEIGHTS = ("size", "importance")
SELECTIONS = ("lowest", "bound")
PRESETS = ("recommended", "paper")
CALLABLES = ("head", "spn")  # fields that hold models or functions: never in :meth:`ReductionOptions.to_dict`
UNCHECKED = ("strategy", "seed", "method_options")  # fields no method refuses


@dataclass(frozen=True, init=False)
class ReductionOptions:
    """How to reduce tokens (defaults in the signature; ``auto`` is resolved per model).

    - ``head``: importance head ``F [B, K, D] -> [B, K]`` (or an SPN) for ``importance``, a callable
      giving imp* for ``oracle``; a sequence gives one per stage of ``layers`` (kept as a tuple).
    - ``ratio``: fraction of patch tokens removed in [0, 1): the total, split evenly over the stages,
      or one fraction per stage (adding up to less than 1).
    - ``layers``: 0-based blocks whose *input* is reduced, strictly increasing.
    - ``mode``: ``merge`` (CLS decoders), ``prune`` (dense decoders) or ``auto``: prune when the
      backbone feeds a dense decoder, merge otherwise.
    - ``strategy``: the method (:func:`pullback_ext.prune.methods.names`): a single-stage criterion
      of :data:`~pullback_ext.prune.strategies.STRATEGIES`, an original method, or another method
      of the registry (below).
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

    Every other field belongs to one method of the registry
    (:func:`pullback_ext.prune.methods.all_methods`): it is given as a keyword like the fields above
    (ToMe's ``r=8``), held in ``method_options`` (the method's own frozen options dataclass, its
    ``options_type``; None when it has none) and read as an attribute (``options.r``); a field of
    another method is refused with the names of the methods that take it
    (:func:`pullback_ext.prune.methods.option_owners`). Each method's module documents its own
    fields (its options dataclass) and which common ones it takes (``Method.takes``);
    ``{m.name: m.option_names() for m in all_methods()}`` maps every method to its own fields and
    :func:`option_names` lists every option.
    """

    head: Optional[Callable | tuple[Callable, ...]] = None
    ratio: float | tuple[float, ...] = 0.3
    layers: tuple[int, ...] = (4,)
    mode: Literal["merge", "prune", "auto"] = "auto"
    strategy: str = "importance"
    llf: Literal["masked", "full", False, "auto"] = "auto"
    spn: Optional[Callable] = None
    matching: Literal["pullback", "cosine", "auto"] = "auto"
    eps: Optional[float] = None
    prop_attn: bool | Literal["auto", "folded"] = "auto"
    weights: Literal["size", "importance", "auto"] = "auto"
    selection: Literal["lowest", "bound", "auto"] = "auto"
    seed: Optional[int] = 0
    recovery: Optional[float] = None
    preset: Literal["recommended", "paper"] = "recommended"
    method_options: object = None

    def __init__(self, **values):
        for name, value in _normalised(values).items():
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        own = self.__dict__.get("method_options")
        if not name.startswith("__") and own is not None and name in _own_names(own):
            return getattr(own, name)
        raise AttributeError(f"ReductionOptions of strategy {self.__dict__.get('strategy')!r} has no option {name!r}")

    @property
    def method(self) -> Method:
        """The method of ``strategy``."""
        return methods.get(self.strategy)

    def values(self) -> dict:
        """Every option by name, the method's own ones included (what :class:`ReductionOptions` takes)."""
        common = {name: getattr(self, name) for name in common_names()}
        own = self.method_options
        return {**common, **({name: getattr(own, name) for name in _own_names(own)} if own is not None else {})}

    def replace(self, **changes) -> ReductionOptions:
        """These options with the fields named in ``changes`` replaced (checked again)."""
        return ReductionOptions(**{**self.values(), **changes})

    def resolve(self, backbone: BackboneShape) -> Reduction:
        """Check the options against ``backbone``, choose every ``auto`` value and build what the method runs."""
        method = self.method
        if method.needs.class_token and not backbone.has_cls:
            raise PullbackError(f"strategy {self.strategy!r} needs a class token; this model has none")
        resolved = self.replace(**method.resolve(self, backbone))
        return Reduction(resolved, backbone, method, method.build(resolved))

    def to_dict(self) -> dict:
        """The options as JSON-ready values (lists for tuples); ``head`` and ``spn`` are left out."""
        out = {name: value for name, value in self.values().items() if name not in CALLABLES}
        return {name: list(value) if isinstance(value, tuple) else value for name, value in out.items()}

    @classmethod
    def from_dict(cls, data: dict, head=None, spn=None) -> ReductionOptions:
        """Inverse of :meth:`to_dict` (``head`` and ``spn`` given separately)."""
        held = sorted(set(data) & set(CALLABLES))
        if held:
            raise PullbackError(f"from_dict: give {', '.join(held)} as keyword arguments, not in the data")
        return with_overrides(None, **data, head=head, spn=spn)


def common_names() -> tuple[str, ...]:
    """The fields every method shares (``method_options`` aside)."""
    return tuple(f.name for f in dataclasses.fields(ReductionOptions) if f.name != "method_options")


def _own_names(own) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(own))


def keyword_parameters() -> list[inspect.Parameter]:
    """Every option as a keyword parameter with its default: the common fields, then each method's own."""
    params = {f.name: inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(ReductionOptions) if f.name != "method_options"}
    for method in methods.all_methods():
        for f in dataclasses.fields(method.options_type) if method.options_type else ():
            params.setdefault(f.name, inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type))
    return list(params.values())


def option_names() -> tuple[str, ...]:
    """Every option a reduction takes, common and methods' own."""
    return tuple(p.name for p in keyword_parameters())


def with_overrides(options: Optional[ReductionOptions] = None, /, **overrides) -> ReductionOptions:
    """``options`` (default: :class:`ReductionOptions`) with the fields named in ``overrides`` replaced."""
    if options is not None and not isinstance(options, ReductionOptions):
        raise PullbackError(f"options must be a ReductionOptions or None (give head=, ratio=, ... as keywords); "
                            f"got {type(options).__name__}")
    return options.replace(**overrides) if options is not None else ReductionOptions(**overrides)


def _normalised(values: dict) -> dict:
    """Every field checked and in its one representation, the method's own in ``method_options``;
    rules between fields apply to the values already chosen (an ``auto`` is checked again once
    :meth:`ReductionOptions.resolve` chose it)."""
    held = values.pop("method_options", None)  # given back whole by dataclasses.replace: its fields, unless named
    values = {**({f.name: getattr(held, f.name) for f in dataclasses.fields(held)} if held is not None else {}), **values}
    names = option_names()
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise PullbackError(f"unknown reduction option(s) {', '.join(unknown)}; the options are {', '.join(names)}")
    defaults = {f.name: f.default for f in dataclasses.fields(ReductionOptions)}
    given = {**defaults, **{k: v for k, v in values.items() if k in defaults}}
    strategy = one_of("strategy", given["strategy"], methods.names(), auto=False)
    method = methods.get(strategy)
    own = _own_values(method, values)
    llf, layers = _llf(given["llf"]), layer_list(given["layers"])
    fields = dict(
        head=method.checked_head(given["head"], layers), ratio=_ratio(given["ratio"], len(layers)), layers=layers,
        mode=one_of("mode", given["mode"], MODES), strategy=strategy, llf=llf, spn=_spn(given["spn"]),
        matching=one_of("matching", given["matching"], MATCHINGS), eps=_eps(given["eps"]),
        prop_attn=_prop_attn(given["prop_attn"]), weights=one_of("weights", given["weights"], WEIGHTS),
        selection=one_of("selection", given["selection"], SELECTIONS), seed=_seed(given["seed"]),
        recovery=_recovery(given["recovery"]), preset=one_of("preset", given["preset"], PRESETS, auto=False),
        method_options=method.build_options(own),
    )
    own_fields = {name: getattr(fields["method_options"], name) for name in method.option_names()}
    own_defaults = {f.name: f.default for f in dataclasses.fields(method.options_type)} if method.options_type else {}
    changed = {name for name in defaults if name not in UNCHECKED and fields[name] != defaults[name]}
    changed |= {name for name, value in own_fields.items() if value != own_defaults[name]}
    if fields["prop_attn"] == "folded" and not method.folds_attention:
        raise PullbackError(f"prop_attn='folded' applies to the single-stage strategies; got strategy {strategy!r} (use prop_attn=True)")
    method.check({**fields, **own_fields}, changed)
    return fields


def _own_values(method: Method, values: dict) -> dict:
    """The method's own fields among ``values``; another method's field is refused unless it is
    at that method's default (options carried over from another strategy)."""
    own = {}
    for name, value in values.items():
        if name in method.option_names():
            own[name] = value
        elif name not in {f.name for f in dataclasses.fields(ReductionOptions)}:
            owners = methods.option_owners(name)
            if any(value != _default_of(owner, name) for owner in owners):
                named = ", ".join(map(repr, owners[:-1])) + " or " * (len(owners) > 1) + repr(owners[-1])
                raise PullbackError(f"{name} is an option of strategy {named}; got strategy {method.name!r}")
    return own


def _default_of(method_name: str, field: str):
    return next(f.default for f in dataclasses.fields(methods.get(method_name).options_type) if f.name == field)


def _ratio(ratio, num_layers: int) -> float | tuple[float, ...]:
    if not (is_real(ratio) or isinstance(ratio, (list, tuple))):
        raise PullbackError(f"ratio must be a float in [0, 1) or one float per layer; got {ratio!r}")
    values = [ratio] if is_real(ratio) else list(ratio)
    if not is_real(ratio) and len(values) != num_layers:
        raise PullbackError(f"ratio has {len(values)} entries but layers has {num_layers}")
    for v in values:
        if not is_real(v) or not (0.0 <= float(v) < 1.0) or v != v:
            raise PullbackError(f"ratio must lie in [0, 1); got {v!r}")
    if not is_real(ratio) and sum(float(v) for v in values) >= 1.0:
        raise PullbackError(f"per-layer ratios must add up to less than 1; got {values}")
    return float(ratio) if is_real(ratio) else tuple(float(v) for v in values)


def _llf(llf):
    """``True`` is the ``masked`` fusion; returns ``masked``, ``full``, ``auto`` or False."""
    if llf is True:
        return "masked"
    if llf is False or (isinstance(llf, str) and llf in LLF_MODES + ("auto",)):
        return llf
    raise PullbackError(f"llf must be True, False, 'masked', 'full' or 'auto'; got {llf!r}")


def _spn(spn):
    if spn is not None and not callable(spn):
        raise PullbackError(f"spn must be None or a callable returning (U, lam); got {type(spn).__name__}")
    return spn


def _eps(eps) -> Optional[float]:
    if eps is None:
        return None
    if not is_real(eps) or not float(eps) >= 0.0 or float(eps) == float("inf"):
        raise PullbackError(f"eps must be None or a finite float >= 0; got {eps!r}")
    return float(eps)


def _prop_attn(prop_attn):
    if not isinstance(prop_attn, bool) and prop_attn not in ("auto", "folded"):
        raise PullbackError(f"prop_attn must be True, False, 'auto' or 'folded'; got {prop_attn!r}")
    return prop_attn


def _recovery(alpha) -> Optional[float]:
    if alpha is not None and (not is_real(alpha) or not 0.0 <= float(alpha) <= 1.0):
        raise PullbackError(f"recovery must be None or a float α in [0, 1] (1: the frozen copy, 0: the kept neighbours' mean); got {alpha!r}")
    return None if alpha is None else float(alpha)


def _seed(seed) -> Optional[int]:
    if seed is None:
        return None
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise PullbackError(f"seed must be an int or None; got {seed!r}")
    return int(seed)
