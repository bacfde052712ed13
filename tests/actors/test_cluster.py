"""Several node daemons on one machine forming one cluster.

Three ``python -m pmetal.node`` processes on loopback, each with its
own ``PMETAL_HOME`` (so its own identity) and the others as static peers,
one actor worker and one task worker each. The driver joins the first one
with ``pmetal.init(address=..., psk=...)``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import pmetal
from pmetal import ActorDiedError, HandshakeError, NetworkNamespace, PlacementError
from pmetal.actors.client import CoreClient
from pmetal.actors.serialization import code_ref
from pmetal.config import load_config
from pmetal.identity import KEYPAIR_FILE
from pmetal.wire import Ack, ActorLocation, CreateActor, Detach, Failure, NodeJoin, OwnerDied

from .actor_classes import Counter, square
from .conftest import (
    WAIT,
    ancestors,
    assert_all_exit,
    descendants,
    free_port,
    pid_alive,
    read_line,
    stop_process,
    wait_until,
)

SECRET = "cluster-test-psk-0123456789-abcdefghijklmnop"
START_WAIT = 30.0
"""Deadline for a node daemon to print its ready line (a loaded 2-core box)."""

REQUEST_TIMEOUT = 8.0
"""Node-to-node and driver-to-node request deadline: a request that hangs
fails in seconds instead of the default 30 s."""

OWNER_LEASE = 2.0
"""s a driver that cannot prove it runs on its node's machine may stay silent."""

SPECIAL = 2.0
"""A custom resource only the third node has."""


@dataclass
class NodeProc:
    proc: subprocess.Popen[bytes]
    port: int
    home: Path
    address: str = ""
    node_id: str = ""

    @property
    def log(self) -> str:
        return (self.home / "node.log").read_text(errors="replace")

    @property
    def host_port(self) -> str:
        return f"127.0.0.1:{self.port}"


def start_node(home: Path, port: int, peers: list[int],
               resources: dict[str, float] | None = None) -> NodeProc:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"}
    env.update(PMETAL_PSK=SECRET, PMETAL_HOME=str(home),
               PMETAL_TRANSPORT_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT),
               PMETAL_ACTORS_OWNER_LEASE=str(OWNER_LEASE))
    cmd = [sys.executable, "-m", "pmetal.node", "--host", "127.0.0.1",
           "--port", str(port), "--peers", ",".join(f"127.0.0.1:{p}" for p in peers),
           "--num-workers", "1", "--num-task-workers", "1"]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    # The log goes to a file: a pipe nobody reads could fill and block the node.
    with open(home / "node.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=log, env=env)
    return NodeProc(proc, port, home)


def await_ready(node: NodeProc) -> None:
    line = read_line(node.proc, START_WAIT, f"node on port {node.port}")
    head, address, node_id = line.split()[:3]
    assert head == "PMETAL_NODE_READY", line
    node.address, node.node_id = address, node_id
    assert address.endswith(f":{node.port}")


def stop_node(node: NodeProc) -> None:
    workers = descendants(node.proc.pid)
    code = stop_process(node.proc, signal.SIGTERM)
    assert code is not None, f"node on port {node.port} ignored SIGTERM"
    assert_all_exit(workers, what=f"workers of the node on port {node.port}")


def other_client(node: NodeProc) -> CoreClient:
    """A second connection, straight to ``node`` (the driver talks to node 0)."""
    return CoreClient(node.address, NetworkNamespace.resolve(load_config().security, SECRET),
                      load_config())


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProc]]:
    ports = [free_port() for _ in range(3)]
    started: list[NodeProc] = []
    try:
        for i, port in enumerate(ports):
            home = tmp_path_factory.mktemp(f"node{i}")
            started.append(start_node(home, port, [p for p in ports if p != port],
                                      {"special": SPECIAL} if i == 2 else None))
        for node in started:
            await_ready(node)
        assert len({n.node_id for n in started}) == 3, "each node needs its own identity"
        yield started
    finally:
        if pmetal.is_initialized():
            pmetal.shutdown(timeout=3.0)
        for node in started:
            stop_node(node)


def connect(node: NodeProc) -> dict[str, Any]:
    """``pmetal.init`` joining the cluster through ``node``."""
    return pmetal.init(address=node.host_port, psk=SECRET,
                       config=load_config(transport={"request_timeout": REQUEST_TIMEOUT}))


@pytest.fixture(scope="module")
def driver(nodes: list[NodeProc]) -> Iterator[dict[str, Any]]:
    if pmetal.is_initialized():
        pmetal.shutdown(timeout=3.0)
    info = connect(nodes[0])
    assert info["node_id"] == nodes[0].node_id
    expected = {n.node_id for n in nodes}
    wait_until(lambda: {n["NodeID"] for n in pmetal.nodes()} == expected, WAIT,
               what="all three nodes in pmetal.nodes()")
    yield info
    pmetal.shutdown(timeout=3.0)


def on(node: NodeProc, **options: Any) -> Any:
    """A Counter placed on ``node``."""
    return Counter.options(node=node.node_id, **options).remote()


def hosted_by(handle: Any, node: NodeProc) -> bool:
    """Whether ``handle``'s actor runs in a worker process of ``node``."""
    pid = pmetal.get(handle.pid.remote(), timeout=WAIT)
    return node.proc.pid in ancestors(pid)


# ---------------------------------------------------------------- members

def test_every_node_sees_every_other(nodes: list[NodeProc], driver: dict[str, Any]) -> None:
    expected = {n.node_id for n in nodes}
    listed = pmetal.nodes()
    assert len(listed) == 3
    assert {n["NodeID"] for n in listed} == expected
    assert all(n["Alive"] for n in listed)
    assert {n["Address"] for n in listed} == {n.address for n in nodes}
    for node in nodes[1:]:
        client = other_client(node)
        try:
            def members(c: CoreClient = client) -> set[str]:
                info = c.status()
                return {info["node_id"], *(m["node_id"] for m in info["members"])}
            wait_until(lambda: members() == expected, WAIT,
                       what=f"membership seen by node {node.port}")
            cluster = client.status()["cluster"]
            # Static peers are given as host:port, Beats carry tcp://host:port:
            # one node, not a clone of itself.
            assert cluster["statistics"]["clones_refused"] == 0, cluster["statistics"]
            assert {m["health"] for m in cluster["members"]} == {"self", "healthy"}, cluster
        finally:
            client.close()


def test_cluster_resources_add_up(nodes: list[NodeProc], driver: dict[str, Any]) -> None:
    total = pmetal.cluster_resources()
    per_node = [n["Resources"] for n in pmetal.nodes()]
    assert total["CPU"] == sum(r["CPU"] for r in per_node)
    assert total["special"] == SPECIAL


def test_wrong_psk_is_refused(nodes: list[NodeProc]) -> None:
    cfg = load_config(transport={"handshake_timeout": 2.0, "connect_timeout": 2.0})
    wrong = NetworkNamespace(cfg.security.namespace, b"not-the-cluster-psk-0123456789abcdef")
    with pytest.raises(HandshakeError):
        CoreClient(nodes[1].address, wrong, cfg)


# -------------------------------------------------------------- placement

def test_actor_placed_on_the_chosen_node(nodes: list[NodeProc], driver: dict[str, Any],
                                         reap: list[Any]) -> None:
    for node in nodes:
        actor = on(node)
        reap.append(actor)
        assert actor._node_id == node.node_id
        assert hosted_by(actor, node)
        assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1


def test_custom_resource_places_on_the_node_that_has_it(nodes: list[NodeProc],
                                                        driver: dict[str, Any],
                                                        reap: list[Any]) -> None:
    actor = Counter.options(resources={"special": 1}).remote()
    reap.append(actor)
    assert actor._node_id == nodes[2].node_id
    assert hosted_by(actor, nodes[2])


@pytest.mark.parametrize("options, words", [
    ({"resources": {"special": SPECIAL + 1}}, "special"),
    ({"resources": {"GPU": 1}}, "GPU"),
    ({"node": "ffffffffffffffffffffffffffffffff"}, "ffffffff"),
])
def test_placement_nobody_can_satisfy_fails_at_the_call_site(
        driver: dict[str, Any], options: dict[str, Any], words: str) -> None:
    with pytest.raises(PlacementError, match=words):
        Counter.options(**options).remote()


def test_actor_names_are_unique_across_the_cluster(nodes: list[NodeProc],
                                                   driver: dict[str, Any],
                                                   reap: list[Any]) -> None:
    first = on(nodes[1], name="cluster-unique")
    reap.append(first)
    with pytest.raises(ValueError, match="cluster-unique"):
        reap.append(on(nodes[2], name="cluster-unique"))


def _create_named(client: CoreClient, name: str) -> Any:
    """CreateActor for a Counter named ``name``, sent by ``client`` itself
    (not this process's pmetal client): its location, or the exception."""
    cls = Counter.__wrapped__
    cls_id, ref = code_ref(cls)
    options = {"name": name, "node": "", "num_cpus": 0, "resources": {}, "max_restarts": 0,
               "max_concurrency": 1, "class_name": cls.__qualname__, "methods": ["inc"],
               "is_async": False}
    try:
        return client.create_actor(CreateActor(client.new_actor_id(), cls_id, ref, [], {},
                                               options), timeout=WAIT)
    except Exception as exc:  # what the test inspects
        return exc


def test_one_name_asked_twice_at_once_on_one_node(nodes: list[NodeProc],
                                                  driver: dict[str, Any]) -> None:
    # The node looks the name up on its peers before taking it; a second
    # request for the name arriving meanwhile must not take it too.
    clients = [other_client(nodes[0]) for _ in range(2)]
    start = threading.Barrier(2, timeout=WAIT)
    results: list[Any] = [None, None]

    def create(i: int) -> None:
        start.wait()
        results[i] = _create_named(clients[i], "cluster-race")

    threads = [threading.Thread(target=create, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        made = [r for r in results if isinstance(r, ActorLocation)]
        refused = [r for r in results if isinstance(r, ValueError)]
        assert len(made) == 1 and len(refused) == 1, results
        assert "cluster-race" in str(refused[0])
    finally:
        for r in results:
            if isinstance(r, ActorLocation):
                clients[0].kill(r.actor_id)
        for c in clients:
            c.close()


# ---------------------------------------------------------------- handles

def test_handles_passed_between_actors_on_different_nodes(nodes: list[NodeProc],
                                                          driver: dict[str, Any],
                                                          reap: list[Any]) -> None:
    a, b = on(nodes[0]), on(nodes[1])
    reap += [a, b]
    # An actor on node B calls one on node A through a handle it was given,
    # and the other way round.
    assert pmetal.get(b.call.remote(a, "inc", 5), timeout=WAIT) == 5
    assert pmetal.get(a.call.remote(b, "inc", 7), timeout=WAIT) == 7
    assert pmetal.get([a.value.remote(), b.value.remote()], timeout=WAIT) == [5, 7]
    # Calls from B to A keep their order.
    items = list(range(100))
    pmetal.get(b.call_many.remote(a, "record", items), timeout=WAIT)
    assert pmetal.get(a.history.remote(), timeout=WAIT) == items


def test_handle_travels_through_a_third_node(nodes: list[NodeProc], driver: dict[str, Any],
                                             reap: list[Any]) -> None:
    a, c = on(nodes[0]), on(nodes[2])
    reap += [a, c]
    # The driver hands C a handle to A; C returns it; the driver uses it.
    back = pmetal.get(c.echo.remote(a), timeout=WAIT)
    assert back == a
    assert pmetal.get(back.inc.remote(3), timeout=WAIT) == 3


def test_actor_on_another_node_runs_remote_functions(nodes: list[NodeProc],
                                                     driver: dict[str, Any],
                                                     reap: list[Any]) -> None:
    c = on(nodes[2])
    reap.append(c)
    assert pmetal.get(c.run_function.remote(9), timeout=WAIT) == 81
    assert pmetal.get(square.remote(5), timeout=WAIT) == 25


def test_driver_disconnect_leaves_the_cluster_running(nodes: list[NodeProc],
                                                      driver: dict[str, Any]) -> None:
    pmetal.shutdown(timeout=3.0)
    try:
        assert all(n.proc.poll() is None for n in nodes)
        assert all(pid_alive(n.proc.pid) for n in nodes)
        # A new driver may join through any node and sees the same cluster.
        connect(nodes[1])
        assert {n["NodeID"] for n in pmetal.nodes()} == {n.node_id for n in nodes}
    finally:
        pmetal.shutdown(timeout=3.0)
        connect(nodes[0])  # the driver the later tests expect


# ------------------------------------------------- finding actors elsewhere
# These ask a node about an actor that lives on another node.

def test_kill_9_on_another_node_restarts_there(nodes: list[NodeProc], driver: dict[str, Any],
                                               reap: list[Any]) -> None:
    actor = on(nodes[1], max_restarts=1)
    reap.append(actor)
    assert pmetal.get(actor.inc.remote(4), timeout=WAIT) == 4
    pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    assert nodes[1].proc.pid in ancestors(pid)
    pending = actor.block.remote(60)
    os.kill(pid, signal.SIGKILL)
    assert_all_exit([pid], what="the SIGKILLed worker")
    start = time.monotonic()
    with pytest.raises(ActorDiedError):
        pmetal.get(pending, timeout=WAIT)
    assert time.monotonic() - start < 5.0
    # Restarted on the same node with a fresh state, and found at once.
    start = time.monotonic()
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1
    assert time.monotonic() - start < 5.0, "finding the restarted actor took too long"
    assert hosted_by(actor, nodes[1])


def test_kill_of_an_actor_on_another_node(nodes: list[NodeProc], driver: dict[str, Any],
                                          reap: list[Any]) -> None:
    actor = on(nodes[2], max_restarts=3)
    reap.append(actor)
    pid = pmetal.get(actor.pid.remote(), timeout=WAIT)
    assert nodes[2].proc.pid in ancestors(pid)
    pending = actor.block.remote(60)
    pmetal.kill(actor)   # the driver's node is nodes[0]: the kill is passed on
    assert_all_exit([pid], what="the killed worker on the other node")
    with pytest.raises(ActorDiedError):
        pmetal.get(pending, timeout=WAIT)
    # no_restart=True: not restarted although it has restarts left.
    with pytest.raises(ActorDiedError, match="dead"):
        pmetal.get(actor.inc.remote(), timeout=WAIT)


def test_named_actor_on_another_node_is_found(nodes: list[NodeProc], driver: dict[str, Any],
                                              reap: list[Any]) -> None:
    actor = on(nodes[2], name="cluster-named")
    reap.append(actor)
    found = pmetal.get_actor("cluster-named")
    assert found._node_id == nodes[2].node_id
    assert pmetal.get(found.inc.remote(2), timeout=WAIT) == 2


def test_get_actor_of_an_unknown_name_fails_promptly(driver: dict[str, Any]) -> None:
    # Every node is asked and none has it: a clear ValueError, not a hang.
    start = time.monotonic()
    with pytest.raises(ValueError, match="cluster-no-such-actor"):
        pmetal.get_actor("cluster-no-such-actor")
    assert time.monotonic() - start < 5.0


# ------------------------------------------------- placement by free resources

def _fill(nodes: list[NodeProc], reap: list[Any]) -> list[Any]:
    """An actor holding every CPU of each node in ``nodes`` (waiting, if it
    must, for the CPUs an actor of an earlier test still holds)."""
    fillers = []
    for node in nodes:
        filler = on(node, num_cpus=float(os.cpu_count() or 1))
        reap.append(filler)
        fillers.append(filler)
    return fillers


def test_actor_that_does_not_fit_here_goes_to_a_member_with_room(
        nodes: list[NodeProc], driver: dict[str, Any], reap: list[Any]) -> None:
    # The driver's node has no CPU free; the others have: the old node
    # answered PlacementError because it had checked totals, not free CPUs.
    _fill(nodes[:1], reap)
    start = time.monotonic()
    actor = Counter.options(num_cpus=1).remote()
    reap.append(actor)
    assert time.monotonic() - start < WAIT
    assert actor._node_id != nodes[0].node_id
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1


def test_actor_that_fits_nowhere_now_waits_for_room(nodes: list[NodeProc],
                                                   driver: dict[str, Any],
                                                   reap: list[Any]) -> None:
    fillers = _fill(nodes, reap)
    made: list[Any] = []
    creating = threading.Thread(
        target=lambda: made.append(Counter.options(num_cpus=1).remote(5)), daemon=True)
    creating.start()
    # Every node could hold it once empty: it waits in the queue of the
    # driver's node until the filler there goes.
    killer = other_client(nodes[0])
    try:
        wait_until(lambda: killer.status()["queue"], WAIT, what="the creation queued")
        killer.kill(fillers[0]._actor_id, True, nodes[0].node_id)
    finally:
        killer.close()
    creating.join(WAIT)
    assert made, "the queued creation did not complete once CPUs were free"
    reap.append(made[0])
    assert made[0]._node_id == nodes[0].node_id
    assert pmetal.get(made[0].inc.remote(), timeout=WAIT) == 6


def test_queued_creation_times_out_saying_what_it_waited_for(nodes: list[NodeProc],
                                                             driver: dict[str, Any],
                                                             reap: list[Any]) -> None:
    _fill(nodes, reap)
    impatient = CoreClient(nodes[0].address,
                           NetworkNamespace.resolve(load_config().security, SECRET),
                           load_config(transport={"request_timeout": 2.0}))
    try:
        cls_id, ref = code_ref(Counter.__wrapped__)
        spec = CreateActor(impatient.new_actor_id(), cls_id, ref, [], {},
                           {"name": "", "node": "", "num_cpus": 1, "resources": {},
                            "max_restarts": 0, "max_concurrency": 1, "class_name": "Counter",
                            "methods": ["inc"], "is_async": False})
        start = time.monotonic()
        with pytest.raises(pmetal.PMetalTimeoutError, match="waited for resources") as info:
            impatient.create_actor(spec, timeout=2.0)
        assert time.monotonic() - start < 2.0 + 1.0
        assert "CPU" in str(info.value)
        assert not impatient.status()["queue"]
    finally:
        impatient.close()


# ------------------------------------------------------------------ owners

CLUSTER_DRIVER = """
import os, sys, pmetal
if sys.argv[4] == "remote":
    # As a driver on another machine: it cannot prove it shares its node's
    # machine (no shared-memory token), so its node gives it a lease.
    from pmetal import shm
    shm._posixshmem = None
pmetal.init(address=sys.argv[1], psk=sys.argv[2])

@pmetal.remote
class Box:
    def pid(self):
        return os.getpid()

box = Box.options(node=sys.argv[3]).remote()
print(pmetal.get(box.pid.remote(), timeout=20), box._actor_id, flush=True)
if sys.stdin.readline().strip() == "shutdown":
    pmetal.shutdown()
    print("shut down", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("where, leaves", [("local", "kill -9"), ("remote", "kill -9"),
                                           ("local", "shutdown"), ("remote", "shutdown")])
def test_actor_on_another_node_dies_with_its_driver(nodes: list[NodeProc],
                                                    driver: dict[str, Any], where: str,
                                                    leaves: str) -> None:
    # The driver's node tells node 1 (OwnerDied) when the driver goes: its
    # pid exits (local), its lease lapses (remote, killed), or it detaches
    # (shutdown, the process living on).
    proc = subprocess.Popen([sys.executable, "-c", CLUSTER_DRIVER, nodes[0].host_port, SECRET,
                             nodes[1].node_id, where], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        pid_text, actor_id = read_line(proc, START_WAIT, "the driver").split()
        pid = int(pid_text)
        assert nodes[1].proc.pid in ancestors(pid)   # a worker (forked) of the second node
        if leaves == "shutdown":
            proc.stdin.write(b"shutdown\n")
            proc.stdin.flush()
            assert read_line(proc, WAIT, "the driver's shutdown").strip() == "shut down"
            assert_all_exit([pid], what="the worker of the detached driver's actor on node 1")
            assert proc.poll() is None
        else:
            proc.kill()   # kill -9 of the owner
            proc.wait(WAIT)
    finally:
        stop_process(proc, signal.SIGKILL)
    assert_all_exit([pid], what="the worker of the killed driver's actor on node 1")
    watcher = other_client(nodes[1])
    try:
        wait_until(lambda: any(a["actor_id"] == actor_id and a["state"] == "dead"
                               for a in watcher.status()["actors"]), WAIT,
                   what="node 1 marks the actor dead")
    finally:
        watcher.close()


# --------------------------------------------------------------- addresses

NETNS_ADDRESS = "10.78.0.1"
"""The one non-loopback address of the network namespace the wildcard test
makes: it exists only inside that namespace."""

WILDCARD_SCRIPT = """
import json, os, subprocess, sys, time
from pmetal.actors.client import CoreClient
from pmetal.node.daemon import read_ready_line
from pmetal.actors.serialization import code_ref
from pmetal.config import load_config
from pmetal.security import NetworkNamespace

def own_address():
    from pmetal.actors import context
    return context.current().self_address

secret, start_wait = sys.argv[1], float(sys.argv[2])
env = dict(os.environ, PMETAL_PSK=secret)
node = subprocess.Popen([sys.executable, "-m", "pmetal.node", "--host", "0.0.0.0",
                         "--port", "0", "--num-workers", "1", "--num-task-workers", "1"],
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
try:
    address = read_ready_line(node, start_wait).split()[1]
    port = address.rpartition(":")[2]
    cfg = load_config()
    client = CoreClient(f"tcp://127.0.0.1:{port}", NetworkNamespace.resolve(cfg.security, secret),
                        cfg)
    try:
        deadline = time.monotonic() + start_wait
        while True:   # one snapshot in which every worker listed is ready
            status = client.status()
            if status["workers"] and all(w["ready"] for w in status["workers"]):
                break
            assert time.monotonic() < deadline, status["workers"]
            time.sleep(0.02)
        fn_id, fn_ref = code_ref(own_address)
        own = client.get([client.run_task(fn_id, fn_ref, [], {}, "own_address")],
                         start_wait)[0]
        after = client.status()["workers"]
    finally:
        client.close()
    print(json.dumps({"ready_line": address, "status": status["address"], "own": own,
                      "workers": [w["address"] for w in status["workers"]],
                      "after": [w["address"] for w in after]}), flush=True)
finally:
    node.terminate()
    node.wait(start_wait)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
                    reason="needs root, unshare(1) and ip(8) to make a network namespace with "
                           "an address of its own; run the suite as root (CI does)")
def test_node_on_all_interfaces_advertises_a_concrete_address(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Bound to 0.0.0.0, the node and its workers must tell peers an address
    # they can dial, never tcp://0.0.0.0:PORT. It runs in a network namespace
    # of its own whose only interfaces are loopback and a veth pair holding
    # NETNS_ADDRESS (the default route), so everything dialled, the
    # advertised address included, stays inside that namespace.
    setup = (f"ip link set lo up && ip link add v0 type veth peer name v1 && "
             f"ip addr add {NETNS_ADDRESS}/24 dev v0 && ip link set v0 up && "
             f"ip link set v1 up && ip route add default dev v0 && "
             f'exec "$0" -c "$1" "$2" "$3"')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PMETAL_") or k == "PMETAL_LOG_LEVEL"}
    env["PMETAL_HOME"] = str(tmp_path_factory.mktemp("wildcard"))
    done = subprocess.run(["unshare", "-n", "sh", "-c", setup, sys.executable, WILDCARD_SCRIPT,
                           SECRET, str(START_WAIT)], env=env, capture_output=True, text=True,
                          timeout=START_WAIT * 4, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The worker's own idea of its address (used for nested task leasing) is
    # the concrete one too; the task may have run on a worker that started
    # after the first snapshot, so it is looked for in the later one.
    assert seen["own"] in seen["after"], seen
    advertised = [seen["ready_line"], seen["status"], seen["own"], *seen["workers"]]
    for address in advertised:
        assert address.removeprefix("tcp://").rpartition(":")[0] == NETNS_ADDRESS, seen


# -------------------------------------------------------------- identity

def test_a_node_cannot_enrol_another_nodes_id(nodes: list[NodeProc],
                                              driver: dict[str, Any]) -> None:
    # A PSK holder with its own key claims to be node 2, or a node that does
    # not exist, at an address of its own.
    impostor = other_client(nodes[1])
    try:
        for claimed in (nodes[2].node_id, "0123456789abcdef0123456789abcdef"):
            reply = impostor.request_node(NodeJoin(claimed, "tcp://127.0.0.1:9", {}),
                                          timeout=WAIT)
            assert isinstance(reply, Failure) and "joins as itself" in reply.message
        members = {m["node_id"]: m["address"] for m in impostor.status()["members"]}
        assert members[nodes[2].node_id] != "tcp://127.0.0.1:9"
        assert "0123456789abcdef0123456789abcdef" not in members
    finally:
        impostor.close()


QUEUED_DRIVER = """
import sys, pmetal
pmetal.init(address=sys.argv[1], psk=sys.argv[2])

@pmetal.remote
class Box:
    pass

print("creating", flush=True)
Box.options(num_cpus=1).remote()     # waits in the queue: the test kills us meanwhile
"""


def test_creation_queued_for_a_killed_driver_leaves_the_queue(nodes: list[NodeProc],
                                                              driver: dict[str, Any],
                                                              reap: list[Any]) -> None:
    fillers = _fill(nodes, reap)
    proc = subprocess.Popen([sys.executable, "-c", QUEUED_DRIVER, nodes[0].host_port, SECRET],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    watcher = other_client(nodes[0])
    try:
        assert read_line(proc, START_WAIT, "the driver").strip() == "creating"
        wait_until(lambda: watcher.status()["queue"], WAIT, what="the creation queued")
        proc.kill()
        proc.wait(WAIT)
        wait_until(lambda: not watcher.status()["queue"], WAIT,
                   what="the dead driver's creation gone from the queue")
        status = watcher.status()
        box = next(a for a in status["actors"] if a["class_name"] == "Box")
        assert box["state"] == "dead" and "owner" in box["reason"], box
        # Nothing is held for it: freeing the filler frees every CPU.
        watcher.kill(fillers[0]._actor_id, True, nodes[0].node_id)
        wait_until(lambda: watcher.status()["available"]["CPU"]
                   == watcher.status()["resources"]["CPU"], WAIT, what="all CPUs free")
    finally:
        stop_process(proc, signal.SIGKILL)
        watcher.close()


def test_a_node_reports_only_its_own_owners_deaths(nodes: list[NodeProc],
                                                 driver: dict[str, Any],
                                                 reap: list[Any]) -> None:
    # OwnerDied names the sender's own node: a PSK holder cannot have node 1
    # kill the actors that a process of node 0 owns.
    actor = on(nodes[1])
    reap.append(actor)
    owner = next(a["owner"] for a in other_client_status(nodes[1])["actors"]
                 if a["actor_id"] == actor._actor_id)
    pid = int(owner.split()[1])
    impostor = other_client(nodes[1])
    try:
        reply = impostor.request_node(OwnerDied(nodes[0].node_id, pid), timeout=WAIT)
        assert isinstance(reply, Failure) and "reports its own processes" in reply.message
        # Nor end them as a client: a Detach ends the sender's own actors only.
        for node in (nodes[0], nodes[1]):
            stranger = other_client(node)
            try:
                reply = stranger.request_node(Detach("not mine"), timeout=WAIT)
                assert isinstance(reply, Ack) and reply.info == 0, reply
            finally:
                stranger.close()
    finally:
        impostor.close()
    assert pmetal.get(actor.inc.remote(), timeout=WAIT) == 1


def other_client_status(node: NodeProc) -> dict[str, Any]:
    client = other_client(node)
    try:
        return client.status()
    finally:
        client.close()


def test_second_node_with_a_cloned_identity_is_refused(nodes: list[NodeProc],
                                                       tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    # Runs last: when it fails, node 1 is left believing the clone is node 0.
    # A node started from a copy of node 0's key pair claims node 0's id.
    # Node 1 already knows node 0: it must refuse the newcomer instead of
    # re-pointing node 0's membership at the clone.
    home = tmp_path_factory.mktemp("clone")
    key = nodes[0].home / KEYPAIR_FILE
    (home / KEYPAIR_FILE).write_bytes(key.read_bytes())
    os.chmod(home / KEYPAIR_FILE, 0o600)
    clone = start_node(home, free_port(), [nodes[1].port])
    client = other_client(nodes[1])
    try:
        await_ready(clone)
        assert clone.node_id == nodes[0].node_id

        def node0_address() -> str:
            info = client.status()
            return next(m["address"] for m in info["members"]
                        if m["node_id"] == nodes[0].node_id)

        def refused() -> bool:
            return "refused" in clone.log or clone.proc.poll() is not None

        # Either the clone is refused (right) or node 1 re-points node 0's id
        # at the clone (wrong); wait for whichever happens first.
        wait_until(lambda: refused() or node0_address() != nodes[0].address, WAIT,
                   what="the clone refused or accepted")
        assert node0_address() == nodes[0].address, "node 1 now believes the clone is node 0"
        assert "identity" in clone.log, clone.log
    finally:
        client.close()
        stop_node(clone)



def test_wait_for_peers_returns_them_or_names_what_it_saw(nodes: list[NodeProc],
                                                          driver: dict[str, Any]) -> None:
    peers = pmetal.wait_for_peers(2, timeout=WAIT)
    assert set(peers) == {n.node_id for n in nodes[1:]}
    with pytest.raises(pmetal.PMetalTimeoutError) as info:
        pmetal.wait_for_peers(5, timeout=0.3)
    text = str(info.value)
    assert "2 of 5 peers joined within 0.3 s" in text, text
    assert all(n.node_id[:8] in text for n in nodes[1:]), text
    assert "static peers" in text   # what to try
    with pytest.raises(pmetal.PMetalValueError):
        pmetal.wait_for_peers(-1)
