"""The Failures a worker answers with when a call cannot give its result.

Shared by the worker's two serving loops (:mod:`pmetal.actors.worker`, the
blocking one; :mod:`pmetal.actors.asyncserve`, the asyncio one) and its
streams (:mod:`pmetal.actors.streams`): the user's exception as a
:class:`~pmetal.wire.Failure` whose traceback starts in user code, a
result that cannot be sent, a malformed batch entry.
"""

from __future__ import annotations

import traceback
from typing import Any

from pmetal.actors.serialization import pack_exception
from pmetal.errors import ProtocolError
from pmetal.values import FailureKind
from pmetal.wire import Failure

_WORKER_MODULES = frozenset({"pmetal.actors.worker", "pmetal.actors.asyncserve"})
"""The modules whose frames a user's traceback starts after."""


def failure_from(exc: BaseException, kind: FailureKind = FailureKind.USER) -> Failure:
    """A Failure describing ``exc`` (raised while running user code)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure(kind, type(exc).__qualname__, str(exc), tb, pack_exception(exc))


_MAX_REFUSALS = 10_000
"""Ids of a malformed batch answered at most (each is one small message)."""

_BAD_ENTRY = Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                     "a batch entry is not [method, args, kwargs]")


def _unsendable(exc: TypeError | ProtocolError) -> Failure:
    """The answer to a call whose result cannot be packed (TypeError) or
    exceeds the wire's limits (ProtocolError): the call ran, its result is
    lost, the worker serves on."""
    if isinstance(exc, ProtocolError):
        return Failure(FailureKind.BAD_REQUEST, "ProtocolError",
                       f"the result cannot be sent: {exc}")
    return failure_from(exc)


def _well_formed(entry: Any) -> bool:
    return (type(entry) is list and len(entry) == 3 and type(entry[0]) is str
            and type(entry[1]) is list and type(entry[2]) is dict)


def _user_traceback(exc: BaseException) -> BaseException:
    """Drop the worker's own frames so the traceback starts in user code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in _WORKER_MODULES:
        tb = tb.tb_next
    return exc.with_traceback(tb)
