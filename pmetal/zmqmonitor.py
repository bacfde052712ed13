"""ZeroMQ socket monitors: readers of a socket's events that never stall
the context.

libzmq sends a socket's monitor events from its I/O thread with a blocking
send. A reader whose queue is full, or one already closed while events are
still coming, blocks that thread for good, and every socket of the context
stops moving (seen as handshakes that never complete). So a reader here
has no queue limit (:func:`_open_monitor`) and is closed only after
EVENT_MONITOR_STOPPED, the last event libzmq sends
(:func:`_retire_monitor`); until then it is parked. :mod:`pmetal.transport`
uses them for a dialer's dropped or refused connections, a listener's
refused handshakes (:data:`REFUSAL_REASONS`) and the wait for a closed
listener's port.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

__all__ = ["REFUSAL_REASONS"]

log = logging.getLogger("pmetal.transport")   # the transport's messages keep its name

# Monitor readers whose socket had not finished closing when we stopped
# waiting. libzmq sends monitor events from its I/O thread with a blocking
# send: an event for a PAIR reader that is already closed blocks that thread
# for good, and every socket of the context stops moving (seen as handshakes
# that never complete). So a reader is closed only after EVENT_MONITOR_STOPPED,
# the last event libzmq sends; until then it is parked here.
_parked_monitors: list[zmq.Socket] = []
_parked_lock = threading.Lock()

# What a dialer's monitor reports: its connection dropped, or the listener
# refused its CURVE handshake (other namespace keys).
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_MONITORED = zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
REFUSAL_REASONS = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
                   zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
                   zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no_detail"}
"""A listener's refused ZMTP handshakes by monitor event: ``protocol`` (a
CURVE handshake that did not decrypt: other keys, or no CURVE at all),
``auth`` (refused by an authenticator), ``no_detail`` (anything else,
such as a connection that is not ZeroMQ, or a stranger that hung up
before the listener read what it sent)."""


def _monitor_url() -> str:
    # pyzmq's default name comes from the socket's file descriptor, which a
    # new socket can reuse while the old monitor's endpoint is still bound.
    return f"inproc://pmetal-monitor-{os.urandom(8).hex()}"


def _open_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A reader of ``sock``'s monitor events with no queue limit: libzmq
    sends events with a blocking send, so a full queue of events nobody
    read would stall every socket of the context."""
    url = _monitor_url()
    sock.monitor(url, events)
    reader = sock.context.socket(zmq.PAIR)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(url)
    return reader


def _drained(monitor: zmq.Socket, timeout: float) -> bool:
    """Read events until EVENT_MONITOR_STOPPED (True) or ``timeout`` (False)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if not monitor.poll(max(0, int(left * 1000))):
            return False
        event = monitor.recv_multipart()[0]
        if int.from_bytes(event[:2], "little") == zmq.EVENT_MONITOR_STOPPED:
            return True


def _retire_monitor(monitor: zmq.Socket, timeout: float) -> None:
    """Close the reader of a monitor whose socket is closing, once libzmq has
    stopped the monitor; park it if that takes longer than ``timeout``."""
    with _parked_lock:
        for parked in [m for m in _parked_monitors if _drained(m, 0)]:
            parked.close(linger=0)
            _parked_monitors.remove(parked)
    if _drained(monitor, timeout):
        monitor.close(linger=0)
        return
    log.warning("a closed ZeroMQ socket had not stopped its monitor after %.3g s; "
                "keeping the monitor open until it does", timeout)
    with _parked_lock:
        _parked_monitors.append(monitor)
