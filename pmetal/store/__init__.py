"""The model store: the pieces of models a node holds, and moving them
between the members of a namespace. See :mod:`pmetal.store.folder` (the
layout under ``$PMETAL_HOME/models``), :mod:`pmetal.store.manifest` (pieces
and their sha256), :mod:`pmetal.store.serve` (a node answering for its
store) and :mod:`pmetal.store.pull` (a process pulling what it lacks), and
docs/pipeline.md ("Where the weights come from")."""

from pmetal.store.errors import (
    ChecksumError,
    ModelError,
    ModelFetchError,
    ModelFormatError,
    ModelUnavailableError,
    UnknownModelError,
)
from pmetal.store.folder import ModelFolder, PieceStore, StoredModelInfo
from pmetal.store.manifest import HEADER, Manifest, Piece, build_manifest, file_sha256

__all__ = [  # noqa: RUF022 - plain sorted order
    "ChecksumError",
    "HEADER",
    "Manifest",
    "ModelError",
    "ModelFetchError",
    "ModelFolder",
    "ModelFormatError",
    "ModelUnavailableError",
    "Piece",
    "PieceStore",
    "StoredModelInfo",
    "UnknownModelError",
    "build_manifest",
    "file_sha256",
]
