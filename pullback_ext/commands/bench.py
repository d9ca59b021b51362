"""``pullback bench``: the kernel microbenchmarks (fused ops vs eager and torch.compile references).

Prints a table and, with ``--out DIR``, writes ``DIR/results.json`` and the speed-up plot ``DIR/results.png``;
``--results-page NAME`` also publishes a stamped page ``docs/results/NAME.md`` from that JSON.
"""

from __future__ import annotations

import argparse

from pullback_ext.progress import info_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pullback_ext.commands.arguments import add_overwrite_argument
    from pullback_ext.results_pages import ALLOW_DIRTY_HELP

    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats (about a minute)")
    parser.add_argument("--out", default=None, metavar="DIR", help="write DIR/results.json and the speed-up plot DIR/results.png "
                                                                 "(a FILE.json, the old spelling, still works with a warning)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="device to benchmark (default: cpu)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per case (default: 15 on the CPU, 50 on CUDA, quick: 3)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile(reference) column")
    parser.add_argument("--kernels", action="store_true",
                        help="CUDA only: also profile each unchecked fused call and print its kernels and launch gaps")
    parser.add_argument("--results-page", default=None, metavar="NAME",
                        help="also publish the results as docs/results/NAME.json and a stamped page NAME.md (or DIR/NAME: into DIR)")
    parser.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    add_overwrite_argument(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from pullback_ext.bench import ops, report
    from pullback_ext.commands.arguments import refuse_earlier_results, result_file, warn_if_busy
    from pullback_ext.errors import PullbackError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise PullbackError("--device cuda: no CUDA device is available to torch")
    if args.repeats is not None and args.repeats < 1:
        raise PullbackError(f"--repeats: expected a positive count, got {args.repeats}")
    if args.kernels and args.device != "cuda":
        raise PullbackError("--kernels: profiles CUDA kernels, needs --device cuda")
    if args.results_page:
        from pullback_ext.results_pages import refuse_dirty

        refuse_dirty(args.allow_dirty)
    out = result_file(args.out) if args.out else None
    if out is not None:
        refuse_earlier_results(args, out.parent, (out.name, out.with_suffix(".png").name), "benchmark results")
    if args.device == "cpu":
        warn_if_busy(args)
    result = ops.run(args.device, args.quick, args.repeats, not args.no_compile, kernel_breakdown=args.kernels)
    print(report.format_table(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        for path in report.write_outputs(result, str(out)):
            info_line(f"wrote {path}")
    if args.results_page:
        from pullback_ext.results_pages import publish_command_results

        render = lambda r: "```\n" + report.format_table(r) + "\n```"  # noqa: E731
        command = getattr(args, "command_line", None)  # None when run as benchmarks/bench_ops.py
        info_line("wrote", *publish_command_results(result, args.results_page, f"Fused-op microbenchmarks ({args.device})", render,
                                                  command, args.allow_dirty))
    return 0
