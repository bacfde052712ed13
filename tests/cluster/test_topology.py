"""The topology: this machine's profile, its trip through the wire, links,
and the ring and tree orders checked against brute force on random graphs."""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmetal.cluster.topology import (
    ClusterTopology,
    ConnectionProfile,
    NodeProfile,
    bandwidth_from,
    chip_from_cpuinfo,
    parse_meminfo,
    parse_vm_stat,
    probe_plan,
)
from pmetal.errors import PMetalValueError, ProtocolError
from pmetal.hardware import gpu_count
from pmetal.wire import ClusterView, decode, encode

MS = 0.001


# ------------------------------------------------------------ node profiles

def test_the_local_profile_describes_this_machine() -> None:
    p = NodeProfile.local("n1")
    assert p.node_id == "n1"
    assert p.chip.strip() and p.chip != "unknown"
    assert p.cores == os.cpu_count()
    assert p.gflops > 0
    assert 0 < p.memory_free <= p.memory_total
    assert p.memory_total == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert p.gpus == gpu_count()
    assert NodeProfile.local("n1", measure=False).gflops == 0.0


PROFILE = NodeProfile("a" * 32, 64 << 30, 40 << 30, 12, "Apple M2 Max", 812.5, 1)


def test_a_profile_round_trips_through_a_dict_and_json() -> None:
    assert NodeProfile.from_dict(PROFILE.to_dict()) == PROFILE
    assert NodeProfile.from_dict(json.loads(json.dumps(PROFILE.to_dict()))) == PROFILE


def test_a_profile_round_trips_inside_a_cluster_view() -> None:
    entry = {"node_id": PROFILE.node_id, "address": "tcp://127.0.0.1:5000", "incarnation": 3,
             "resources": {"CPU": 12.0}, "profile": PROFILE.to_dict(), "state": "alive"}
    frames = encode(ClusterView(2, PROFILE.node_id, 7, [entry]))
    view = decode(frames).body
    assert isinstance(view, ClusterView)
    got = view.members[0]
    assert NodeProfile.from_dict(got["profile"], node_id=got["node_id"]) == PROFILE


def test_from_dict_ignores_unknown_keys_and_defaults_missing_ones() -> None:
    newer = {**PROFILE.to_dict(), "npu_tops": 38, "chip": "Apple M4"}
    assert NodeProfile.from_dict(newer).chip == "Apple M4"
    older = {"node_id": "b", "cores": 4}
    assert NodeProfile.from_dict(older) == NodeProfile("b", cores=4)
    # The id proven in the handshake wins over the map's.
    assert NodeProfile.from_dict({"node_id": "forged", "cores": 2}, node_id="c").node_id == "c"
    assert NodeProfile.from_dict({"gflops": 3}, node_id="c").gflops == 3.0


@pytest.mark.parametrize(("data", "match"), [
    ([1, 2], "must be a map"),
    ({"node_id": "b", "cores": "many"}, "'cores' must be a non-negative int"),
    ({"node_id": "b", "memory_free": -1}, "'memory_free' must be a non-negative int"),
    ({"node_id": "b", "gflops": True}, "'gflops'"),
    ({"node_id": 5}, "'node_id' must be a str, not 5"),
    ({"cores": 2}, "without a node_id"),
])
def test_from_dict_refuses_a_malformed_profile(data: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        NodeProfile.from_dict(data)  # type: ignore[arg-type]


def test_machine_descriptions_are_parsed() -> None:
    meminfo = "MemTotal:       16384000 kB\nMemFree:  1000 kB\nMemAvailable:    8192000 kB\n"
    assert parse_meminfo(meminfo) == (16384000 * 1024, 8192000 * 1024)
    assert parse_meminfo("MemTotal: 2048 kB\nMemFree: 1024 kB\n") == (2048 * 1024, 1024 * 1024)
    vm_stat = ("Mach Virtual Memory Statistics: (page size of 16384 bytes)\n"
               "Pages free:                               10.\n"
               "Pages active:                            999.\n"
               "Pages inactive:                           20.\n"
               "Pages speculative:                         5.\n")
    assert parse_vm_stat(vm_stat) == 35 * 16384
    x86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Core(TM) i7 \n"
    assert chip_from_cpuinfo(x86) == "Intel(R) Core(TM) i7"
    pi = "processor\t: 0\nBogoMIPS\t: 108.00\n\nModel\t\t: Raspberry Pi 5 Model B Rev 1.0\n"
    assert chip_from_cpuinfo(pi) == "Raspberry Pi 5 Model B Rev 1.0"
    assert chip_from_cpuinfo("processor : 0\n") == ""


# ------------------------------------------------------------------ links

def topology(*ids: str) -> ClusterTopology:
    t = ClusterTopology()
    for node_id in ids:
        t.add_node(NodeProfile(node_id))
    return t


def test_links_are_updated_piecewise_and_symmetric() -> None:
    t = topology("a", "b", "c")
    assert t.link("a", "b") is None
    assert t.update_link("a", "b", latency=2 * MS, now=1.0)
    assert t.update_link("b", "a", bandwidth=1e8, now=2.0)
    assert t.link("a", "b") == t.link("b", "a") == ConnectionProfile(2 * MS, 1e8, 2.0)
    assert t.update_link("a", "b", latency=3 * MS, now=3.0)
    assert t.link("a", "b") == ConnectionProfile(3 * MS, 1e8, 3.0)
    assert t.link("a", "b").cost() == pytest.approx(3 * MS + (1 << 20) / 1e8)
    assert not t.update_link("a", "zz", latency=MS, now=4.0)   # not a node yet
    with pytest.raises(PMetalValueError, match="itself"):
        t.update_link("a", "a", latency=MS, now=4.0)


def test_nodes_come_and_go() -> None:
    t = topology("b", "a", "c")
    t.update_link("a", "c", latency=MS, now=1.0)
    t.add_node(NodeProfile("a", cores=8))              # a refreshed profile keeps links
    assert t.profile("a").cores == 8 and t.link("a", "c") is not None
    t.remove_node("c")
    t.remove_node("c")                                  # twice is harmless
    assert t.nodes() == ["a", "b"] and "c" not in t and len(t) == 2
    t.add_node(NodeProfile("c"))                        # back, as a new machine: no old links
    assert t.link("a", "c") is None
    with pytest.raises(PMetalValueError, match="'zz' is not in the topology"):
        t.profile("zz")


def test_to_dict_lists_profiles_and_measured_links() -> None:
    t = topology("b", "a")
    t.update_link("a", "b", latency=MS, now=5.0)
    d = json.loads(json.dumps(t.to_dict()))
    assert [n["node_id"] for n in d["nodes"]] == ["a", "b"]
    assert d["links"] == [{"a": "a", "b": "b", "latency": MS, "bandwidth": None,
                           "measured_at": 5.0}]


# ------------------------------------------------------------------- rings

def reference_ring_key(t: ClusterTopology, ring: list[str]) -> tuple[float, int, float]:
    """An independent statement of what best_ring minimises: the slowest
    link (an unknown one slower than any), then the number of unknown
    links, then the total time of the known ones."""
    slowest, unknown, total = 0.0, 0, 0.0
    for a, b in zip(ring, ring[1:] + ring[:1]):
        if a == b:
            continue
        link = t.link(a, b)
        if link is None:
            slowest, unknown = math.inf, unknown + 1
        else:
            cost = link.latency + ((1 << 20) / link.bandwidth if link.bandwidth else 0.0)
            slowest, total = max(slowest, cost), total + cost
    return slowest, unknown, total


graphs = st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.just(n),
    st.lists(st.one_of(st.none(), st.tuples(st.integers(1, 50), st.none() | st.integers(1, 5))),
             min_size=n * (n - 1) // 2, max_size=n * (n - 1) // 2),
    st.permutations(range(n))))


def build(n: int, links: list, order: list[int]) -> ClusterTopology:
    ids = [f"n{i}" for i in range(n)]
    t = topology(*[ids[i] for i in order])           # insertion order must not matter
    for (a, b), link in zip(itertools.combinations(ids, 2), links):
        if link is not None:
            latency, bandwidth = link
            t.update_link(a, b, latency=latency * MS,
                          bandwidth=None if bandwidth is None else bandwidth * 1e8, now=1.0)
    return t


@settings(max_examples=120, deadline=None)
@given(graphs)
def test_best_ring_is_optimal_against_brute_force(graph: tuple) -> None:
    n, links, order = graph
    t = build(n, links, order)
    ring = t.best_ring()
    assert sorted(ring) == t.nodes() and ring[0] == "n0"
    first, *rest = t.nodes()     # a ring's rotations all cost the same
    best = min(reference_ring_key(t, [first, *p]) for p in itertools.permutations(rest))
    assert reference_ring_key(t, ring) == pytest.approx(best)
    assert build(n, links, list(range(n))).best_ring() == ring


def test_a_slow_link_is_avoided() -> None:
    t = topology("a", "b", "c", "d")
    for a, b in itertools.combinations("abcd", 2):
        t.update_link(a, b, latency=MS, bandwidth=1e9, now=1.0)
    t.update_link("a", "b", bandwidth=1e6, now=2.0)     # a Wi-Fi hop
    ring = t.best_ring()
    assert ring == ["a", "c", "b", "d"]                 # the only rings without a-b
    pairs = {frozenset(p) for p in zip(ring, ring[1:] + ring[:1])}
    assert frozenset("ab") not in pairs


def test_measured_links_are_preferred_and_unknown_ones_still_give_a_ring() -> None:
    t = topology("a", "b", "c", "d", "e")
    for a, b in ("ac", "cb", "bd"):
        t.update_link(a, b, latency=9 * MS, now=1.0)
    # Five nodes, three measured links: a ring needs two unknown ones.
    ring = t.best_ring()
    assert sorted(ring) == list("abcde")
    assert reference_ring_key(t, ring)[1] == 2
    pairs = {frozenset(p) for p in zip(ring, ring[1:] + ring[:1])}
    assert {frozenset("ac"), frozenset("cb"), frozenset("bd")} <= pairs
    assert topology("x", "y").best_ring() == ["x", "y"]
    assert topology().best_ring() == []


def test_ties_are_broken_by_node_id() -> None:
    ids = ["d", "b", "e", "a", "c"]
    t = topology(*ids)
    assert t.best_ring() == ["a", "b", "c", "d", "e"]
    for a, b in itertools.combinations(ids, 2):
        t.update_link(a, b, latency=MS, now=1.0)
    assert t.best_ring() == ["a", "b", "c", "d", "e"]
    assert t.best_ring(["e", "c", "a"]) == ["a", "c", "e"]
    with pytest.raises(PMetalValueError, match="'zz' is not in the topology"):
        t.best_ring(["a", "zz"])


@pytest.mark.parametrize("n", [9, 12])
def test_large_rings_are_valid_and_no_worse_than_id_order(n: int) -> None:
    rng = random.Random(n)
    ids = [f"n{i:02d}" for i in range(n)]
    t = topology(*ids)
    for a, b in itertools.combinations(ids, 2):
        t.update_link(a, b, latency=rng.uniform(1, 20) * MS, now=1.0)
    ring = t.best_ring()
    assert sorted(ring) == ids and ring[0] == ids[0]
    assert reference_ring_key(t, ring) <= reference_ring_key(t, ids)
    assert t.best_ring() == ring


# ------------------------------------------------------------------- trees

def check_tree(tree: dict[str, list[str]], root: str, nodes: list[str]) -> int:
    """Asserts a spanning tree of ``nodes`` rooted at ``root``; its depth."""
    assert sorted(tree) == sorted(nodes)
    children = [c for kids in tree.values() for c in kids]
    assert sorted(children) == sorted(set(nodes) - {root})
    depth, level, seen = 0, [root], {root}
    while level:
        level = [c for p in level for c in tree[p]]
        assert not seen & set(level)
        seen |= set(level)
        depth += bool(level)
    assert seen == set(nodes)
    return depth


@settings(max_examples=120, deadline=None)
@given(graphs, st.data())
def test_best_tree_is_a_shallow_spanning_tree_from_any_root(graph: tuple,
                                                            data: st.DataObject) -> None:
    n, links, order = graph
    t = build(n, links, order)
    root = data.draw(st.sampled_from(t.nodes()))
    tree = t.best_tree(root)
    rounds = math.ceil(math.log2(n))    # the data reaches twice as many nodes each round
    assert check_tree(tree, root, t.nodes()) <= rounds
    assert len(tree[root]) == rounds                # the root sends in every round
    assert build(n, links, list(range(n))).best_tree(root) == tree


def test_on_a_uniform_network_the_tree_is_the_binomial_tree_in_id_order() -> None:
    t = topology(*"abcdefgh")
    assert t.best_tree("a") == {"a": ["b", "c", "e"], "b": ["d", "f"], "c": ["g"],
                                "d": ["h"], "e": [], "f": [], "g": [], "h": []}
    assert t.best_tree("c", ["c", "a"]) == {"c": ["a"], "a": []}
    assert t.best_tree("a", ["a"]) == {"a": []}
    with pytest.raises(PMetalValueError, match="root 'b' is not among"):
        t.best_tree("b", ["a", "c"])


def test_the_tree_sends_over_fast_links_first() -> None:
    t = topology("r", "x", "y", "z")
    for a, b in itertools.combinations("rxyz", 2):
        t.update_link(a, b, latency=10 * MS, now=1.0)
    t.update_link("r", "z", latency=1 * MS, now=1.0)
    t.update_link("z", "y", latency=1 * MS, now=1.0)
    assert t.best_tree("r") == {"r": ["z", "x"], "z": ["y"], "x": [], "y": []}


# ------------------------------------------------------------------ probes

def test_probe_plan_alternates_small_and_large_payloads() -> None:
    assert probe_plan(1 << 20, 2) == [4096, 1 << 20, 4096, 1 << 20]
    with pytest.raises(PMetalValueError, match="max_bytes"):
        probe_plan(100)


def test_bandwidth_from_subtracts_the_fixed_part_and_ignores_a_stall() -> None:
    latency, rate = 0.8 * MS, 110e6
    samples = [(n, latency + n / rate) for n in probe_plan(4 << 20, 3)]
    assert bandwidth_from(samples) == pytest.approx(rate)
    samples[3] = (4 << 20, 5.0)                          # one probe stalled
    assert bandwidth_from(samples) == pytest.approx(rate)
    naive = sum(n for n, _ in samples[-1:]) / samples[-1][1]
    assert naive < rate                                  # what subtracting latency corrects


def test_bandwidth_from_one_size_or_nothing() -> None:
    assert bandwidth_from([(1000, 0.01), (1000, 0.02), (1000, 1.0)]) == pytest.approx(50_000)
    with pytest.raises(PMetalValueError, match="no probe timing"):
        bandwidth_from([])
    with pytest.raises(PMetalValueError, match="no probe timing"):
        bandwidth_from([(1000, 0.0), (0, 1.0)])


def test_a_probe_over_a_real_loopback_socket_gives_a_plausible_bandwidth() -> None:
    """The probe's pure part on real timings: ZeroMQ over TCP on 127.0.0.1,
    each payload answered by a few bytes, as a node answers a Probe with an Ack."""
    import threading
    import time

    import zmq

    ctx = zmq.Context.instance()
    server, client = ctx.socket(zmq.REP), ctx.socket(zmq.REQ)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    client.connect(f"tcp://127.0.0.1:{port}")
    plan = probe_plan(4 << 20, 3)

    def answer() -> None:
        for _ in plan:
            server.send(str(len(server.recv())).encode())

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        samples = []
        for size in plan:
            start = time.perf_counter()
            client.send(b"\0" * size)
            assert int(client.recv()) == size
            samples.append((size, time.perf_counter() - start))
        thread.join(5)
    finally:
        server.close()
        client.close()
    rate = bandwidth_from(samples)
    print(f"loopback probe: {rate / 1e6:.0f} MB/s")
    assert 1e6 < rate < 1e12        # between a slow Wi-Fi and nothing real
