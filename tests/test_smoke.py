"""A pmetal node answers an authenticated request over real TCP loopback."""

from pmetal.config import load_config
from pmetal.endpoint import Channel, SecureListener, Server
from pmetal.identity import NodeIdentity
from pmetal.security import NetworkNamespace
from pmetal.transport import ZmqTransport
from pmetal.wire import Ping, Pong


def test_request_reply_over_tcp() -> None:
    cfg = load_config(env={})
    ns = NetworkNamespace.generate()
    transport = ZmqTransport(cfg.transport, curve=ns.curve_keys())
    listener = SecureListener(transport.listen("tcp://127.0.0.1:0"), NodeIdentity.generate(),
                              ns, cfg)
    with Server(listener, lambda inc: Pong(inc.body.payload)):
        channel = Channel(transport.dial(listener.address), NodeIdentity.generate(), ns, cfg)
        assert channel.open(timeout=5) == listener.identity.node_id
        reply = channel.request(Ping({"x": [1, 2, 3]}), timeout=5)
        channel.close()
    assert reply.body == Pong({"x": [1, 2, 3]})
