"""What every token-reduction method is: one :class:`Method` object, exported by its own module.

A method names itself (``name``, ``title``), owns its options (``options_type``: a frozen dataclass
of the fields only it takes, validated when built; ``takes``: the common fields of
:class:`~pullback_ext.prune.reduction_options.ReductionOptions` it accepts besides ``strategy``),
states what it needs of a model (:class:`Needs`, matched against a family's :class:`Traits` by
:func:`refusal`), and implements four steps:

- :meth:`Method.check`: rules between the fields once the options are built (messages name the option);
- :meth:`Method.resolve`: the ``auto`` choices and the checks that need the model's :class:`BackboneShape`;
- :meth:`Method.run`: the block loop, ``(final [B, N, D], {i: features after block i})``, full-length;
- :meth:`Method.patch_tokens_per_block`: its patch-token count after each block (for η and FLOPs);

plus :meth:`Method.describe` (the selection and averaging rules its comparison rows are labelled
by) and ``sweep`` (the knob values ``pullback evaluate --pareto`` sweeps by default; a method with
more knobs than one also names in ``defaults_sweep`` the one a user sets, for a row of its defaults).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from pullback_ext.errors import PullbackError
from pullback_ext.prune.split_block import SplitBlock

PRUNED = {"masked": "pruned, masked LLF", "full": "pruned, full LLF", False: "pruned, no LLF"}


@dataclass(frozen=True)
class BackboneShape:
    """What resolving options needs to know of a backbone: ``depth`` blocks, ``num_prefix`` tokens
    before the patches (CLS, registers), whether it ``has_cls``, whether its features feed a
    dense decoder (``dense_neck``: ``mode="auto"`` prunes), and ``num_patch``: its patch tokens at
    the configured image size (None: not known; a method whose ``auto`` choice needs it says so)."""

    depth: int
    num_prefix: int
    has_cls: bool
    dense_neck: bool = False
    num_patch: Optional[int] = None


@dataclass(frozen=True)
class Reduction:
    """What the block loop runs: ``options`` with every ``auto`` chosen and checked against
    ``backbone``, its ``method``, and ``strategy``: what the method built from the options (the
    single-stage scorer, TAP's register; None for the others)."""

    options: object
    backbone: BackboneShape
    method: "Method"
    strategy: object = None


class BlockLoop(NamedTuple):
    """How a method runs a model's blocks: ``blocks``; ``call_block(block, state, bias)`` runs one
    block on ``state.x`` (``bias``: additive attention mask or None) and returns the new current
    tokens; ``attention_probs(block, x, bias)`` gives its head-averaged attention ``[B, K, K]``;
    ``split`` runs a block in its attention and MLP halves (None: this model's blocks cannot be split)."""

    blocks: Sequence
    call_block: Callable
    attention_probs: Callable
    split: Optional[SplitBlock]


class Traits(NamedTuple):
    """What a model family offers the methods: a class token, a rotary position embedding, blocks
    that run in two halves (attention, MLP), and room for one more prefix token."""

    has_cls: bool
    rotary: bool = False
    splittable: bool = True
    takes_extra_token: bool = True

    @classmethod
    def of(cls, family, model=None) -> "Traits":
        """The traits of ``model`` of the family adapter ``family`` (:mod:`pullback_ext.families`)."""
        return cls(has_cls=family.has_cls(model), rotary=family.rotary, splittable=family.splittable,
                   takes_extra_token=family.takes_extra_token)


@dataclass(frozen=True)
class Needs:
    """What a method needs of a model; each is None or the reason, in the words of a refusal
    ("needs a class token (…)")."""

    class_token: Optional[str] = None  # reads the class token
    split_blocks: Optional[str] = None  # reduces between a block's attention and its MLP
    no_rotary: Optional[str] = None  # makes tokens that have no rotary position
    extra_token: Optional[str] = None  # adds a prefix token of its own


def refusal(method: "Method", traits: Traits) -> Optional[str]:
    """Why a model with ``traits`` cannot run ``method`` (a sentence after "it"), or None."""
    needs = method.needs
    if needs.class_token and not traits.has_cls:
        return f"needs a class token ({needs.class_token}); this model has none"
    if needs.split_blocks and not traits.splittable:
        return f"runs blocks in two halves ({needs.split_blocks}), which this model's blocks do not allow"
    if needs.no_rotary and traits.rotary:
        return needs.no_rotary
    if needs.extra_token and not traits.takes_extra_token:
        return needs.extra_token
    return None


class Method:
    """Base of every method (see the module docstring). Subclasses set the class attributes and
    override :meth:`run` and :meth:`patch_tokens_per_block`; the other steps have defaults."""

    name: str = ""
    short: str = ""  # the name in prose ("ToMe")
    title: str = ""
    kind: str = "original"  # "original" (as its authors define it), "ours" (the library's own), "criterion" (a plain score)
    single_stage: bool = False  # a scorer of the staged single-stage pipeline (one column of the support table)
    options_type: Optional[type] = None  # frozen dataclass of the method's own fields
    takes: tuple = ()  # common ReductionOptions fields it accepts besides strategy and seed
    needs: Needs = Needs()
    attention: str = "none"  # attention probabilities of earlier blocks read: "none" | "last" | "all"
    folds_attention: bool = False  # takes prop_attn="folded"
    own_loop: bool = False  # keeps its own token state (Hugging Face layers run on its current tokens directly)
    staged: bool = False  # reduces at the single-stage ``layers`` by ``ratio`` (swept like them)
    sweep: dict = {}  # default --pareto sweep: {field: values}
    defaults_sweep: dict = {}  # one more --pareto row: these fields swept, the rest at their defaults
    head_from: Optional[str] = None  # the scorer its head= is ("importance": a trained head, "oracle": imp*)
    head_optional: bool = False  # runs without a head too
    trained_by: Optional[str] = None  # the command whose output folder its head= is (a learned module of its own)
    # an image's token counts depend on the other images of its batch (ALGM: the batch's smallest count; TAP: the
    # batch-mean split over depth), and so do its outputs and FLOPs: a matched-cost comparison measures it one image
    # at a time (pullback_ext.comparison.pareto)
    batch_dependent: bool = False

    @property
    def ours(self) -> bool:
        """The library's own method (marked in tables and plots): ``kind == "ours"``."""
        return self.kind == "ours"

    def sweep_grid(self, mode: str, ratios: tuple) -> dict:
        """``{field: values}`` swept by default in a matched-cost comparison (``mode``: the task's,
        ``ratios``: the fractions the staged methods remove)."""
        return {"ratio": ratios} if self.staged else dict(self.sweep)

    def sweep_base(self, base: dict) -> dict:
        """The options a sweep point takes from ``base`` (``layers``, ``mode``, ``preset`` of the comparison)."""
        return {}

    def option_names(self) -> tuple:
        """The method's own option fields."""
        return tuple(f.name for f in dataclasses.fields(self.options_type)) if self.options_type else ()

    def build_options(self, values: dict):
        """The method's options object from its own ``values`` (None when it has no options)."""
        return self.options_type(**values) if self.options_type else None

    def checked_head(self, head, layers: tuple):
        """``head=`` checked for this method: a callable, a non-empty sequence of callables (kept as
        a tuple), or None."""
        if isinstance(head, (list, tuple)):
            if not head or not all(callable(h) for h in head):
                raise PullbackError(f"head must be a callable or a non-empty sequence of callables (one per stage); got {head!r}")
            return tuple(head)
        if head is not None and not callable(head):
            raise PullbackError(f"head must be a callable or a non-empty sequence of callables (one per stage); got {head!r}")
        return head

    def check(self, fields: dict, changed: set) -> None:
        """Rules between the fields of built options (``fields``: common and own, by name;
        ``changed``: the fields that differ from their defaults)."""
        refused = sorted(changed - set(self.takes) - set(self.option_names()))
        if refused:
            raise PullbackError(f"strategy {self.name!r} does not take {refused[0]}; it takes {self.takes_in_words()}")

    def takes_in_words(self) -> str:
        return ", ".join(self.takes + self.option_names()) or "no option"

    def resolve(self, options, backbone: BackboneShape) -> dict:
        """The fields to replace in ``options`` for ``backbone`` (its ``auto`` choices), after checks."""
        return {}

    def build(self, options):
        """What the block loop needs besides the options (e.g. a scorer); None by default."""
        return None

    def check_blocks(self, reduction: Reduction, blocks: Sequence, width: int) -> None:
        """At patch time: checks against the model's ``blocks`` and token ``width`` (none by default)."""

    def run(self, reduction: Reduction, x: torch.Tensor, loop: BlockLoop, take=()):
        """Run ``loop.blocks`` on ``x [B, N, D]`` reducing tokens. Returns ``(final [B, N, D],
        {i: features after block i [B, N, D] for i in take})``, full-length. After each block the
        loop reports where every original token is (:func:`pullback_ext.prune.token_maps.report`;
        :func:`~pullback_ext.prune.merged_tokens.run_tracked` does it for the loops built on it), so
        that the groups can be read (``pullback visualize``); a loop that does not report cannot be drawn."""
        raise NotImplementedError

    def patch_tokens_per_block(self, reduction: Reduction, num_patch: int) -> list:
        """Patch tokens after each block for ``num_patch`` patch tokens (None where they depend on the
        batch: a method with such counts sets ``batch_dependent``)."""
        raise NotImplementedError

    def eta(self, reduction: Reduction, num_patch: int) -> float:
        """The fraction of the ``num_patch`` patch tokens removed by the end of the last block."""
        return 1.0 - self.patch_tokens_per_block(reduction, num_patch)[-1] / num_patch

    def describe(self, reduction: Reduction) -> dict:
        """``{method, selection, averaging}``: the rules a comparison row of this method is labelled by."""
        return {"method": self.name, "selection": self.title, "averaging": ""}


class BlockLoopMethod(Method):
    """A method that reduces in its own block loop with its own knobs: it takes only its own fields
    (and ``prop_attn`` where ``prop_attn_applies``), has no prune mode, and its rows are labelled by
    the authors' rules ``rules = (selection, averaging)``. Like every method it overrides
    :meth:`run` and :meth:`patch_tokens_per_block`; the per-block merging methods get both from
    :class:`~pullback_ext.prune.methods.merging.MergingMethod` and supply their ranking."""

    own_loop = True
    prop_attn_applies = False
    prop_attn_default = True  # what prop_attn="auto" chooses where it applies
    rules: tuple = ("", "")
    required: tuple = ()  # (field, what it is) that must be given

    def check(self, fields: dict, changed: set) -> None:
        from pullback_ext.prune.option_checks import SINGLE_STAGE_FIELDS

        for name in SINGLE_STAGE_FIELDS:
            if name in changed and name not in self.takes:
                extra = " and prop_attn" if self.prop_attn_applies else ""
                raise PullbackError(f"strategy {self.name!r} does not take {name} (an option of the single-stage strategies); "
                                    f"it takes {', '.join(self.option_names() + tuple(t for t in self.takes if t != 'prop_attn'))}{extra}")
        if fields["mode"] == "prune":
            raise PullbackError(f"strategy {self.name!r} has no prune mode (full-length features always give reduced tokens "
                                f"back at their source positions); leave mode at 'auto'")
        if fields["prop_attn"] is True and not self.prop_attn_applies:
            raise PullbackError(f"prop_attn applies to ToMe and the single-stage merges; {self.short} runs its "
                                f"attention unchanged")
        if self.required and fields[self.required[0]] is None:
            raise PullbackError(f"strategy {self.name!r} needs {self.required[0]}= ({self.required[1]})")

    def resolve(self, options, backbone: BackboneShape) -> dict:
        chosen = options.prop_attn if isinstance(options.prop_attn, bool) else self.prop_attn_default
        prop_attn = chosen if self.prop_attn_applies else False
        return {"mode": "merge", "prop_attn": prop_attn}

    def describe(self, reduction: Reduction) -> dict:
        selection, averaging = self.rules
        return {"method": self.name, "selection": selection, "averaging": averaging}

