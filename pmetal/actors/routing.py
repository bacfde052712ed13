"""Tasks with a scheduling strategy: run them on another node's task workers.

A remote function without a strategy runs on a task worker of the
caller's node (``CoreClient._task_link``: that path is untouched). With
``scheduling_strategy="SPREAD"``, a :class:`NodeAffinitySchedulingStrategy`
or a :class:`PlacementGroupSchedulingStrategy` (or the older
``placement_group=`` options), :func:`run_placed` picks the node first:

* ``"SPREAD"``: the live nodes whose resources could hold the task, in
  turn (round robin), the caller's node among them;
* a node affinity: that node (a full id or a unique prefix); when it is not
  a live member, PlacementError naming the live ones, or with ``soft=True``
  the caller's node;
* a placement group: the node of the bundle (index -1: the bundles that
  could hold the task, in turn). A task for a group still pending waits
  (in the caller, as a task waits for its ObjectRef arguments) until the
  group is created, and fails if it is removed first; the task's resources
  must fit the bundle. As everywhere in pmetal, a task's resources are
  checked, not held.

A task for another node goes straight to one of that node's task workers:
the client asks that node (a session of its own with it, opened on first
use and closed with the client's links) for its workers' addresses
(``LeaseWorkers``), as it asks its own, and calls the worker directly.
Inside a worker it asks for workers lent to it alone, as on its own node:
a task that waits for the tasks it starts must not queue them behind
itself (with one task worker per node, SPREAD tasks that fan out SPREAD
tasks deadlocked without that). A worker that dies, or whose node dies,
fails (or retries) its tasks as on the caller's node. The live nodes are the
client's cluster watch's (a long poll its node answers at each change), with
each node's address and resources from one status request; a group's
bundles are kept for :data:`FRESH_FOR` seconds (a removal through this
client forgets them at once), so a loop of placed tasks costs no request
per task.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pmetal.actors.links import _TASKS, PeerLink
from pmetal.actors.refs import ObjectRef, failure_error
from pmetal.actors.serialization import code_ref, load_code
from pmetal.actors.strategies import (NodeAffinitySchedulingStrategy,
                                      PlacementGroupSchedulingStrategy)
from pmetal.errors import ActorDiedError, PlacementError, PMetalError
from pmetal.wire import Failure, LeaseWorkers, PlacementGroupQuery, PlacementGroups, WorkerList

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient
    from pmetal.actors.handles import RemoteFunction

__all__ = ["FRESH_FOR", "NODE_SESSION", "after_ready", "forget_group", "run_placed"]

NODE_SESSION = "<node>"   # owner of a client's link to a node (not a worker)

FRESH_FOR = 1.0   # s the live nodes and a group's bundles are kept before asking again

_routers: weakref.WeakKeyDictionary[Any, _Router] = weakref.WeakKeyDictionary()
_routers_lock = threading.Lock()


def _router(client: CoreClient) -> _Router:
    with _routers_lock:
        router = _routers.get(client)
        if router is None:
            router = _routers[client] = _Router(client)
        return router


def run_placed(client: CoreClient, strategy: Any, fn: RemoteFunction,
               env_vars: dict[str, str], code: tuple[str, Any], args: list[Any],
               kwargs: dict[str, Any]) -> ObjectRef:
    """Submit a task of remote function ``fn`` (its code: ``code``) that
    runs where ``strategy`` says (see the module doc); a retry picks its
    node again. A task that must wait for its placement group to be created
    gets the group's ``ready()`` ref first among its arguments and runs
    ``fn`` behind :func:`after_ready`, so it is sent once the ref resolves
    (and fails as it does if the group is removed first)."""
    from pmetal.actors.handles import needed_resources
    router = _router(client)
    name = fn._fn.__qualname__
    what = f"remote function {name}"
    need = needed_resources(fn._options)
    fn_id, fn_ref = code
    first: list[str] = []   # the node picked now, for the first send (a retry picks again)
    try:   # errors in the strategy itself show at .remote(), as for actors
        first.append(router.node_for(strategy, need, what))
    except _Pending:
        key = ("<after ready>", fn_id)
        if key not in fn._env_code:
            # The task's own code (with its env_vars, its working_dir), behind the wait.
            fn._env_code[key] = code_ref(functools.partial(after_ready, load_code(fn_ref)))
        fn_id, fn_ref = fn._env_code[key]
        args = [strategy.placement_group.ready(), *args]
    except PMetalError as exc:
        return ObjectRef.of_error(exc)
    return client.run_task(fn_id, fn_ref, args, kwargs, name, fn._max_retries,
                           fn._retry_exceptions,
                           where=lambda w: router.link_for(strategy, need, w,
                                                           first.pop() if first else ""))


def stream_place(client: CoreClient, strategy: Any,
                 fn: RemoteFunction) -> Callable[[str], PeerLink | BaseException]:
    """Where a streaming task of ``fn`` goes: a function giving the link to
    a task worker of the node ``strategy`` picks now (called under the
    client lock). A stream is not retried, and it cannot wait for its
    placement group: a group not created yet is a PlacementError here."""
    from pmetal.actors.handles import needed_resources
    router = _router(client)
    need = needed_resources(fn._options)
    what = f"remote function {fn._fn.__qualname__}"
    try:
        node = router.node_for(strategy, need, what)
    except _Pending as exc:
        raise PlacementError(f"{what}: a streaming task cannot wait for its placement group "
                             f"to be created ({exc}); pmetal.get(pg.ready()) first") from exc
    return lambda w: router.link_for(strategy, need, w, node)


def after_ready(fn: Callable[..., Any], _group: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, for a task that waited for its placement
    group (``_group``, what ``pg.ready()`` resolved to)."""
    return fn(*args, **kwargs)


def forget_group(client: CoreClient, group_id: str) -> None:
    """``group_id`` was removed through ``client``: its tasks fail from now on."""
    router = _routers.get(client)
    if router is not None:
        router.groups.pop(group_id, None)


class _Pending(PlacementError):
    """The task's placement group is not created yet."""


class _Router:
    """One client's view of where placed tasks go (used under its lock)."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        self.nodes: dict[str, tuple[str, dict[str, float]]] = {}   # id -> (address, resources)
        self.nodes_until = 0.0
        self._seen: tuple[Any, dict[str, tuple[str, dict[str, float]]]] = (None, {})
        self.groups: dict[str, tuple[float, dict[str, Any]]] = {}   # id -> (until, entry)
        self.workers: dict[str, list[str]] = {}    # node id -> its task workers' addresses
        self.turn = itertools.count()

    # ----------------------------------------------------------------- nodes

    def live(self) -> dict[str, tuple[str, dict[str, float]]]:
        """The live nodes: the cluster watch's members (kept current by its
        long poll) when we know each one's address and resources, else a
        status request (at most once per FRESH_FOR)."""
        state = self.client.watch.state
        if state is not None and state.members:
            if state is self._seen[0]:
                return self._seen[1]   # (nothing changed since we last looked)
            members = set(state.members) - set(state.dead)
            if members <= set(self.nodes):
                live = {n: self.nodes[n] for n in sorted(members)}
                self._seen = (state, live)
                return live
        now = time.monotonic()
        if now >= self.nodes_until:
            info = self.client.status()
            members = [m for m in (info.get("cluster") or {}).get("members") or []
                       if m.get("state") != "dead" and m.get("health") != "dead"]
            nodes = {m["node_id"]: (m.get("address") or "", dict(m.get("resources") or {}))
                     for m in members}
            nodes[info["node_id"]] = (info["address"], dict(info["resources"]))
            self.nodes, self.nodes_until, self._seen = nodes, now + FRESH_FOR, (None, {})
        return self.nodes

    def group(self, strategy: PlacementGroupSchedulingStrategy, what: str) -> dict[str, Any]:
        group_id = strategy.placement_group.id
        now = time.monotonic()
        until, entry = self.groups.get(group_id, (0.0, {}))
        if now >= until:
            reply = self.client.request_node(PlacementGroupQuery(group_id))
            if isinstance(reply, Failure):
                raise failure_error(reply)
            found = [e for e in reply.groups if e.get("group_id") == group_id] \
                if isinstance(reply, PlacementGroups) else []
            if not found:
                raise PlacementError(f"{what}: no placement group {group_id} in this cluster "
                                     f"(it was removed, or its node left)")
            entry = found[0]
            if entry.get("state") == "CREATED":
                self.groups[group_id] = (now + FRESH_FOR, entry)
        state = entry.get("state")
        if state == "REMOVED":
            raise PlacementError(f"{what}: placement group {group_id} was removed "
                                 f"({entry.get('reason') or 'remove_placement_group'}); "
                                 f"create another one")
        if state != "CREATED":
            raise _Pending(f"{what}: placement group {group_id} is not created yet "
                                 f"({entry.get('reason') or state}); wait for it first: "
                                 f"pmetal.get(pg.ready()) or pg.wait(timeout)")
        return entry

    def node_for(self, strategy: Any, need: dict[str, float], what: str) -> str:
        own = self.client.node_id
        if isinstance(strategy, PlacementGroupSchedulingStrategy):
            entry = self.group(strategy, what)
            bundles, nodes = entry["bundles"], entry["bundle_nodes"]
            index = strategy.placement_group_bundle_index
            chosen = range(len(bundles)) if index == -1 else [index]
            fitting = [i for i in chosen if _fits(need, bundles[i])]
            if not fitting:
                raise PlacementError(f"{what} needs {need}, more than bundle "
                                     f"{'any' if index == -1 else index} of placement group "
                                     f"{entry['group_id']} holds ({bundles})")
            return nodes[fitting[next(self.turn) % len(fitting)]]
        live = self.live()
        if isinstance(strategy, NodeAffinitySchedulingStrategy):
            found = [n for n in live if n.startswith(strategy.node_id)]
            if len(found) == 1 and _fits(need, live[found[0]][1]):
                return found[0]
            if strategy.soft:
                return own
            why = ("is not a live member of this cluster" if not found else
                   f"is ambiguous ({len(found)} nodes begin with it)" if len(found) > 1 else
                   f"has {live[found[0]][1]} in all; the task needs {need}")
            raise PlacementError(f"{what}: node affinity: node {strategy.node_id} {why}; live "
                                 f"nodes: {sorted(live)} (soft=True falls back to another node)")
        room = sorted(n for n, (_, total) in live.items() if _fits(need, total))
        if not room:
            raise PlacementError(f"{what} needs {need}, but no node has that much; the nodes "
                                 f"have {[t for _, t in live.values()]}")
        return room[next(self.turn) % len(room)]

    # ----------------------------------------------------------------- links

    def link_for(self, strategy: Any, need: dict[str, float], what: str,
                 node: str = "") -> PeerLink | BaseException:
        """A link to a task worker of ``node``, or of the node ``strategy``
        picks now (client lock held)."""
        if not node:
            try:
                node = self.node_for(strategy, need, what)
            except PMetalError as exc:
                return exc
        if node == self.client.node_id:
            return self.client._task_link(what)
        return self._worker_on(node, what)

    def _session(self, node: str) -> PeerLink:
        """Our session with ``node`` (a link the client closes with its others)."""
        link = self.client._own(self.client.link(self.live()[node][0]), NODE_SESSION)
        if link.dead:
            raise PlacementError(f"node {node[:8]}: {link.dead}")
        return link

    def _worker_on(self, node: str, what: str) -> PeerLink | BaseException:
        client = self.client
        dead: set[str] = set()
        for _ in range(4):   # each failed try adds an address to avoid
            addresses = self.workers.get(node)
            if not addresses:
                try:
                    session = self._session(node)
                    # Inside a worker, workers of our own, as on our node: a
                    # task that waits for its child must not queue it behind itself.
                    reply = session.channel.request(
                        LeaseWorkers(1 if client.self_address else 0, tuple(sorted(dead))),
                        timeout=client.config.transport.request_timeout).body
                except (PMetalError, KeyError) as exc:
                    self.nodes_until = 0.0
                    return ActorDiedError(f"{what}: cannot reach node {node[:8]}: {exc}")
                if isinstance(reply, Failure):
                    return failure_error(reply)
                assert isinstance(reply, WorkerList)
                addresses = self.workers[node] = [a for a in reply.addresses
                                                  if a != client.self_address]
                if not addresses:
                    return PlacementError(f"{what}: node {node[:8]} has no task worker ready")
            address = client._least_busy(addresses)
            known = client._link_for(address, _TASKS)
            if known is not None:
                known.check()
                if known.dead:
                    dead.add(address)
                    self.workers[node] = []
                    continue
            link = client._own(client.link(address), _TASKS)
            if not link.dead:
                if not link.node_id:   # its calls fail at once when that node is held dead
                    link.node_id, link.watch = node, client.watch
                return link
            dead.add(address)
            self.workers[node] = []
        return ActorDiedError(f"{what}: no task worker of node {node[:8]} answers")


def _fits(need: dict[str, float], pool: dict[str, float]) -> bool:
    return all(pool.get(k, 0.0) >= v for k, v in need.items() if v)
