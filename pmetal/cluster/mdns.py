"""The mDNS records of pmetal nodes, and the watcher that judges them.

The record's layout, what a node of another namespace or version gets,
and the bounds on what a stranger's records cost are in the docstring of
:mod:`pmetal.cluster.discovery`, which owns the zeroconf instance and
announces this node. This module holds what it reads: the TXT record
written and parsed (:func:`_txt`, :func:`_parse`), a
:class:`DiscoveredPeer` or an :class:`IgnoredPeer` for each record, and
:class:`_Watcher`, which browses for records on zeroconf's loop, looks up
incomplete ones (at most ``_MAX_LOOKUPS`` at once), keeps at most
``max_records`` of ours and ``_MAX_IGNORED`` others, and hands each change
to the discovery's callbacks; plus opening zeroconf on exactly the given
interfaces (:func:`_open`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from zeroconf import (
    DNSOutgoing,
    DNSQuestion,
    InterfaceChoice,
    IPVersion,
    ServiceInfo,
    ServiceStateChange,
    Zeroconf,
    current_time_millis,
)
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

from pmetal.cluster.candidates import LogLimiter
from pmetal.errors import PMetalValueError, TransportError
from pmetal.wire import PROTOCOL_VERSION
from pmetal.values import host_of

__all__ = ["MAX_RECORDS", "REFRESH_INTERVAL", "SERVICE_TYPE", "DiscoveredPeer", "IgnoredPeer",
           "Interfaces"]

log = logging.getLogger("pmetal.cluster.discovery")   # discovery's messages keep its name

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
