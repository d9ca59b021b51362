"""``pullback demo``: everything the library does, on the embedded demo model and held-out scenes.

The run itself is the application :mod:`pullback_ext.demo.pipeline`: the model's held-out quality,
then its stages (diagnostic, importance head, pruning), with ``DIR/results.json`` rewritten
after every stage.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="out/demo", metavar="DIR", help="output folder (default: out/demo)")
    parser.add_argument("--quick", action="store_true", help="smaller, faster run (about 2 minutes on 2 cores)")
    parser.add_argument("--weights", default=None, metavar="FILE",
                        help="demo model weights (.safetensors; default: the weights shipped with the package)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pullback_ext.commands.arguments import warn_if_busy
    from pullback_ext.demo.pipeline import run_demo
    from pullback_ext.errors import PullbackError

    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise PullbackError(f"--out: expected a folder, got the existing file {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    warn_if_busy(args, "its stage times and measured speed-ups")
    return run_demo(out_dir, bool(args.quick), args.weights)
