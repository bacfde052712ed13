"""Fork server ("zygote"): a node's workers start as forks of a warm process.

Starting ``python -m pmetal.actors.worker`` costs an interpreter and its
imports, 0.2-0.4 s of CPU per worker; on a two-core machine the first actor
after ``pmetal.init()`` waited that long. A fork of a process that has
already imported everything a worker needs starts in a few milliseconds.

The node forks the zygote at the top of its ``main()``, before it creates a
thread, an event loop or a ZeroMQ context: a process with threads cannot be
forked safely (locks other threads hold stay locked in the child) and a
ZeroMQ context does not survive a fork. The zygote stays single-threaded
(numpy's BLAS may start threads of its own at import; OpenBLAS stops and
restarts them around ``fork`` itself). It imports what every worker needs
(pmetal's worker runtime, numpy, zmq, msgpack, cloudpickle, cryptography,
uvloop) between requests, and forks a worker per request. Each child makes
its own ZeroMQ context, identity and sessions, as a fresh interpreter would.
On macOS the zygote must never initialise Metal or MLX (neither survives a
fork): it does not import ``mlx``, and it never computes with numpy; an actor
imports MLX itself, after the fork.

Node and zygote talk over a Unix socket pair (inherited, never on a network
or a file system path): frames of a 4-byte big-endian length and a JSON
object.

* node to zygote: ``{"op": "preload"}`` (import the heavier modules now),
  ``{"op": "kill", "pid": P}`` (SIGKILL a child not reaped yet: only the zygote
  knows whether ``P`` is still its child, or already a pid the system may have
  given to an unrelated process), and
  ``{"op": "fork", "tag": N, "argv": [...], "env": {...}}``
  with one file descriptor attached (``SCM_RIGHTS``): the worker's
  *lifeline*, one end of a socket pair whose other end the node keeps. The
  child reads it as its stdin, so it exits when the node goes away (the
  worker watches stdin for end-of-file), and the node sees end-of-file on
  its end when the worker is gone even if the zygote is not there to say so.
* zygote to node: ``{"op": "started", "tag": N, "pid": P}``,
  ``{"op": "failed", "tag": N, "error": "..."}`` and
  ``{"op": "exited", "pid": P, "code": C}`` (codes as
  :attr:`asyncio.subprocess.Process.returncode`: negative for a signal).

A worker that crashes is one reaped child; the zygote keeps serving. When the
zygote itself dies, :class:`ForkServer` fails what is pending with
:class:`ForkServerError`, the pool starts interpreters instead, and workers
the zygote forked keep running (their exit is then seen on the lifeline,
with the code unknown: :data:`UNKNOWN_EXIT`).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import itertools
import json
import logging
import os
import selectors
import signal
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from pmetal.errors import PMetalError

__all__ = ["UNKNOWN_EXIT", "ForkServer", "ForkServerError", "ForkedProcess", "supported"]

log = logging.getLogger(__name__)

UNKNOWN_EXIT = -255
"""Exit code reported for a forked worker that exited after its zygote died
(nobody was left to learn the real code)."""

# Imported by the zygote one at a time between requests: PRELOAD at once,
# PRELOAD_LATER when the node says its first workers run (on two cores, the
# first actor of a fresh driver would otherwise wait for numpy to load).
# Never mlx (see the module docstring).
PRELOAD = ("pmetal.actors.worker", "pmetal.aio", "cloudpickle")
PRELOAD_LATER = ("uvloop", "concurrent.futures", "numpy", "numpy.random")

_HEADER = struct.Struct(">I")
_MAX_FRAME = 1 << 20


class ForkServerError(PMetalError):
    """The fork server is gone or did not answer; start an interpreter instead."""


def supported() -> bool:
    """Whether this platform can run a fork server (fork and fd passing)."""
    return hasattr(os, "fork") and hasattr(socket, "send_fds") and sys.platform != "win32"


def _frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def _frames(buffer: bytearray) -> list[dict[str, Any]]:
    """Complete frames taken off the front of ``buffer``."""
    out = []
    while len(buffer) >= _HEADER.size:
        (size,) = _HEADER.unpack_from(buffer)
        if size > _MAX_FRAME:
            raise ValueError(f"fork server frame of {size} bytes")
        if len(buffer) < _HEADER.size + size:
            break
        out.append(json.loads(bytes(buffer[_HEADER.size:_HEADER.size + size])))
        del buffer[:_HEADER.size + size]
    return out


# ------------------------------------------------------------------ zygote

@dataclass(frozen=True)
class _Child:
    """What a freshly forked child runs: the worker's argv and environment."""
    argv: list[str]
    env: dict[str, str]


class _Zygote:
    """The zygote's loop: one thread, blocking I/O, no event loop."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.control.setblocking(True)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_w.setblocking(False)
        self.buffer = bytearray()
        self.fds: list[int] = []
        self.preload = list(PRELOAD)
        self.node_gone = False
        self.children: set[int] = set()   # forked, not reaped yet

    def serve(self) -> _Child | None:
        """Serve fork requests until the node closes the socket (None), or
        return, in a forked child, what that child must run."""
        # Ctrl-C in a terminal reaches the whole process group: the node
        # decides what stops, and the zygote follows when the node closes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        # No collections here, and everything frozen before each fork: a
        # child's collector then never walks (and so never copies the pages
        # of) the objects it inherits, as the gc module's documentation advises.
        gc.disable()
        signal.set_wakeup_fd(self.wake_w.fileno())
        with selectors.DefaultSelector() as sel:
            sel.register(self.control, selectors.EVENT_READ)
            sel.register(self.wake_r, selectors.EVENT_READ)
            while not self.node_gone:
                self._reap()
                # Preload between requests: a request waiting is served first.
                events = sel.select(0 if self.preload else None)
                if not events and self.preload:
                    self._import(self.preload.pop(0))
                    continue
                for key, _ in events:
                    if key.fileobj is self.wake_r:
                        self._drain_wakeups()
                        continue
                    try:
                        data, fds, flags, _ = socket.recv_fds(self.control, 1 << 16, 16)
                    except ConnectionResetError:  # the node died with our news unread
                        return None
                    self.fds.extend(fds)
                    if not data:
                        return None
                    if flags & getattr(socket, "MSG_CTRUNC", 0):
                        raise ForkServerError("file descriptors were cut off a fork request")
                    self.buffer += data
                    for request in _frames(self.buffer):
                        if request.get("op") == "preload":
                            self.preload += PRELOAD_LATER
                            continue
                        if request.get("op") == "kill":
                            self._kill(request.get("pid"))
                            continue
                        child = self._fork(request)
                        if child is not None:
                            sel.close()
                            return child
        return None

    def _import(self, name: str) -> None:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional one (uvloop): workers go without it
            pass

    def _drain_wakeups(self) -> None:
        try:
            while self.wake_r.recv(4096, socket.MSG_DONTWAIT):
                pass
        except BlockingIOError:
            pass

    def _kill(self, pid: Any) -> None:
        if pid in self.children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self._send({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self.control.sendall(_frame(message))
        except OSError:  # the node closed its end (it stops): so do we
            self.node_gone = True

    def _fork(self, request: dict[str, Any]) -> _Child | None:
        tag = request.get("tag")
        if not self.fds:
            self._send({"op": "failed", "tag": tag, "error": "fork request without a lifeline"})
            return None
        lifeline = self.fds.pop(0)
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(lifeline)
            self._send({"op": "failed", "tag": tag, "error": f"fork failed: {exc}"})
            return None
        if pid:
            os.close(lifeline)
            self.children.add(pid)
            self._send({"op": "started", "tag": tag, "pid": pid})
            return None
        # The child: nothing of the zygote's may stay open in it (the node
        # sees the zygote's end of the control socket close only when every
        # copy is closed).
        gc.enable()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.control.close()
        self.wake_r.close()
        self.wake_w.close()
        for fd in self.fds:
            os.close(fd)
        os.dup2(lifeline, 0)
        os.close(lifeline)
        return _Child(list(request.get("argv") or []),
                      {str(k): str(v) for k, v in (request.get("env") or {}).items()})


def _run_child(child: _Child) -> int:
    """Become the worker ``python -m pmetal.actors.worker ARGV`` would be."""
    os.environ.pop("PMETAL_PSK", None)
    os.environ.update(child.env)
    # numpy's global generator was seeded once, in the zygote: every worker
    # would draw the same numbers. (The random module reseeds itself.)
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    logging.root.handlers.clear()
    from pmetal.actors import worker
    sys.argv = [worker.__file__, *child.argv]
    return worker.main(child.argv)


def _zygote_main(control: socket.socket) -> None:
    """The zygote's life after the fork that made it; never returns in the
    zygote. In a worker it forks, it raises SystemExit with the worker's exit
    code: the caller's frames unwind and the interpreter exits as a fresh
    worker would (atexit handlers, non-daemon threads joined, output flushed)."""
    code = 0
    try:
        # The node's stdin (a pipe from the driver) is not the zygote's business.
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        child = _Zygote(control).serve()
    except BaseException as exc:  # the zygote must never run its parent's code
        print(f"pmetal fork server: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
        child = None
    if child is None:
        sys.stdout.flush()
        os._exit(code)
    sys.exit(_run_child(child))


# -------------------------------------------------------------------- node

class ForkedProcess:
    """A worker forked by the zygote, seen as the pool sees a process it
    started itself (the fields and methods of
    :class:`asyncio.subprocess.Process` the pool uses)."""

    def __init__(self, pid: int, lifeline: socket.socket, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._lifeline = lifeline
        self._server = server
        self._done = asyncio.Event()
        self._watching = False

    async def wait(self) -> int:
        await self._done.wait()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is not None:
            return
        # Through the zygote: it reaps the child before telling us, so the
        # pid may already be free (and reused) when we would signal it.
        if self._server._kill(self.pid):
            return
        # The zygote is gone: this orphan's exit shows on its lifeline,
        # which has not shown it yet.
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _exited(self, code: int) -> None:
        if self.returncode is not None:
            return
        self.returncode = code
        self._unwatch()
        self._lifeline.close()
        self._done.set()

    def _watch_lifeline(self, loop: asyncio.AbstractEventLoop) -> None:
        """The zygote is gone: learn of the exit from the lifeline's end of
        file (the worker never writes to it)."""
        if self.returncode is None and not self._watching:
            self._watching = True
            loop.add_reader(self._lifeline.fileno(), self._exited, UNKNOWN_EXIT)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            asyncio.get_running_loop().remove_reader(self._lifeline.fileno())


class ForkServer:
    """The node's handle on its zygote. Made by :meth:`fork_here` before the
    node has threads; used from the node's event loop."""

    def __init__(self, control: socket.socket, pid: int) -> None:
        self.pid = pid
        self._control = control
        self._control.setblocking(False)
        self._buffer = bytearray()
        self._tags = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[ForkedProcess], socket.socket]] = {}
        self._procs: dict[int, ForkedProcess] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.alive = True
        self.forked = 0

    @classmethod
    def fork_here(cls) -> ForkServer | None:
        """Fork this process into a zygote. Call it while this process has a
        single thread. None where fork servers are not supported. Returns in
        the parent only (see :func:`_zygote_main` for the children)."""
        if not supported():
            return None
        node_end, zygote_end = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            log.warning("cannot fork a fork server (%s); workers start as interpreters", exc)
            node_end.close()
            zygote_end.close()
            return None
        if pid == 0:
            node_end.close()
            _zygote_main(zygote_end)
        zygote_end.close()
        return cls(node_end, pid)

    def _attach(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._control.fileno(), self._readable)
        return loop

    async def spawn(self, argv: list[str], env: dict[str, str], timeout: float) -> ForkedProcess:
        """Fork a worker running ``python -m pmetal.actors.worker ARGV`` with
        ``env`` added to the environment. Raises ForkServerError when the
        zygote is gone or does not answer within ``timeout``."""
        if not self.alive:
            raise ForkServerError("the fork server is not running")
        loop = self._attach()
        tag = next(self._tags)
        mine, theirs = socket.socketpair()
        future: asyncio.Future[ForkedProcess] = loop.create_future()
        self._pending[tag] = (future, mine)
        try:
            frame = _frame({"op": "fork", "tag": tag, "argv": argv, "env": env})
            try:
                sent = socket.send_fds(self._control, [frame], [theirs.fileno()])
            except OSError as exc:
                self._died(f"cannot reach it: {exc}")
                raise ForkServerError(f"the fork server (pid {self.pid}) is gone: "
                                      f"{exc}") from exc
            if sent != len(frame):  # the zygote stopped reading: a frame cut in two
                self._died("its socket is full")
        finally:
            theirs.close()
        try:
            proc = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError as exc:
            self._died(f"no answer to a fork request within {timeout:.3g} s")
            raise ForkServerError(f"the fork server (pid {self.pid}) did not fork a worker "
                                  f"within {timeout:.3g} s") from exc
        finally:
            entry = self._pending.pop(tag, None)
            if entry is not None and not entry[0].done():
                entry[1].close()
        self.forked += 1
        return proc

    def _tell(self, message: dict[str, Any]) -> bool:
        """Send the zygote a message that needs no answer; False when it is gone."""
        if not self.alive:
            return False
        frame = _frame(message)
        try:
            sent = self._control.send(frame)
        except OSError as exc:
            self._died(f"cannot reach it: {exc}")
            return False
        if sent != len(frame):  # it stopped reading: a frame cut in two
            self._died("its socket is full")
            return False
        return True

    def _kill(self, pid: int) -> bool:
        """Ask the zygote to SIGKILL its child ``pid``; False when it is gone."""
        return self._tell({"op": "kill", "pid": pid})

    def preload(self) -> None:
        """Let the zygote import the heavier modules (numpy) now."""
        self._tell({"op": "preload"})

    def _readable(self) -> None:
        try:
            data = self._control.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError as exc:
            self._died(str(exc))
            return
        if not data:
            self._died("it exited")
            return
        self._buffer += data
        try:
            messages = _frames(self._buffer)
        except ValueError as exc:
            self._died(f"garbled message: {exc}")
            return
        for message in messages:
            self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "exited":
            proc = self._procs.pop(message["pid"], None)
            if proc is not None:
                proc._exited(int(message["code"]))
            return
        entry = self._pending.get(message.get("tag", -1))
        if entry is None or entry[0].done():
            return
        future, lifeline = entry
        if op == "started":
            proc = ForkedProcess(int(message["pid"]), lifeline, self)
            self._procs[proc.pid] = proc
            future.set_result(proc)
        else:
            lifeline.close()
            future.set_exception(ForkServerError(
                f"the fork server could not fork a worker: {message.get('error')}"))

    def _died(self, why: str) -> None:
        if not self.alive:
            return
        self.alive = False
        log.warning("the fork server (pid %s) stopped (%s); new workers start as "
                    "interpreters (slower)", self.pid, why)
        if self._loop is not None:
            self._loop.remove_reader(self._control.fileno())
        self._control.close()
        for future, lifeline in self._pending.values():
            if not future.done():
                lifeline.close()
                future.set_exception(ForkServerError(f"the fork server stopped: {why}"))
        self._pending.clear()
        for proc in self._procs.values():
            if self._loop is not None:
                proc._watch_lifeline(self._loop)
        self._procs.clear()
        self._reap_zygote()

    def _reap_zygote(self) -> None:
        # Our own child: collect it (SIGKILL first, so the wait is short even
        # if it merely stopped answering).
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    def close(self) -> None:
        """Stop the zygote (it exits when its socket closes); workers it
        forked exit when the node does (their lifelines close)."""
        if self.alive:
            self.alive = False
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._control.fileno())
            self._control.close()
            for _, lifeline in self._pending.values():
                lifeline.close()
            self._pending.clear()
            try:
                os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pass
