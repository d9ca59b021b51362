"""Op microbenchmarks: fused kernels vs eager torch and torch.compile of the references.

    python benchmarks/bench_ops.py [--quick] [--device cpu|cuda] [--out out/bench_ops.json]

Same as ``pullback bench``; see pullback_ext/bench/ops.py for what is measured.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pullback_ext.commands import bench  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
