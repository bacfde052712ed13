"""The ``pmetal`` commands that need no node: ``config``, ``identity`` and
``keygen``; and :func:`_fail`, how every command reports a failure that is not
a pmetal exception.

``pmetal start`` makes its namespace PSK with :func:`_write_new_key` from here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from pmetal.config import config_as_dict, load_config, pmetal_home
from pmetal.identity import KEYPAIR_FILE, NodeIdentity

_PSK_BYTES = 32


def _fail(args: argparse.Namespace, message: str) -> int:
    """Report a failure that is not a pmetal exception, as main() reports those."""
    print(f"pmetal {args.command}: {message}", file=sys.stderr)
    return 1



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


def _write_new_key(path: Path) -> str:
    """Write a fresh PSK to a new file of mode 0600 and return it. Raises
    FileExistsError rather than overwrite a key (or follow a planted symlink)."""
    psk = os.urandom(_PSK_BYTES).hex()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a restrictive umask may have removed the owner's bits
        with os.fdopen(fd, "w") as f:
            f.write(psk + "\n")
    except OSError:
        path.unlink(missing_ok=True)
        raise
    return psk


def _run_keygen(args: argparse.Namespace) -> int:
    if args.out is None:
        print(os.urandom(_PSK_BYTES).hex())
        return 0
    path = args.out.expanduser()
    try:
        _write_new_key(path)
    except FileExistsError:
        return _fail(args, f"{path} already exists; refusing to overwrite a key "
                           f"(remove it first if you really mean to replace it)")
    except OSError as exc:
        return _fail(args, f"cannot create {path}: {exc.strerror}")
    print(f"wrote a new PSK to {path}; copy it to every node of the namespace and set "
          f"PMETAL_SECURITY_PSK_FILE={path.absolute()}")
    return 0
