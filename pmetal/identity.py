"""Persistent node identity: an Ed25519 key pair per machine.

The key pair lives in ``~/.pmetal/node_keypair`` (``PMETAL_HOME`` moves the
folder), created once with mode 0600 inside a 0700 folder. The file holds 64
bytes: the 32-byte private seed followed by the 32-byte public key (the
layout of ed25519-dalek key pairs); the public half lets a corrupt file be
told apart from a different key. The node id is the first 16 bytes of
SHA-256 of the public key, as 32 hex characters.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (Ed25519PrivateKey,
                                                               Ed25519PublicKey)
from cryptography.hazmat.primitives.serialization import (Encoding, NoEncryption,
                                                          PrivateFormat, PublicFormat)

from pmetal.config import pmetal_home
from pmetal.errors import IdentityError, PMetalError
from pmetal.ids import NodeId

__all__ = ["KEYPAIR_FILE", "NodeIdentity", "check_home", "check_private_file", "node_id_for",
           "verify_signature"]

KEYPAIR_FILE = "node_keypair"
_FILE_BYTES = 64


def node_id_for(public_key: bytes) -> NodeId:
    """The node id that belongs to an Ed25519 public key."""
    return NodeId(hashlib.sha256(public_key).hexdigest()[:32])


def _user(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def _check_owner_and_writers(path: Path, st: os.stat_result, what: str,
                             error: type[PMetalError], chmod: str) -> None:
    """ssh's rule: what we trust must be ours (or root's) and writable by
    nobody else; otherwise another local user could plant it."""
    if not hasattr(os, "getuid"):  # Windows: no POSIX owners to check
        return
    me = os.getuid()
    if st.st_uid not in (me, 0):
        raise error(f"{what} {path} belongs to user {_user(st.st_uid)}, not to you "
                    f"({_user(me)}); another user could have planted it. If you trust it, "
                    f"run 'sudo chown {_user(me)} {path}'; otherwise remove it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise error(f"{what} {path} is writable by other users (mode {mode:04o}), who could "
                    f"replace it; run 'chmod {chmod} {path}' and start again")


def check_home(folder: Path) -> None:
    """Refuse a pmetal folder another user owns or others may write into
    (they could plant a key file, a PSK or a node record). Raises
    IdentityError; a folder that does not exist yet passes."""
    try:
        st = folder.stat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise IdentityError(f"cannot inspect the pmetal folder {folder}: {exc}") from exc
    _check_owner_and_writers(folder, st, "the pmetal folder", IdentityError, "go-w")


def check_private_file(path: Path, what: str, error: type[PMetalError] = IdentityError) -> None:
    """Refuse a secret or state file (PSK, node record) that another user
    owns or others may write, as ssh refuses such a key. Raises ``error``."""
    try:
        st = path.stat()
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc}") from exc
    _check_owner_and_writers(path, st, what, error, "go-w")


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s signature of ``data``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class NodeIdentity:
    """An Ed25519 key pair and the node id derived from it."""

    __slots__ = ("_private", "node_id", "path", "public_key")

    def __init__(self, private_key: Ed25519PrivateKey, path: Path | None = None) -> None:
        self._private = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(Encoding.Raw,
                                                                       PublicFormat.Raw)
        self.node_id: NodeId = node_id_for(self.public_key)
        self.path = path

    @classmethod
    def generate(cls) -> NodeIdentity:
        """A fresh identity that is not saved anywhere (tests, one-off tools)."""
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, home: str | os.PathLike[str] | None = None) -> NodeIdentity:
        """Load the key pair from ``home`` (default: ``PMETAL_HOME`` or
        ``~/.pmetal``), creating it on first use."""
        folder = Path(home) if home is not None else pmetal_home()
        check_home(folder)
        path = folder / KEYPAIR_FILE
        if not path.exists():
            cls._create(folder, path)
        return cls._load(path)

    def sign(self, data: bytes) -> bytes:
        return self._private.sign(data)

    def seed(self) -> bytes:
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @staticmethod
    def _create(folder: Path, path: Path) -> None:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise IdentityError(f"cannot create the pmetal folder {folder}: {exc}") from exc
        key = Ed25519PrivateKey.generate()
        ident = NodeIdentity(key)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".node_keypair.")
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, ident.seed() + ident.public_key)
            os.fsync(fd)
            os.close(fd)
            # link() fails if another process created the file meanwhile: theirs wins.
            os.link(tmp, path)
        except FileExistsError:
            pass
        except OSError as exc:
            raise IdentityError(f"cannot write the node key file {path}: {exc}") from exc
        finally:
            os.unlink(tmp)

    @classmethod
    def _load(cls, path: Path) -> NodeIdentity:
        try:
            st = path.stat()
            mode = st.st_mode
            if not stat.S_ISREG(mode):
                raise IdentityError(f"node key file {path} is not a regular file")
            _check_owner_and_writers(path, st, "node key file", IdentityError, "600")
            if mode & 0o077:
                raise IdentityError(
                    f"node key file {path} is readable by other users (mode "
                    f"{stat.S_IMODE(mode):04o}); run 'chmod 600 {path}' and start again")
            data = path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read the node key file {path}: {exc}") from exc
        if len(data) != _FILE_BYTES:
            raise IdentityError(
                f"node key file {path} is corrupt ({len(data)} bytes, expected {_FILE_BYTES}); "
                f"move it away to create a new identity (the node id will change)")
        try:
            key = Ed25519PrivateKey.from_private_bytes(data[:32])
        except ValueError as exc:
            raise IdentityError(f"node key file {path} is corrupt: {exc}") from exc
        ident = cls(key, path)
        if ident.public_key != data[32:]:
            raise IdentityError(
                f"node key file {path} is corrupt (its public half does not match its "
                f"private half); move it away to create a new identity")
        return ident

    def __repr__(self) -> str:
        return f"NodeIdentity({self.node_id})"
