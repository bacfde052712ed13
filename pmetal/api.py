"""The Ray-style entry points: ``pmetal.init``, ``get``, ``wait``, ``put``, ...

A process talks to the cluster through one :class:`~pmetal.actors.client.CoreClient`,
held by :mod:`pmetal.actors.context` (the runtime reads it there; this facade
sets it). In a driver it is made by :func:`init`, or, as in Ray, by the first
``.remote()``, ``put``, ``get`` or ``wait`` without ``init`` (auto-init: an
embedded node, logged at INFO). Inside an actor or task (a worker process) it
is made on first use and reaches the worker's own node.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
from dataclasses import replace
from typing import Any

from pmetal.actors import context
from pmetal.actors.client import CoreClient, ObjectRef
from pmetal.actors.generators import ObjectRefGenerator
from pmetal.actors.generators import wait as stream_wait
from pmetal.actors.handles import ActorHandle
from pmetal.actors.runtime_context import get_runtime_context
from pmetal.actors.runtime_env import (check_runtime_env, set_job_env_vars,
                                       set_job_setup_hook, set_job_working_dir,
                                       setup_hook_spec, working_dir_spec)
from pmetal.config import PMetalConfig, config_env, load_config
from pmetal.errors import (ConfigError, NotInitializedError, PeerError, PMetalError,
                           PMetalTypeError, PMetalValueError)
from pmetal.security import NetworkNamespace
from pmetal.values import ActorState

__all__ = [
    "available_resources",
    "cancel",
    "client",
    "cluster_resources",
    "get",
    "get_actor",
    "get_runtime_context",
    "init",
    "is_initialized",
    "kill",
    "nodes",
    "put",
    "shutdown",
    "wait",
    "wait_for_peers",
]

log = logging.getLogger(__name__)

_lock = context.lock
_node_proc: subprocess.Popen[bytes] | None = None   # the embedded node init started


def _start_node(namespace: NetworkNamespace, config: PMetalConfig, num_workers: int | None,
                resources: dict[str, float] | None, timeout: float,
                peers: list[str] | None = None, discovery: bool = False) -> tuple[Any, str]:
    env = dict(os.environ)
    env.pop("PMETAL_PSK", None)
    # The node runs with the caller's settings (pmetal.init(config=...)),
    # not only with what this process's environment says.
    env.update(config_env(config))
    env["PMETAL_PSK_HEX"] = namespace.psk.hex()
    env["PMETAL_SECURITY_NAMESPACE"] = namespace.name
    # Its workers report this driver's job id (get_runtime_context()).
    env[context.JOB_ID_ENV] = context.job_id()
    # Workers import user code by reference: give them the driver's import
    # path (its script folder, the current folder), as Ray does for a job.
    here = [os.path.abspath(p or os.curdir) for p in sys.path if os.path.isdir(p or os.curdir)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(here))
    # Alone, an embedded node listens on 127.0.0.1 whatever the config says:
    # a plain script never opens a port to the network.
    host = config.transport.host if (peers or discovery) else "127.0.0.1"
    cmd = [sys.executable, "-m", "pmetal.node", "--embedded", "--host", host,
           "--port", "0", "--resources", json.dumps(resources or {})]
    if peers:
        cmd += ["--peers", ",".join(peers)]
    cmd += ["--discovery" if discovery else "--no-discovery"]
    if discovery and config.discovery.interfaces:
        cmd += ["--interfaces", config.discovery.interfaces]
    if num_workers is not None:
        cmd += ["--num-workers", str(num_workers)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    from pmetal.node.process import read_ready_line
    _head, address, _node_id = read_ready_line(proc, timeout).split()[:3]
    # Workers print to the node's stdout, a pipe to us: keep draining it (to
    # our stdout, as Ray forwards its workers' output), or a chatty actor
    # blocks once the pipe's buffer is full. Ends when the node exits.
    threading.Thread(target=_forward_output, args=(proc.stdout.fileno(),),
                     name="pmetal-node-output", daemon=True).start()
    return proc, address


def _forward_output(fd: int) -> None:
    out = getattr(sys.stdout, "buffer", None)
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            return
        if not chunk:
            return
        try:
            if out is not None:
                out.write(chunk)
                out.flush()
        except (OSError, ValueError):  # our stdout closed: keep draining anyway
            out = None


def init(address: str | None = None, *, namespace: str | None = None,
         psk: str | bytes | None = None, peers: list[str] | None = None,
         num_workers: int | None = None, resources: dict[str, float] | None = None,
         discovery: bool = False, config: PMetalConfig | None = None,
         ignore_reinit_error: bool = False, num_cpus: float | None = None,
         num_gpus: float | None = None,
         runtime_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Connect this process to a cluster, starting a local one if needed.

    * ``address=None``: start an embedded node on this machine (127.0.0.1
      only, nothing announced) with ``num_workers`` pre-started workers. It
      is stopped by :func:`shutdown` or when this process exits.
    * ``address="auto"``: join the node ``pmetal start`` runs on this machine.
    * ``address="host:port"``: join that node (``psk`` or ``PMETAL_PSK``).

    ``num_cpus``, ``num_gpus`` and ``resources`` set what the embedded node
    advertises (its ``CPU``, ``GPU`` and custom resources), as in Ray; with
    ``address=`` they are refused: the node joined has its own.
    ``runtime_env={"env_vars": {...}, "working_dir": path}`` sets variables
    in the workers of every task and actor this driver starts, and runs them
    in a copy of the folder (:mod:`pmetal.actors.runtime_env`).

    Returns a dict with the node id and address.
    """
    global _node_proc
    _check_init_arguments(num_workers)
    if resources is not None:
        from pmetal.node.placement import check_resources
        try:
            resources = check_resources(resources, "pmetal.init(resources=...)")
        except TypeError as exc:
            raise PMetalTypeError(str(exc)) from exc
        except ValueError as exc:
            raise PMetalValueError(str(exc)) from exc
    node_resources = _node_resources(num_cpus, num_gpus, resources)
    job_env = check_runtime_env(runtime_env, "pmetal.init")
    job_dir = working_dir_spec(runtime_env, "pmetal.init")   # packed by the check: cached
    job_hook = setup_hook_spec(runtime_env, "pmetal.init")
    given = [name for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus),
                                      ("resources", resources)) if value is not None]
    if given and address is not None:
        raise ConfigError(f"{' and '.join(given)} configure the embedded node that "
                          f"pmetal.init() starts; with address=... the node you join "
                          f"advertises its own (give them to 'pmetal start', or call "
                          f"pmetal.init() without address=)")
    with _lock:
        current = context.current_or_none()
        if current is not None:
            if ignore_reinit_error:
                return {"node_id": current.node_id, "address": current.node_address}
            raise PMetalError("pmetal.init() was already called; call pmetal.shutdown() first "
                              "or pass ignore_reinit_error=True")
        if (peers or discovery) and address is not None:
            raise ConfigError("peers= and discovery= configure the embedded node that "
                              "pmetal.init() starts; with address=... the node you join has "
                              "its own (give them to 'pmetal start')")
        if peers is not None:
            from pmetal.transport import normalize_address
            if isinstance(peers, str) or not all(isinstance(p, str) for p in peers):
                raise PMetalTypeError(f"peers must be a list of 'host:port' strings, not "
                                      f"{peers!r:.60}")
            try:
                peers = [normalize_address(p) for p in peers]
            except ValueError as exc:
                raise PMetalValueError(f"peers: {exc}") from exc
        if not isinstance(discovery, bool):
            raise PMetalTypeError(f"discovery must be True or False, not {discovery!r:.40}")
        if config is not None and not isinstance(config, PMetalConfig):
            raise PMetalTypeError(f"config must be a PMetalConfig (pmetal.config.load_config "
                                  f"makes one), not {type(config).__name__}")
        cfg = config or load_config()
        if namespace is not None:
            cfg = replace(cfg, security=replace(cfg.security, namespace=namespace))
        # A job per init, as in Ray: get_runtime_context().get_job_id().
        context.set_job_id(secrets.token_hex(4))
        node_proc = None
        if address is None:
            ns = (NetworkNamespace(cfg.security.namespace,
                                   psk.encode() if isinstance(psk, str) else psk)
                  if psk is not None else NetworkNamespace.generate(cfg.security.namespace))
            node_proc, node_address = _start_node(ns, cfg, num_workers, node_resources,
                                                  timeout=cfg.transport.connect_timeout + 20,
                                                  peers=peers, discovery=discovery)
        else:
            if address == "auto":
                local = local_node()
                node_address = local["address"]
                # The running node's own namespace and key file win over this
                # process's environment; an explicit psk= argument wins over both.
                security = {"namespace": local["namespace"] or cfg.security.namespace}
                if local["psk_file"]:
                    security["psk_file"] = local["psk_file"]
                cfg = replace(cfg, security=replace(cfg.security, **security))
                if psk is None:
                    psk = local["psk"]
            else:
                from pmetal.transport import normalize_address
                node_address = normalize_address(address)
            ns = NetworkNamespace.resolve(cfg.security, psk)
        try:
            client = CoreClient(node_address, ns, cfg)
        except BaseException:
            if node_proc is not None:
                node_proc.kill()
                node_proc.wait()
            raise
        _node_proc = node_proc
        set_job_env_vars(job_env)
        set_job_working_dir(job_dir)
        set_job_setup_hook(job_hook)
        context.set_current(client)
        client.report()   # collectives and pipelines run here, for the node's /metrics
        return {"node_id": client.node_id, "address": node_address}


def local_node() -> dict[str, Any]:
    """The node ``pmetal start`` runs on this machine, from its record
    (``$PMETAL_HOME/node.json``): its ``address``, ``namespace``,
    ``psk_file`` and ``psk`` (the key, None without a file). PeerError when
    none runs, ConfigError when its key file cannot be read."""
    from pmetal.node.process import is_node_process, node_file
    path = node_file()
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PeerError(f"address='auto' found no running node ({path}: {exc}); "
                        f"start one with 'pmetal start'") from exc
    if not isinstance(info, dict) or not is_node_process(info.get("pid")):
        raise PeerError(f"address='auto': the node recorded in {path} (pid "
                        f"{info.get('pid') if isinstance(info, dict) else '?'}) is "
                        f"not running; start one with 'pmetal start'")
    psk = None
    if info.get("psk_file"):
        from pathlib import Path
        try:
            psk = Path(info["psk_file"]).expanduser().read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the node's PSK file "
                              f"{info['psk_file']}: {exc}") from exc
    return {"address": info["address"], "namespace": info.get("namespace") or "",
            "psk_file": info.get("psk_file") or "", "psk": psk}


def wait_for_peers(n: int, timeout: float = 30.0) -> list[str]:
    """Wait until the cluster has ``n`` nodes besides this process's node,
    all in the master's member list and alive; returns their node ids.

    Raises PMetalTimeoutError after ``timeout`` seconds, naming what was
    seen: the members, the nodes found but not (yet) members, and the
    nodes discovery ignored with the reason (another namespace or PSK,
    another protocol version)."""
    if type(n) is not int or n < 0:
        raise PMetalValueError(f"wait_for_peers: n must be a non-negative int, not {n!r:.40}")
    _check_timeout(timeout, "wait_for_peers")
    client = context.current()
    return client.wait_for_peers(n, timeout)


def _check_init_arguments(num_workers: Any) -> None:
    if num_workers is not None and (type(num_workers) is not int or num_workers < 0):
        raise PMetalValueError(f"num_workers must be a non-negative int, not {num_workers!r}")


def _node_resources(num_cpus: Any, num_gpus: Any,
                    resources: dict[str, float] | None) -> dict[str, float]:
    """What the embedded node advertises beyond what it detects: ``resources``
    with ``num_cpus`` as ``CPU`` and ``num_gpus`` as ``GPU`` (each refused when
    it is not a non-negative number, or when ``resources`` names it too)."""
    out = dict(resources or {})
    for option, key, value in (("num_cpus", "CPU", num_cpus), ("num_gpus", "GPU", num_gpus)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PMetalTypeError(f"pmetal.init: {option} must be a number, not "
                                  f"{type(value).__name__} {value!r:.40}")
        if not 0 <= value < float("inf"):   # also refuses NaN
            raise PMetalValueError(f"pmetal.init: {option}={value!r}; it must be a "
                                   f"non-negative finite number")
        if key in out:
            raise PMetalValueError(f"pmetal.init: {key} given twice, as {option} and in "
                                   f"resources; give it once")
        out[key] = float(value)
    return out


def _check_timeout(timeout: Any, fn: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise PMetalTypeError(f"pmetal.{fn}: timeout must be a number of seconds or None, "
                              f"not {type(timeout).__name__}")
    if not timeout >= 0:
        raise PMetalValueError(f"pmetal.{fn}: timeout={timeout!r}; it must not be negative")


def _auto_init() -> CoreClient:
    """Start an embedded node for a script that never called init (Ray's
    auto-init); runs under the context lock."""
    info = init()
    log.info("Started a local pmetal instance (node %s at %s); call pmetal.init() "
             "yourself to choose its options", info["node_id"][:12], info["address"])
    client = context.current_or_none()
    assert client is not None
    return client


context.set_auto_init(_auto_init)
context.set_initializer(init)


def is_initialized() -> bool:
    """Whether this process is connected: after init (or auto-init), or in a worker."""
    return context.current_or_none() is not None or context.in_worker()


def client() -> CoreClient:
    """This process's client (inside a worker: one to the worker's node).
    Unlike ``.remote()``, ``put``, ``get`` and ``wait`` it never starts a
    node: without ``init`` it raises NotInitializedError, as Ray's
    cluster calls do."""
    current = context.current_or_none()
    if current is not None:
        return current
    if not context.in_worker():
        raise NotInitializedError("call pmetal.init() first")
    return context.current()


def shutdown(timeout: float = 10.0) -> None:
    """Disconnect; stop the embedded node (and its workers) if init started one.
    Joined to a node (``address=...``), the actors this driver created that
    are not detached end now, as in Ray when a driver disconnects."""
    global _node_proc
    with _lock:
        client_, proc = context.take(), _node_proc
        _node_proc = None
        set_job_env_vars({})
        set_job_working_dir(None)
        set_job_setup_hook(None)
    if client_ is None:
        return
    try:
        if client_.reporter is not None:   # while the node still listens
            client_.reporter.close()
        if proc is not None:
            try:
                client_.shutdown_node(timeout=min(timeout, 5.0))
            except PMetalError:
                pass
        else:
            try:
                client_.detach(timeout=min(timeout, 5.0))
            except PMetalError as exc:
                # Its node is gone or silent: it ends them when it notices
                # this process exit (or, from another machine, our lease lapse).
                log.warning("pmetal.shutdown(): could not tell the node to end this "
                            "driver's actors: %s", exc)
    finally:
        client_.close()
        if proc is not None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


atexit.register(shutdown)


def get(refs: ObjectRef | list[ObjectRef], *, timeout: float | None = None) -> Any:
    """The value(s) of ``refs``. Raises the remote exception (as a
    RemoteError that is also the original type), ActorDiedError, or
    GetTimeoutError after ``timeout`` seconds."""
    if timeout is not None:
        _check_timeout(timeout, "get")
    if type(refs) is ObjectRef:   # one ref, the common case: no list walks
        if refs.done():
            return refs.result()
        return (refs._client or context.current()).get_one(refs, timeout)
    if isinstance(refs, ObjectRef):
        return _client_for([refs]).get([refs], timeout)[0]
    refs = _ref_list(refs, "get", "an ObjectRef or a list of ObjectRefs")
    return _client_for(refs).get(refs, timeout)


def _ref_list(refs: Any, fn: str, what: str) -> list[ObjectRef]:
    if not isinstance(refs, (list, tuple)):
        hint = f"; for one ref: pmetal.{fn}([ref])" if isinstance(refs, ObjectRef) else ""
        if isinstance(refs, ObjectRefGenerator):
            hint = "; iterate it (for ref in gen) for the refs of its items"
        raise PMetalTypeError(f"pmetal.{fn} takes {what}, not {type(refs).__name__}{hint}")
    bad = next((r for r in refs if not isinstance(r, ObjectRef)), None)
    if bad is not None:
        raise PMetalTypeError(f"pmetal.{fn} takes {what}; the list holds a "
                              f"{type(bad).__name__}")
    return list(refs)


def _client_for(refs: list[ObjectRef]) -> CoreClient:
    """The client that waits for ``refs``: the one that made the pending ones."""
    for r in refs:
        if not r.done() and r._client is not None:
            return r._client
    if not refs:
        return context.current()   # Ray starts a node here too
    return _DoneOnly()  # type: ignore[return-value]


class _DoneOnly:
    """``get``/``wait`` on refs that are already resolved need no cluster."""

    def get(self, refs: list[ObjectRef], timeout: float | None) -> list[Any]:
        return [r.result() for r in refs]

    def wait(self, refs: list[ObjectRef], num_returns: int,
             timeout: float | None) -> tuple[list[ObjectRef], list[ObjectRef]]:
        return refs[:num_returns], refs[num_returns:]


def wait(refs: list[ObjectRef], *, num_returns: int = 1, timeout: float | None = None,
         fetch_local: bool = True) -> tuple[list[ObjectRef], list[ObjectRef]]:
    """``(ready, not_ready)``: the first ``num_returns`` refs that are done, in
    input order, once that many are done or ``timeout`` passes. The list may
    hold ObjectRefGenerators too (Ray's ``ray.wait([gen])``): one is ready
    when ``next`` on it would not block. ``fetch_local`` is accepted for
    Ray's scripts and changes nothing: a ref is ready when its value exists
    at its owner, which is where ``get`` takes it from."""
    if type(fetch_local) is not bool:
        raise PMetalTypeError(f"fetch_local must be True or False, not {fetch_local!r:.40}")
    if isinstance(refs, (list, tuple)) and any(isinstance(r, ObjectRefGenerator) for r in refs):
        refs = list(refs)
        others = [r for r in refs if not isinstance(r, ObjectRefGenerator)]
        _ref_list(others, "wait", "a list of ObjectRefs and ObjectRefGenerators")
        if timeout is not None:
            _check_timeout(timeout, "wait")
        if len(set(map(id, refs))) != len(refs):
            raise PMetalValueError("pmetal.wait got the same ObjectRef or generator twice")
        if type(num_returns) is not int or not 0 <= num_returns <= len(refs):
            raise PMetalValueError(f"num_returns={num_returns!r}; it must be an int from 0 "
                                   f"to {len(refs)}")
        return stream_wait(refs, num_returns, timeout)
    refs = _ref_list(refs, "wait", "a list of ObjectRefs")
    if timeout is not None:
        _check_timeout(timeout, "wait")
    if len(set(map(id, refs))) != len(refs):
        raise PMetalValueError("pmetal.wait got the same ObjectRef twice")
    if type(num_returns) is not int:
        raise PMetalTypeError(f"num_returns must be an int, not {type(num_returns).__name__}")
    if not 0 <= num_returns <= len(refs):
        raise PMetalValueError(f"num_returns={num_returns} but only {len(refs)} refs were "
                               f"given")
    return _client_for(refs).wait(refs, num_returns, timeout)


def put(value: Any) -> ObjectRef:
    """Store ``value`` in this process and return a ref to it."""
    if isinstance(value, ObjectRef):
        raise PMetalTypeError("pmetal.put of an ObjectRef; pass the ref itself instead")
    context.current()   # as in Ray, a put without init starts a node
    return ObjectRef.of_value(value)


def cancel(ref: ObjectRef | ObjectRefGenerator, *, force: bool = False,
           recursive: bool = True) -> None:
    """Cancel ``ref``'s task or actor call, as Ray's ``ray.cancel``; from now
    on ``get(ref)`` raises TaskCancelledError.

    A call not sent yet (waiting for its ObjectRef arguments, to be retried,
    or queued behind calls in flight) is dropped: it never runs. An async
    actor method already sent is cancelled through asyncio (CancelCall).
    Any other call already sent runs to completion in its worker and its
    result is discarded (pmetal does not interrupt running sync code).
    ``force=True`` on a task already sent kills its worker process (the node
    starts another; other calls queued there fail as for a crashed worker),
    and ``get`` raises TaskCancelledError; on an actor method it is refused
    (use :func:`kill`), as in Ray. ``recursive`` is accepted for Ray's signature:
    tasks the cancelled task started are not cancelled. Cancelling a ref that
    is done, or twice, does nothing.

    Cancelling an ObjectRefGenerator (``num_returns="streaming"``) stops its
    generator in the worker (an async one waiting is cancelled through
    asyncio; a sync one stops before its next item): the items that arrived
    are still yielded, then one ref whose ``get`` raises TaskCancelledError,
    then the iteration ends."""
    if isinstance(ref, ObjectRefGenerator):
        for name, value in (("force", force), ("recursive", recursive)):
            if type(value) is not bool:
                raise PMetalTypeError(f"pmetal.cancel: {name} must be a bool, not "
                                      f"{type(value).__name__}")
        ref._cancel(force)
        return
    if not isinstance(ref, ObjectRef):
        raise PMetalTypeError(f"pmetal.cancel takes an ObjectRef (what .remote() returns), "
                              f"not {type(ref).__name__}; to end an actor use pmetal.kill")
    for name, value in (("force", force), ("recursive", recursive)):
        if type(value) is not bool:
            raise PMetalTypeError(f"pmetal.cancel: {name} must be a bool, not "
                                  f"{type(value).__name__}")
    if ref.done() or ref._client is None:
        return
    ref._client.cancel(ref, force)


def kill(actor: ActorHandle, *, no_restart: bool = True) -> None:
    """Kill ``actor``'s process now; returns once that process has exited
    (its node waits up to 2 s for it), so the objects it owned are lost from
    then on (OwnerDiedError) and its resources are free. Pending calls fail
    with ActorDiedError; with ``no_restart=False`` it is restarted if it has
    restarts left."""
    if not isinstance(actor, ActorHandle):
        raise PMetalTypeError(f"pmetal.kill takes an actor handle, not {type(actor).__name__}")
    if type(no_restart) is not bool:
        raise PMetalTypeError(f"no_restart must be a bool, not {type(no_restart).__name__}")
    client().kill(actor._actor_id, no_restart, actor._node_id)


def get_actor(name: str) -> ActorHandle:
    """The handle of the live actor created with ``.options(name=name)``."""
    if type(name) is not str:
        raise PMetalTypeError(f"pmetal.get_actor takes an actor name (a str), not "
                              f"{type(name).__name__}")
    if not name:
        raise PMetalValueError("pmetal.get_actor needs a non-empty name")
    current = client()
    loc = current.lookup(name=name)
    if loc.state == ActorState.DEAD:
        raise PMetalValueError(f"actor {name!r} is dead: {loc.reason}")
    return ActorHandle(loc, current)


def nodes() -> list[dict[str, Any]]:
    """Every node of the cluster, as dicts like Ray's ``ray.nodes()`` (the
    connected node first), plus each node's health as this node sees it and
    whether it is the master."""
    info = client().status()
    cluster = info.get("cluster") or {}
    out = []
    for m in cluster.get("members") or []:
        health = m.get("health", "unknown")
        out.append({"NodeID": m["node_id"], "Address": m.get("address", ""),
                    "Alive": m.get("state") != "dead" and health != "dead",
                    "Resources": m.get("resources") or {}, "Health": health,
                    "IsMaster": m["node_id"] == cluster.get("master")})
    if not out:   # the node has not joined a cluster yet: itself
        out.append({"NodeID": info["node_id"], "Address": info["address"], "Alive": True,
                    "Resources": info["resources"], "Health": "self", "IsMaster": False})
    out.sort(key=lambda n: n["NodeID"] != info["node_id"])   # the connected node first
    return out


def cluster_resources() -> dict[str, float]:
    """Total resources of the live nodes."""
    total: dict[str, float] = {}
    for node in nodes():
        if node["Alive"]:
            for k, v in node["Resources"].items():
                total[k] = total.get(k, 0.0) + v
    return total


def available_resources() -> dict[str, float]:
    """Resources of the live nodes not held by actors (a member that did
    not say in time counts with its totals)."""
    info = client().status()
    members = [m for m in (info.get("cluster") or {}).get("members") or []
               if m.get("state") != "dead" and m.get("health") != "dead"]
    if not members:
        return dict(info["available"])
    total: dict[str, float] = {}
    for m in members:
        for k, v in (m.get("available") or m.get("resources") or {}).items():
            total[k] = total.get(k, 0.0) + v
    return total
