"""all_reduce like nccl-tests: the same code as ``pmetal bench allreduce``
(:mod:`pmetal.bench.allreduce`, in the package so that an installed
pmetal can measure itself).

    python -m benchmarks allreduce            # 2 and 4 ranks, 4 B to 64 MiB
    python -m benchmarks allreduce --quick    # up to 1 MiB, 3 repetitions

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import sys

from pmetal.cli import main as pmetal_main

QUICK = ["--max-bytes", "1M", "--iters", "3", "--warmup", "1"]


def main(quick: bool = False) -> int:
    return pmetal_main(["bench", "allreduce", *(QUICK if quick else [])])


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
