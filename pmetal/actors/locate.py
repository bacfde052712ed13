"""How a client finds the worker of an actor it calls, and finds it again
after a death: :class:`ActorLocator`, one per
:class:`~pmetal.actors.client.CoreClient`.

A call whose actor has a live link goes out at once (:meth:`ActorLocator.ready`,
under the client lock). Otherwise :meth:`ActorLocator.find` runs without the
client lock, under a lock of that actor's own: opening a session with its
worker (a worker busy in a long call answers the handshake only after it)
and asking our node where the actor lives now (it may be restarting: the
wait is bounded by ``actors.restart_wait``) hold up later calls to the same
actor, never calls to other actors.

A first link to a worker whose port refuses connections is dead at once: its
process exited (its creator was killed and took it along, say), and the
node says whether the actor died or moved. A handle that came from elsewhere
(pickled, or from a session that ``pmetal.shutdown()`` ended) is looked up
before anything is dialed: the OS hands a dead worker's port to the next
worker it starts (5 of 25 tries on one machine), and a new worker that is
not ready yet answers no handshake.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from pmetal.actors.links import PeerLink
from pmetal.errors import (
    ActorDiedError,
    ClosedError,
    PMetalError,
    PMetalValueError,
    RequestTimeoutError,
)
from pmetal.values import ActorState, Address

if TYPE_CHECKING:
    from pmetal.actors.client import CoreClient
    from pmetal.actors.refs import ObjectRef

__all__ = ["SHUT_DOWN", "ActorCall", "ActorLocator"]

SHUT_DOWN = "pmetal is shut down: pmetal.shutdown() closed this client; call pmetal.init() first"


def _accepts(address: str) -> bool:
    """False when the TCP port at ``address`` refuses a connection at once
    (the process that listened there exited); True when it accepts, or
    when we cannot tell within a short time (a host that does not answer)."""
    try:
        parsed = Address.parse(address)
    except ValueError:
        return True
    try:
        socket.create_connection((parsed.host, parsed.port), timeout=0.5).close()
    except ConnectionRefusedError:
        return False
    except OSError:
        return True
    return True


class ActorCall:
    """How a deferred or retried actor call is sent (deferred.Submit): its
    actor is found first, without the client lock (``prepare``)."""

    __slots__ = ("client", "handle", "method")

    def __init__(self, client: CoreClient, handle: Any, method: str) -> None:
        self.client, self.handle, self.method = client, handle, method

    def prepare(self) -> BaseException | None:
        return self.client.locator.prepare(self.handle)

    def __call__(self, args: list[Any], kwargs: dict[str, Any],
                 nested: list[ObjectRef] | None = None) -> ObjectRef:
        # Sent under the client lock (deferred._send), after prepare found
        # the actor: finding it again there could wait for the lock of an
        # actor whose finder waits for the client lock.
        return self.client._call_now(self.handle, self.method, args, kwargs, locate=False,
                                     nested=nested)


class ActorLocator:
    """Finds live links to actors for one client (see the module docstring)."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client
        # One lock per actor being found: that wait holds up later calls to
        # the same actor, never the others.
        self._locating: dict[str, list[Any]] = {}   # actor id -> [lock, threads using it]

    def prepare(self, handle: Any) -> BaseException | None:
        """Find a live link to ``handle``'s actor now, without the client
        lock (what a deferred call does before it is sent under the lock);
        the error its call would get, if any."""
        with self.client.lock:
            if self.ready(handle) is not None:
                return None
        found = self.find(handle)
        return found if isinstance(found, BaseException) else None

    def ready(self, handle: Any) -> PeerLink | None:
        """Our live link to ``handle``'s actor, if we have one (lock held)."""
        client = self.client
        link = client._link_for(handle._address, handle._actor_id)
        if link is None or link.dead:
            return None
        if client.node_link.dead and handle._node_id == client.node_id:
            # Our node died, and its workers with it: one may still answer
            # for a moment while it exits, but no call may start there now.
            link.die(f"its node died ({client.node_link.dead})")
            return None
        # With calls in flight, a death shows up while waiting for their
        # results (the monitor is polled with the data socket). An idle
        # link may have died unnoticed: look before sending to it.
        if link.channel.pending() or link.outbox:
            return link
        link.check()
        return None if link.dead else link

    def find(self, handle: Any) -> PeerLink | BaseException:
        """A live link to ``handle``'s actor, found without the client lock:
        opening a session (a worker busy in a long call answers only after
        it) and waiting for a restart take as long as they take, and only
        calls to this actor wait behind them."""
        client = self.client
        with client.lock:
            # One lock per actor being found, dropped when no thread needs it
            # (a long-lived driver meets many actors).
            entry = self._locating.setdefault(handle._actor_id, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                return self._find(handle)
        finally:
            with client.lock:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locating[handle._actor_id]

    def _find(self, handle: Any) -> PeerLink | BaseException:
        client = self.client
        with client.lock:
            if client.closed:
                return ClosedError(SHUT_DOWN)
            link = self.ready(handle)   # another thread found it meanwhile
            if link is not None:
                return link
            watch = client._watch
            fresh = (client._link_for(handle._address, handle._actor_id) is None
                     and handle._state == ActorState.ALIVE
                     and not (watch is not None and handle._node_id in watch.dead))
            if fresh and handle._origin is not client:
                # A handle from elsewhere (pickled, or from a shut-down
                # session): its actor may have died since, and the OS
                # may have given its port to another worker already
                # (seen in 5 of 25 tries on one machine). Ask our node
                # where it lives before dialing anything.
                handle._origin = client
                handle._state = ActorState.PENDING
                fresh = False
        if fresh:
            link = self._open_link(handle._address, handle._actor_id, handle)
            if not link.dead:
                return link
        return self._relocate(handle)

    def _relocate(self, handle: Any) -> PeerLink | BaseException:
        """Ask our node where ``handle``'s actor lives now: the worker we
        knew died, or its node did. Waits up to ``actors.restart_wait`` for
        its restart (and on while the node answers that the restart is
        under way, up to one request_timeout more); a call to an actor that
        cannot come back (it is dead for good, or its node is cut off from a
        master that could restart it) fails within that bound with
        ActorDiedError."""
        # A handle that never saw its actor alive (found by name while its
        # creator was still making it) waits for that same incarnation: the
        # next one would come only with a restart.
        client = self.client
        incarnation = handle._incarnation + (0 if handle._state == ActorState.PENDING else 1)
        bound = client.config.actors.restart_wait
        deadline = time.monotonic() + bound
        # A restart its node says is under way ("restarting") is waited for
        # past restart_wait: it ends by its own creation deadline, so up to
        # one request_timeout more.
        last = deadline + client.config.transport.request_timeout
        while True:
            remaining = deadline - time.monotonic()
            try:
                loc = client.lookup(handle._actor_id, min_incarnation=incarnation,
                                    wait=max(0.0, remaining))
            except PMetalValueError as exc:   # no such actor: not (yet) restarted anywhere
                # The master that placed it died with its node: its restart
                # comes from the next master, once elected. A call that may
                # be retried waits for it; others fail now.
                if handle._max_task_retries == 0 or remaining <= 0 or client.closed:
                    return ActorDiedError(f"actor {handle._class_name}"
                                          f"({handle._actor_id[-8:]}) is unreachable: {exc}")
                client._closing.wait(min(0.1, remaining))
                continue
            except PMetalError as exc:
                return ActorDiedError(f"actor {handle._actor_id} is unreachable: {exc}")
            if loc.state == ActorState.DEAD:
                handle._update(loc)
                return ActorDiedError(f"actor {handle._class_name}({handle._actor_id[-8:]}) "
                                      f"is dead: {loc.reason or loc.state}")
            if loc.state == ActorState.ALIVE and loc.incarnation >= incarnation:
                handle._update(loc)
                link = self._open_link(loc.address, handle._actor_id, handle)
                if not link.dead:
                    return link
                if time.monotonic() >= deadline:
                    return ActorDiedError(f"actor {handle._class_name}"
                                          f"({handle._actor_id[-8:]}): {link.dead}")
                # Its process is gone and its node has not noticed yet: wait
                # for the node to say that it died, or where it restarted.
                incarnation = loc.incarnation + 1
                continue
            if loc.state == ActorState.RESTARTING and time.monotonic() < last:
                deadline = max(deadline, min(last, time.monotonic() + bound))
            if time.monotonic() >= deadline:
                return ActorDiedError(
                    f"actor {handle._class_name}({handle._actor_id[-8:]}) did not come back "
                    f"within actors.restart_wait={bound:g} s (last seen {loc.state} on node "
                    f"{loc.node_id[:8]}); if its node is cut off from this one, this node may "
                    f"be on the minority side of a partition")
            # Answered before its wait was up, without the new incarnation
            # (a member that knows only the old one): ask again shortly.
            client._closing.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def _open_link(self, address: str, owner: str, handle: Any) -> PeerLink:
        """A link to the worker at ``address`` hosting ``owner``: ours if it
        is live, else a new one, whose session is opened without the
        client lock. Dead when nothing listens there any more (the worker's
        process exited: the port refuses at once) or it never answers."""
        client = self.client
        with client.lock:
            link = client._link_for(address, owner)
            if link is not None and not link.dead:
                return client._on(link, handle)
        link = self._session(address, handle)
        with client.lock:
            old = client.links.get(address)
            if old is not None and old is not link:
                if not old.dead and old.owner == owner:
                    link.close()   # another thread opened one meanwhile
                    return client._on(old, handle)
                old.die(f"the worker at {address} is gone")
                old.close()
            if client.closed:
                link.die(SHUT_DOWN)
            client.links[address] = link
            return client._on(client._own(link, owner), handle)

    def _session(self, address: str, handle: Any) -> PeerLink:
        """A new link with a session open to the worker at ``address``, or a
        dead one saying why not. A worker busy in a long call answers the
        handshake only after it, so the wait may last ``request_timeout``;
        but a worker that does not answer may also be a new one, not ready
        yet, that the OS gave the port of the actor's dead worker: the wait
        goes in growing slices (0.5 s, 1 s, 2 s, ...), each on a connection
        of its own, and between two the node is asked whether the actor
        still lives there."""
        client = self.client
        deadline = time.monotonic() + client.config.transport.request_timeout
        slice_s = min(0.5, client.config.transport.handshake_timeout)
        while True:
            link = PeerLink(client.transport, client.identity, client.namespace, client.config,
                            address, client.node_link, client.worker_gone)
            if not _accepts(address):
                link.die(f"nothing listens at {address} any more (its process exited)")
                return link
            try:
                link.channel.open(timeout=max(0.0, min(slice_s, deadline - time.monotonic())))
                return link
            except RequestTimeoutError as exc:
                if time.monotonic() >= deadline or not self._still_at(handle, address):
                    link.die(f"cannot open a session with {address}: {exc}")
                    return link
            except PMetalError as exc:
                link.die(f"cannot open a session with {address}: {exc}")
                return link
            link.die("its handshake took too long; trying again on a new connection")
            link.close()
            slice_s *= 2

    def _still_at(self, handle: Any, address: str) -> bool:
        """Whether our node still places ``handle``'s actor at ``address``."""
        try:
            loc = self.client.lookup(handle._actor_id)
        except PMetalError:
            return False
        return loc.state == ActorState.ALIVE and loc.address == address
