"""The ``pullback`` command line.

Each subcommand lives in ``pullback_ext/commands/<name>.py`` and exposes
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when their
subcommand runs, so ``pullback --help`` stays fast. Every subcommand also gets ``--threads`` and
``--quiet`` (``commands.arguments.add_run_arguments``), applied around its ``run``. User errors (``PullbackError`` and its
subclasses, and files that cannot be opened) and argument errors (:class:`OneLineParser`) become a
one-line message on stderr and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

# name -> (module, one-line help)
COMMANDS = {
    "demo": ("pullback_ext.commands.demo", "run everything the library does on the embedded demo model"),
    "diagnose": ("pullback_ext.commands.diagnose", "matrix-free tractability diagnostic of a backbone-decoder pair"),
    "train": ("pullback_ext.commands.train", "SPN, importance head, VAE, TAP, DTEM, or fine-tune a head"),
    "eval-head": ("pullback_ext.commands.eval_head", "Spearman rho of an importance head against imp*"),
    "evaluate": ("pullback_ext.commands.evaluate", "token pruning / merging quality and cost against baselines"),
    "subprobe": ("pullback_ext.commands.subprobe", "interventions on a linear token probe's geometric subspace (Geosubprobe)"),
    "bench": ("pullback_ext.commands.bench", "run the kernel microbenchmarks"),
    "study": ("pullback_ext.commands.study", "sweep a measurement (diagnose, subspace, criteria) over the layers of a model"),
    "visualize": ("pullback_ext.commands.visualize", "pictures of the merges: each merged group painted over the image at chosen blocks"),
}

# Operating-system errors about a path the user named (the message names the path).
USER_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, FileExistsError)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose argument errors are one line on stderr (``pullback CMD: error:
    MESSAGE; see pullback CMD --help``) and exit code 2, instead of the usage text; its subparsers
    are of the same class."""

    def error(self, message: str):
        print(f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pullback", description=__doc__.splitlines()[0])
    from pullback_ext import __version__
    from pullback_ext.commands.arguments import add_run_arguments

    parser.add_argument("--version", action="version", version=f"pullback_ext {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
        add_run_arguments(p)  # --threads, --quiet: every subcommand
    return parser


def main(argv=None) -> int:
    from pullback_ext.commands.arguments import run_options
    from pullback_ext.errors import PullbackError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argument error already reported in one line
        return int(exc.code or 0)
    args.command_line = "pullback " + shlex.join(sys.argv[1:] if argv is None else argv)  # as the user typed it
    try:
        with run_options(args):
            return int(importlib.import_module(args._module).run(args) or 0)
    except (PullbackError, *USER_ERRORS) as exc:
        print(f"pullback {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resumable = " (the same command with --resume continues from what it saved in --out)" if hasattr(args, "resume") else ""
        print(f"pullback {args.command}: interrupted{resumable}", file=sys.stderr)
        return 130


def console_main() -> None:
    """The ``pullback`` command and ``python -m pullback_ext``: ``main()``'s exit status, through
    :func:`pullback_ext.distributed.leave` (a rank of a torchrun job leaves without the
    interpreter's teardown, which torch's gloo threads can abort)."""
    from pullback_ext import distributed

    distributed.leave(main())


if __name__ == "__main__":
    console_main()
