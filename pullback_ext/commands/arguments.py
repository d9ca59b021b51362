"""Command-line arguments shared by the commands: where the model and the images come from
(``--model demo|timm:NAME|hf:DIR``, ``--weights``, ``--img-size``, ``--images PATH|builtin:NAME``,
``--num-images`` and the deprecated ``--demo``), the output folder ``--out``, the run options
every subcommand has (``--threads``, ``--quiet``: :func:`add_run_arguments`, applied by
:func:`run_options`), the refusal of a results folder an earlier run filled (``--overwrite``:
:func:`refuse_earlier_results`), renamed options whose old spelling still works for one release, and
comma-separated numeric values validated with the option named in errors. The vocabulary every
command shares is the table of docs/cli.md."""

from __future__ import annotations

import argparse
import contextlib
import warnings
from pathlib import Path
from typing import Iterator, Optional

from pullback_ext.errors import PullbackError
from pullback_ext.sources.images import builtin_help, builtin_names

MODEL_HELP = "demo (the embedded demo model), timm:NAME (random weights unless --weights) or hf:DIR (a local transformers folder)"
BUILTIN_HELP = f"{builtin_help()}; builtin:scenes is the default with --model demo"
IMAGES_HELP = f"a folder of images, or a built-in set: {BUILTIN_HELP}"
DEMO_SPELLING = "--model demo --images builtin:scenes"


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text}")
    return value


def add_source_arguments(parser: argparse.ArgumentParser, num_images: int, num_images_help: str, *,
                         model_help: str = MODEL_HELP, images_help: str = IMAGES_HELP, img_size: bool = False) -> None:
    """``--model``, ``--weights`` (, ``--img-size``), ``--images``, ``--num-images`` and ``--demo``
    as one group; read them back with :func:`model_spec` and :func:`image_source`."""
    group = parser.add_argument_group("model and images")
    group.add_argument("--model", metavar="SPEC", help=model_help)
    group.add_argument("--weights", metavar="FILE", help="local model weights: a state dict (.safetensors / .pth); demo: a demo "
                       "weights file (default: the shipped one); hf:DIR: default the folder's own")
    if img_size:
        group.add_argument("--img-size", type=positive_int, default=None, help="timm models: build for this input size")
    group.add_argument("--images", metavar="PATH|builtin:NAME", help=images_help)
    group.add_argument("--num-images", type=int, default=num_images, help=f"{num_images_help} (default {num_images})")
    group.add_argument("--demo", action="store_true", help=f"deprecated spelling of {DEMO_SPELLING}")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``--threads N`` and ``--quiet``. ``pullback_ext.cli`` adds them to every subcommand after its
    own ``add_arguments`` and runs the command inside :func:`run_options`, so a subcommand gets
    them without defining them (one that still defines either keeps its own). They join the
    subcommand's own "run" section when it has one, so that ``--help`` shows one such section."""
    group = next((g for g in parser._action_groups if g.title == "run"), None) or parser.add_argument_group("run")
    for flag, kwargs in (("--threads", dict(type=positive_int, default=None, metavar="N", help="torch CPU threads (default torch's)")),
                         ("--quiet", dict(action="store_true", help="no progress output and no info lines (which file was written, which "
                                                                   "stage runs); results, warnings and errors still show"))):
        try:
            group.add_argument(flag, **kwargs)
        except argparse.ArgumentError:  # the subcommand defines it itself
            pass


@contextlib.contextmanager
def run_options(args: argparse.Namespace) -> Iterator[None]:
    """Apply :func:`add_run_arguments`'s options around a command: ``--threads`` sets torch's CPU
    threads; ``--quiet`` silences progress output and info lines inside the block
    (:func:`pullback_ext.progress.silenced`)."""
    from pullback_ext.progress import silenced

    if getattr(args, "threads", None) is not None:
        import torch

        torch.set_num_threads(args.threads)
    with silenced() if getattr(args, "quiet", False) else contextlib.nullcontext():
        yield


def warn_if_busy(args: argparse.Namespace, what: str = "wall-clock times") -> None:
    """At the start of a timed run, once its options are checked (an argument error stays one
    line): one warning line on stderr when the machine's load average exceeds its cores
    (:func:`pullback_ext.machine.busy_note`)."""
    import sys

    from pullback_ext.machine import busy_note

    note = busy_note(what)
    if note is not None:
        print(f"pullback {getattr(args, 'command', None) or 'bench'}: warning: {note}", file=sys.stderr, flush=True)


def model_spec(args: argparse.Namespace, required: bool = True):
    """The :class:`~pullback_ext.sources.models.ModelSpec` of ``--model`` (``--demo``: demo, with
    a deprecation warning); None when neither is given and not ``required``."""
    from pullback_ext.sources.models import MODEL_GRAMMAR, ModelSpec, parse_model

    if args.demo:
        warnings.warn(f"--demo is deprecated and will be removed in the next release; write {DEMO_SPELLING}",
                      FutureWarning, stacklevel=2)
        if args.model is not None and parse_model(args.model).kind != "demo":
            raise PullbackError(f"--demo: conflicts with --model {args.model!r}")
        return ModelSpec("demo")
    if args.model is None:
        if required:
            raise PullbackError(f"--model: required ({MODEL_GRAMMAR})")
        return None
    return parse_model(args.model)


def image_source(args: argparse.Namespace, model):
    """The :class:`~pullback_ext.sources.image_sets.ImageSource` of ``--images``: a folder or
    ``builtin:NAME``; with the demo model (``model.kind == "demo"``) it defaults to builtin:scenes."""
    from pullback_ext.sources.images import open_images

    if args.num_images < 1:
        raise PullbackError(f"--num-images must be at least 1; got {args.num_images}")
    if args.images is not None:
        return open_images(args.images)
    if model is None or model.kind != "demo":
        raise PullbackError(f"--images: required with --model {model} (a folder, or one of {', '.join(builtin_names())})")
    return open_images("builtin:scenes")


def output_folder(path: str, flag: str = "--out") -> Path:
    """``path`` as an output folder, checked before any work is done: an existing file is refused
    (an output folder never replaces a file)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise PullbackError(f"{flag}: {path!r} is an existing file; expected a folder (it is never overwritten)")
    return folder


def add_overwrite_argument(parser, flag: str = "--out") -> None:
    """``--overwrite``, read by :func:`refuse_earlier_results`: every command that writes a results
    folder takes it."""
    parser.add_argument("--overwrite", action="store_true",
                        help=f"replace the results an earlier run wrote in {flag} (without it such a folder is refused)")


def refuse_earlier_results(args: argparse.Namespace, folder: Path, names, what: str, *, flag: str = "--out",
                           resumable: bool = False) -> None:
    """Before any work: refuse a ``folder`` that already holds one of ``names`` (file names or glob
    patterns inside it) from an earlier run, unless ``--overwrite`` (a ``resumable`` command: or
    ``--resume``). ``what`` names that earlier run in the one-line message, e.g. "a diagnosis"."""
    overwrite, resume = bool(getattr(args, "overwrite", False)), resumable and bool(getattr(args, "resume", False))
    if overwrite and resume:
        raise PullbackError("--overwrite: conflicts with --resume (--resume continues the run in --out, --overwrite replaces it)")
    if overwrite or resume:
        return
    found = sorted({p.relative_to(folder).as_posix() for name in names for p in Path(folder).glob(name)})
    if found:
        shown = ", ".join(found[:3]) + (", …" if len(found) > 3 else "")
        how = ("pass --resume to continue it, --overwrite to replace it, or choose another folder" if resumable
               else "pass --overwrite to replace it or choose another folder")
        raise PullbackError(f"{flag}: {str(folder)!r} already holds {what} ({shown}); {how}")


def results_folder(args: argparse.Namespace, names, what: str, *, resumable: bool = False) -> Path:
    """``--out`` as an output folder (:func:`output_folder`) that holds no earlier results
    (:func:`refuse_earlier_results`), both checked before any work."""
    folder = output_folder(args.out)
    refuse_earlier_results(args, folder, names, what, resumable=resumable)
    return folder


def result_file(out: str, name: str = "results.json") -> Path:
    """``--out DIR`` -> ``DIR/name``; a ``FILE.json`` (the spelling of the last release) is written
    as before, with a FutureWarning."""
    if out.endswith(".json") and not Path(out).is_dir():
        warnings.warn(f"--out {out}: a file is deprecated and will be refused in the next release; name a folder "
                      f"(the result goes to FOLDER/{name})", FutureWarning, stacklevel=2)
        return Path(out)
    return output_folder(out) / name


def _old_dest(old: str) -> str:
    return "deprecated_" + old.lstrip("-").replace("-", "_")


TASK_HELP = ("cls (the CLS embedding, every model) | logits (the classifier output; the demo model) | tokens | pooled | "
             "depth | depth-multi | segmentation (the class logits of the demo's segmentation head) | linear:FILE")
_DEMO_DECODERS = {"cls": "embedding", "logits": "cls"}  # --task on the demo model -> the demo probe's decoder


def add_task_argument(parser, extra: str = "") -> None:
    """``--task NAME``, the probe output ψ (see :data:`TASK_HELP`; ``extra`` adds to the help), and its
    old spelling ``--decoder``."""
    parser.add_argument("--task", default=None, help=f"the probe output ψ: {TASK_HELP}{extra}")
    add_renamed(parser, "--decoder", "--task")


def probe_decoder(args: argparse.Namespace, model: Optional[str], default: Optional[str] = None) -> Optional[str]:
    """The probe's decoder for ``--task`` (default ``default``) on ``model`` (its canonical spelling).

    On the demo model ``cls`` is the CLS embedding (the probe's ``embedding``) and ``logits`` the
    classifier (the probe's ``cls``), so that ``cls`` means the CLS embedding for every model. The old
    ``--decoder`` keeps its old meaning for this release (a FutureWarning gives the ``--task`` spelling).
    """
    demo = model == "demo"
    old = getattr(args, _old_dest("--decoder"), None)
    if old is not None:
        if args.task is not None:
            raise PullbackError(f"--decoder: conflicts with --task {args.task!r}; write --task only")
        warnings.warn(f"--decoder is deprecated and will be removed in the next release; write --task {task_name(old, model)}",
                      FutureWarning, stacklevel=2)
        return old
    task = args.task if args.task is not None else default
    if task == "embedding":
        raise PullbackError("--task: the CLS embedding is spelled cls (for every model)")
    if task == "logits" and not demo:
        raise PullbackError(f"--task logits: the classifier output is probed on the demo model only; "
                            f"for {model or 'this model'} write --task cls (the CLS embedding)")
    return _DEMO_DECODERS.get(task, task) if demo else task


def task_name(decoder: str, model: Optional[str]) -> str:
    """The ``--task`` spelling of the probe decoder ``decoder`` on ``model`` (the inverse of
    :func:`probe_decoder`): on the demo model ``embedding`` is ``cls`` and ``cls`` is ``logits``."""
    return {v: k for k, v in _DEMO_DECODERS.items()}.get(decoder, decoder) if model == "demo" else decoder


def add_renamed(parser, old: str, new: str, **kwargs) -> None:
    """``old`` as the deprecated spelling of the option ``new`` (same ``kwargs``, default None);
    read both back with :func:`renamed`."""
    parser.add_argument(old, dest=_old_dest(old), default=None, help=f"deprecated spelling of {new}", **kwargs)


def _warn_renamed(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; write {new}", FutureWarning, stacklevel=3)


def renamed(args: argparse.Namespace, old: str, new: str):
    """The value of ``new``, or of its deprecated spelling ``old`` (with a FutureWarning)."""
    value, old_value = getattr(args, new.lstrip("-").replace("-", "_")), getattr(args, _old_dest(old))
    if old_value is None:
        return value
    _warn_renamed(old, new)
    if value is not None and value != old_value:
        raise PullbackError(f"{old}: conflicts with {new} {value!r}")
    return old_value


def renamed_switch(args: argparse.Namespace, old: str, new: str) -> bool:
    """Whether the switch ``new`` or its deprecated spelling ``old`` (with a FutureWarning) is on;
    ``old`` added by :func:`add_renamed` with ``action="store_true"``."""
    if getattr(args, _old_dest(old)):
        _warn_renamed(old, new)
        return True
    return bool(getattr(args, new.lstrip("-").replace("-", "_")))


def option_value(text: str):
    """One value of a reduction option on the command line (``--sweep METHOD:FIELD=v1,v2``,
    ``--option FIELD=VALUE``): an int, a float, ``off`` / ``false`` (False), ``on`` / ``true``
    (True), in any case (``False`` as Python writes it), or a word."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"off": False, "false": False, "on": True, "true": True}.get(text.lower(), text)


def comma_floats(text: str, name: str) -> tuple:
    """``"0.1,0.2"`` -> ``(0.1, 0.2)``; ``name`` is the option, for the error message."""
    try:
        values = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise PullbackError(f"{name} must be comma-separated numbers; got {text!r}") from None
    if not values:
        raise PullbackError(f"{name} must name at least one value")
    return values


def comma_ints(text: str, name: str) -> tuple:
    """``"1,64"`` -> ``(1, 64)``: positive integers only."""
    values = comma_floats(text, name)
    if any(v != int(v) or v < 1 for v in values):
        raise PullbackError(f"{name} must be positive integers; got {text!r}")
    return tuple(int(v) for v in values)

