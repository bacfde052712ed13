"""Where a placement group's bundles go (pmetal.node.bundles.plan): a table
of cases per strategy, and properties over random clusters (every plan fits
what the nodes have free; strict strategies hold their promise; a
STRICT_SPREAD plan exists whenever one bundle per node could fit)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmetal.node.bundles import STRATEGIES, plan, why_pending
from pmetal.node.placement import fits

FREE = {"a": {"CPU": 4.0}, "b": {"CPU": 2.0}, "c": {"CPU": 2.0, "GPU": 1.0}}
ONE = {"CPU": 1.0}


@pytest.mark.parametrize("bundles, strategy, home, want", [
    ([ONE] * 3, "STRICT_PACK", "b", ["a"] * 3),          # b cannot hold 3: the first that can
    ([ONE] * 2, "STRICT_PACK", "b", ["b"] * 2),          # the group's node first
    ([ONE] * 5, "STRICT_PACK", "a", None),
    ([ONE] * 2, "PACK", "c", ["c", "c"]),
    ([{"CPU": 3.0}, {"CPU": 2.0}], "PACK", "", ["a", "b"]),   # two nodes, the roomiest first
    ([ONE] * 3, "STRICT_SPREAD", "", ["a", "b", "c"]),
    ([ONE] * 4, "STRICT_SPREAD", "", None),              # more bundles than nodes
    ([{"GPU": 1.0}, ONE], "STRICT_SPREAD", "", ["c", "a"]),   # the GPU bundle takes c
    ([{"CPU": 3.0}] * 2, "STRICT_SPREAD", "", None),     # only a has 3
    ([ONE] * 4, "SPREAD", "", ["a", "b", "c", "a"]),
    ([{"CPU": 3.0}] * 2, "SPREAD", "", None),
    ([{"CPU": 2.0}] * 2, "SPREAD", "", ["a", "b"]),
])
def test_plans(bundles: list[dict[str, float]], strategy: str, home: str,
               want: list[str] | None) -> None:
    assert plan(bundles, FREE, strategy, home) == want


def test_why_pending_tells_waiting_from_infeasible() -> None:
    total = FREE
    busy = {n: {"CPU": 0.0} for n in FREE}
    assert why_pending([ONE] * 4, busy, total, "STRICT_SPREAD").startswith(
        "infeasible: STRICT_SPREAD needs 4 nodes")
    assert why_pending([{"CPU": 9.0}], busy, total, "PACK").startswith("infeasible")
    assert why_pending([ONE], busy, total, "PACK").startswith("waiting for resources")


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown placement strategy"):
        plan([ONE], FREE, "BEST")


pools = st.dictionaries(st.sampled_from("abcdef"),
                        st.fixed_dictionaries({"CPU": st.integers(0, 4).map(float)}),
                        min_size=1, max_size=6)
bundle_lists = st.lists(st.fixed_dictionaries({"CPU": st.integers(1, 3).map(float)}),
                        min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(pools, bundle_lists, st.sampled_from(STRATEGIES))
def test_every_plan_fits_and_keeps_its_promise(free: dict[str, dict[str, float]],
                                               bundles: list[dict[str, float]],
                                               strategy: str) -> None:
    nodes = plan(bundles, free, strategy)
    if nodes is None:
        if strategy == "STRICT_SPREAD" and len(bundles) <= len(free):
            # none exists: no assignment of distinct nodes fits
            assert not any(all(fits(b, free[n]) for b, n in zip(bundles, perm))
                           for perm in itertools.permutations(free, len(bundles)))
        return
    used: dict[str, dict[str, float]] = {}
    for bundle, node in zip(bundles, nodes):
        for k, v in bundle.items():
            used.setdefault(node, {})[k] = used.get(node, {}).get(k, 0.0) + v
    assert all(fits(need, free[n]) for n, need in used.items())
    if strategy == "STRICT_PACK":
        assert len(set(nodes)) == 1
    if strategy == "STRICT_SPREAD":
        assert len(set(nodes)) == len(nodes)
