"""OwnerLeases: the pure bookkeeping of remote owners' leases, on a fake clock
(the node around it is tested with real processes in tests/test_cli_daemon.py)."""

from __future__ import annotations

from pmetal.node.owners import LeaseStatistics, OwnerLeases


def test_a_lease_lapses_only_after_its_timeout_without_a_message() -> None:
    leases = OwnerLeases(4.0)
    assert not leases
    leases.hold("a", now=0.0)
    leases.hold("b", now=1.0)
    assert leases and "a" in leases
    assert leases.expired(now=3.9) == []
    leases.renew("a", now=3.0)           # a message from a: another 4 s
    leases.renew("stranger", now=3.0)    # holds no lease: nothing to renew
    assert leases.expired(now=5.0) == ["b"]
    assert "b" not in leases
    assert leases.expired(now=6.9) == []
    assert leases.expired(now=7.0) == ["a"]
    assert not leases
    assert leases.statistics() == LeaseStatistics(held=0, renewed=1, expired=2)


def test_a_dropped_lease_never_lapses() -> None:
    leases = OwnerLeases(1.0)
    leases.hold("a", now=0.0)
    leases.drop("a")                     # its client detached
    leases.drop("a")
    assert leases.expired(now=10.0) == []
    assert leases.describe(now=0.0) == []
    leases.hold("b", now=0.0)
    assert leases.describe(now=0.5) == [{"client": "b", "expires_in": 0.5}]
