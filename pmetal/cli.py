"""The ``pmetal`` command line.

Each subcommand is one :class:`Command` in :data:`COMMANDS`: a help line, a
function that declares its arguments, and a function that runs it and
returns the exit status. A later subcommand (``start``, ``status``, ``stop``,
``bench``, ``generate``, ``discover``) is one more entry in that table.

Exit status: 0 success, 1 a pmetal error (printed as one line, no
traceback), 2 a usage or configuration error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pmetal._version import __version__
from pmetal.config import config_as_dict, load_config, pmetal_home
from pmetal.errors import ConfigError, PMetalError
from pmetal.identity import KEYPAIR_FILE, NodeIdentity

__all__ = ["COMMANDS", "Command", "main"]

_PSK_BYTES = 32


def _fail(args: argparse.Namespace, message: str) -> int:
    """Report a failure that is not a pmetal exception, as main() reports those."""
    print(f"pmetal {args.command}: {message}", file=sys.stderr)
    return 1


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


@dataclass(frozen=True)
class Command:
    """One subcommand: ``run(args)`` returns the exit status."""

    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments


# ------------------------------------------------------------------ config

def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print JSON (sections of fields) instead of TOML-style text")


def _run_config(args: argparse.Namespace) -> int:
    cfg = config_as_dict(load_config())
    if args.json:
        print(json.dumps(cfg, indent=2))
        return 0
    env = os.environ
    print(f"# home: {pmetal_home()}")
    print(f"# psk: {_psk_source(env, cfg['security']['psk_file'])}")
    print(f"# log level: {env.get('PMETAL_LOG_LEVEL') or 'WARNING (default)'}")
    for section, values in cfg.items():
        print(f"\n[{section}]")
        for name, value in values.items():
            var = f"PMETAL_{section.upper()}_{name.upper()}"
            origin = f"  # from {var}" if var in env else ""
            print(f"{name} = {json.dumps(value)}{origin}")
    return 0


def _psk_source(env: Mapping[str, str], psk_file: str) -> str:
    """Where the PSK would come from; never the PSK itself."""
    if env.get("PMETAL_PSK"):
        return "set in PMETAL_PSK (not shown)"
    if psk_file:
        return f"read from security.psk_file ({psk_file})"
    return "none (set PMETAL_PSK or security.psk_file; 'pmetal keygen' makes one)"


# ---------------------------------------------------------------- identity

def _identity_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", type=Path, default=None, metavar="PATH",
                        help="folder of the key pair (default: $PMETAL_HOME or ~/.pmetal)")


def _run_identity(args: argparse.Namespace) -> int:
    home = args.home.expanduser() if args.home is not None else pmetal_home()
    existed = (home / KEYPAIR_FILE).exists()
    ident = NodeIdentity.load_or_create(home)
    print(f"node id     {ident.node_id}")
    print(f"public key  {ident.public_key.hex()}")
    print(f"key file    {ident.path}{'' if existed else ' (created)'}")
    return 0


# ------------------------------------------------------------------ keygen

def _keygen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, metavar="PATH",
                        help="write the key to a new file (mode 0600) instead of printing it")


def _run_keygen(args: argparse.Namespace) -> int:
    psk = os.urandom(_PSK_BYTES).hex()
    if args.out is None:
        print(psk)
        return 0
    path = args.out.expanduser()
    try:
        # O_EXCL: never overwrite a key (or follow a planted symlink).
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _fail(args, f"{path} already exists; refusing to overwrite a key "
                           f"(remove it first if you really mean to replace it)")
    except OSError as exc:
        return _fail(args, f"cannot create {path}: {exc.strerror}")
    try:
        os.fchmod(fd, 0o600)  # a restrictive umask may have removed the owner's bits
        with os.fdopen(fd, "w") as f:
            f.write(psk + "\n")
    except OSError as exc:
        path.unlink(missing_ok=True)
        return _fail(args, f"cannot write {path}: {exc.strerror}")
    print(f"wrote a new PSK to {path}; copy it to every node of the namespace and set "
          f"PMETAL_SECURITY_PSK_FILE={path.absolute()}")
    return 0


# ------------------------------------------------------------------- table

COMMANDS: dict[str, Command] = {
    "config": Command("print the effective configuration (environment applied)",
                      _run_config, _config_arguments),
    "identity": Command("show this machine's node id, creating its key pair on first use",
                        _run_identity, _identity_arguments),
    "keygen": Command("make a new random namespace PSK", _run_keygen, _keygen_arguments),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        args = parser.parse_args(argv)
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
