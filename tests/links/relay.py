"""A TCP relay on loopback that sits between ranks (the machine in the
middle of docs/security.md): it forwards a link's handshake and frames,
and may rewrite them on the way.

The dialler (the higher rank) connects to the relay instead of the lower
rank's listener. Dialler to listener, the relay reads the hello (64 bytes:
``hello`` may rewrite it), the dialler's proof (32 bytes) and then, when
``record`` is given, the stream in records of that many bytes, handing
each to ``script`` (record number, bytes) which returns what to forward
instead (any number of byte strings; ``None`` closes the connection).
Listener to dialler, it reads the reply (48 bytes: ``reply`` may rewrite
it) and forwards the rest as it comes. ``flip_at``: without ``record``,
the byte at that offset of the dialler's stream after its handshake is
flipped on the way. Everything forwarded either way
after the handshake is kept in ``seen`` (what an eavesdropper reads).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

HELLO, PROOF, REPLY = 64, 32, 48

Rewrite = Callable[[bytes], bytes]
Script = Callable[[int, bytes], "list[bytes] | None"]


def _read(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            return bytes(data)
        data += part
    return bytes(data)


class Relay:
    """Relays every connection made to ``address`` to ``target``, each
    on its own pair of threads (``script`` numbers each one's records
    from 0)."""

    def __init__(self, target: tuple[str, int], *, hello: Rewrite | None = None,
                 reply: Rewrite | None = None, record: int = 0,
                 script: Script | None = None, flip_at: int | None = None) -> None:
        self.target = target
        self.flip_at = flip_at
        self.hello, self.reply, self.record, self.script = hello, reply, record, script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.seen = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._run, daemon=True)]
        self._threads[0].start()

    def _run(self) -> None:
        while True:
            try:
                dialler, _ = self.listener.accept()
            except OSError:
                return      # closed
            self.connections += 1
            try:
                listener = socket.create_connection(self.target, timeout=15.0)
            except OSError:
                dialler.close()
                continue
            for sock in (dialler, listener):
                sock.settimeout(15.0)
                self._socks.append(sock)
            for target, args in ((self._up, (dialler, listener)),
                                 (self._down, (listener, dialler))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                self._threads.append(thread)

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self.seen += data

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            hello = _read(src, HELLO)
            dst.sendall(self.hello(hello) if self.hello and len(hello) == HELLO else hello)
            number = 0
            if self.record:
                dst.sendall(_read(src, PROOF))
            else:   # the proof, or a refusal and its reason, forwarded as they come
                number = -PROOF
            while True:
                if self.record and self.script is not None:
                    data = _read(src, self.record)
                    if len(data) < self.record:
                        dst.sendall(data)
                        break
                    out = self.script(number, data)
                    number += 1
                    if out is None:
                        break
                    for piece in out:
                        self._keep(piece)
                        dst.sendall(piece)
                else:
                    data = src.recv(1 << 16)
                    if not data:
                        break
                    at = None if self.flip_at is None else self.flip_at - number
                    if at is not None and 0 <= at < len(data):
                        data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
                    number += len(data)
                    self._keep(data[max(0, len(data) - max(0, number)):])
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            self._end(src, dst)

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            reply = _read(src, REPLY)
            dst.sendall(self.reply(reply) if self.reply and len(reply) == REPLY else reply)
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                self._keep(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._end(src, dst)

    @staticmethod
    def _end(src: socket.socket, dst: socket.socket) -> None:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accepting thread
        except OSError:
            pass
        self.listener.close()
        for s in self._socks:
            s.close()
        for t in self._threads:
            t.join(5.0)


def clear_flag(hello_or_reply: bytes, at: int) -> bytes:
    """``hello_or_reply`` with its seal flag (the byte at ``at``) cleared."""
    return hello_or_reply[:at] + b"\x00" + hello_or_reply[at + 1:]


HELLO_FLAG, REPLY_FLAG = 7, 0   # where each side's seal flag sits
