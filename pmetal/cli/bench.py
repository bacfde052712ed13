"""``pmetal bench``: measure this machine. One subcommand per benchmark:

- ``pmetal bench allreduce``: all_reduce over 127.0.0.1 with 2 and 4
  ranks (real processes), each strategy and the automatic choice, timed
  like nccl-tests (:mod:`pmetal.bench.allreduce`), then the issue's
  targets against torch.distributed gloo (run too when torch is
  installed) and the anchors' MPI figures.
- ``pmetal bench pipeline``: the model engine's (``--backend``) prefill,
  time to first token, decode tokens/s alone, batched and beside CPU hogs,
  and a long prompt's prefill, against llama.cpp on the same GGUF in the
  same run when llama-cpp-python is installed, then issue [7/11]'s targets
  (:mod:`pmetal.bench.pipeline`).
- ``pmetal bench agreement``: greedy tokens of the quantized engine, the
  float32 reference and llama.cpp, prompt by prompt
  (:mod:`pmetal.bench.agreement`).
- ``pmetal bench serve``: ``pmetal serve``'s throughput and time to first
  token for 1, 4 and 16 concurrent clients, against llama.cpp's server on
  the same GGUF file when llama-cpp-python[server] is installed
  (:mod:`pmetal.bench.serve`).

Exit status: 0 when every result was right, 1 when some all_reduce gave a
wrong element (the tables say where) or a rank failed, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from pmetal.errors import ConfigError

_STRATEGIES = ("ring", "tree", "naive", "auto")
_DEFAULTS: dict[str, object] = {}  # allreduce's option defaults, for the header
_PIPELINE_DEFAULTS: dict[str, object] = {}
_AGREEMENT_DEFAULTS: dict[str, object] = {}
_SERVE_DEFAULTS: dict[str, object] = {}
_QUICK = {"tokens": 8, "repeats": 1, "prompts": 2, "prefill_tokens": 128}


def _bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    allreduce = sub.add_parser(
        "allreduce", help="all_reduce time, algbw and busbw per size, strategy and world "
                          "size, like nccl-tests",
        description="all_reduce of float32 sums over 127.0.0.1, ranks as processes; "
                    "tables like nccl-tests, then the targets against gloo and MPI.")
    allreduce.add_argument("--world", default="2,4", metavar="N,M",
                           help="world sizes (default 2,4)")
    allreduce.add_argument("--min-bytes", default="4", metavar="SIZE",
                           help="smallest buffer, e.g. 4, 1K (default 4)")
    allreduce.add_argument("--max-bytes", default="64M", metavar="SIZE",
                           help="largest buffer, e.g. 64M (default 64M)")
    allreduce.add_argument("--step-factor", type=int, default=4, metavar="F",
                           help="each size is F times the one before (default 4)")
    allreduce.add_argument("--iters", type=int, default=15, metavar="R",
                           help="timed repetitions per size (default 15; the median is "
                                "shown)")
    allreduce.add_argument("--warmup", type=int, default=3, metavar="W",
                           help="untimed repetitions first (default 3)")
    allreduce.add_argument("--strategy", default="ring,tree,naive,auto", metavar="S,..",
                           help="strategies among ring, tree, naive, auto (default all)")
    allreduce.add_argument("--same-machine", choices=("off", "on", "both"), default="off",
                           help="the ranks' same-machine path (shared memory; "
                                "collectives.shared_memory): off measures what a LAN uses "
                                "(default off)")
    allreduce.add_argument("--sealed", choices=("off", "on", "both"), default="off",
                           help="TCP links sealed (AES-256-GCM; collectives.link_encryption "
                                "on): both prints clear against sealed (default off: on "
                                "127.0.0.1 'auto' leaves them in clear)")
    allreduce.add_argument("--anchors", choices=("auto", "off"), default="auto",
                           help="also run torch.distributed gloo when torch is installed "
                                "(default auto)")
    allreduce.add_argument("--chunk-bytes", default=None, metavar="SIZE",
                           help="the ring's largest message (default: collectives."
                                "chunk_bytes)")
    allreduce.add_argument("--tree-max-bytes", default=None, metavar="SIZE",
                           help="auto's tree/ring threshold (default: collectives."
                                "tree_max_bytes)")
    allreduce.add_argument("--timeout", type=float, default=30.0, metavar="S",
                           help="seconds one operation may take (default 30)")
    allreduce.add_argument("--markdown", action="store_true",
                           help="print markdown tables (for docs/performance.md)")
    _DEFAULTS.update({a.dest: a.default for a in allreduce._actions if a.dest != "help"})
    pipeline = sub.add_parser(
        "pipeline", help="model engine speed against llama.cpp: prefill, first token, "
                         "tokens/s alone, batched and under load; issue [7/11]'s targets",
        description="Greedy decoding with pmetal's model engine (--backend) in one process "
                    "(compute threads 1 and 2), against llama.cpp on the same GGUF file in "
                    "the same run when llama-cpp-python is installed; a long prompt's "
                    "prefill; decode beside --hogs busy loops; then the model as a pipeline "
                    "of --stages stage actors on this machine (1 sequence, several, and the "
                    "lossy activation codecs against none), and the targets.")
    pipeline.add_argument("--model", default=None, metavar="PATH",
                          help="the model (a GGUF file; default: the default model)")
    pipeline.add_argument("--backend", default="auto", metavar="B",
                          help="the engine: auto (the quantized engine for a GGUF file), "
                               "quantized, reference (float32) or mlx (default auto)")
    pipeline.add_argument("--tokens", type=int, default=32, metavar="N",
                          help="timed decode steps per sequence (default 32)")
    pipeline.add_argument("--repeats", type=int, default=3, metavar="R",
                          help="repetitions, each over every prompt (default 3; medians "
                               "shown)")
    pipeline.add_argument("--batch", type=int, default=4, metavar="B",
                          help="sequences decoded together for the aggregate rate "
                               "(default 4)")
    pipeline.add_argument("--prompts", type=int, default=4, metavar="P",
                          help="how many of the built-in chat prompts (default 4)")
    pipeline.add_argument("--threads", default="1,2", metavar="N,M",
                          help="compute thread counts to measure (default 1,2)")
    pipeline.add_argument("--prefill-tokens", type=int, default=512, metavar="N",
                          help="the long prompt whose prefill both engines time (default "
                               "512; 0: skip)")
    pipeline.add_argument("--hogs", type=int, default=2, metavar="N",
                          help="busy-loop processes beside the under-load decode (default 2; "
                               "0: skip table (d))")
    pipeline.add_argument("--anchors", choices=("auto", "off"), default="auto",
                          help="also run llama.cpp when llama-cpp-python is installed "
                               "(default auto)")
    pipeline.add_argument("--random-weights", choices=("smollm2-135m", "tiny"), default=None,
                          help="measure random weights of this shape instead of the "
                               "model's (tiny: for tests)")
    pipeline.add_argument("--stages", type=int, default=2, metavar="K",
                          help="stages of the pipeline table (c) (default 2; 0: skip it)")
    pipeline.add_argument("--quick", action="store_true",
                          help=f"a short run: {_QUICK['tokens']} tokens, "
                               f"{_QUICK['repeats']} repetition, {_QUICK['prompts']} prompts, "
                               f"a long prompt of at most {_QUICK['prefill_tokens']} tokens")
    pipeline.add_argument("--markdown", action="store_true",
                          help="print markdown tables (for docs/performance.md)")
    _PIPELINE_DEFAULTS.update(
        {a.dest: a.default for a in pipeline._actions if a.dest != "help"})
    agreement = sub.add_parser(
        "agreement", help="greedy tokens of the quantized engine, the float32 reference and "
                          "llama.cpp, prompt by prompt",
        description="Each prompt through the model's tokenizer, then greedy tokens from the "
                    "quantized engine, the float32 reference engine and llama.cpp (when "
                    "llama-cpp-python is installed) from the same ids; for each pair: the "
                    "leading tokens that agree and the fraction of positions equal.")
    agreement.add_argument("--model", default=None, metavar="PATH",
                           help="the model (a GGUF file; default: the default model)")
    agreement.add_argument("--tokens", type=int, default=32, metavar="N",
                           help="greedy tokens per prompt (default 32)")
    agreement.add_argument("--prompts", type=int, default=8, metavar="P",
                           help="how many of the built-in prompts (default 8)")
    agreement.add_argument("--anchors", choices=("auto", "off"), default="auto",
                           help="also run llama.cpp when llama-cpp-python is installed "
                                "(default auto)")
    agreement.add_argument("--markdown", action="store_true",
                           help="print a markdown table (for docs/performance.md)")
    _AGREEMENT_DEFAULTS.update(
        {a.dest: a.default for a in agreement._actions if a.dest != "help"})
    serve = sub.add_parser(
        "serve", help="pmetal serve's tokens/s and time to first token for concurrent "
                      "clients, against llama.cpp's server",
        description="Streamed chat requests from 1, 4 and 16 concurrent clients to pmetal "
                    "serve (a pipeline of --stages stages on this machine) and, when "
                    "llama-cpp-python[server] is installed, to llama.cpp's server on the same "
                    "GGUF file; aggregate tokens/s and time to first token (median, p90).")
    serve.add_argument("--model", default=None, metavar="PATH",
                       help="the model (a GGUF file; default: the default model)")
    serve.add_argument("--stages", type=int, default=2, metavar="K",
                       help="pipeline stages (default 2)")
    serve.add_argument("--clients", default="1,4,16", metavar="N,M",
                       help="concurrent client counts (default 1,4,16)")
    serve.add_argument("--requests", type=int, default=16, metavar="R",
                       help="requests per client count, spread over the clients (default "
                            "16; at least one per client)")
    serve.add_argument("--tokens", type=int, default=64, metavar="N",
                       help="new tokens per request (default 64)")
    serve.add_argument("--anchors", choices=("auto", "off"), default="auto",
                       help="also run llama.cpp's server when installed (default auto)")
    serve.add_argument("--markdown", action="store_true",
                       help="print a markdown table (for docs/performance.md)")
    _SERVE_DEFAULTS.update({a.dest: a.default for a in serve._actions if a.dest != "help"})
    memory = sub.add_parser(
        "memory", help="peak memory of every process of 'pmetal generate' (Linux)",
        description="Runs 'pmetal generate --stages K' for each K and samples every process "
                    "it starts: anonymous plus shared memory (PSS; a mapped model file's pages "
                    "do not count), and each stage's resident pages of the model file.")
    memory.add_argument("--stages", default="1,2,3", metavar="K,..",
                        help="stage counts (default 1,2,3)")
    memory.add_argument("--model", default=None, metavar="PATH",
                        help="the model (default: the default model)")
    memory.add_argument("--backend", default="auto", metavar="B",
                        help="the stages' backend (default auto)")
    memory.add_argument("--markdown", action="store_true",
                        help="print a markdown table (for docs/performance.md)")
    seal = sub.add_parser(
        "seal", help="what sealing a rank-to-rank link costs: the AEADs, and one link in "
                     "clear against sealed",
        description="AES-256-GCM against ChaCha20-Poly1305 on one core, then one TCP link "
                    "over 127.0.0.1 carrying --bytes in clear and sealed.")
    seal.add_argument("--bytes", default="64M", metavar="SIZE",
                      help="bytes sent over the link per run (default 64M)")
    seal.add_argument("--message", default="1M", metavar="SIZE",
                      help="bytes per message (default 1M, the ring's chunk)")
    seal.add_argument("--repeats", type=int, default=5, metavar="R",
                      help="runs per link, the median shown (default 5)")
    seal.add_argument("--markdown", action="store_true",
                      help="print markdown tables (for docs/performance.md)")


def _command(args: argparse.Namespace, parser_defaults: dict[str, object],
             benchmark: str = "allreduce") -> str:
    """The command line that repeats this run (options that differ from
    the defaults), for the header."""
    parts = [f"pmetal bench {benchmark}"]
    for name, default in parser_defaults.items():
        value = getattr(args, name, default)
        if value != default:
            flag = "--" + name.replace("_", "-")
            parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


def _run_bench(args: argparse.Namespace) -> int:
    if args.benchmark == "allreduce":
        return _run_allreduce(args)
    if args.benchmark == "pipeline":
        return _run_pipeline(args)
    if args.benchmark == "agreement":
        return _run_agreement(args)
    if args.benchmark == "memory":
        return _run_memory(args)
    if args.benchmark == "seal":
        return _run_seal(args)
    if args.benchmark == "serve":
        return _run_serve_bench(args)
    raise ConfigError(f"unknown benchmark {args.benchmark!r}")  # argparse refuses it first


def _run_agreement(args: argparse.Namespace) -> int:
    from pmetal.bench import agreement
    from pmetal.bench.pipeline import default_model

    if not 1 <= args.prompts <= len(agreement.PROMPTS):
        raise ConfigError(f"--prompts {args.prompts}: choose 1 to {len(agreement.PROMPTS)}")
    agreement.run(agreement.Options(
        model=args.model if args.model is not None else default_model(),
        prompts=agreement.PROMPTS[:args.prompts], tokens=args.tokens,
        anchors=args.anchors == "auto", markdown=args.markdown,
        command=_command(args, _AGREEMENT_DEFAULTS, "agreement")))
    return 0


def _run_seal(args: argparse.Namespace) -> int:
    from pmetal.bench import seal
    from pmetal.bench.allreduce import parse_size

    total, message = parse_size(args.bytes), parse_size(args.message)
    if not 0 < message <= total or args.repeats < 1:
        raise ConfigError(f"--bytes {args.bytes} / --message {args.message} / --repeats "
                          f"{args.repeats}: a message of at least 1 byte and at most --bytes, "
                          "and at least 1 repeat")
    seal.run(total, message, args.repeats, markdown=args.markdown)
    return 0


def _run_serve_bench(args: argparse.Namespace) -> int:
    from pmetal.bench.pipeline import default_model
    from pmetal.bench.serve import Options, parse_clients, run

    clients = parse_clients(args.clients)
    for name in ("stages", "requests", "tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)}: must be at least 1")
    run(Options(model=args.model if args.model is not None else default_model(),
                stages=args.stages, clients=clients, requests=args.requests,
                tokens=args.tokens, anchors=args.anchors == "auto", markdown=args.markdown,
                command=_command(args, _SERVE_DEFAULTS, "serve")))
    return 0


def _run_memory(args: argparse.Namespace) -> int:
    from pmetal.bench import memory

    try:
        counts = [int(k) for k in args.stages.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--stages {args.stages!r}: stage counts like 1,2,3") from exc
    if not counts or min(counts) < 1:
        raise ConfigError(f"--stages {args.stages!r}: every count must be at least 1")
    rows = memory.run(counts, model=args.model, backend=args.backend, markdown=args.markdown)
    failed = [r for r in rows if r.returncode != 0]
    for r in failed:
        print(f"pmetal bench memory: generate with {r.stages} stage(s) failed:\n{r.output}",
              file=sys.stderr)
    return 1 if failed else 0


def _run_allreduce(args: argparse.Namespace) -> int:
    from pmetal.bench.allreduce import parse_size, sizes_between
    from pmetal.bench.report import Options, run

    try:
        worlds = tuple(int(w) for w in args.world.split(",") if w.strip())
    except ValueError:
        raise ConfigError(f"--world {args.world!r}: write world sizes such as 2,4") from None
    strategies = tuple(dict.fromkeys(s.strip() for s in args.strategy.split(",") if s.strip()))
    unknown = sorted(set(strategies) - set(_STRATEGIES))
    if unknown or not strategies:
        raise ConfigError(f"--strategy {args.strategy!r}: choose among "
                          f"{', '.join(_STRATEGIES)}")
    options = Options(
        worlds=worlds,
        sizes=sizes_between(parse_size(args.min_bytes), parse_size(args.max_bytes),
                            args.step_factor),
        strategies=strategies, iters=args.iters, warmup=args.warmup,
        same_machine={"off": (False,), "on": (True,), "both": (False, True)}[
            args.same_machine],
        sealed={"off": (False,), "on": (True,), "both": (False, True)}[args.sealed],
        anchors=args.anchors == "auto",
        chunk_bytes=None if args.chunk_bytes is None else parse_size(args.chunk_bytes),
        tree_max_bytes=(None if args.tree_max_bytes is None
                        else parse_size(args.tree_max_bytes)),
        timeout=args.timeout, markdown=args.markdown, command=_command(args, _DEFAULTS))
    results = run(options)
    wrong = sum(row.wrong for r in results for rows in r.rows.values() for row in rows)
    wrong += sum(r.cold.wrong for r in results)
    if wrong:
        print(f"pmetal bench allreduce: {wrong} wrong element(s); see #wrong in the tables",
              file=sys.stderr)
        return 1
    return 0


def _run_pipeline(args: argparse.Namespace) -> int:
    from pmetal.bench.pipeline import PROMPTS, Options, default_model, run
    from pmetal.bench.pipeline_stages import measure_pipeline

    try:
        threads = tuple(int(t) for t in args.threads.split(",") if t.strip())
    except ValueError:
        raise ConfigError(f"--threads {args.threads!r}: write thread counts such as 1,2") \
            from None
    tokens, repeats, prompts = args.tokens, args.repeats, args.prompts
    prefill = args.prefill_tokens
    if args.quick:
        tokens, repeats = min(tokens, _QUICK["tokens"]), min(repeats, _QUICK["repeats"])
        prompts = min(prompts, _QUICK["prompts"])
        prefill = min(prefill, _QUICK["prefill_tokens"])
    if not 1 <= prompts <= len(PROMPTS):
        raise ConfigError(f"--prompts {prompts}: choose 1 to {len(PROMPTS)}")
    if args.stages < 0:
        raise ConfigError(f"--stages {args.stages}: 0 (skip the pipeline table) or more")
    model = args.model
    if model is None and args.random_weights is None:
        model = default_model()
    options = Options(
        model=model, backend=args.backend, random_shape=args.random_weights,
        prompts=PROMPTS[:prompts], decode_tokens=tokens, repeats=repeats,
        batch=args.batch, threads=threads, prefill_tokens=prefill, hogs=args.hogs,
        anchors=args.anchors == "auto", markdown=args.markdown,
        command=_command(args, _PIPELINE_DEFAULTS, "pipeline"),
        pipeline=measure_pipeline if args.stages else None, extra={"stages": args.stages})
    if not args.stages:
        run(options)
        return 0
    import pmetal  # the pipeline table needs a cluster: a local node, as pmetal generate

    started = not pmetal.is_initialized()
    if started:
        pmetal.init(num_workers=max(args.stages, 2))
    try:
        run(options)
    finally:
        if started:
            pmetal.shutdown()
    return 0
