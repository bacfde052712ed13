"""Run the pmetal benchmark suites and print their tables.

    python -m benchmarks                # every suite
    python -m benchmarks transport      # one suite
    python -m benchmarks --quick        # fewer repetitions (smoke run)

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import actors, transport

SUITES = {"transport": transport.main, "actors": actors.main}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"suites to run: {', '.join(SUITES)} (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    unknown = set(args.suites) - set(SUITES)
    if unknown:
        parser.error(f"unknown suite(s) {sorted(unknown)}; choose from {list(SUITES)}")
    for name in args.suites or list(SUITES):
        SUITES[name](quick=args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
