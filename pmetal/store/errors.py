"""The errors of the model store (importable from :mod:`pmetal.pipeline.models`
as before the store became a layer of its own)::

    ModelError (PMetalError)
    ├── UnknownModelError (PMetalValueError)  no such name, hash or path
    ├── ModelFetchError                       pip failed or timed out
    ├── ModelUnavailableError                 no reachable member holds the pieces
    ├── ChecksumError                         a download's or a piece's sha256 is wrong
    └── ModelFormatError                      not a Llama model, missing or
                                              malformed tensor, bad header or manifest
"""

from __future__ import annotations

from pmetal.errors import PMetalError, PMetalValueError

__all__ = ["ChecksumError", "ModelError", "ModelFetchError", "ModelFormatError",
           "ModelUnavailableError", "UnknownModelError"]


class ModelError(PMetalError):
    """A model could not be found, fetched or read."""


class UnknownModelError(ModelError, PMetalValueError):
    """Neither a known model name, a stored model's hash, nor an existing path."""


class ModelFetchError(ModelError):
    """Fetching a model from the package index failed."""


class ModelUnavailableError(ModelError):
    """Pieces of a model are held by no member that answered (none has them,
    or those that had them died or were unreachable)."""


class ChecksumError(ModelError):
    """A downloaded file or a piece received from a member does not have the
    sha256 it must have; it was not kept."""


class ModelFormatError(ModelError):
    """A model file or folder is not what pmetal can run: another architecture,
    a missing or misshapen tensor, a corrupt header or manifest."""
