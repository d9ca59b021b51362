"""``pullback demo``: everything the library does, on the embedded demo model and held-out scenes.

The run itself is the application :mod:`pullback_ext.demo.pipeline`: the model's held-out quality,
then its stages (diagnostic, importance head, pruning), with ``DIR/results.json`` rewritten
after every stage.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument
    from pullback_ext.demo.page import PAGE
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP

    parser.add_argument("--out", default="out/demo", metavar="DIR", help="output folder (default: out/demo)")
    parser.add_argument("--quick", action="store_true", help="smaller, faster run (about 2 minutes on 2 cores)")
    parser.add_argument("--weights", default=None, metavar="FILE",
                        help="demo model weights (.safetensors; default: the weights shipped with the package)")
    parser.add_argument("--results-page", nargs="?", const=PAGE, default=None, metavar="NAME",
                        help=f"also publish the run as the stamped page docs/results/NAME.{{json,md}} (default NAME: {PAGE}; "
                             "needs a checkout without local changes)")
    parser.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    from pullback_ext.commands.arguments import results_folder, warn_if_busy
    from pullback_ext.demo.pipeline import run_demo

    out_dir = results_folder(args, ("results.json",), "a demo run")  # rewritten after every stage: there from the first
    if args.results_page:
        from pullback_ext.results_pages import refuse_dirty

        refuse_dirty(args.allow_dirty)  # before the run, not after it
    out_dir.mkdir(parents=True, exist_ok=True)
    warn_if_busy(args, "its stage times and measured speed-ups")
    code = run_demo(out_dir, bool(args.quick), args.weights)
    if args.results_page:
        import json

        from pullback_ext.demo import page
        from pullback_ext.progress import info_line
        from pullback_ext.results_pages import publish_command_results

        results = json.loads((out_dir / "results.json").read_text())
        info_line("wrote", *publish_command_results(results, args.results_page, page.TITLE, page.render,
                                                   getattr(args, "command_line", None), args.allow_dirty))
    return code
