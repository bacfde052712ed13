"""``pmetal serve``: an OpenAI-compatible HTTP server over a pipeline.

Without ``--address`` it starts an embedded local node with a worker per
stage, as ``pmetal generate`` does; with it, the stages go on that node's
cluster. The model (default: SmolLM2-135M-Instruct, fetched on first use)
is split over ``--stages`` stage actors, then :class:`~pmetal.serve.OpenAIServer`
listens on ``--host:--port`` until Ctrl-C or SIGTERM, which cancel the
requests running, stop the stages and end the node's workers. The API key
is ``--api-key`` or ``PMETAL_API_KEY``; binding beyond loopback without one
is refused before anything starts. While it listens, a record in
``$PMETAL_HOME/serve/`` (:mod:`pmetal.served`) tells the node's dashboard
where it is, for its chat page. See docs/serving.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from pmetal.errors import ConfigError


def _serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a GGUF file, a Hugging Face folder or a known model's name "
                             "(default: smollm2-135m-instruct, fetched on first use)")
    parser.add_argument("--stages", type=int, default=2, metavar="K",
                        help="pipeline stages (default 2)")
    parser.add_argument("--address", default=None, metavar="A",
                        help="put the stages on this node's cluster (tcp://host:port, or "
                             "auto) instead of starting a local one")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; "
                             "any other needs an API key)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any "
                                                               "free one)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="requests must send 'Authorization: Bearer KEY' (default: "
                             "$PMETAL_API_KEY; required beyond loopback)")
    parser.add_argument("--max-len", type=int, default=2048, metavar="N",
                        help="context per request, prompt included (default 2048, at most "
                             "the model's)")
    parser.add_argument("--max-running", type=int, default=32, metavar="N",
                        help="requests decoded together at most (default 32)")
    parser.add_argument("--max-waiting", type=int, default=64, metavar="N",
                        help="requests queued beyond those; more get 503 (default 64)")
    parser.add_argument("--token-timeout", type=float, default=60.0, metavar="S",
                        help="a request waiting longer than this for its next token fails "
                             "with 504 (default 60)")
    parser.add_argument("--codec", default="none", choices=("none", "fp16", "bf16", "int8"),
                        help="how activations travel between stages (default none)")
    parser.add_argument("--backend", default="auto",
                        choices=("auto", "quantized", "reference", "mlx"),
                        help="the engine of every stage (default auto)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="BLAS threads per stage (default: the cores over the stages)")


def _check_port(host: str, port: int) -> None:
    """Refuse a port that is taken before the model loads (the server
    binds it, as aiohttp does, with SO_REUSEADDR, only once the stages run)."""
    import socket

    from pmetal.errors import PMetalError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ConfigError(f"--host {host}: not an address of this machine ({exc})") from exc
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise PMetalError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                                  "(another server has it? choose another --port, or 0 for "
                                  "any free one)") from exc


def _local_url(server: Any) -> str:
    """Where a process of this machine reaches the server: its address, or
    loopback when it listens on every address."""
    if server.host in ("", "0.0.0.0"):
        return f"http://127.0.0.1:{server.port}"
    if server.host == "::":
        return f"http://[::1]:{server.port}"
    return str(server.url)


def _run_serve(args: argparse.Namespace) -> int:
    from pmetal.serve.server import API_KEY_ENV, check_binding

    for name in ("stages", "max_running", "max_waiting"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at "
                              "least 1")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be 0 to 65535")
    if not args.token_timeout > 0:
        raise ConfigError(f"--token-timeout {args.token_timeout}: must be positive")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    check_binding(args.host, key)       # before a node or a stage starts
    _check_port(args.host, args.port)

    import pmetal
    from pmetal.cli.generate import connect
    from pmetal.pipeline.pipeline import Pipeline
    from pmetal.serve.server import OpenAIServer, serve_forever, served_name
    from pmetal.served import remove_record, write_record

    err = sys.stderr
    started = time.perf_counter()
    connect(pmetal, args.address, args.stages)
    record = None
    try:
        with Pipeline.from_pretrained(args.model, stages=args.stages, codec=args.codec,
                                      max_len=args.max_len, threads=args.threads,
                                      backend=args.backend, progress=err) as pipe:
            server = OpenAIServer(pipe, model_id=served_name(args.model), api_key=key,
                                  max_running=args.max_running, max_waiting=args.max_waiting,
                                  token_timeout=args.token_timeout)

            def ready(server: OpenAIServer) -> None:
                nonlocal record
                record = write_record(_local_url(server), server.model_id, key)
                where = ", ".join(f"{p.start}-{p.end - 1}" for p in pipe.placements)
                print(f"pmetal serve: {server.model_id} as {args.stages} stage(s) (layers "
                      f"{where}), ready in {time.perf_counter() - started:.1f} s", file=err)
                print(f"pmetal serve: listening on {server.url}/v1 (OpenAI API"
                      f"{', API key required' if key else ''}); Ctrl-C stops", file=err,
                      flush=True)

            serve_forever(server, args.host, args.port, ready=ready)
            print("pmetal serve: stopping", file=err, flush=True)
    finally:
        if record is not None:
            remove_record(record)
        pmetal.shutdown()
    return 0
