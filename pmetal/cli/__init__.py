"""The ``pmetal`` command line.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a help line, a
function that declares its arguments, and a function that runs it and
returns the exit status. A later subcommand (``bench``, ``generate``,
``discover``) is one more entry in that table.

This module holds the table, the parser, logging set-up and :func:`main`;
the commands live in ``basic`` (``config``, ``identity``, ``keygen``),
``daemon`` (``start``, ``stop``, the node.json record), ``dashboard``, ``status``
(``status``, ``kill``), ``discover``, ``models``, ``launch`` (with ``_rank``, the
keeper each launched rank runs under), ``generate``, ``serve`` and ``bench``.

Exit status: 0 success, 1 a pmetal error (printed as one line, no
traceback), 2 a usage or configuration error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from pmetal._version import __version__
from pmetal.cli.basic import (_config_arguments, _identity_arguments, _keygen_arguments,
                              _run_config, _run_identity, _run_keygen)
from pmetal.cli.bench import _bench_arguments, _run_bench
from pmetal.cli.daemon import _run_start, _run_stop, _start_arguments
from pmetal.cli.dashboard import _dashboard_arguments, _run_dashboard
from pmetal.cli.discover import _discover_arguments, _run_discover
from pmetal.cli.generate import _generate_arguments, _run_generate
from pmetal.cli.launch import _launch_arguments, _run_launch
from pmetal.cli.models import _models_arguments, _run_models
from pmetal.cli.serve import _run_serve, _serve_arguments
from pmetal.cli.status import _kill_arguments, _run_kill, _run_status, _status_arguments
from pmetal.config import pmetal_home
from pmetal.errors import ConfigError, PMetalError

__all__ = ["COMMANDS", "Command", "main"]


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


@dataclass(frozen=True)
class Command:
    """One subcommand: ``run(args)`` returns the exit status."""

    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


# ------------------------------------------------------------------- table

COMMANDS: dict[str, Command] = {
    "config": Command("print the effective configuration (environment applied)",
                      _run_config, _config_arguments),
    "identity": Command("show this machine's node id, creating its key pair on first use",
                        _run_identity, _identity_arguments),
    "keygen": Command("make a new random namespace PSK", _run_keygen, _keygen_arguments),
    "start": Command("start this machine's node daemon (in the background unless --block)",
                     _run_start, _start_arguments),
    "status": Command("show the running node: members, workers, actors, statistics",
                      _run_status, _status_arguments),
    "dashboard": Command("print the URL of the running node's web dashboard (with the "
                         "namespace's token when it serves beyond loopback)", _run_dashboard,
                         _dashboard_arguments),
    "stop": Command("stop this machine's node daemon and its workers", _run_stop),
    "kill": Command("kill a named actor of the cluster (through this machine's node)",
                    _run_kill, _kill_arguments),
    "discover": Command("list the pmetal nodes visible on the network (mDNS)",
                        _run_discover, _discover_arguments),
    "launch": Command("run a script as N ranks (SPMD), here or on --hosts, with the rank "
                      "environment set", _run_launch, _launch_arguments),
    "generate": Command("run a model as a pipeline over the cluster's machines and stream "
                        "its answer (default: SmolLM2-135M-Instruct)", _run_generate,
                        _generate_arguments),
    "serve": Command("serve a model over the cluster's machines as an OpenAI-compatible HTTP "
                     "API (/v1/chat/completions, /v1/completions; default: "
                     "SmolLM2-135M-Instruct)", _run_serve, _serve_arguments),
    "bench": Command("measure this machine: 'pmetal bench allreduce' (collectives, like "
                     "nccl-tests), 'pipeline' (model engine against llama.cpp), 'agreement' "
                     "(greedy tokens of the engines), 'memory', 'serve' (pmetal serve against "
                     "llama.cpp's server)", _run_bench,
                     _bench_arguments),
    "models": Command("list, fetch or remove the models pipelines run ($PMETAL_HOME/models)",
                      _run_models, _models_arguments),
}


class _Parser(argparse.ArgumentParser):
    """argparse, whose errors for a mistyped command, choice or option name
    the closest known one (Python 3.11's argparse does not)."""

    def error(self, message: str) -> NoReturn:
        super().error(message + _did_you_mean(self, message))


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    if choice:
        known = re.findall(r"'([^']*)'", choice.group(2))
        close = difflib.get_close_matches(choice.group(1), known, n=1, cutoff=0.5)
        return f"; did you mean '{close[0]}'?" if close else ""
    unknown = re.match(r"unrecognized arguments: (.*)$", message)
    if not unknown:
        return ""
    options = [o for action in parser._actions for o in action.option_strings]
    hints = {}
    for word in unknown.group(1).split():
        if word.startswith("-"):
            close = difflib.get_close_matches(word.partition("=")[0], options, n=1, cutoff=0.5)
            if close:
                hints[word] = close[0]
    if len(hints) == 1:
        return f"; did you mean '{next(iter(hints.values()))}'?"
    return ("; did you mean " + ", ".join(f"'{o}' for '{w}'" for w, o in hints.items()) + "?"
            if hints else "")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pmetal", description="Ray-style actor clusters for the machines you own.")
    parser.add_argument("--version", action="version", version=f"pmetal {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log pmetal's INFO messages to stderr (-vv: DEBUG); "
                             "default: $PMETAL_LOG_LEVEL or WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in COMMANDS.items():
        child = sub.add_parser(name, help=command.help, description=command.help)
        command.arguments(child)
    return parser


def _home_error(exc: OSError) -> str | None:
    """What to do about ``exc`` when it concerns a file under PMETAL_HOME (a
    folder that is read-only, full, or another user's); None otherwise."""
    home = pmetal_home()
    where = next((Path(f) for f in (exc.filename, exc.filename2)
                  if isinstance(f, (str, os.PathLike)) and Path(f).is_relative_to(home)), None)
    if where is None:
        return None
    if where.name.startswith("."):   # a temporary file, made to be renamed
        where = where.parent
    return (f"cannot write in {where}: {exc.strerror or exc}. pmetal keeps this machine's state "
            f"in PMETAL_HOME ({home}: the node key pair, node.json, models); make that folder "
            f"writable by this user, or point PMETAL_HOME at one that is "
            f"(export PMETAL_HOME=/a/writable/folder)")


def _subcommand(parser: argparse.ArgumentParser,
                name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


def _log_level(verbose: int, env: Mapping[str, str]) -> int | None:
    """pmetal's log level: -v/-vv, else PMETAL_LOG_LEVEL, else None (leave it)."""
    if verbose:
        return logging.DEBUG if verbose > 1 else logging.INFO
    name = env.get("PMETAL_LOG_LEVEL", "").strip()
    if not name:
        return None
    level = logging.getLevelName(name.upper())
    if not isinstance(level, int):
        raise ConfigError(f"PMETAL_LOG_LEVEL: unknown level {name!r}; "
                          f"use DEBUG, INFO, WARNING or ERROR")
    return level


def _configure_logging(verbose: int) -> None:
    level = _log_level(verbose, os.environ)
    # Does nothing when the embedding program (or pytest) already configured logging.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level is not None:
        logging.getLogger("pmetal").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:
            # Report them with the subcommand's options, the ones meant.
            command = _subcommand(parser, getattr(args, "command", None))
            (command or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except SystemExit as exc:  # --help, --version, usage errors: keep main() returning
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        _configure_logging(args.verbose)
        return COMMANDS[args.command].run(args)
    except ConfigError as exc:
        print(f"pmetal {args.command}: configuration error: {exc}", file=sys.stderr)
        return 2
    except PMetalError as exc:
        print(f"pmetal {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        message = _home_error(exc)
        if message is None:
            raise
        print(f"pmetal {args.command}: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # 'pmetal status | head': the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
