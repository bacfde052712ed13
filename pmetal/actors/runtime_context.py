"""Ray's ``ray.get_runtime_context()``: who and where the calling code is.

The same object answers in a driver, inside a task and inside an actor
method; the ids are hex strings (Ray's ``get_*_id()`` methods return hex
strings too). What each id is in pmetal:

* **job id**: made by ``pmetal.init`` in the driver, and given to the
  embedded node it starts, whose workers (tasks, actors) report it. A worker
  of a node that ``pmetal start`` runs does not know which driver called it:
  there it is None.
* **node id**: the node this process is connected to (a driver) or runs on
  (a worker), as in ``pmetal.nodes()``.
* **task id**: the task or actor call running now; None in a driver.
  Unique in the cluster (node, worker process, call number); a retry of a
  task gets a new one.
* **actor id**: the actor this worker hosts (as in ``repr(handle)``); None
  in a driver and in a task.
"""

from __future__ import annotations

import os
from typing import Any

from pmetal.actors import context

__all__ = ["RuntimeContext", "get_runtime_context"]


class _Id(str):
    """An id string that also answers ``.hex()``, as Ray's ID objects do
    (``ctx.node_id.hex()`` in older Ray scripts)."""

    def hex(self) -> str:
        return str(self)


def _id(value: str | None) -> _Id | None:
    return _Id(value) if value else None


class RuntimeContext:
    """What ``pmetal.get_runtime_context()`` returns. Each method reads the
    current state when called (keep the object or ask again: the same)."""

    def get_job_id(self) -> str | None:
        return context.job_id() or None

    def get_node_id(self) -> str:
        return context.current().node_id

    def get_task_id(self) -> str | None:
        n = context.current_task.get()
        if not n or not context.in_worker():
            return None
        return f"{self.get_node_id()[:12]}-{os.getpid()}-{n}"

    def get_actor_id(self) -> str | None:
        return context.current_actor_id() or None

    def get_worker_id(self) -> str:
        """This process: the node id and the process id (a driver too)."""
        return f"{self.get_node_id()[:12]}-{os.getpid()}"

    @property
    def job_id(self) -> _Id | None:
        return _id(self.get_job_id())

    @property
    def node_id(self) -> _Id:
        return _Id(self.get_node_id())

    @property
    def task_id(self) -> _Id | None:
        return _id(self.get_task_id())

    @property
    def actor_id(self) -> _Id | None:
        return _id(self.get_actor_id())

    @property
    def namespace(self) -> str:
        """The security namespace of the cluster (pmetal's only namespace)."""
        return context.current().namespace.name

    @property
    def current_actor(self) -> Any:
        """A handle to the actor this code runs in (Ray's ``current_actor``);
        outside an actor a PMetalValueError."""
        from pmetal.actors.handles import ActorHandle
        from pmetal.errors import PMetalValueError
        actor_id = self.get_actor_id()
        if actor_id is None:
            raise PMetalValueError("get_runtime_context().current_actor: this code does not "
                                   "run in an actor (it is a driver or a task)")
        client = context.current()
        return ActorHandle(client.lookup(actor_id=actor_id), client)

    def is_canceled(self) -> bool:
        """Ray's ``is_canceled()``: whether ``pmetal.cancel`` reached the
        actor method running in this thread. A sync method is not
        interrupted (as in Ray): it may look here and return early. An
        async method is cancelled through asyncio instead. False in a task
        (a task's cancel does not reach its worker unless ``force=True``)."""
        return context.is_canceled()

    def get(self) -> dict[str, Any]:
        """Ray's ``get()``: the ids as a dict (None where there is none)."""
        return {"job_id": self.get_job_id(), "node_id": self.get_node_id(),
                "task_id": self.get_task_id(), "actor_id": self.get_actor_id()}

    def __repr__(self) -> str:
        return f"RuntimeContext({self.get()})"


def get_runtime_context() -> RuntimeContext:
    """Ray's ``ray.get_runtime_context()``. Its node id needs a connection:
    in a driver without ``init`` it starts a node, as ``.remote()`` does."""
    return RuntimeContext()
