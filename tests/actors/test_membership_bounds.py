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


def test_a_request_to_a_member_dropped_meanwhile_ends_then() -> None:
    """A member that took our request and went silent (held dead, fenced,
    dropped from the list) fails the request with a PeerError when it is
    dropped. Before, closing its channel cancelled the read under the
    request, and the CancelledError silently ended whatever asked: a
    restart placed on a node fenced mid-construction was never retried."""
    import asyncio
    import threading

    from pmetal.config import load_config
    from pmetal.endpoint import SecureListener, Server
    from pmetal.node.membership import Member
    from pmetal.wire import Failure, Ping

    config = load_config(env={}, transport={"request_timeout": 60.0})
    ns = NetworkNamespace.generate()
    transport = ZmqTransport(config.transport, curve=ns.curve_keys())
    listener = SecureListener(transport.listen("tcp://127.0.0.1:0"), NodeIdentity.generate(),
                              ns, config)
    arrived = threading.Event()

    def silent(_incoming: object) -> None:   # takes the request, never answers
        arrived.set()

    async def scenario() -> object:
        membership = Membership(NodeIdentity.generate(), ns, config, transport)
        member = membership.members["peer"] = Member("peer", listener.address, {})
        asked = asyncio.ensure_future(membership.ask(member, Ping({})))
        assert await asyncio.to_thread(arrived.wait, 20.0), "the request never arrived"
        assert not asked.done()
        membership.drop("peer")
        reply = await asyncio.wait_for(asked, 10.0)   # not the 60 s request timeout
        # Asked again after the drop: at once, without sending.
        again = await asyncio.wait_for(membership.ask(member, Ping({})), 10.0)
        return reply, again

    with Server(listener, silent):
        reply, again = asyncio.run(scenario())
    for answer in (reply, again):
        assert isinstance(answer, Failure) and answer.error_type == "PeerError"
        assert "held dead or left the member list" in answer.message
