"""mDNS discovery: announce this node and find the other pmetal nodes of the LAN.

What it owns: one python-zeroconf instance, with zeroconf's own thread and
event loop, that announces one service of type ``_pmetal._tcp.local.`` for
this node and browses for the others. What it hands out: a
:class:`DiscoveredPeer` for every node of our namespace and protocol version
(``on_peer``, again when its record changes), an :class:`IgnoredPeer` with the
reason for any other pmetal node (``on_ignored``), and the
:class:`DiscoveredPeer` whose record was withdrawn (``on_gone``). Callbacks
run on the caller's asyncio loop (``loop.call_soon_threadsafe``), never on
zeroconf's thread.

What it does not tell: whether a peer is alive, nor whether a record is
true. A node that crashed sends no goodbye and its record lingers in caches
for minutes; liveness comes from heartbeats (pmetal.cluster.health). And
anyone on the LAN can announce a record: the namespace tag and the node ids
are public. Discovery only says where to knock; the cluster service
believes an address once a handshake there proved the node's id
(pmetal.cluster.candidates).

What a stranger's records can cost, bounded: at most ``max_records``
records of our namespace are kept (256 by default) and 64 of the others
(``ignored``); the zeroconf cache entries of an ignored record, or of one
beyond ``max_records``, are dropped once it is judged. Log lines about records are rate-limited per source
address (2 a minute) and in all (10 a minute); the next line says how many
were held back.

The record (one per node)::

    instance  <node id>._pmetal._tcp.local.     (32 hex characters: unique)
    SRV/A     the node's address and port, on the announcing interfaces
    TXT       id=<node id>  ns=<namespace tag, 16 hex>  v=<PROTOCOL_VERSION>
              port=<port>  inc=<incarnation>  cpu=<cores>  mem=<GiB, 1 decimal>
              gpu=<count>

The namespace tag (:attr:`pmetal.security.NetworkNamespace.tag`) is a keyed
hash of the namespace name under its PSK: equal tags mean "same name and
same PSK", and it reveals neither. A node of another namespace, another
protocol version or with an unreadable record is ignored with its reason.

Speed: a new node is seen by the others within tens of milliseconds of
:meth:`Discovery.start` on a quiet LAN. The browser starts before the
service is registered, and the registration skips mDNS's name probing
(``cooperating_responders``): instance names are node ids, unique by
construction, so the 1.2-1.7 s of probing would buy nothing.

Interfaces are always explicit (:func:`discovery_interfaces`): the
configured addresses, else the address the node listens on; every IPv4
interface of the machine (``"all"``) only when the node listens on a
wildcard address and nothing narrower is configured. IPv6 is never used.

The records themselves (written, parsed, judged) and the watcher that
browses for them are :mod:`pmetal.cluster.mdns`; the names tests and the
CLI import stay importable from here.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable, Mapping
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from zeroconf import (
    NonUniqueNameException,
    ServiceInfo,
    Zeroconf,
)

from pmetal.cluster.mdns import (_ZEROCONF_TIMEOUT, MAX_RECORDS, REFRESH_INTERVAL, SERVICE_TYPE,
                                 DiscoveredPeer, IgnoredPeer, Interfaces, _open, _run, _txt,
                                 _Watcher)
from pmetal.errors import PMetalValueError, TransportError
from pmetal.security import NetworkNamespace
from pmetal.values import Address, host_of

__all__ = [
    "DiscoveredPeer",
    "Discovery",
    "DiscoveryStatistics",
    "IgnoredPeer",
    "Interfaces",
    "REFRESH_INTERVAL",
    "SERVICE_TYPE",
    "browse",
    "discovery_interfaces",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class DiscoveryStatistics:
    peers: int               # nodes of our namespace and version seen now
    ignored: int             # other pmetal nodes seen now (other namespace, version, ...)
    records: int             # pmetal records read (announcements, answers, changes)
    found: int               # peers that appeared (a node that comes back counts again)
    updated: int             # records of known peers that changed (incarnation, resources)
    gone: int                # peers whose records were withdrawn (goodbye or expiry)
    resolve_failures: int    # announcements whose full record never arrived
    announcements: int       # our own record, announced or re-announced
    queries: int = 0         # our refresh queries (every refresh_interval, or refresh())
    dropped: int = 0         # records not kept: beyond max_records, or ignored beyond 64
    held_back: int = 0       # log lines about records held back by the rate limit


def discovery_interfaces(configured: str, listen_address: str) -> list[str] | Literal["all"]:
    """The interfaces to announce and browse on.

    ``configured``: ``DiscoveryConfig.interfaces`` (comma-separated IPv4
    addresses, "" for none); ``listen_address``: the address the node
    listens on, before any wildcard is replaced (``tcp://0.0.0.0:7420``)."""
    chosen = [part.strip() for part in configured.split(",") if part.strip()]
    if chosen:
        return chosen
    host = host_of(listen_address, listen_address)
    if host in ("0.0.0.0", "*", "", "::"):
        return "all"
    try:
        ipaddress.IPv4Address(host)
    except ValueError as exc:
        raise PMetalValueError(f"discovery needs an IPv4 address to announce on, not {host!r}: "
                               f"set discovery.interfaces") from exc
    return [host]


# ------------------------------------------------------------------ the node's

class Discovery:
    """Announce one node and report the other nodes of its namespace.

    ``address`` is what peers dial (``tcp://ip:port``, the routable address);
    ``interfaces`` come from :func:`discovery_interfaces`. ``start()`` and
    ``close()`` are awaited on the node's loop, where the callbacks run.
    Every ``refresh_interval`` seconds (0: never) it asks for the nodes it
    has not seen, which finds those that were out of reach when they
    announced themselves: one small packet, answered only by such nodes.
    """

    def __init__(self, node_id: str, address: str, namespace: NetworkNamespace, *,
                 interfaces: Interfaces, incarnation: int = 0,
                 resources: Mapping[str, float] | None = None,
                 on_peer: Callable[[DiscoveredPeer], None],
                 on_ignored: Callable[[IgnoredPeer], None] | None = None,
                 on_gone: Callable[[DiscoveredPeer], None] | None = None,
                 loop: asyncio.AbstractEventLoop | None = None,
                 refresh_interval: float = REFRESH_INTERVAL,
                 max_records: int = MAX_RECORDS) -> None:
        try:
            parsed = Address.parse(address)
            self._host = str(ipaddress.IPv4Address(parsed.host))
            self._port = parsed.port
        except ValueError as exc:
            raise PMetalValueError(f"discovery announces an IPv4 tcp://ip:port address, not "
                                   f"{address!r}") from exc
        self.node_id = node_id
        self.address = address
        self._tag = namespace.tag.hex()
        self.interfaces = interfaces
        self._incarnation = incarnation
        self._resources = dict(resources or {})
        self._on = {"peer": on_peer, "ignored": on_ignored, "gone": on_gone}
        self._loop = loop
        self.refresh_interval = refresh_interval
        self.max_records = max_records
        self._zc: Zeroconf | None = None
        self._watcher: _Watcher | None = None
        self._info: ServiceInfo | None = None
        self._pending: set[Future[Any]] = set()   # re-announcements under way
        self._closed = False
        self.announcements = 0

    def __repr__(self) -> str:
        return f"Discovery({self.node_id}, {self.address}, interfaces={self.interfaces})"

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Browse, then announce. Raises TransportError when mDNS cannot open."""
        if self._zc is not None or self._closed:
            raise PMetalValueError(f"{self!r} was already started (a Discovery starts once)")
        self._loop = self._loop or asyncio.get_running_loop()
        zc = await asyncio.to_thread(_open, self.interfaces)
        self._watcher = _Watcher(zc, self._tag, self._deliver, self.node_id, self.address,
                                 self.refresh_interval, self.max_records)
        try:
            await asyncio.wait_for(asyncio.wrap_future(_run(zc, self._start_in_zeroconf(zc))),
                                   _ZEROCONF_TIMEOUT)
        except BaseException:
            await asyncio.to_thread(self._shutdown, zc)
            raise
        self._zc = zc
        log.info("mDNS: announcing %s at %s on %s", self.node_id, self.address,
                 self.interfaces)

    async def _start_in_zeroconf(self, zc: Zeroconf) -> None:
        assert self._watcher is not None
        # Browsing first: the answers to our first query also tell us who was there.
        await self._watcher.start()
        self._info = self._service_info()
        try:
            # Returns the task that sends the three announcements: it runs on by itself.
            await zc.async_register_service(self._info, cooperating_responders=True)
        except NonUniqueNameException as exc:  # cannot happen without probing; be explicit
            raise TransportError(f"mDNS name {self._info.name} is taken") from exc
        self.announcements += 1

    async def close(self) -> None:
        """Withdraw the record (goodbye packets) and stop; bounded, never raises
        for a slow network (a warning says the goodbye may not have gone out)."""
        self._closed = True
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._shutdown, zc), 2 * _ZEROCONF_TIMEOUT)
        except TimeoutError:
            log.warning("mDNS did not stop within %.0f s; peers will forget %s when its record "
                        "expires", 2 * _ZEROCONF_TIMEOUT, self.node_id)

    def _shutdown(self, zc: Zeroconf) -> None:
        """Zeroconf's close sends the goodbyes of our record, then stops its thread."""
        try:
            # Let re-announcements finish: once zeroconf's loop stops, their
            # futures (which update() returned) would never complete.
            futures.wait(list(self._pending), timeout=_ZEROCONF_TIMEOUT)
            if self._watcher is not None:
                _run(zc, self._watcher.stop()).result(_ZEROCONF_TIMEOUT)
        finally:
            zc.close()

    def refresh(self) -> None:
        """Ask the network for nodes we have not seen, now (as every
        ``refresh_interval`` seconds): e.g. when a link came back up."""
        zc, watcher = self._zc, self._watcher
        if zc is not None and watcher is not None and zc.loop is not None:
            zc.loop.call_soon_threadsafe(watcher.query)

    # ------------------------------------------------------------ state

    def peers(self) -> list[DiscoveredPeer]:
        """Nodes of our namespace and version whose record is current."""
        return self._watcher.peers() if self._watcher else []

    def ignored(self) -> list[IgnoredPeer]:
        return self._watcher.ignored() if self._watcher else []

    def statistics(self) -> DiscoveryStatistics:
        w = self._watcher
        if w is None:
            return DiscoveryStatistics(0, 0, 0, 0, 0, 0, 0, self.announcements)
        return DiscoveryStatistics(len(w.peers()), len(w.ignored()), w.records, w.found,
                                   w.updated, w.gone, w.resolve_failures, self.announcements,
                                   w.queries, w.dropped, w.limiter.held_total)

    def update(self, *, incarnation: int | None = None,
               resources: Mapping[str, float] | None = None) -> Future[None]:
        """Re-announce the record with a new incarnation and/or resources.

        Returns at once; the future completes when the announcements went
        out (about 0.5 s: three, as mDNS repeats them), or at once when the
        node is not started (``start()`` announces the new values)."""
        if incarnation is not None:
            self._incarnation = incarnation
        if resources is not None:
            self._resources = dict(resources)
        zc = self._zc
        if zc is None:
            done: Future[None] = Future()
            done.set_result(None)
            return done
        future = _run(zc, self._reannounce(zc, self._service_info()))
        self._pending.add(future)
        future.add_done_callback(self._reannounced)
        return future

    async def _reannounce(self, zc: Zeroconf, info: ServiceInfo) -> None:
        self._info = info
        self.announcements += 1
        await (await zc.async_update_service(info))

    def _reannounced(self, future: Future[Any]) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("mDNS: re-announcing %s failed: %s", self.node_id, future.exception())

    # ------------------------------------------------------------ internals

    def _service_info(self) -> ServiceInfo:
        return ServiceInfo(
            SERVICE_TYPE, f"{self.node_id}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(self._host)], port=self._port,
            properties=_txt(self.node_id, self._tag, self._port, self._incarnation,
                            self._resources),
            server=f"pmetal-{self.node_id}.local.")

    def _deliver(self, kind: str, item: Any) -> None:
        """On zeroconf's thread: hand ``item`` to the callback on the node's loop."""
        callback = self._on[kind]
        if callback is None or self._closed or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, item)
        except RuntimeError:  # the node's loop closed before us: nobody to tell
            log.debug("discovery: loop closed, dropped %s %s", kind, item)


# ------------------------------------------------------------------ one-shot

def browse(namespace: NetworkNamespace | None, interfaces: Interfaces, timeout: float, *,
           expect: int | None = None) -> tuple[list[DiscoveredPeer], list[IgnoredPeer]]:
    """Listen for pmetal nodes for ``timeout`` seconds (less once ``expect``
    nodes of our namespace were seen), announcing nothing.

    With ``namespace`` None every node of our protocol version counts as a
    peer (no tag to compare); otherwise other namespaces are ignored.
    Blocking: from async code, run it with ``asyncio.to_thread``."""
    zc = _open(interfaces)
    try:
        watcher = _Watcher(zc, None if namespace is None else namespace.tag.hex(),
                           lambda kind, item: None)
        _run(zc, watcher.start()).result(_ZEROCONF_TIMEOUT)
        with watcher.changed:
            watcher.changed.wait_for(
                lambda: expect is not None and len(watcher._peers) >= expect, timeout)
        _run(zc, watcher.stop()).result(_ZEROCONF_TIMEOUT)
    finally:
        zc.close()
    return watcher.peers(), watcher.ignored()
