"""Run the pmetal benchmark suites and print their tables.

    python -m benchmarks                # transport, actors and cluster
    python -m benchmarks transport      # one suite
    python -m benchmarks --quick        # fewer repetitions (smoke run)
    python -m benchmarks instructions   # opt-in: instruction counts (valgrind)
    python -m benchmarks allreduce      # collectives only, = pmetal bench allreduce
    python -m benchmarks pipeline       # opt-in: Llama decoding, = pmetal bench pipeline
    python -m benchmarks kernels        # opt-in: quantized matmul GB/s per GGUF format
    python -m benchmarks store          # opt-in: pulling a model between nodes
    python -m benchmarks capacity       # opt-in: what measuring a node for placement costs
    python -m benchmarks placement      # opt-in: placement groups and placed tasks, 3 nodes
    python -m benchmarks ownership      # opt-in: ObjectRefs inside values (fetch, lend, release)

All traffic stays on loopback (the cluster suite uses 127.0.0.11-13).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import (
    actors,
    allreduce,
    capacity,
    cluster,
    instructions,
    kernels,
    ownership,
    pipeline,
    placement,
    store,
    transport,
)

SUITES = {"transport": transport.main, "actors": actors.main, "cluster": cluster.main,
          "allreduce": allreduce.main}
# Run only when named: instructions needs valgrind; pipeline loads a model;
# kernels and capacity measure compute, not the cluster; store moves the default model.
OPT_IN = {"instructions": instructions.main, "pipeline": pipeline.main, "kernels": kernels.main,
          "capacity": capacity.main, "store": store.main, "placement": placement.main,
          "ownership": ownership.main}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"suites to run: {', '.join([*SUITES, *OPT_IN])} "
                             f"(default: {', '.join(SUITES)})")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    every = {**SUITES, **OPT_IN}
    unknown = set(args.suites) - set(every)
    if unknown:
        parser.error(f"unknown suite(s) {sorted(unknown)}; choose from {list(every)}")
    for name in args.suites or list(SUITES):
        every[name](quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
