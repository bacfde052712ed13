"""``pmetal bench``: measure this machine. One subcommand per benchmark:

- ``pmetal bench allreduce``: all_reduce over 127.0.0.1 with 2 and 4
  ranks (real processes), each strategy and the automatic choice, timed
  like nccl-tests (:mod:`pmetal.bench.allreduce`), then the issue's
  targets against torch.distributed gloo (run too when torch is
  installed) and the anchors' MPI figures.

Exit status: 0 when every result was right, 1 when some all_reduce gave a
wrong element (the tables say where) or a rank failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pmetal.errors import ConfigError

_STRATEGIES = ("ring", "tree", "naive", "auto")
_DEFAULTS: dict[str, object] = {}  # allreduce's option defaults, for the header


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    allreduce = sub.add_parser(
        "allreduce", help="all_reduce time, algbw and busbw per size, strategy and world "
                          "size, like nccl-tests",
        description="all_reduce of float32 sums over 127.0.0.1, ranks as processes; "
                    "tables like nccl-tests, then the targets against gloo and MPI.")
    allreduce.add_argument("--world", default="2,4", metavar="N,M",
                           help="world sizes (default 2,4)")
    allreduce.add_argument("--min-bytes", default="4", metavar="SIZE",
                           help="smallest buffer, e.g. 4, 1K (default 4)")
    allreduce.add_argument("--max-bytes", default="64M", metavar="SIZE",
                           help="largest buffer, e.g. 64M (default 64M)")
    allreduce.add_argument("--step-factor", type=int, default=4, metavar="F",
                           help="each size is F times the one before (default 4)")
    allreduce.add_argument("--iters", type=int, default=15, metavar="R",
                           help="timed repetitions per size (default 15; the median is "
                                "shown)")
    allreduce.add_argument("--warmup", type=int, default=3, metavar="W",
                           help="untimed repetitions first (default 3)")
    allreduce.add_argument("--strategy", default="ring,tree,naive,auto", metavar="S,..",
                           help="strategies among ring, tree, naive, auto (default all)")
    allreduce.add_argument("--same-machine", choices=("off", "on", "both"), default="off",
                           help="the ranks' same-machine path (shared memory; "
                                "collectives.shared_memory): off measures what a LAN uses "
                                "(default off)")
    allreduce.add_argument("--anchors", choices=("auto", "off"), default="auto",
                           help="also run torch.distributed gloo when torch is installed "
                                "(default auto)")
    allreduce.add_argument("--chunk-bytes", default=None, metavar="SIZE",
                           help="the ring's largest message (default: collectives."
                                "chunk_bytes)")
    allreduce.add_argument("--tree-max-bytes", default=None, metavar="SIZE",
                           help="auto's tree/ring threshold (default: collectives."
                                "tree_max_bytes)")
    allreduce.add_argument("--timeout", type=float, default=30.0, metavar="S",
                           help="seconds one operation may take (default 30)")
    allreduce.add_argument("--markdown", action="store_true",
                           help="print markdown tables (for docs/performance.md)")
    _DEFAULTS.update({a.dest: a.default for a in allreduce._actions if a.dest != "help"})


def _command(args: argparse.Namespace, parser_defaults: dict[str, object]) -> str:
    """The command line that repeats this run (options that differ from
    the defaults), for the header."""
    parts = ["pmetal bench allreduce"]
    for name, default in parser_defaults.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def _run_bench(args: argparse.Namespace) -> int:
    if args.benchmark == "allreduce":
        return _run_allreduce(args)
    raise ConfigError(f"unknown benchmark {args.benchmark!r}")  # argparse refuses it first


def _run_allreduce(args: argparse.Namespace) -> int:
    from pmetal.bench.allreduce import parse_size, sizes_between
    from pmetal.bench.report import Options, run

    try:
        worlds = tuple(int(w) for w in args.world.split(",") if w.strip())
    except ValueError:
        raise ConfigError(f"--world {args.world!r}: write world sizes such as 2,4") from None
    strategies = tuple(dict.fromkeys(s.strip() for s in args.strategy.split(",") if s.strip()))
    unknown = sorted(set(strategies) - set(_STRATEGIES))
    if unknown or not strategies:
        raise ConfigError(f"--strategy {args.strategy!r}: choose among "
                          f"{', '.join(_STRATEGIES)}")
    options = Options(
        worlds=worlds,
        sizes=sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes),
                            args.step_factor),
        strategies=strategies, iters=args.iters, warmup=args.warmup,
        same_machine={"off": (False,), "on": (True,), "both": (False, True)}[
            args.same_machine],
        anchors=args.anchors == "auto",
        chunk_bytes=None if args.chunk_bytes is None else parse_size(args.chunk_bytes),
        tree_max_bytes=(None if args.tree_max_bytes is None
                        else parse_size(args.tree_max_bytes)),
        timeout=args.timeout, markdown=args.markdown, command=_command(args, _DEFAULTS))
    results = run(options)
    wrong = sum(row.wrong for r in results for rows in r.rows.values() for row in rows)
    wrong += sum(r.cold.wrong for r in results)
    if wrong:
        print(f"pmetal bench allreduce: {wrong} wrong element(s); see #wrong in the tables",
              file=sys.stderr)
        return 1
    return 0
