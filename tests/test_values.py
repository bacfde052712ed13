"""pmetal.values: the typed values that cross the wire.

The enums must leave the wire exactly as it was (the same msgpack bytes as
the plain strings they replace), decode into their members, and refuse a
string outside the enum; ``Address`` parses and writes every form of
``tcp://host:port`` pmetal meets, IPv6 included, and says what is wrong
with anything else.
"""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
from typing import Any

import msgpack
import pytest

from pmetal.codec import decode, encode
from pmetal.errors import ProtocolError
from pmetal.values import ActorState, Address, CollectiveStrategy, FailureKind
from pmetal.wire import ActorLocation, Failure

ENUMS = (ActorState, FailureKind, CollectiveStrategy)


@pytest.mark.parametrize("member", [m for enum in ENUMS for m in enum])
def test_a_member_travels_as_the_string_it_replaced(member: Any) -> None:
    plain = member.value
    assert member == plain and hash(member) == hash(plain) and f"{member}" == plain
    assert msgpack.packb(member) == msgpack.packb(plain)
    assert json.dumps({"v": member}) == json.dumps({"v": plain})


def test_messages_encode_to_the_same_bytes_as_with_plain_strings() -> None:
    typed = encode(ActorLocation("a1", ActorState.RESTARTING), corr=3)
    plain = encode(ActorLocation("a1", "restarting"), corr=3)  # type: ignore[arg-type]
    assert typed == plain
    assert encode(Failure(FailureKind.ACTOR_DIED, "ActorDiedError", "gone")) == \
        encode(Failure("actor_died", "ActorDiedError", "gone"))  # type: ignore[arg-type]


def test_decoded_fields_are_members() -> None:
    loc = decode(encode(ActorLocation("a1", ActorState.MOVED))).body
    assert type(loc.state) is ActorState and loc.state is ActorState.MOVED and not loc.live
    failure = decode(encode(Failure(FailureKind.PLACEMENT, "PlacementError", "no room"))).body
    assert failure.kind is FailureKind.PLACEMENT


@pytest.mark.parametrize(("body", "field"), [
    (ActorLocation("a1", "sleeping"), "ActorState"),  # type: ignore[arg-type]
    (Failure("exploded", "E", "m"), "FailureKind"),  # type: ignore[arg-type]
])
def test_a_string_outside_the_enum_is_a_protocol_error(body: Any, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"is not a {field}"):
        decode(encode(body))


def test_actor_states_live() -> None:
    assert [s for s in ActorState if s.live] == [ActorState.PENDING, ActorState.ALIVE,
                                                 ActorState.RESTARTING]


# ------------------------------------------------------------------ Address

@pytest.mark.parametrize(("text", "host", "port", "url"), [
    ("tcp://192.168.1.20:52416", "192.168.1.20", 52416, "tcp://192.168.1.20:52416"),
    ("192.168.1.20:52416", "192.168.1.20", 52416, "tcp://192.168.1.20:52416"),
    ("studio.local:7000", "studio.local", 7000, "tcp://studio.local:7000"),
    ("tcp://[::1]:52416", "::1", 52416, "tcp://[::1]:52416"),
    ("[fd00::1]:0", "fd00::1", 0, "tcp://[fd00::1]:0"),
    ("  tcp://127.0.0.1:1  ", "127.0.0.1", 1, "tcp://127.0.0.1:1"),
])
def test_address_parses_and_formats(text: str, host: str, port: int, url: str) -> None:
    address = Address.parse(text)
    assert (address.host, address.port, address.url(), str(address)) == (host, port, url, url)
    assert Address.parse(address.url()) == address            # a round trip
    assert address.hostport == url.removeprefix("tcp://")


@pytest.mark.parametrize(("text", "host"), [
    ("studio.local", "studio.local"), ("[fd00::1]", "fd00::1"), ("fd00::1", "fd00::1"),
])
def test_a_host_alone_takes_the_default_port(text: str, host: str) -> None:
    assert Address.parse(text, default_port=52416) == Address(host, 52416)


@pytest.mark.parametrize(("text", "message"), [
    ("studio.local", "has no port: write host:port"),
    ("udp://1.2.3.4:5", "only tcp:// addresses"),
    ("1.2.3.4:http", "port 'http' is not a number"),
    ("1.2.3.4:70000", "not a port number (0-65535)"),
    ("[fd00::1:5", "needs its closing ']'"),
    ("[fd00::1]5", "expected ':port' after ']'"),
    ("fd00::zz:1", "an IPv6 address with a port goes in brackets"),
    (":52416", "is not a host name or IP address"),
])
def test_a_bad_address_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as raised:
        Address.parse(text)
    assert repr(text) in str(raised.value)


def test_address_is_frozen_and_checked_when_built() -> None:
    address = Address("10.0.0.1", 1)
    with pytest.raises(FrozenInstanceError):
        address.port = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="port"):
        Address("10.0.0.1", -1)
    with pytest.raises(ValueError, match="host"):
        Address("[::1]", 1)


# ------------------------------------------------------------- member entries

def test_member_entries_are_frozen_values_that_round_trip_their_map() -> None:
    from pmetal.cluster.view import MemberEntry, MemberState
    wire = {"node_id": "n1", "address": "tcp://10.0.0.2:52416", "incarnation": 7,
            "resources": {"CPU": 8.0}, "profile": {"cores": 8}, "state": "dead",
            "unknown": "dropped"}
    member = MemberEntry.from_wire(wire)
    assert (member.node_id, member.incarnation, member.state, member.alive) == \
        ("n1", 7, MemberState.DEAD, False)
    assert member.to_wire() == {k: v for k, v in wire.items() if k != "unknown"}
    assert msgpack.packb(member.to_wire()) == msgpack.packb(
        {k: v for k, v in wire.items() if k != "unknown"})
    with pytest.raises(FrozenInstanceError):
        member.state = MemberState.ALIVE  # type: ignore[misc]
    for bad in ({"node_id": ""}, {"node_id": "n", "incarnation": "7"},
                {"node_id": "n", "state": "sleeping"}, {"node_id": "n", "state": ["x"]}):
        with pytest.raises(ValueError, match="not a member entry"):
            MemberEntry.from_wire(bad)
