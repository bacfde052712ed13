"""This process's current client: the one :class:`CoreClient` that handles,
refs and the public API use.

The runtime only reads it; who sets it depends on the process:

* a driver: the public facade (``pmetal.api``) sets it in ``init`` and clears
  it in ``shutdown``; it also installs the *auto-init* hook, which starts an
  embedded node when a script calls ``.remote()``, ``put``, ``get`` or
  ``wait`` without ``init`` (as Ray does);
* a worker: ``pmetal.actors.worker`` installs a *worker factory* at start-up;
  the first use builds a client to the worker's own node. It wins over
  auto-init, so user code inside an actor never starts a node of its own.

This module sits below everything that needs the client (handles, refs,
the facade) and imports none of them, so the layers never form a loop.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from pmetal.errors import NotInitializedError

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient

__all__ = ["auto_init", "current", "current_actor_id", "current_call", "current_or_none",
           "current_task", "in_worker", "initialize", "is_canceled", "job_id", "lock",
           "set_actor_id", "set_auto_init", "set_cancel_probe", "set_current",
           "set_initializer", "set_job_id", "set_worker_factory", "take"]

Factory = Callable[[], "CoreClient"]

# One lock for the current client and for whoever sets it (the facade's
# init and shutdown take it too): auto-init runs the facade's init under it,
# so two locks would be taken in both orders.
lock = threading.RLock()
_lock = lock
_current: CoreClient | None = None
_worker_factory: Factory | None = None
_auto_init: Factory | None = None
_initializer: Callable[..., object] | None = None
_actor_id = ""
_job_id = ""
# The number of the task or actor call running in this thread or asyncio
# task of a worker (its worker counts them); 0 outside one. A context
# variable, so concurrent calls of one actor (threads, coroutines) each see
# their own.
current_task: contextvars.ContextVar[int] = contextvars.ContextVar("pmetal_task", default=0)
# The (caller's route, call id) of the actor call a thread of a threaded
# actor runs (a sync actor's serving thread keeps its own on the worker).
current_call: contextvars.ContextVar[tuple[bytes, int]] = contextvars.ContextVar(
    "pmetal_call", default=(b"", 0))
JOB_ID_ENV = "PMETAL_JOB_ID"


def current() -> CoreClient:
    """The current client; made on first use in a worker, or by auto-init in
    a driver when a hook is installed; else :class:`NotInitializedError`."""
    client = _current
    if client is not None:   # the hot path: one global read
        return client
    return auto_init()


def auto_init() -> CoreClient:
    """:func:`current`'s slow path, for the entry points Ray auto-initialises."""
    global _current
    with _lock:
        if _current is not None:
            return _current
        if _worker_factory is not None:
            _current = _worker_factory()
            return _current
        if _auto_init is not None:
            client = _auto_init()   # the hook calls set_current itself
            if _current is None:
                _current = client
            return _current
    raise NotInitializedError("call pmetal.init() first")


def current_or_none() -> CoreClient | None:
    """The current client if one is set; never makes one."""
    return _current


def in_worker() -> bool:
    """Whether this process is a pmetal worker (its client reaches its node)."""
    return _worker_factory is not None


def current_actor_id() -> str:
    """The id of the actor this process hosts: set by its worker before the
    constructor runs; "" in a driver or a task worker. Collective groups
    find the caller's rank from it."""
    return _actor_id


def set_actor_id(actor_id: str) -> None:
    global _actor_id
    _actor_id = actor_id


_cancel_probe: Callable[[], bool] | None = None


def set_cancel_probe(probe: Callable[[], bool] | None) -> None:
    """Install the worker's answer to "was the call running here cancelled?"."""
    global _cancel_probe
    _cancel_probe = probe


def is_canceled() -> bool:
    """Whether ``pmetal.cancel`` reached the actor call running in this
    thread (the worker's probe; see Worker.is_canceled)."""
    if _cancel_probe is None:
        raise NotInitializedError("get_runtime_context().is_canceled() answers in an actor's "
                                  "method (a worker), not in a driver")
    return _cancel_probe()


def job_id() -> str:
    """This driver's job id (set by ``pmetal.init``); in a worker, the one
    of the driver whose embedded node started it (from the environment);
    "" when unknown (a worker of a node ``pmetal start`` runs)."""
    return _job_id or os.environ.get(JOB_ID_ENV, "")


def set_job_id(job: str) -> None:
    global _job_id
    _job_id = job


def set_current(client: CoreClient | None) -> None:
    global _current
    with _lock:
        _current = client


def take() -> CoreClient | None:
    """Clear the current client and return it (for ``shutdown`` to close)."""
    global _current
    with _lock:
        client, _current = _current, None
        return client


def set_worker_factory(factory: Factory | None) -> None:
    global _worker_factory
    with _lock:
        _worker_factory = factory


def set_initializer(init: Callable[..., object] | None) -> None:
    """Install the facade's ``init``, for the layers below it that join a
    cluster on the user's behalf (the collectives' auto-discovery backend)
    without importing the facade."""
    global _initializer
    _initializer = init


def initialize(**options: object) -> object:
    """``pmetal.init(**options)`` through the hook the facade installed."""
    if _initializer is None:
        raise NotInitializedError("pmetal's facade is not loaded: import pmetal and call "
                                  "pmetal.init() first")
    return _initializer(**options)


def set_auto_init(hook: Factory | None) -> None:
    """Install the hook that starts a node when nothing is connected
    (``None``: such calls raise :class:`NotInitializedError` instead)."""
    global _auto_init
    with _lock:
        _auto_init = hook
