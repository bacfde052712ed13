"""Model engine speed against llama.cpp: the same code as ``pmetal bench pipeline``
(:mod:`pmetal.bench.pipeline`, in the package so that an installed pmetal
can measure itself).

    python -m benchmarks pipeline            # the default model, 3 repetitions
    python -m benchmarks pipeline --quick    # 8 tokens, 1 repetition, 2 prompts, 128-token prefill

llama.cpp runs as the anchor when llama-cpp-python is installed.
"""

from __future__ import annotations

import sys

from pmetal.cli import main as pmetal_main


def main(quick: bool = False) -> int:
    return pmetal_main(["bench", "pipeline", *(["--quick"] if quick else [])])


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
