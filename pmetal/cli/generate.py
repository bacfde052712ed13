"""``pmetal generate``: run a model as a pipeline and stream its answer.

Without ``--address`` it starts an embedded local node with a worker per
stage on this machine (the stages are then processes of this machine,
joined over loopback); with it, the stages go on that node's cluster. The
model (default: SmolLM2-135M-Instruct, fetched on first use) is split over
``--stages`` stage actors; the answer streams to stdout as it comes, the
statistics go to stderr: tokens/s, time to first token, each stage's time
per step and the bytes each hop moved per token.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pmetal.errors import ConfigError

DEFAULT_PROMPT = "Which city is the capital of France?"


def _generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="a GGUF file, a Hugging Face folder, a known model's name or "
                             "a stored model's sha256 (default: smollm2-135m-instruct, "
                             "fetched on first use; see 'pmetal models')")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, metavar="TEXT",
                        help=f"the prompt (default: {DEFAULT_PROMPT!r}); the model's chat "
                             "template is applied unless --raw")
    parser.add_argument("--raw", action="store_true",
                        help="feed the prompt as it is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128, metavar="N",
                        help="new tokens at most (default 128)")
    parser.add_argument("--stages", type=int, default=2, metavar="K",
                        help="pipeline stages (default 2)")
    parser.add_argument("--codec", default="none", choices=("none", "fp16", "bf16", "int8"),
                        help="how activations travel between stages (default none)")
    parser.add_argument("--address", default=None, metavar="A",
                        help="join this node's cluster (tcp://host:port, or auto: the node "
                             "'pmetal start' runs here) instead of starting a local one; the "
                             "key is PMETAL_PSK, else security.psk_file, else that of the "
                             "node running here")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 is greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P", help="1: off")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--max-len", type=int, default=2048, metavar="N",
                        help="context per sequence, prompt included (default 2048)")
    parser.add_argument("--backend", default="auto",
                        choices=("auto", "quantized", "reference", "mlx"),
                        help="the engine of every stage: quantized (GGUF blocks kept as they "
                             "are), reference (float32 numpy), mlx; auto (default): mlx on "
                             "Apple silicon, else quantized for a GGUF file")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="BLAS threads per stage (default: the cores over the stages)")


def _run_generate(args: argparse.Namespace) -> int:
    import pmetal  # numpy and the pipeline load only for this command
    from pmetal.pipeline.pipeline import Pipeline

    if args.stages < 1:
        raise ConfigError(f"--stages {args.stages}: must be at least 1")
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens {args.max_tokens}: must be at least 1")
    from pmetal.pipeline.sampling import SamplingConfig

    # Sampling settings are checked before a node or a stage starts.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, max_tokens=args.max_tokens)
    err = sys.stderr
    started = time.perf_counter()
    connect(pmetal, args.address, args.stages)
    try:
        pipe = Pipeline.from_pretrained(args.model, stages=args.stages, codec=args.codec,
                                        max_len=args.max_len, threads=args.threads,
                                        backend=args.backend, progress=err)
        with pipe:
            ready = time.perf_counter()
            where = ", ".join(f"{p.start}-{p.end - 1}" for p in pipe.placements)
            print(f"pmetal: {pipe.model} as {args.stages} stage(s) (layers {where}), ready "
                  f"in {ready - started:.1f} s", file=err, flush=True)

            def show(_index: int, text: str) -> None:
                sys.stdout.write(text)
                sys.stdout.flush()

            result = pipe.generate(args.prompt, max_tokens=args.max_tokens,
                                   temperature=args.temperature, top_k=args.top_k,
                                   top_p=args.top_p, seed=args.seed,
                                   chat=False if args.raw else None, stream=show)[0]
            sys.stdout.write("\n")
            sys.stdout.flush()
            _report(result, pipe.statistics(), err)
            if result.error:
                print(f"pmetal: generation failed: {result.error}", file=err)
                return 1
    finally:
        pmetal.shutdown()
    return 0


def connect(pmetal: Any, address: str | None, stages: int) -> None:
    """The cluster a pipeline command runs on: ``--address`` joins it (see
    :func:`_join`); without one, a local node with a worker per stage."""
    if address:
        _join(pmetal, address)
    else:
        pmetal.init(num_workers=max(stages, 2))


def _join(pmetal: Any, address: str) -> None:
    """``pmetal.init(address=...)`` with the cluster's PSK: PMETAL_PSK or
    ``security.psk_file`` when set, else the key of the node ``pmetal start``
    runs on this machine (a machine of that cluster, as a rule)."""
    from pmetal.api import local_node
    from pmetal.config import load_config
    from pmetal.errors import PeerError
    from pmetal.security import NetworkNamespace

    if address == "auto":
        pmetal.init(address="auto")
        return
    try:
        NetworkNamespace.resolve(load_config().security)
    except ConfigError as exc:
        try:
            local = local_node()
        except PeerError:
            raise ConfigError(
                f"--address {address}: {exc}; that is the cluster's key: 'pmetal start' "
                f"keeps it in $PMETAL_HOME/psk on the machine that made it") from exc
        if local["psk"] is None:
            raise ConfigError(f"--address {address}: {exc}") from exc
        pmetal.init(address=address, psk=local["psk"],
                    namespace=local["namespace"] or None)
        return
    pmetal.init(address=address)


def _report(result: Any, stats: dict[str, Any], out: Any) -> None:
    n = len(result.tokens)
    ttft = result.time_to_first_token or 0.0
    decode = max(result.seconds - ttft, 1e-9)
    rate = (n - 1) / decode if n > 1 else 0.0
    print(f"pmetal: {n} tokens ({result.finish_reason}) from a {len(result.prompt)}-token "
          f"prompt; first token {ttft * 1e3:.0f} ms, then {rate:.1f} tokens/s", file=out)
    rows = len(result.prompt) + max(n - 1, 0)
    for s in stats["stages"]:
        steps = max(int(s.get("steps", 0)), 1)
        moved = s.get("bytes_out", 0) / max(rows, 1)
        layers = s["layers"]
        print(f"pmetal:   stage {s['index']} layers {layers[0]}-{layers[1] - 1} on node "
              f"{s['node'][:8]} (pid {s.get('pid', '?')}): "
              f"{s.get('compute_seconds', 0.0) / steps * 1e3:.1f} ms per "
              f"step, sends {moved:.0f} bytes per token", file=out)
    out.flush()
