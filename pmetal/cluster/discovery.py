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
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    InterfaceChoice,
    IPVersion,
    NonUniqueNameException,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    current_time_millis,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from pmetal.cluster.candidates import LogLimiter
from pmetal.errors import PMetalValueError, TransportError
from pmetal.security import NetworkNamespace
from pmetal.wire import PROTOCOL_VERSION
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

SERVICE_TYPE = "_pmetal._tcp.local."
Interfaces = Sequence[str] | Literal["all"]
"""IPv4 addresses of the interfaces to use, or ``"all"`` (every IPv4 interface)."""

_ZEROCONF_TIMEOUT = 5.0
"""Longest wait for zeroconf's thread to start, stop or run one of our steps."""
_RESOLVE_TIMEOUT_MS = 3000
"""How long to ask for a record whose announcement arrived incomplete."""
_GIB = float(1 << 30)
_TYPE_A, _TYPE_PTR, _TYPE_TXT, _TYPE_SRV = 1, 12, 16, 33   # DNS constants (RFC 1035)
_CLASS_IN, _FLAGS_QUERY = 1, 0x0000
REFRESH_INTERVAL = 15.0
"""Seconds between our own queries for pmetal records (see :class:`Discovery`)."""
MAX_RECORDS = 256
"""Records of our namespace kept at most (DiscoveryConfig.max_records)."""
_MAX_IGNORED = 64
"""Ignored records kept (for ``pmetal status`` and ``discover``) at most."""
_MAX_LOOKUPS = 64
"""Lookups of incomplete records under way at most (each one sends queries)."""


@dataclass(frozen=True)
class DiscoveredPeer:
    """A node of our namespace and protocol version, as its record says.

    ``seen_at`` is ``time.monotonic()`` when the record (or its last change)
    arrived; ``resources`` has the node's keys: ``CPU``, ``memory`` (bytes,
    rounded to 0.1 GiB) and ``GPU``."""

    node_id: str
    address: str
    namespace_tag: str
    version: int
    incarnation: int
    resources: dict[str, float] = field(hash=False, compare=True)
    seen_at: float = field(compare=False)


@dataclass(frozen=True)
class IgnoredPeer:
    """A pmetal node that is not ours to join, and why.

    ``kind``: "namespace" (another namespace or PSK), "version" (another
    protocol version), "malformed" (an unreadable record) or "duplicate"
    (announces this node's id from another address); each is logged at
    WARNING once per node and reason, within the rate limit per source."""

    node_id: str
    address: str
    reason: str
    kind: str


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


# ------------------------------------------------------------------ records

def _txt(node_id: str, tag: str, port: int, incarnation: int,
         resources: Mapping[str, float]) -> dict[str, str]:
    return {"id": node_id, "ns": tag, "v": str(PROTOCOL_VERSION), "port": str(port),
            "inc": str(incarnation), "cpu": f"{resources.get('CPU', 0):g}",
            "mem": f"{resources.get('memory', 0) / _GIB:.1f}",
            "gpu": f"{resources.get('GPU', 0):g}"}


def _number(props: Mapping[str, str | None], key: str, kind: type = int) -> Any:
    value = props.get(key)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}={value!r} is not a number") from None


def _parse(info: ServiceInfo, own_tag: str | None) -> DiscoveredPeer | IgnoredPeer:
    """The record of ``info`` judged against our namespace tag (None: accept any)."""
    props = info.decoded_properties
    addresses = info.parsed_addresses(IPVersion.V4Only)
    address = f"tcp://{addresses[0]}:{info.port}" if addresses and info.port else ""
    node_id = props.get("id") or ""
    try:
        if not node_id or not address:
            raise ValueError("no node id" if not node_id else "no IPv4 address or port")
        version = _number(props, "v")
        if version != PROTOCOL_VERSION:
            why = f"protocol version {version}, this node speaks {PROTOCOL_VERSION} " \
                  f"(run the same pmetal version on every node)"
            return IgnoredPeer(node_id, address, why, "version")
        tag = props.get("ns") or ""
        if len(tag) != 16 or tag.strip("0123456789abcdef"):
            raise ValueError(f"namespace tag {tag!r} is not 16 hex characters")
        if own_tag is not None and tag != own_tag:
            why = f"another namespace (tag {tag}, ours {own_tag}): other name or other PSK"
            return IgnoredPeer(node_id, address, why, "namespace")
        incarnation = _number(props, "inc")
        resources = {"CPU": _number(props, "cpu", float),
                     "memory": float(round(_number(props, "mem", float) * _GIB)),
                     "GPU": _number(props, "gpu", float)}
    except ValueError as exc:
        name = info.name.removesuffix("." + SERVICE_TYPE)
        return IgnoredPeer(node_id or name, address, f"malformed record: {exc}", "malformed")
    return DiscoveredPeer(node_id, address, tag, version, incarnation, resources,
                          time.monotonic())


# ------------------------------------------------------------------ browsing

Deliver = Callable[[str, Any], None]


class _Watcher:
    """Browses for pmetal records on zeroconf's loop and keeps what it saw.

    Every method but :meth:`peers`, :meth:`ignored` and :meth:`counts` runs
    on zeroconf's loop. ``deliver(kind, item)`` is called there for each
    change: ("peer", DiscoveredPeer), ("ignored", IgnoredPeer), ("gone", DiscoveredPeer)."""

    def __init__(self, zc: Zeroconf, own_tag: str | None, deliver: Deliver,
                 own_id: str = "", own_address: str = "", refresh: float = 0.0,
                 max_records: int = MAX_RECORDS) -> None:
        self._zc = zc
        self._max_records = max_records
        self.limiter = LogLimiter(log)
        self._refresh = refresh
        self._timer: asyncio.TimerHandle | None = None
        self._own_tag = own_tag
        self._own_id = own_id
        self._own_address = own_address
        self._deliver = deliver
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)
        self._peers: dict[str, DiscoveredPeer] = {}     # by instance name
        self._ignored: dict[str, IgnoredPeer] = {}
        self._browser: AsyncServiceBrowser | None = None
        # Lookups of records that arrived incomplete: owned here, cancelled by stop().
        self._lookups: set[asyncio.Task[None]] = set()
        self.records = self.found = self.updated = self.gone = self.resolve_failures = 0
        self.queries = self.dropped = 0

    async def start(self) -> None:
        self._browser = AsyncServiceBrowser(self._zc, [SERVICE_TYPE],
                                            handlers=[self._on_change])
        if self._refresh > 0:
            self._timer = asyncio.get_running_loop().call_later(self._refresh, self._tick)

    def _tick(self) -> None:
        self.query()
        self._timer = asyncio.get_running_loop().call_later(self._refresh, self._tick)

    def query(self) -> None:
        """Ask for pmetal records now, listing those we know (RFC 6762 known
        answers), so that only nodes we have not seen answer.

        zeroconf's browser stops asking after its first four queries (about
        14 s) and then only refreshes records it knows, near their expiry
        (an hour): a node that was out of reach when it announced itself (a
        partition, a laptop joining the Wi-Fi later) would stay unseen."""
        out = DNSOutgoing(_FLAGS_QUERY)
        out.add_question(DNSQuestion(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN))
        now = current_time_millis()
        for record in self._zc.cache.async_all_by_details(SERVICE_TYPE, _TYPE_PTR, _CLASS_IN):
            out.add_answer_at_time(record, now)  # type: ignore[arg-type]
        self.queries += 1
        self._zc.async_send(out)

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        for task in list(self._lookups):
            task.cancel()
        await asyncio.gather(*self._lookups, return_exceptions=True)

    def peers(self) -> list[DiscoveredPeer]:
        with self._lock:
            return sorted(self._peers.values(), key=lambda p: p.node_id)

    def ignored(self) -> list[IgnoredPeer]:
        with self._lock:
            return sorted(self._ignored.values(), key=lambda p: p.node_id)

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            self._remove(name)
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        # An announcement carries PTR, SRV, TXT and A together: usually all cached.
        if info.load_from_cache(self._zc):
            self._judge(name, info)
            return
        if len(self._lookups) >= _MAX_LOOKUPS:
            self.resolve_failures += 1
            return
        task = asyncio.get_running_loop().create_task(self._lookup(name, info))
        self._lookups.add(task)
        task.add_done_callback(self._lookups.discard)

    async def _lookup(self, name: str, info: AsyncServiceInfo) -> None:
        if await info.async_request(self._zc, _RESOLVE_TIMEOUT_MS):
            self._judge(name, info)
        else:
            self.resolve_failures += 1
            log.debug("mDNS: the record of %s never arrived in full", name)

    def _judge(self, name: str, info: ServiceInfo) -> None:
        seen = _parse(info, self._own_tag)
        self.records += 1
        if seen.node_id == self._own_id and self._own_id:
            if seen.address == self._own_address:
                return  # our own record
            seen = IgnoredPeer(seen.node_id, seen.address,
                               "announces this node's id (a second process with the same "
                               "identity, or this node's earlier run at another address)",
                               "duplicate")
        gone = None
        now = time.monotonic()
        with self._lock:
            if isinstance(seen, DiscoveredPeer):
                self._ignored.pop(name, None)
                old = self._peers.get(name)
                if old == seen:
                    return
                if old is None and len(self._peers) >= self._max_records:
                    self.dropped += 1
                    self.limiter.log(now, _host(seen.address), logging.WARNING,
                                     "mDNS: more than %d records of this namespace; left out "
                                     "%s at %s (a flood of forged records?)",
                                     self._max_records, seen.node_id, seen.address)
                    self._forget(name, info)
                    return
                self._peers[name] = seen
                if old is None:
                    self.found += 1
                    self.limiter.log(now, _host(seen.address), logging.INFO,
                                     "discovered node %s at %s", seen.node_id, seen.address)
                else:
                    self.updated += 1
            else:
                gone = self._peers.pop(name, None)
                known = self._ignored.get(name)
                if known == seen:
                    return
                if known is None and len(self._ignored) >= _MAX_IGNORED:
                    self.dropped += 1
                else:
                    self._ignored[name] = seen
                # A WARNING: a node that cannot join is what a user who
                # expected it to must see (pmetal discover and pmetal status
                # list it too); rate-limited, as records cost a stranger nothing.
                self.limiter.log(now, _host(seen.address), logging.WARNING,
                                 "ignoring pmetal node %s at %s: %s", seen.node_id,
                                 seen.address, seen.reason)
                if gone is None:
                    # Nothing of it is ours to keep: zeroconf's copy of the
                    # record goes too (2,500 of them held 12 MB).
                    self._forget(name, info)
            self.changed.notify_all()
        if isinstance(seen, IgnoredPeer) and gone is not None:
            self._deliver("gone", gone)
        self._deliver("peer" if isinstance(seen, DiscoveredPeer) else "ignored", seen)

    def _forget(self, name: str, info: ServiceInfo) -> None:
        """Drop an ignored record from zeroconf's cache, and the browser's
        refresh of it: nothing of it is kept (a later announcement is judged
        again, and costs a packet's work)."""
        cache = self._zc.cache
        records = [r for t in (_TYPE_SRV, _TYPE_TXT)
                   for r in cache.async_all_by_details(name, t, _CLASS_IN)]
        pointer = cache.current_entry_with_name_and_alias(SERVICE_TYPE, name)
        if pointer is not None:
            records.append(pointer)
            scheduler = getattr(self._browser, "query_scheduler", None)
            if scheduler is not None and hasattr(scheduler, "cancel_ptr_refresh"):
                scheduler.cancel_ptr_refresh(pointer)
        cache.async_remove_records(records)
        server = info.server
        if server and not cache.async_entries_with_server(server):
            cache.async_remove_records(cache.async_all_by_details(server, _TYPE_A, _CLASS_IN))

    def _remove(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
            self._ignored.pop(name, None)
            if peer is None:
                return
            self.gone += 1
            self.changed.notify_all()
        self.limiter.log(time.monotonic(), _host(peer.address), logging.INFO,
                         "node %s withdrew its mDNS record", peer.node_id)
        self._deliver("gone", peer)


def _host(address: str) -> str:
    """The IP of ``tcp://ip:port``: the source a rate limit counts by."""
    return host_of(address, address)


def _open(interfaces: Interfaces) -> Zeroconf:
    """A zeroconf instance on exactly ``interfaces``, IPv4 only."""
    if interfaces == "all":
        choice: Any = InterfaceChoice.All
    else:
        choice = list(interfaces)
        if not choice:
            raise PMetalValueError("discovery needs at least one interface address "
                                   "(or 'all')")
        for address in choice:
            try:
                ipaddress.IPv4Address(address)
            except ValueError as exc:
                raise PMetalValueError(f"discovery interface {address!r} is not an IPv4 "
                                       f"address") from exc
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        # Zeroconf would adopt this loop instead of starting its own thread,
        # and our blocking waits on it would then deadlock.
        raise PMetalValueError("mDNS must be opened outside a running asyncio loop: use "
                               "Discovery.start(), or asyncio.to_thread(browse, ...)")
    try:
        return Zeroconf(interfaces=choice, ip_version=IPVersion.V4Only)
    except OSError as exc:
        raise TransportError(f"cannot open mDNS (UDP 5353) on {interfaces}: {exc} (is every "
                             f"address one of this machine's interfaces?)") from exc


def _run(zc: Zeroconf, coro: Any) -> Future[Any]:
    assert zc.loop is not None
    return asyncio.run_coroutine_threadsafe(coro, zc.loop)


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
