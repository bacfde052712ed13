"""Configuration: one frozen dataclass per concern.

Every field can be overridden from the environment as
``PMETAL_<SECTION>_<FIELD>`` (for example ``PMETAL_TRANSPORT_PORT=6000``).
Three variables stand outside the sections: ``PMETAL_HOME`` (the folder that
holds the node key pair, ``~/.pmetal`` by default), ``PMETAL_PSK`` (the
namespace pre-shared key; never printed) and ``PMETAL_LOG_LEVEL`` (logging
level of pmetal's own processes: node daemons and workers). Any other ``PMETAL_*`` variable is
rejected, so a typo fails loudly instead of being ignored.

Tests shrink timeouts by building a config, never by patching constants::

    cfg = load_config(transport={"request_timeout": 0.5})
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pmetal.errors import ConfigError

__all__ = [
    "ActorsConfig",
    "CollectiveConfig",
    "DEFAULT_METRICS_PORT",
    "DEFAULT_PORT",
    "DiscoveryConfig",
    "ElectionConfig",
    "HealthConfig",
    "MetricsConfig",
    "PMetalConfig",
    "SecurityConfig",
    "TransportConfig",
    "config_as_dict",
    "config_env",
    "load_config",
    "log_level",
    "pmetal_home",
    "setup_process_logging",
]

DEFAULT_PORT = 52416
DEFAULT_METRICS_PORT = 8265
"""Where a node serves /metrics: Ray's dashboard port."""
_MiB = 1 << 20

# Variables that do not belong to a section.
# PMETAL_PSK_HEX is how a node hands its key to the processes it starts (any
# bytes survive hex; a raw key does not survive an environment string).
# Not config fields: the launcher's rank environment (pmetal launch),
# process-wide settings read where they are used, and the API key of
# pmetal serve (a secret for its HTTP clients, not a cluster setting), and
# the job id a driver hands to the node it embeds (get_runtime_context()).
_STANDALONE_ENV = frozenset({"PMETAL_HOME", "PMETAL_PSK", "PMETAL_PSK_HEX", "PMETAL_LOG_LEVEL",
                             "PMETAL_RANK", "PMETAL_WORLD_SIZE", "PMETAL_LOCAL_RANK",
                             "PMETAL_NODES", "PMETAL_API_KEY", "PMETAL_JOB_ID"})


def _require(cond: bool, section: str, name: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{section}.{name}: {why}")


@dataclass(frozen=True)
class TransportConfig:
    """Sockets, limits and deadlines of the message transport."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_message_bytes: int = 2048 * _MiB
    """Largest message accepted, envelope plus buffers; larger is refused."""
    max_envelope_bytes: int = 64 * _MiB
    """Largest msgpack envelope (pickled code and small values live here)."""
    chunk_bytes: int = 1 * _MiB
    """Arrays larger than this travel as several frames (zmq is ~3x faster
    with 1 MiB frames than with 64 MiB frames on loopback)."""
    shm_min_bytes: int = 4 * _MiB
    """Arrays at least this large go to peers on the same host through
    shared memory instead of the socket (0: never)."""
    send_hwm: int = 10_000
    """Messages queued per peer before sends block: bounds sender memory."""
    recv_hwm: int = 10_000
    send_timeout: float = 10.0
    """How long a send may wait for queue space before BackpressureError."""
    request_timeout: float = 30.0
    connect_timeout: float = 10.0
    handshake_timeout: float = 5.0
    reconnect_ivl: float = 0.1
    reconnect_ivl_max: float = 2.0
    max_sessions: int = 4096
    """Authenticated sessions kept per listener; the least recently used
    session beyond this is forgotten (its peer re-handshakes)."""
    max_pending_handshakes: int = 256
    """Handshakes between Hello and Confirm kept per listener (about 1 KiB
    each); a Hello beyond this evicts the oldest, so a flood of Hellos that
    never complete cannot keep a real peer out."""
    heartbeat_ivl: float = 5.0
    """ZMTP heartbeat interval: a connection that stays silent for three
    intervals is closed, so a connection that died half-open (a sleeping
    laptop) frees its routing id for the peer's reconnection."""

    def __post_init__(self) -> None:
        s = "transport"
        _require(0 <= self.port < 65536, s, "port", f"{self.port} is not a TCP port")
        for name in ("max_message_bytes", "max_envelope_bytes", "chunk_bytes",
                     "send_hwm", "recv_hwm", "max_sessions", "max_pending_handshakes"):
            _require(getattr(self, name) > 0, s, name, "must be positive")
        _require(self.chunk_bytes <= self.max_message_bytes, s, "chunk_bytes",
                 "must not exceed max_message_bytes")
        for name in ("send_timeout", "request_timeout", "connect_timeout",
                     "handshake_timeout", "reconnect_ivl", "reconnect_ivl_max",
                     "heartbeat_ivl"):
            _require(getattr(self, name) > 0, s, name, "must be a positive number of seconds")


@dataclass(frozen=True)
class SecurityConfig:
    """Namespace and message protection.

    ``bulk_auth`` authenticates array buffers as well as envelopes (default);
    turning it off leaves buffer *contents* unauthenticated but still
    authenticates their sizes and every control field. ``encrypt`` encrypts
    envelopes and buffers with ChaCha20-Poly1305 (implies authentication).
    """

    namespace: str = "default"
    psk_file: str = ""
    bulk_auth: bool = True
    encrypt: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.namespace) and len(self.namespace) <= 64, "security",
                 "namespace", "must be 1-64 characters")


@dataclass(frozen=True)
class ActorsConfig:
    """The actor runtime's lifetime rules, and what the node offers.

    ``owner_lease``: a driver whose node cannot watch its process (it runs on
    another machine) holds a lease on its actors: it sends its node something
    at least every quarter of this many seconds (a one-way Ping when idle),
    and the node ends its non-detached actors once it has heard nothing for
    this long. The node's value is the one that counts; it tells the driver.

    ``restart_wait``: the longest a call waits for the actor it is made to
    when that actor's process or node died: for its restart (a retried call,
    ``max_task_retries``, included), or to learn that it is dead for good.
    Past it the call fails with ActorDiedError, unless the actor's node says
    its restart is under way: then up to one ``transport.request_timeout``
    more (that restart ends by its own creation deadline). It bounds every
    call of a driver on the minority side of a partition to an actor it
    cannot reach.
    The default leaves room for a master's loss on a wired LAN (declared
    dead in under 1 s, a new master in about 1 s, the restart).

    ``borrower_lease``: a process that borrows ObjectRefs (it received them
    inside values) tells each of their owners that it is alive at least every
    quarter of this many seconds; an owner that has heard from a borrower
    once and then hears nothing for this long takes it for dead and drops
    its counts (see pmetal.actors.ownership). A borrower renews by its own
    value and an owner lapses by its own: use one value on every machine.
    """

    owner_lease: float = 30.0
    restart_wait: float = 5.0
    borrower_lease: float = 30.0
    # Bytes of memory this node advertises to the cluster (the "memory"
    # resource that pipeline placement divides among stages); 0: the
    # machine's physical memory. A budget for a machine that does other work.
    memory: int = 0

    def __post_init__(self) -> None:
        _require(self.owner_lease > 0, "actors", "owner_lease",
                 "must be a positive number of seconds")
        _require(self.borrower_lease > 0, "actors", "borrower_lease",
                 "must be a positive number of seconds")
        _require(self.restart_wait >= 0, "actors", "restart_wait",
                 "must be a number of seconds, 0 or more")
        _require(type(self.memory) is int and self.memory >= 0, "actors", "memory",
                 "must be a whole number of bytes >= 0 (0: the machine's physical memory)")


@dataclass(frozen=True)
class HealthConfig:
    """Heartbeats and the failure detector (pmetal.cluster.health).

    Every node sends a Beat to every other every ``interval`` seconds. A
    peer silent for ``degraded_after`` is Degraded, for ``suspect_after``
    Suspect, for ``dead_after`` Dead (its actors' calls fail, the master
    restarts what may restart). The master drops a member Dead for
    ``remove_after`` from the member list (it rejoins as a new incarnation).
    The defaults suit a wired LAN (a killed peer is Dead within 1 s);
    :meth:`wifi` is the preset for Wi-Fi, whose pauses last seconds.
    """

    interval: float = 0.1
    degraded_after: float = 0.3
    suspect_after: float = 0.5
    dead_after: float = 0.8
    remove_after: float = 10.0

    def __post_init__(self) -> None:
        s = "health"
        for name in ("interval", "degraded_after", "suspect_after", "dead_after", "remove_after"):
            _require(getattr(self, name) > 0, s, name, "must be a positive number of seconds")
        _require(self.interval < self.degraded_after <= self.suspect_after <= self.dead_after,
                 s, "dead_after", "need interval < degraded_after <= suspect_after <= dead_after")
        _require(self.remove_after >= self.dead_after, s, "remove_after",
                 "must be at least dead_after")

    @classmethod
    def wifi(cls) -> HealthConfig:
        """Wi-Fi: beats every 0.5 s, Dead after 5 s of silence."""
        return cls(interval=0.5, degraded_after=1.5, suspect_after=3.0, dead_after=5.0,
                   remove_after=30.0)


@dataclass(frozen=True)
class ElectionConfig:
    """Master election (pmetal.cluster.election).

    A follower that hears nothing from its master for ``timeout`` seconds
    (plus a random part of up to half of it, so candidates rarely collide)
    starts an election; a master that hears from no majority for ``timeout``
    steps down. A node that starts waits ``bootstrap`` seconds for the
    peers discovery finds before it elects a master among them.
    """

    timeout: float = 0.8
    bootstrap: float = 2.0

    def __post_init__(self) -> None:
        _require(self.timeout > 0, "election", "timeout", "must be a positive number of seconds")
        _require(self.bootstrap >= 0, "election", "bootstrap",
                 "must be a number of seconds, 0 or more")

    @classmethod
    def wifi(cls) -> ElectionConfig:
        return cls(timeout=3.0, bootstrap=3.0)


@dataclass(frozen=True)
class DiscoveryConfig:
    """mDNS discovery (pmetal.cluster.discovery).

    ``enabled``: announce this node and browse for others. ``pmetal start``
    turns it on unless ``--no-discovery``; an embedded node from
    ``pmetal.init()`` only with ``discovery=True``. ``interfaces``: comma-
    separated IPv4 addresses to announce and browse on ("" = the address
    the node listens on, or every interface when it listens on 0.0.0.0).

    A record is only a hint (docs/security.md, "Forged mDNS records"): its
    address is dialled, and believed once a handshake there proves the
    node's id. ``max_candidates``: addresses waiting for that proof, at
    most (more are left for later). A candidate that fails is dialled again
    after ``backoff`` seconds, doubling (with jitter) up to ``backoff_max``,
    and given up ``give_up`` seconds after its first failure; it stays given
    up until no record has named it for ``give_up`` seconds. A withdrawn
    record (an mDNS goodbye) ends its candidate at once. ``max_records``:
    records of this namespace kept at most (a home cluster has a few; the
    rest of a flood is dropped).
    """

    enabled: bool = False
    interfaces: str = ""
    max_candidates: int = 64
    backoff: float = 0.5
    backoff_max: float = 30.0
    give_up: float = 60.0
    max_records: int = 256

    def __post_init__(self) -> None:
        s = "discovery"
        for name in ("max_candidates", "max_records"):
            _require(type(getattr(self, name)) is int and getattr(self, name) > 0, s, name,
                     "must be a whole number > 0")
        for name in ("backoff", "backoff_max", "give_up"):
            _require(getattr(self, name) > 0, s, name, "must be a positive number of seconds")
        _require(self.backoff <= self.backoff_max, s, "backoff_max", "must be at least backoff")
        for part in (p.strip() for p in self.interfaces.split(",") if p.strip()):
            import ipaddress
            try:
                ipaddress.IPv4Address(part)
            except ValueError as exc:
                raise ConfigError(f"discovery.interfaces: {part!r} is not an IPv4 address "
                                  f"(give the addresses of the interfaces, comma-separated)"
                                  ) from exc


# CompressionStrategy's values (pmetal.collectives.compression), and "auto".
_COMPRESSIONS = ("none", "auto", "topk", "random_k", "fp16", "bf16", "int8", "one_bit",
                 "powersgd")

# pmetal.links.seal.requires_seal's policies.
_LINK_ENCRYPTION = ("auto", "on", "off")


@dataclass(frozen=True)
class CollectiveConfig:
    """Collective operations (pmetal.collectives).

    The master (or rank 0 of a static world) fixes these for a group when
    it forms; each operation's plan follows from them and the buffer's
    size, the same on every rank. ``strategy``: "auto" (with three ranks
    or more the tree up to ``tree_max_bytes``, the ring above; with two
    the ring), or "ring", "tree", "naive" for
    every operation. ``chunk_bytes``: the largest message of a pipelined
    ring (smaller pipelines deeper, larger costs fewer headers).
    ``timeout``: seconds one operation may take before every survivor
    raises CollectiveError. ``connect_timeout``: seconds to form the
    group's connections. ``shared_memory``: ranks on one machine exchange
    through shared memory instead of TCP. ``compression``: what a SUM or
    MEAN all_reduce of floats of at least ``compression_min_bytes`` sends:
    "none", a strategy of
    :class:`~pmetal.collectives.compression.CompressionStrategy` ("topk",
    "one_bit", ...; always with error feedback, keeping
    ``compression_ratio`` of the elements for topk and random_k), or
    "auto": the master turns TopK on for a group whose slowest ring link
    it measured below ``compress_below_bandwidth`` bytes/s (Wi-Fi), and
    off otherwise. Lossy compression is for gradients: leave it "none" for
    anything else. ``link_encryption``: whether this rank requires the
    group's TCP links sealed (encrypted and authenticated, AES-256-GCM,
    :mod:`pmetal.links.seal`): "auto" (default) when any rank is off
    loopback, "on" always, "off" never: for links you trust (a cable
    between two machines), to save the cipher's pass over the data. A link
    is sealed when either of its ranks requires it, so "off" takes effect
    only where every rank of the group says "off". Shared-memory links
    (one machine) are never sealed; pipeline hops always are.
    """

    strategy: str = "auto"
    tree_max_bytes: int = 256 * 1024
    chunk_bytes: int = 1 * _MiB
    timeout: float = 30.0
    connect_timeout: float = 30.0
    shared_memory: bool = True
    compression: str = "none"
    compression_ratio: float = 0.01
    compression_min_bytes: int = 256 * 1024
    compress_below_bandwidth: float = 25e6
    link_encryption: str = "auto"

    def __post_init__(self) -> None:
        s = "collectives"
        _require(self.link_encryption in _LINK_ENCRYPTION, s, "link_encryption",
                 f"is {self.link_encryption!r}; use {', '.join(_LINK_ENCRYPTION)} (off: "
                 "trusted links, the data crosses in clear)")
        _require(self.strategy in ("auto", "ring", "tree", "naive"), s, "strategy",
                 f"is {self.strategy!r}; use auto, ring, tree or naive")
        _require(self.tree_max_bytes >= 0, s, "tree_max_bytes", "must be 0 or more")
        _require(self.chunk_bytes >= 4096, s, "chunk_bytes", "must be at least 4096")
        _require(self.timeout > 0, s, "timeout", "must be a positive number of seconds")
        _require(self.connect_timeout > 0, s, "connect_timeout",
                 "must be a positive number of seconds")
        _require(self.compression in _COMPRESSIONS, s, "compression",
                 f"is {self.compression!r}; use {', '.join(_COMPRESSIONS)}")
        _require(0 < self.compression_ratio <= 1, s, "compression_ratio",
                 "must be a fraction in (0, 1] (0.01 keeps 1% of the elements)")
        _require(self.compression_min_bytes >= 0, s, "compression_min_bytes",
                 "must be 0 or more")
        _require(self.compress_below_bandwidth >= 0, s, "compress_below_bandwidth",
                 "must be a number of bytes per second, 0 or more")


@dataclass(frozen=True)
class MetricsConfig:
    """The node's HTTP listener for Prometheus (``/metrics``;
    :mod:`pmetal.node.metrics`).

    ``enabled``: serve it. ``host``: where it listens; on a loopback address
    it is open to this machine, on any other every request needs the
    namespace's dashboard token (:mod:`pmetal.dashboard.auth`). ``port``: 0 takes any free port (the bound
    address is in ``pmetal status --json``). A port already taken (a second
    node on this machine) leaves the node running without metrics, with one
    warning. ``report_interval``: a driver pushes what it ran (collectives,
    pipelines) to its node at most once per this many seconds (0: never;
    :mod:`pmetal.actors.reporter`). ``probe_interval``: the node measures
    the bandwidth of one link to a peer every this many seconds, each in
    turn (0: only on demand, ``pmetal status --probe``).
    """

    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = DEFAULT_METRICS_PORT
    report_interval: float = 1.0
    probe_interval: float = 300.0

    def __post_init__(self) -> None:
        for name in ("report_interval", "probe_interval"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and 0 <= value < float("inf"), "metrics",
                     name, f"{value!r} is not a number of seconds >= 0 (0: off)")
        _require(type(self.port) is int and 0 <= self.port < 65536, "metrics", "port",
                 f"{self.port} is not a TCP port (0: any free port)")
        _require(isinstance(self.host, str) and bool(self.host.strip()), "metrics", "host",
                 f"{self.host!r} is not a host to listen on (127.0.0.1: this machine only; "
                 "another address asks for the namespace's dashboard token)")


@dataclass(frozen=True)
class PMetalConfig:
    """The whole configuration: one field per section."""

    transport: TransportConfig = field(default_factory=TransportConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    actors: ActorsConfig = field(default_factory=ActorsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    election: ElectionConfig = field(default_factory=ElectionConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    collectives: CollectiveConfig = field(default_factory=CollectiveConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def pmetal_home(env: Mapping[str, str] | None = None) -> Path:
    """The folder for node state: ``$PMETAL_HOME`` or ``~/.pmetal``."""
    env = os.environ if env is None else env
    home = env.get("PMETAL_HOME")
    return Path(home).expanduser() if home else Path.home() / ".pmetal"


def log_level(env: Mapping[str, str] | None = None) -> int:
    """The level from ``PMETAL_LOG_LEVEL`` (a name in any case, or a number);
    WARNING when unset. Raises ConfigError for an unknown name."""
    import logging
    env = os.environ if env is None else env
    raw = (env.get("PMETAL_LOG_LEVEL") or "WARNING").strip()
    if raw.isdigit():
        return int(raw)
    level = logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise ConfigError(f"PMETAL_LOG_LEVEL={raw!r} is not a logging level; use DEBUG, INFO, "
                          f"WARNING or ERROR")
    return level


def setup_process_logging(process: str) -> None:
    """Logging for a process pmetal starts itself (node daemon, worker), at
    ``PMETAL_LOG_LEVEL``. Raises ConfigError for a bad level."""
    import logging
    logging.basicConfig(level=log_level(),
                        format=f"%(asctime)s {process} %(process)d %(name)s %(levelname)s "
                               f"%(message)s")


def _coerce(raw: Any, target: type, where: str) -> Any:
    if isinstance(raw, target) and not (target is int and isinstance(raw, bool)):
        return raw
    if not isinstance(raw, str):
        if target is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        raise ConfigError(f"{where}: expected {target.__name__}, got {raw!r}")
    text = raw.strip()
    try:
        if target is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if target is int:
            return int(text, 0)
        if target is float:
            return float(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: cannot read {raw!r} as {target.__name__}") from exc
    return text


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(PMetalConfig)}  # type: ignore[misc]


def load_config(env: Mapping[str, str] | None = None,
                **sections: Mapping[str, Any]) -> PMetalConfig:
    """Defaults, then ``PMETAL_*`` variables from ``env``, then ``sections``.

    ``load_config(transport={"port": 6000})`` overrides one field. Unknown
    sections, fields or variables raise :class:`ConfigError`.
    """
    env = os.environ if env is None else env
    classes = _section_types()
    values: dict[str, dict[str, Any]] = {name: {} for name in classes}

    for key, raw in env.items():
        if not key.startswith("PMETAL_") or key in _STANDALONE_ENV:
            continue
        rest = key[len("PMETAL_"):].lower()
        section, _, name = rest.partition("_")
        if section not in classes or name not in _field_names(classes[section]):
            raise ConfigError(
                f"unknown environment variable {key}; known: "
                f"{', '.join(sorted(_known_env(classes)))}")
        values[section][name] = raw

    for section, overrides in sections.items():
        if section not in classes:
            raise ConfigError(f"unknown config section {section!r}; known: {sorted(classes)}")
        for name, raw in overrides.items():
            if name not in _field_names(classes[section]):
                raise ConfigError(f"unknown setting {section}.{name}")
            values[section][name] = raw

    built = {}
    for section, cls in classes.items():
        typed = {}
        for f in fields(cls):
            if f.name in values[section]:
                target = _TYPES[f.type] if isinstance(f.type, str) else f.type
                typed[f.name] = _coerce(values[section][f.name], target,
                                        f"{section}.{f.name}")
        built[section] = cls(**typed)
    return PMetalConfig(**built)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _known_env(classes: dict[str, type]) -> set[str]:
    names = set(_STANDALONE_ENV)
    for section, cls in classes.items():
        names.update(f"PMETAL_{section.upper()}_{n.upper()}" for n in _field_names(cls))
    return names


def config_as_dict(cfg: PMetalConfig) -> dict[str, dict[str, Any]]:
    """The configuration as plain dicts, for printing (``pmetal config``)."""
    return dataclasses.asdict(cfg)


def config_env(cfg: PMetalConfig) -> dict[str, str]:
    """``cfg`` as ``PMETAL_<SECTION>_<FIELD>`` variables: what a process
    started with them loads (:func:`load_config`) is ``cfg`` again. How a
    driver hands its settings to the node it starts."""
    env = {}
    for section in fields(cfg):
        for f in fields(getattr(cfg, section.name)):
            value = getattr(getattr(cfg, section.name), f.name)
            text = ("true" if value else "false") if isinstance(value, bool) else repr(value) \
                if isinstance(value, float) else str(value)
            env[f"PMETAL_{section.name.upper()}_{f.name.upper()}"] = text
    return env
