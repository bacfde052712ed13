"""What a node keeps of the peers that refused it is bounded, whoever names
the addresses (static peers, nodes that dial us with another key)."""

from __future__ import annotations

from pmetal.node.membership import MAX_REFUSED, Membership
from pmetal.config import PMetalConfig
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport


def test_the_refused_list_keeps_the_newest_addresses_and_no_more() -> None:
    membership = Membership(NodeIdentity.generate(), NetworkNamespace("t", b"k" * 32),
                            PMetalConfig(), ZmqTransport())
    for i in range(MAX_REFUSED + 50):
        membership.refuse(f"tcp://10.0.{i // 250}.{i % 250}:7100", "another PSK")
    membership.refuse("tcp://10.0.0.60:7100", "another namespace")  # seen again: newest
    listed = membership.describe_refused()
    assert len(listed) == MAX_REFUSED
    assert listed[-1] == {"address": "tcp://10.0.0.60:7100", "reason": "another namespace"}
    addresses = {entry["address"] for entry in listed}
    assert "tcp://10.0.0.0:7100" not in addresses            # the oldest went
    assert f"tcp://10.0.1.{(MAX_REFUSED + 49) % 250}:7100" in addresses
    assert membership.statistics().joins_refused == MAX_REFUSED + 51
