"""``pmetal status`` and ``pmetal kill``: commands that talk to the node
recorded in node.json. The text ``pmetal status`` prints for a person is
:func:`pmetal.cli.picture.picture`.

``pmetal status --watch [SECONDS]`` redraws the picture every SECONDS
(:data:`_WATCH_DEFAULT`, within :data:`_WATCH_RANGE`) until Ctrl-C, or for
``--count N`` frames: over the previous frame on a terminal (ANSI clear
screen), as blocks one after another otherwise (a pipe, a log). Every frame
is one status request with the deadline of :data:`_STATUS_TIMEOUT`; a node
that does not answer, or is gone, makes a frame that says so, and the next
frame connects again (a restarted node is picked up). A member that leaves
the member list is listed as gone for the rest of the watch.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any

from pmetal.actors.client import CoreClient
from pmetal.node.process import node_file
from pmetal.cli.basic import _fail
from pmetal.cli.daemon import _is_node_process, _read_node_file
from pmetal.cli.picture import WIDTH, Memory, picture
from pmetal.config import load_config, pmetal_home
from pmetal.errors import PeerError, PMetalError
from pmetal.security import NetworkNamespace
from pmetal.values import ActorState

_STATUS_TIMEOUT = 5.0
"""Cap on connect and request deadlines of ``pmetal status`` (each frame of
``--watch`` too)."""
_WATCH_DEFAULT = 2.0
"""Seconds between frames of ``--watch`` given no SECONDS (as watch(1))."""
_WATCH_RANGE = (0.1, 3600.0)
"""The seconds ``--watch`` accepts."""
_CLEAR = "\x1b[H\x1b[2J"
"""ANSI: cursor home, clear the screen (a frame of --watch on a terminal)."""


def _interval(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    low, high = _WATCH_RANGE
    if not low <= value <= high:   # (NaN too)
        raise argparse.ArgumentTypeError(f"{text} s is out of range: give {low:g} to "
                                         f"{high:g} seconds between frames")
    return value


def _frames(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of frames") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} frames: give 1 or more")
    return value


def _status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print the node's full status as JSON")
    parser.add_argument("--probe", action="store_true",
                        help="first measure the bandwidth of the link from this node to "
                             "every member (a few MiB each)")
    parser.add_argument("--measure", action="store_true",
                        help="add each member's capacity as pipeline placement sees it: "
                             "compute rate (measured over a quarter second of every CPU "
                             "the first time, then kept 10 minutes), free memory now, links")
    parser.add_argument("--watch", nargs="?", type=_interval, const=_WATCH_DEFAULT,
                        default=None, metavar="SECONDS",
                        help=f"redraw every SECONDS (default {_WATCH_DEFAULT:g}) until Ctrl-C; "
                             f"with --json, one JSON document a line per frame")
    parser.add_argument("--count", type=_frames, default=None, metavar="N",
                        help="with --watch (which it implies): stop after N frames")


def _run_status(args: argparse.Namespace) -> int:
    if args.watch is not None or args.count is not None:
        return _watch(args, args.watch or _WATCH_DEFAULT, args.count)
    client = _client_of_recorded_node()
    try:
        status = client.status(probe=args.probe, measure=args.measure)
    finally:
        client.close()
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        _print_status(status, {"pid": _recorded_pid()})
    return 0


def _watch(args: argparse.Namespace, interval: float, count: int | None) -> int:
    """Frames until Ctrl-C or ``count``; the exit status is the last frame's
    (0: the node answered, 1: it did not)."""
    tty = sys.stdout.isatty()
    memory = Memory()
    client: CoreClient | None = None
    last_answer = ""
    frame = code = 0
    try:
        while True:
            frame += 1
            began = time.monotonic()
            try:
                if client is None:
                    client = _client_of_recorded_node()
                # --probe moves a few MiB per link: once, before the first frame.
                status = client.status(probe=args.probe and not last_answer,
                                       measure=args.measure)
            except (PMetalError, OSError) as exc:
                if client is not None:
                    client.close()
                    client = None
                code = 1
                lines = [f"no status: {exc}",
                         f"(last answer at {last_answer})" if last_answer else
                         "(no answer yet)"]
                status = {"error": str(exc)}
            else:
                code = 0
                last_answer = time.strftime("%H:%M:%S")
                lines = [] if args.json else picture(status, _recorded_pid(), width=_width(),
                                                     memory=memory)
            if args.json:
                print(json.dumps(status, default=str), flush=True)
            else:
                of = f"/{count}" if count else ""
                head = (f"pmetal status   every {interval:g} s   {time.strftime('%H:%M:%S')}"
                        f"   frame {frame}{of}" + ("" if count else "   Ctrl-C stops"))
                sys.stdout.write((_CLEAR if tty else "\n" if frame > 1 else "") + head + "\n"
                                 + "\n".join(lines) + "\n")
                sys.stdout.flush()
            if count is not None and frame >= count:
                return code
            time.sleep(max(0.0, interval - (time.monotonic() - began)))
    except KeyboardInterrupt:
        return code
    finally:
        if client is not None:
            client.close()


def _print_status(s: dict[str, Any], info: dict[str, Any]) -> None:
    """Print the picture of status ``s`` (``info``: the node.json record)."""
    print("\n".join(picture(s, info.get("pid", "?"), width=_width())))


def _width() -> int:
    """The terminal's columns (COLUMNS wins); 80 when not a terminal."""
    if not sys.stdout.isatty():
        return WIDTH
    return max(40, shutil.get_terminal_size((WIDTH, 24)).columns)


def _recorded_pid() -> Any:
    return (_read_node_file(pmetal_home()) or {}).get("pid", "?")


def _client_of_recorded_node() -> CoreClient:
    """A client of the node recorded in node.json, with short deadlines."""
    home = pmetal_home()
    path = node_file(home)
    info = _read_node_file(home)
    if info is None:
        raise PeerError(f"no pmetal node is running on this machine (no {path}); "
                        f"start one with 'pmetal start'")
    if not _is_node_process(info["pid"]):
        raise PeerError(f"the node recorded in {path} (pid {info['pid']}) is not running; "
                        f"'pmetal start' starts a new one")
    cfg = load_config()
    security = {"namespace": info.get("namespace") or cfg.security.namespace}
    if info.get("psk_file"):
        security["psk_file"] = info["psk_file"]
    cfg = load_config(security=security, transport={
        "connect_timeout": min(cfg.transport.connect_timeout, _STATUS_TIMEOUT),
        "handshake_timeout": min(cfg.transport.handshake_timeout, _STATUS_TIMEOUT),
        "request_timeout": min(cfg.transport.request_timeout, _STATUS_TIMEOUT)})
    # A recorded PSK file wins over a PMETAL_PSK meant for something else.
    namespace = NetworkNamespace.resolve(cfg.security,
                                         env={} if info.get("psk_file") else None)
    return CoreClient(info["address"], namespace, cfg)


def _kill_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="name of the actor (as given to .options(name=...))")
    parser.add_argument("--restart", action="store_true",
                        help="let it restart if it has restarts left (default: it stays dead)")


def _run_kill(args: argparse.Namespace) -> int:
    client = _client_of_recorded_node()
    try:
        try:
            loc = client.lookup(name=args.name)
        except ValueError as exc:
            return _fail(args, str(exc))
        if loc.state == ActorState.DEAD:
            return _fail(args, f"actor {args.name!r} is already dead: {loc.reason}")
        client.kill(loc.actor_id, not args.restart, loc.node_id)
    finally:
        client.close()
    print(f"killed actor {args.name!r} ({loc.class_name}, {loc.actor_id}) on node "
          f"{loc.node_id[:8]}")
    return 0
