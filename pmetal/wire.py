"""The pmetal wire protocol: every message kind, and how it becomes frames.

Frame layout (``PROTOCOL_VERSION`` = 1)
=======================================

A message is one multipart ZeroMQ message::

    frame 0          envelope: msgpack array [version, kind, corr, term, sender, body]
                     (+ a seal appended on an authenticated session; see security.py)
    frames 1..n      buffers: raw bytes of arrays, never copied into msgpack

``version``  int, must equal ``PROTOCOL_VERSION``.
``kind``     int, the :class:`Kind` of the body.
``corr``     int >= 0, correlation id: a reply carries its request's ``corr``;
             0 means "no reply expected".
``term``     int or nil: the master's term when the master issued the message
             (fencing; see DESIGN.md section 4).
``sender``   str or nil: the sender's node id.
``body``     msgpack array: the message's fields in declaration order.

Arrays (numpy, or MLX when installed) anywhere in the body are msgpack
extension values (code 1 numpy, code 3 MLX) holding
``[dtype, shape, first_frame, nframes]``: the array's bytes are frames
``first_frame .. first_frame+nframes-1`` (C order), split into chunks of at
most ``chunk_bytes`` because ZeroMQ moves 1 MiB frames about three times
faster than 64 MiB ones. A single-frame array is decoded without copying
(and is read-only, like Ray's zero-copy arrays); a multi-frame array is
reassembled into one new array. Zero-size arrays have no frames.

Extension code 4 is an array handed over in shared memory
(``[code, dtype, shape, name, nbytes]``, see pmetal.shm); it is accepted only
from an authenticated peer that proved it runs on the same host. Extension
code 5 is the same for a reusable slot (``[code, dtype, shape, name, nbytes,
slot size]``): the receiver copies the array out while decoding, and the
sender reuses the slot once the request that carried it is answered.

Extension code 2 carries a cloudpickle payload (:class:`Pickled`). Only
explicitly wrapped values are pickled, and :func:`decode` refuses them
unless the caller says the peer is authenticated (``allow_pickle=True``).
Even then they stay bytes until :meth:`Pickled.load` is called.

Decoding anything malformed (garbage, truncation, wrong version, unknown
kind, wrong field types, oversize, buffers that do not match the envelope)
raises :class:`~pmetal.errors.ProtocolError` and nothing else.

Kinds added after version 1 was fixed (still version 1: an old node answers
them with a ``bad_request`` Failure): ``OwnerDied`` (36), ``ResourcesRequest``
(37) and ``Resources`` (38), node to node, for actor lifetime and placement;
``Detach`` (32), a client to its node when it shuts down. Placement groups
(33-35, 39: ``CreatePlacementGroup`` and ``PlacementGroupQuery`` from a
client to its node, ``ReserveBundles`` from the group's node to the nodes
that hold its bundles, ``PlacementGroupQuery`` with ``local`` node to node,
``PlacementGroups`` the answer). ``StreamCall``, ``StreamCredit`` and
``StreamStop`` (47-49), a caller to a worker, for generators
(``num_returns="streaming"``).
Object ownership's kinds (70-71: ``FetchObject``, ``BorrowUpdates``) go from
a process that borrows an ObjectRef to the object server of the process
that owns it.
The cluster's kinds (50-58: ``Beat``, ``BeatEcho``, ``VoteRequest``, ``Vote``,
``ClusterView``, ``JoinCluster``, ``WatchCluster``, ``ClusterState``, ``Probe``)
are node to node, but for the watch, which a client asks of its own node.
The model store's kinds (60-63: ``ModelQuery``, ``ModelHoldings``,
``PieceRead``, ``PieceData``) are asked of a node by any process of the
namespace. The dashboard's (67-68: ``MachineRequest``, ``Machine``) go node
to node: what a member's machine hosts, for the asking node's page.
The metrics' kinds (76-77: ``TelemetryRequest``, ``Telemetry``): a node
asks each of its workers at a scrape of ``/metrics``; a driver pushes its
own to its node.
Fields added at the end of a message (an old peer's shorter message decodes
with their defaults): ``ActorLocation.max_task_retries`` and
``ActorLocation.owner_lease``, ``OwnerDied.client``.

This module holds the messages; :mod:`pmetal.codec` turns them into frames
and back (:func:`encode`, :func:`decode`, :class:`Envelope`,
:class:`WireLimits`, :func:`frame_bytes`, importable from here too).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "Accepted",
    "Ack",
    "ActorLocation",
    "Beat",
    "BeatEcho",
    "BorrowUpdates",
    "Call",
    "CallBatch",
    "CancelCall",
    "ClusterState",
    "ClusterView",
    "Confirm",
    "CreateActor",
    "CreatePlacementGroup",
    "Detach",
    "ErrorReply",
    "Failure",
    "FetchObject",
    "Hello",
    "InitActor",
    "JoinCluster",
    "KillActor",
    "Kind",
    "LeaseWorkers",
    "LookupActor",
    "Machine",
    "MachineRequest",
    "Message",
    "ModelHoldings",
    "ModelQuery",
    "NodeJoin",
    "OwnerDied",
    "PROTOCOL_VERSION",
    "Pickled",
    "PieceData",
    "PieceRead",
    "Ping",
    "PlacementGroupQuery",
    "PlacementGroups",
    "Pong",
    "Probe",
    "Rejected",
    "ReserveBundles",
    "Resources",
    "ResourcesRequest",
    "Result",
    "RunTask",
    "Shutdown",
    "Status",
    "StatusRequest",
    "StreamCall",
    "StreamCredit",
    "StreamStop",
    "Telemetry",
    "TelemetryRequest",
    "Vote",
    "VoteRequest",
    "WatchCluster",
    "Welcome",
    "WorkerList",
    "WorkerReady",
    "message_types",
]

PROTOCOL_VERSION = 1

class Kind(enum.IntEnum):
    """Message kinds. Values are wire constants: never renumber."""

    HELLO = 1
    WELCOME = 2
    CONFIRM = 3
    ACCEPTED = 4
    REJECTED = 5
    PING = 10
    PONG = 11
    ERROR = 12
    # actor runtime: node control
    WORKER_READY = 20
    CREATE_ACTOR = 21
    ACTOR_LOCATION = 22
    LOOKUP_ACTOR = 23
    KILL_ACTOR = 24
    LEASE_WORKERS = 25
    WORKER_LIST = 26
    STATUS_REQUEST = 27
    STATUS = 28
    ACK = 29
    SHUTDOWN = 30
    NODE_JOIN = 31
    DETACH = 32
    # placement groups (pmetal.node.groups)
    CREATE_PLACEMENT_GROUP = 33
    RESERVE_BUNDLES = 34
    PLACEMENT_GROUP_QUERY = 35
    OWNER_DIED = 36
    RESOURCES_REQUEST = 37
    RESOURCES = 38
    PLACEMENT_GROUPS = 39
    # actor runtime: execution in workers
    INIT_ACTOR = 40
    CALL = 41
    RUN_TASK = 42
    RESULT = 43
    FAILURE = 44
    CALL_BATCH = 45
    CANCEL_CALL = 46
    # actor runtime: streaming generators (num_returns="streaming")
    STREAM_CALL = 47
    STREAM_CREDIT = 48
    STREAM_STOP = 49
    # the cluster: health, election, membership, topology (pmetal.cluster)
    BEAT = 50
    BEAT_ECHO = 51
    VOTE_REQUEST = 52
    VOTE = 53
    CLUSTER_VIEW = 54
    JOIN_CLUSTER = 55
    WATCH_CLUSTER = 56
    CLUSTER_STATE = 57
    PROBE = 58
    # the model store: pieces of models between nodes (pmetal.store)
    MODEL_QUERY = 60
    MODEL_HOLDINGS = 61
    PIECE_READ = 62
    PIECE_DATA = 63
    # object ownership: borrowers and owners of ObjectRefs (pmetal.actors.objects)
    FETCH_OBJECT = 70
    BORROW_UPDATES = 71
    # the dashboard (pmetal.dashboard): a member's machine, node to node
    MACHINE_REQUEST = 67
    MACHINE = 68
    # metrics: what workers and drivers ran, for their node (pmetal.tally)
    TELEMETRY_REQUEST = 76
    TELEMETRY = 77


class Message:
    """Base of every message body. Subclasses are frozen dataclasses
    registered with :func:`_message`."""

    KIND: ClassVar[Kind]
    __slots__ = ()


_REGISTRY: dict[int, type[Message]] = {}
# Per class: (number of required fields, ((field name, checker), ...)).
_CHECKERS: dict[type[Message], tuple[int, tuple[tuple[str, Callable[[Any], Any] | None], ...]]] = {}
_UNCHECKED: set[type[Message]] = set()   # classes whose fields are all Any


def _message(kind: Kind) -> Callable[[type], type]:
    def register(cls: type) -> type:
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.KIND = kind
        if int(kind) in _REGISTRY:
            raise RuntimeError(f"kind {kind!r} registered twice")
        _REGISTRY[int(kind)] = cls
        return cls
    return register


def message_types() -> dict[Kind, type[Message]]:
    """Every registered message class by kind."""
    return {Kind(k): cls for k, cls in sorted(_REGISTRY.items())}


class Pickled:
    """A value shipped by value with cloudpickle (user code defined in
    ``__main__``, closures). Unpickling is deferred to :meth:`load` so that
    processes that only route a payload never execute it."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = bytes(data)

    @classmethod
    def dumps(cls, obj: Any) -> Pickled:
        import cloudpickle
        return cls(cloudpickle.dumps(obj))

    def load(self) -> Any:
        import cloudpickle  # noqa: F401  (cloudpickle output may need it importable)
        import pickle
        return pickle.loads(self.data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pickled) and other.data == self.data

    def __hash__(self) -> int:
        return hash(self.data)

    def __repr__(self) -> str:
        return f"Pickled({len(self.data)} bytes)"


# ----------------------------------------------------------------- messages

@_message(Kind.HELLO)
class Hello(Message):
    """Client to server, unauthenticated: opens the namespace handshake."""

    node_id: str
    public_key: bytes
    ephemeral_key: bytes
    nonce: bytes
    namespace_tag: bytes
    mode: int = 2
    """The protection mode the client requires (security.Mode); the session
    uses the stricter of the two sides' modes."""
    host: bytes = b""
    """The client's half of the same-machine proof (shm.offer): boot id,
    pid and a shared-memory token; see docs/protocol.md."""


@_message(Kind.WELCOME)
class Welcome(Message):
    """Server to client: the server's keys and its proof of the PSK,
    signed with its identity key."""

    node_id: str
    public_key: bytes
    ephemeral_key: bytes
    nonce: bytes
    proof: bytes
    signature: bytes
    mode: int = 2
    host: bytes = b""
    """The server's answer to the same-machine proof (shm.answer); empty
    when the client is not on this machine."""


@_message(Kind.CONFIRM)
class Confirm(Message):
    """Client to server: the client's proof of the PSK and its signature."""

    proof: bytes
    signature: bytes


@_message(Kind.ACCEPTED)
class Accepted(Message):
    """Server to client, sealed: the session is open."""

    node_id: str


@_message(Kind.REJECTED)
class Rejected(Message):
    """Server to client, unauthenticated: the handshake was refused."""

    reason: str


@_message(Kind.PING)
class Ping(Message):
    """Liveness probe and echo request; the reply is a :class:`Pong` with
    the same payload (arrays included)."""

    payload: Any = None


@_message(Kind.PONG)
class Pong(Message):
    payload: Any = None


@_message(Kind.ERROR)
class ErrorReply(Message):
    """A request failed at the receiver."""

    error_type: str
    message: str
    traceback: str = ""


# ------------------------------------------------- actor runtime: node control
# User values (arguments, results) are "packed": native msgpack values and
# arrays as they are, anything else as a Pickled payload (actors.serialization).

@_message(Kind.WORKER_READY)
class WorkerReady(Message):
    """Worker to its node: started and listening at ``address``."""

    worker_id: str
    address: str
    pid: int


@_message(Kind.CREATE_ACTOR)
class CreateActor(Message):
    """Creator to a node: place and construct an actor. ``cls_ref`` is
    ``"module:qualname"`` or a Pickled class; ``options`` holds num_cpus,
    resources, max_restarts, max_concurrency, node and name."""

    actor_id: str
    cls_id: str
    cls_ref: Any
    args: list
    kwargs: dict
    options: dict


@_message(Kind.ACTOR_LOCATION)
class ActorLocation(Message):
    """Where an actor lives now. ``state`` is "alive", "restarting", "dead" or
    "moved" (its copy on that node ended when the node was fenced; its owner's
    node restarts it elsewhere, so a caller waits for the next incarnation);
    ``incarnation`` counts restarts (0 for the first constructor run).
    ``max_task_retries`` is the actor's own option, so that a handle found by
    name retries calls as the creator's handle does. ``owner_lease``: see below."""

    actor_id: str
    state: str
    address: str = ""
    node_id: str = ""
    incarnation: int = 0
    name: str = ""
    reason: str = ""
    class_name: str = ""
    methods: tuple[str, ...] = ()
    is_async: bool = False
    max_task_retries: int = 0
    owner_lease: float = 0.0
    """In the answer to a CreateActor from a client whose process its node
    cannot watch (another machine): s within which the client must send its
    node a message, and keep doing so, or its actors die (0: no lease)."""
    node_incarnation: int = 0
    """The incarnation of the node it lives on (0: not known): a fence gives
    the node a new one and ends its actors, so the creator's node, which
    restarts the actors it placed, knows a copy is gone when the master's
    list shows a newer incarnation of that node."""

    @property
    def live(self) -> bool:
        """A copy that is (or is about to be) running: neither dead nor
        "moved" (ended by a fence; its restart lives elsewhere)."""
        return self.state not in ("dead", "moved")


@_message(Kind.LOOKUP_ACTOR)
class LookupActor(Message):
    """Ask a node where an actor is, by id or by name; with ``wait`` > 0 the
    node answers once the actor has an incarnation >= ``min_incarnation`` (or
    is dead), or when ``wait`` seconds pass."""

    actor_id: str = ""
    name: str = ""
    min_incarnation: int = 0
    wait: float = 0.0
    local: bool = False
    """Answer from this node's own actors only (a node asking its peers)."""


@_message(Kind.KILL_ACTOR)
class KillActor(Message):
    """Kill an actor's process. ``node_id``: the node that hosts it (from
    the handle); a node that does not host the actor passes the request on
    to that member. With ``worker_address`` (pmetal.cancel(force=True) of a
    running task; ``actor_id`` is then ignored): kill this node's task
    worker at that address instead; the node starts another."""

    actor_id: str
    no_restart: bool = True
    node_id: str = ""
    worker_address: str = ""


@_message(Kind.LEASE_WORKERS)
class LeaseWorkers(Message):
    """Ask a node for the addresses of its task workers (remote functions).
    ``count`` > 0: lend that many workers to the asker alone (a task that
    starts tasks), taken from the idle pool. ``avoid``: addresses the asker
    saw die, which the node may not have noticed yet; the node answers with
    other workers (their replacements), waiting for them if it must."""

    count: int = 0
    avoid: tuple[str, ...] = ()


@_message(Kind.WORKER_LIST)
class WorkerList(Message):
    addresses: tuple[str, ...]
    starting: int = 0
    """Task workers of the node not ready yet: ask again later to use them."""


@_message(Kind.STATUS_REQUEST)
class StatusRequest(Message):
    """Ask a node for its view of the cluster (``pmetal status``).
    ``detail``: measure the bandwidth of its links first; ``measure``: each
    member's entry gets its ``capacity`` (see :class:`Resources`)."""

    detail: bool = False
    measure: bool = False


@_message(Kind.STATUS)
class Status(Message):
    info: dict


@_message(Kind.ACK)
class Ack(Message):
    info: Any = None


@_message(Kind.SHUTDOWN)
class Shutdown(Message):
    reason: str = ""


@_message(Kind.NODE_JOIN)
class NodeJoin(Message):
    """Node to node: "I am a member at ``address``"; the answer is the
    receiver's :class:`Status`. Membership before discovery (static peers)."""

    node_id: str
    address: str
    resources: dict


@_message(Kind.DETACH)
class Detach(Message):
    """Client to its node, at ``pmetal.shutdown()``: end the actors this
    client's session created that are not detached, here and on the members
    hosting some (as when its process exits). The answer is an Ack with the
    number of actors ended on this node."""

    reason: str = ""


@_message(Kind.OWNER_DIED)
class OwnerDied(Message):
    """Node to a member: an owner that reached the cluster through node
    ``node_id`` (the sender itself) is gone; kill the actors it owned that
    are not detached. The owner is process ``pid`` of that machine (it
    exited), or, when ``client`` is set, the client session with that id (it
    detached, or its lease lapsed; ``pid`` is then 0). Sent to the members
    that host actors of that owner; the answer is an Ack."""

    node_id: str
    pid: int
    client: str = ""


@_message(Kind.RESOURCES_REQUEST)
class ResourcesRequest(Message):
    """Node to a member: its resources now (placement); the answer is
    :class:`Resources`, with its ``capacity`` when ``measure``."""

    measure: bool = False


@_message(Kind.MACHINE_REQUEST)
class MachineRequest(Message):
    """Node to a member, for the asking node's dashboard: what the member's
    machine hosts now. The answer is :class:`Machine`."""


@_message(Kind.MACHINE)
class Machine(Message):
    """A member's machine as a dashboard shows it: its ``actors`` (one map
    each: actor_id, name, class_name, state, restarts, restarts_left,
    last_error, pid), the pipeline ``stages`` it hosts (maps: pipeline,
    index, steps, seconds_per_step, hop_bytes), its memory now (bytes),
    resources ``available``, creations ``queued``, worker processes and the
    node daemon's resident bytes (:mod:`pmetal.dashboard.snapshot`)."""

    actors: list
    stages: list
    memory_total: int
    memory_free: int
    available: dict
    queued: int = 0
    workers: int = 0
    node_rss: int = 0


@_message(Kind.RESOURCES)
class Resources(Message):
    """A node's resources: ``total`` and ``available`` (not held by actors),
    and how many creations wait in its queue for resources; ``capacity``
    (asked with ``measure``): its compute rate, free memory and links, a
    map of :class:`pmetal.cluster.capacity.Capacity`."""

    total: dict
    available: dict
    queued: int = 0
    actors: int = 0
    capacity: dict | None = None


# ---------------------------------------------------------- placement groups
#
# A bundle is a map of resource name to amount ({"CPU": 1.0, "GPU": 1.0}).
# A group entry (``PlacementGroups.groups``) is a map with the keys
# ``group_id``, ``name``, ``strategy``, ``state`` ("PENDING", "CREATED" or
# "REMOVED"), ``bundles`` (list of bundle maps), ``bundle_nodes`` (list of
# node ids, "" for a bundle not reserved yet), ``owner_node``, ``lifetime``
# and ``reason`` (why it is pending), plus, in a host's answer,
# ``available``: {index: the bundle's resources not held by its actors}.

@_message(Kind.CREATE_PLACEMENT_GROUP)
class CreatePlacementGroup(Message):
    """Client to its node: create a placement group of ``bundles`` (resource
    maps) by ``strategy`` ("PACK", "SPREAD", "STRICT_PACK" or
    "STRICT_SPREAD"). This node holds the group and reserves its bundles on
    the nodes it picks; ``options`` holds ``lifetime`` and ``owner_pid``.
    The answer is a :class:`PlacementGroups` with the group's entry, at
    once, pending or created."""

    group_id: str
    name: str
    bundles: list
    strategy: str
    options: dict


@_message(Kind.RESERVE_BUNDLES)
class ReserveBundles(Message):
    """The group's node to a node: hold ``bundles`` (``[[index, {resource:
    amount}], ...]``) of group ``group_id`` out of the free resources, all
    or none (a Failure of kind "placement" when they do not fit now); with
    ``release``, give back the bundles listed of attempt ``attempt`` (a
    rolled-back attempt), or, with none listed, every bundle of that group
    held for attempts up to ``attempt``, and end the actors placed in them. A reserve of an attempt already released is
    refused, so a release that overtakes its reserve leaves nothing held."""

    group_id: str
    attempt: int
    bundles: list
    release: bool = False
    owner_node: str = ""


@_message(Kind.PLACEMENT_GROUP_QUERY)
class PlacementGroupQuery(Message):
    """Ask a node about placement groups: the one with ``group_id`` or
    ``name``, or every one (both empty). ``remove``: remove it (its bundles
    are released, their actors end). ``wait``: answer with a
    :class:`Result` once the group is created, or a Failure once it is
    removed (``pg.ready()``). ``local``: from this node's own groups and
    bundles only (a node asking its members). The answer is
    :class:`PlacementGroups`."""

    group_id: str = ""
    name: str = ""
    remove: bool = False
    wait: bool = False
    local: bool = False


@_message(Kind.PLACEMENT_GROUPS)
class PlacementGroups(Message):
    """Entries of placement groups (see the comment above)."""

    groups: list


# ------------------------------------------------------------ the cluster
#
# Member entries (``ClusterView.members``, ``JoinCluster.members``) are maps
# with the keys ``node_id`` (str), ``address`` (str, tcp://host:port),
# ``incarnation`` (int), ``resources`` (map), ``profile`` (map: see
# pmetal.cluster.topology.NodeProfile) and, in a master's view, ``state``
# ("alive" or "dead").

@_message(Kind.BEAT)
class Beat(Message):
    """Node to node, one-way, every ``health.interval``: "I am alive, and
    this is my view of the cluster". The receiver answers with a
    :class:`BeatEcho` (link latency) and feeds its failure detector and its
    election. ``incarnation`` changes whenever the node starts or fences
    itself; ``master`` is "" while the sender knows none; ``epoch`` and
    ``size`` describe its member list; ``sent`` is the sender's clock,
    echoed back unchanged."""

    node_id: str
    incarnation: int
    address: str
    term: int
    master: str
    epoch: int
    size: int
    sent: float
    master_address: str = ""


@_message(Kind.BEAT_ECHO)
class BeatEcho(Message):
    """The answer to a :class:`Beat` (one-way): its ``sent``, unchanged."""

    node_id: str
    sent: float


@_message(Kind.VOTE_REQUEST)
class VoteRequest(Message):
    """A candidate asks for a vote in ``term`` (one-way). ``pre`` marks a
    pre-vote, which changes no one's term. ``epoch`` is the candidate's
    member-list epoch: no one votes for a candidate whose list is older."""

    term: int
    candidate: str
    epoch: int
    pre: bool = False


@_message(Kind.VOTE)
class Vote(Message):
    """The answer to a :class:`VoteRequest` (one-way)."""

    term: int
    voter: str
    granted: bool
    pre: bool = False
    reason: str = ""


@_message(Kind.CLUSTER_VIEW)
class ClusterView(Message):
    """Master to members: the member list, versioned by ``epoch`` (see the
    member entries above). Sent when it changes, and to a member whose
    :class:`Beat` shows an older epoch."""

    term: int
    master: str
    epoch: int
    members: list


@_message(Kind.JOIN_CLUSTER)
class JoinCluster(Message):
    """To a master: add these members (the sender first; a master that
    yields to a larger cluster sends all of its own). One-way: the answer is
    a :class:`ClusterView` that lists them."""

    term: int
    members: list


@_message(Kind.WATCH_CLUSTER)
class WatchCluster(Message):
    """Client to its node: answer with :class:`ClusterState` as soon as its
    ``version`` is past ``version``, or after ``wait`` seconds."""

    version: int
    wait: float


@_message(Kind.CLUSTER_STATE)
class ClusterState(Message):
    """A node's cluster as its clients need it: the nodes declared dead
    (their actors' calls fail at once), the master and its term, the
    member-list epoch, and the live members (this node included).
    ``version`` grows with every change."""

    version: int
    dead: tuple[str, ...]
    master: str
    term: int
    epoch: int
    members: tuple[str, ...] = ()


@_message(Kind.PROBE)
class Probe(Message):
    """Node to node: ``payload`` to measure the link's bandwidth; the answer
    is an :class:`Ack` holding its length."""

    payload: bytes


# ------------------------------------------------------ the model store
#
# Asked of a node daemon by any process of the namespace (a stage, ``pmetal
# models pull``); answered from the node's store ($PMETAL_HOME/models), or
# with a Failure of kind "not_found". See pmetal.store and docs/protocol.md.

@_message(Kind.MODEL_QUERY)
class ModelQuery(Message):
    """What the node holds of the model whose file has sha256 ``sha256``;
    the answer is :class:`ModelHoldings`."""

    sha256: str


@_message(Kind.MODEL_HOLDINGS)
class ModelHoldings(Message):
    """The model's manifest (its canonical bytes, as a uint8 array) and one
    byte per piece of it, 1 where the node holds the piece."""

    manifest: Any
    held: bytes


@_message(Kind.PIECE_READ)
class PieceRead(Message):
    """Bytes ``[offset, offset + length)`` of the model's file, which must
    lie in pieces the node holds and be at most ``store.chunk_bytes`` long;
    the answer is :class:`PieceData`."""

    sha256: str
    offset: int
    length: int


@_message(Kind.PIECE_DATA)
class PieceData(Message):
    """The bytes a :class:`PieceRead` asked for (a uint8 array: a frame of
    its own, never inside the envelope)."""

    data: Any


# -------------------------------------------- actor runtime: execution

@_message(Kind.INIT_ACTOR)
class InitActor(Message):
    """Node to a worker: become this actor (run its constructor)."""

    actor_id: str
    cls_id: str
    cls_ref: Any
    args: list
    kwargs: dict
    options: dict
    incarnation: int = 0


@_message(Kind.CALL)
class Call(Message):
    """Caller to an actor's worker: run ``method`` with packed arguments."""

    actor_id: str
    method: str
    args: list
    kwargs: dict


@_message(Kind.RUN_TASK)
class RunTask(Message):
    """Caller to a task worker: run a remote function. ``fn_ref`` may be
    None when the worker already has ``fn_id``; it answers with a Failure of
    kind "unknown_function" when it has not."""

    fn_id: str
    fn_ref: Any
    args: list
    kwargs: dict


@_message(Kind.RESULT)
class Result(Message):
    value: Any = None


@_message(Kind.FAILURE)
class Failure(Message):
    """A call or task failed. ``kind``: "user" (the user code raised;
    ``exception`` is the Pickled exception when it could be pickled),
    "actor_died", "no_such_method", "unknown_function", "bad_request",
    "placement", "not_found", "timeout" (a creation waited for resources past
    its deadline)."""

    kind: str
    error_type: str
    message: str
    traceback: str = ""
    exception: Any = None


@_message(Kind.CALL_BATCH)
class CallBatch(Message):
    """Several calls to one actor in one message (one-way). ``calls`` holds
    ``[method, args, kwargs]`` triples; the worker answers each call on its
    own, as soon as it is done, with the correlation id in ``corrs`` at the
    same position, so a batch never holds a result back. Callers batch only
    calls queued behind others, so a lone call never waits."""

    actor_id: str
    calls: list
    corrs: tuple[int, ...]


@_message(Kind.CANCEL_CALL)
class CancelCall(Message):
    """Caller to an actor's worker, one-way (pmetal.cancel): cancel the
    running call that has correlation id ``corr`` on this connection. An
    async method is cancelled through asyncio and answered with
    ``Failure("cancelled")``; anything else (a sync method, a call already
    done) is left as it is."""

    corr: int


@_message(Kind.STREAM_CALL)
class StreamCall(Message):
    """Caller to a worker: run a generator (``num_returns="streaming"``) and
    send each item it yields as it comes. ``actor_id`` names the actor whose
    method ``name`` runs; an empty ``actor_id`` makes it a task: ``name`` is
    then a function id and ``fn_ref`` its code (None when the worker has it,
    as in :class:`RunTask`). ``corrs`` are the correlation ids for the first
    items, one each: item i is answered with ``Result`` (or ``Failure``, the
    exception the generator raised, after which it ends) on ``corrs[i]``.
    The worker pulls an item only while it holds an unused id, so the caller
    bounds how far the generator runs ahead (backpressure) by the ids it
    grants (:class:`StreamCredit`). When the generator ends the worker
    answers the StreamCall's own correlation id with ``Result(count)``, the
    number of items sent; a call that cannot start (no such actor or method,
    unknown function) is answered there with a ``Failure`` and no item."""

    actor_id: str
    name: str
    fn_ref: Any
    args: list
    kwargs: dict
    corrs: tuple[int, ...]


@_message(Kind.STREAM_CREDIT)
class StreamCredit(Message):
    """Caller to a worker, one-way: more correlation ids for the items of
    the stream that the StreamCall with correlation id ``stream`` opened on
    this connection (sent as the caller consumes items). Ids for a stream
    that has ended are ignored."""

    stream: int
    corrs: tuple[int, ...]


@_message(Kind.STREAM_STOP)
class StreamStop(Message):
    """Caller to a worker, one-way: stop the stream ``stream`` (the
    caller's ObjectRefGenerator was cancelled with ``pmetal.cancel``:
    ``cancel``; or dropped unread). The worker pulls no further item, closes
    the generator (an async generator waiting in ``__anext__`` is cancelled
    through asyncio) and answers ``stream`` as when it ends."""

    stream: int
    cancel: bool = False


# ------------------------------------------------------ object ownership
#
# Between processes that hold ObjectRefs: a borrower (a process that
# received a ref inside a value) and the ref's owner (the process that made
# it), whose object server answers. See pmetal.actors.objects and
# docs/protocol.md#object-ownership.

@_message(Kind.FETCH_OBJECT)
class FetchObject(Message):
    """Borrower to owner: the value of object ``oid``. The answer is a
    Result (the packed value) once the owner has it; an owner whose object
    is still pending holds the request up to ``wait`` s and then answers
    ``Failure("timeout")`` (ask again). ``Failure("object")`` carries the
    object's error (its call failed), ``Failure("not_found")`` an object
    the owner no longer holds."""

    oid: int
    wait: float = 10.0


@_message(Kind.BORROW_UPDATES)
class BorrowUpdates(Message):
    """Borrower to owner, one-way: changes to the owner's borrower counts,
    applied together: count(``oids[i]``, ``borrowers[who[i]]``) +=
    ``deltas[i]`` (+n: an AddBorrower for a process the sender passed the
    ref to; -n: a Release of n registrations the borrower received). Any
    message renews the sender's lease as a borrower; an empty one only
    does that."""

    borrowers: tuple[str, ...] = ()
    oids: tuple[int, ...] = ()
    who: tuple[int, ...] = ()
    deltas: tuple[int, ...] = ()


@_message(Kind.TELEMETRY_REQUEST)
class TelemetryRequest(Message):
    """Node to one of its workers, at a scrape of ``/metrics``: its
    :class:`Telemetry`."""


@_message(Kind.TELEMETRY)
class Telemetry(Message):
    """A process's counters for its node's metrics: a worker's answer to
    :class:`TelemetryRequest`, or a driver's report (answered with an Ack).
    ``calls``/``failed``: calls served and those whose code raised;
    ``latency``: calls by duration, one count per bucket of
    ``pmetal.tally``'s bounds plus one above them (empty: not timed),
    ``latency_sum`` their seconds; ``owned``/``borrowed``: ObjectRefs held
    for other processes and borrowed from them; ``collectives``,
    ``pipelines``, ``stages``: the rows of :meth:`pmetal.tally.Tally.report`."""

    pid: int
    role: str                                    # "worker" or "driver"
    calls: int = 0
    failed: int = 0
    latency: tuple[int, ...] = ()
    latency_sum: float = 0.0
    owned: int = 0
    borrowed: int = 0
    collectives: tuple[list, ...] = ()
    pipelines: tuple[list, ...] = ()
    stages: tuple[list, ...] = ()


_CODEC = frozenset({"Envelope", "WireLimits", "decode", "encode", "frame_bytes"})


def __getattr__(name: str) -> Any:
    """The codec's names, importable from here as before the split (loaded on
    first use: pmetal.codec imports this module)."""
    if name in _CODEC:
        from pmetal import codec
        return getattr(codec, name)
    raise AttributeError(f"module 'pmetal.wire' has no attribute {name!r}")
