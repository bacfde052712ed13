"""Data-parallel training with gradient all-reduce, with or without compression.

Every rank runs this same script (SPMD, as with torchrun or mlx.launch). Each
holds one shard of a synthetic classification problem (labels sampled from a
random "teacher", so the best loss is above zero), computes the gradient of
its model on its shard (softmax regression by default, ``--model mlp`` for a
2-layer tanh network), and the ranks average their gradients before every
step, so that all ranks keep identical weights (full-batch gradient descent
on the whole training set, whatever the number of ranks):

- ``--compression none``: ``ctx.all_reduce_blocking(gradient, ReduceOp.MEAN)``;
- ``--compression topk`` (1%, ``--ratio``), ``onebit``, ``int8``, ``fp16``,
  ``bf16``, ``randomk`` or ``powersgd``: each rank compresses its gradient
  with error feedback and the ranks exchange the compressed form
  (``pmetal.collectives.all_reduce_compressed``).

The gradients travel as one flat buffer (a "bucket", as PyTorch DDP does):
one exchange per step instead of one per layer. PowerSGD, which compresses
matrices, gets them layer by layer (``all_reduce_compressed_many``).

Run it::

    pmetal launch -n 2 examples/train_data_parallel.py --compression topk
    python examples/train_data_parallel.py --world 2        # starts its own ranks
    # or by hand, one command per rank:
    python examples/train_data_parallel.py --rank 0 --world 2 --base-port 29600
    python examples/train_data_parallel.py --rank 1 --world 2 --base-port 29600

Give each rank its share of the cores (``OPENBLAS_NUM_THREADS=1`` for two
ranks on two cores; the script does it for the ranks it starts itself):
BLAS threads of several ranks spinning against each other make training
many times slower. ``--backend mlx`` computes with MLX (when installed);
the gradients, MLX arrays then, go through the same collectives. Rank 0
prints the loss every ``--log-every`` steps, the final loss on the whole
training set and the gradient bytes the ranks sent, and with ``--json``
one machine-readable line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np

import pmetal
from pmetal.collectives import (
    CompressionConfig,
    CompressionStrategy,
    GradientCompressor,
    ReduceOp,
    all_reduce_compressed,
    all_reduce_compressed_many,
    traffic,
)

CLASSES = 10
MODELS = {
    # features, hidden units (0: none), defaults for --samples --lr --weight-decay
    "softmax": {"features": 1024, "hidden": 0, "samples": 2048, "lr": 0.5, "weight_decay": 1e-3},
    "mlp": {"features": 64, "hidden": 128, "samples": 2048, "lr": 0.5, "weight_decay": 1e-3},
}
STRATEGIES = {
    "none": CompressionStrategy.NONE,
    "topk": CompressionStrategy.TOPK,
    "randomk": CompressionStrategy.RANDOM_K,
    "fp16": CompressionStrategy.FP16,
    "bf16": CompressionStrategy.BF16,
    "int8": CompressionStrategy.INT8,
    "onebit": CompressionStrategy.ONE_BIT,
    "powersgd": CompressionStrategy.POWERSGD,
}


# ------------------------------------------------------------------ data


def make_shard(model, seed, rank, world, samples):
    """This rank's share of a training set of ``samples`` rows drawn from a
    random teacher (linear for softmax regression, a small tanh network for
    the MLP), labels sampled from the teacher's softmax (Gumbel trick). The
    set is the same whatever the world size: more ranks, smaller shards."""
    features = MODELS[model]["features"]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features))
    if model == "softmax":
        logits = x @ (rng.standard_normal((features, CLASSES)) * 3 / math.sqrt(features))
    else:
        w1 = rng.standard_normal((features, 32)) * 2 / math.sqrt(features)
        logits = np.tanh(x @ w1) @ (rng.standard_normal((32, CLASSES)) * 4 / math.sqrt(32))
    labels = (logits + rng.gumbel(size=logits.shape)).argmax(axis=1)
    rows = np.array_split(np.arange(samples), world)[rank]
    return x[rows].astype(np.float32), labels[rows]


def init_params(model, seed):
    """The same initial weights on every rank (same seed)."""
    rng = np.random.default_rng(seed + 1)
    features, hidden = MODELS[model]["features"], MODELS[model]["hidden"]
    if not hidden:
        return {"w_out": np.zeros((features, CLASSES), np.float32),
                "b_out": np.zeros(CLASSES, np.float32)}
    return {
        "w_hidden": (rng.standard_normal((features, hidden)) / math.sqrt(features)
                     ).astype(np.float32),
        "b_hidden": np.zeros(hidden, np.float32),
        "w_out": (rng.standard_normal((hidden, CLASSES)) / math.sqrt(hidden)).astype(np.float32),
        "b_out": np.zeros(CLASSES, np.float32),
    }


# ---------------------------------------------------------------- models


class NumpyModel:
    """Softmax cross-entropy over an optional tanh hidden layer, plus an L2
    penalty on the weights, gradients by hand."""

    def __init__(self, params, x, labels, weight_decay):
        self.params, self.x, self.labels = params, x, labels
        self.weight_decay = weight_decay

    def loss_and_gradients(self):
        p, x, labels, decay = self.params, self.x, self.labels, self.weight_decay
        hidden = np.tanh(x @ p["w_hidden"] + p["b_hidden"]) if "w_hidden" in p else x
        logits = hidden @ p["w_out"] + p["b_out"]
        logits -= logits.max(axis=1, keepdims=True)
        prob = np.exp(logits)
        prob /= prob.sum(axis=1, keepdims=True)
        rows = np.arange(len(labels))
        loss = -np.log(prob[rows, labels]).mean()
        loss += decay / 2 * sum(float((v ** 2).sum()) for k, v in p.items() if k[0] == "w")
        prob[rows, labels] -= 1
        prob /= len(labels)
        grads = {"w_out": hidden.T @ prob + decay * p["w_out"], "b_out": prob.sum(axis=0)}
        if "w_hidden" in p:
            d_hidden = (prob @ p["w_out"].T) * (1 - hidden ** 2)
            grads["w_hidden"] = x.T @ d_hidden + decay * p["w_hidden"]
            grads["b_hidden"] = d_hidden.sum(axis=0)
        return float(loss), np.concatenate([grads[k].reshape(-1) for k in p]).astype(np.float32)

    def layers(self, flat):
        """The bucket's per-layer views, named and shaped like the weights."""
        bounds = np.cumsum([0] + [v.size for v in self.params.values()])
        return {name: flat[lo:hi].reshape(value.shape) for (name, value), lo, hi
                in zip(self.params.items(), bounds[:-1], bounds[1:], strict=True)}

    def bucket(self, layers):
        return np.concatenate([layer.reshape(-1) for layer in layers.values()])

    def step(self, flat_gradient, learning_rate):
        offset = 0
        for value in self.params.values():
            value -= learning_rate * flat_gradient[offset:offset + value.size].reshape(value.shape)
            offset += value.size


class MlxModel:
    """The same model computed by MLX (mx.value_and_grad)."""

    def __init__(self, params, x, labels, weight_decay):
        import mlx.core as mx
        self.mx = mx
        self.params = {k: mx.array(v) for k, v in params.items()}
        x, labels = mx.array(x), mx.array(labels)

        def loss_fn(p):
            hidden = mx.tanh(x @ p["w_hidden"] + p["b_hidden"]) if "w_hidden" in p else x
            logits = hidden @ p["w_out"] + p["b_out"]
            picked = mx.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
            penalty = sum(mx.sum(v ** 2) for k, v in p.items() if k[0] == "w")
            return mx.mean(mx.logsumexp(logits, axis=1) - picked) + weight_decay / 2 * penalty

        self.value_and_grad = mx.value_and_grad(loss_fn)

    def loss_and_gradients(self):
        loss, grads = self.value_and_grad(self.params)
        flat = self.mx.concatenate([grads[k].reshape(-1) for k in self.params])
        return loss.item(), flat   # an MLX array: the collectives take it as it is

    layers = NumpyModel.layers

    def bucket(self, layers):
        return self.mx.concatenate([layer.reshape(-1) for layer in layers.values()])

    def step(self, flat_gradient, learning_rate):
        offset = 0
        for name, value in self.params.items():
            part = flat_gradient[offset:offset + value.size].reshape(value.shape)
            self.params[name] = value - learning_rate * part
            offset += value.size
        self.mx.eval(self.params)


# --------------------------------------------------------------- training


def train(args, ctx):
    rank, world = ctx.rank, ctx.world_size
    x, labels = make_shard(args.model, args.seed, rank, world, args.samples)
    model_class = MlxModel if args.backend == "mlx" else NumpyModel
    model = model_class(init_params(args.model, args.seed), x, labels, args.weight_decay)
    strategy = STRATEGIES[args.compression]
    compressor = GradientCompressor(CompressionConfig(strategy=strategy, ratio=args.ratio))

    def global_mean(value):
        return float(ctx.all_reduce_blocking(np.array([value], np.float64), ReduceOp.MEAN)[0])

    gradient_bytes = wire_bytes = 0
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss, gradient = model.loss_and_gradients()
        gradient_bytes += gradient.nbytes
        before = traffic(ctx.group).bytes_sent
        if strategy is CompressionStrategy.NONE:
            gradient = ctx.all_reduce_blocking(gradient, ReduceOp.MEAN)
        elif strategy is CompressionStrategy.POWERSGD:
            # PowerSGD compresses matrices: one tensor per layer, not the bucket.
            layers = all_reduce_compressed_many(ctx.group, model.layers(gradient), compressor,
                                                ReduceOp.MEAN)
            gradient = model.bucket(layers)
        else:
            gradient = all_reduce_compressed(ctx.group, gradient, compressor, ReduceOp.MEAN,
                                             name="gradients")
        wire_bytes += traffic(ctx.group).bytes_sent - before
        model.step(gradient, args.lr)
        if step % args.log_every == 0 or step == 1:
            mean_loss = global_mean(loss)   # the loss before this step's update
            if rank == 0:
                print(f"step {step:4d}/{args.steps}  loss {mean_loss:.4f}", flush=True)
    seconds = time.perf_counter() - started

    final_loss = global_mean(model.loss_and_gradients()[0])
    stats = compressor.statistics()   # what the compressor took in and put out
    if strategy is CompressionStrategy.NONE:
        stats = dataclasses.replace(stats, bytes_in=gradient_bytes, bytes_out=gradient_bytes)
    totals = ctx.all_reduce_blocking(
        np.array([gradient_bytes, stats.bytes_in, stats.bytes_out, wire_bytes], np.int64))
    summary = {"compression": args.compression, "world": world, "steps": args.steps,
               "backend": args.backend, "model": args.model, "final_loss": final_loss,
               "gradient_bytes": int(totals[0]), "compressor_in": int(totals[1]),
               "compressor_out": int(totals[2]), "wire_bytes": int(totals[3]),
               "seconds": round(seconds, 3)}
    if rank == 0:
        print(f"final loss {final_loss:.4f} after {args.steps} steps on {world} ranks "
              f"({args.model}, {args.compression}, {args.backend}, {seconds:.1f} s)")
        print(f"gradient bytes sent: {summary['wire_bytes']:,} on the links for "
              f"{summary['gradient_bytes']:,} bytes of gradients (compressed "
              f"{summary['compressor_in'] / summary['compressor_out']:.1f}x)")
        if args.json:
            print("json " + json.dumps(summary), flush=True)


# ------------------------------------------------------------------ ranks


def free_ports(count, host):
    sockets = [socket.create_server((host, 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def spawn_ranks(args, argv):
    """No rank given and not under ``pmetal launch``: start ``--world``
    copies of this script on this machine, one per rank."""
    nodes = ",".join(f"{args.host}:{p}" for p in free_ports(args.world, args.host))
    # Share the cores between the ranks: OpenBLAS threads of several ranks
    # spinning against each other made this 20x slower on two cores.
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.world)))
    ranks = [subprocess.Popen([sys.executable, __file__, *argv, "--rank", str(r),
                               "--nodes", nodes], env=env) for r in range(args.world)]
    codes = [p.wait() for p in ranks]
    return max(codes, key=abs)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compression", choices=sorted(STRATEGIES), default="none")
    parser.add_argument("--ratio", type=float, default=0.01, help="topk/randomk: kept fraction")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--model", choices=sorted(MODELS), default="softmax",
                        help="softmax regression (10 250 parameters) or a 2-layer MLP (9 610)")
    parser.add_argument("--lr", type=float, help="learning rate (default 0.5)")
    parser.add_argument("--weight-decay", type=float, help="L2 penalty (default 1e-3)")
    parser.add_argument("--samples", type=int, help="training samples, split among the ranks (default: "
                        + ", ".join(f"{m} {d['samples']}" for m, d in MODELS.items()) + ")")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--backend", choices=("numpy", "mlx"), default="numpy")
    parser.add_argument("--json", action="store_true", help="print a json summary line")
    parser.add_argument("--rank", type=int, help="this rank (default: PMETAL_RANK)")
    parser.add_argument("--world", type=int, default=2, help="number of ranks")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, help="rank r listens on base-port + r")
    parser.add_argument("--nodes", help="host:port of every rank, comma-separated")
    args = parser.parse_args(argv)
    for name in ("samples", "lr", "weight_decay"):
        if getattr(args, name) is None:
            setattr(args, name, MODELS[args.model][name])
    return args


def main(argv):
    args = parse_args(argv)
    if args.backend == "mlx":
        try:
            import mlx.core  # noqa: F401
        except ImportError:
            sys.exit("--backend mlx needs MLX: pip install mlx (or mlx[cpu] on Linux)")
    if args.rank is None and "PMETAL_RANK" in os.environ:
        config = pmetal.DistributedConfig.from_env()
    elif args.rank is None:
        return spawn_ranks(args, argv)
    else:
        if args.nodes:
            nodes = args.nodes.split(",")
        elif args.base_port:
            nodes = [f"{args.host}:{args.base_port + r}" for r in range(args.world)]
        else:
            sys.exit("--rank needs --base-port (or --nodes) so the ranks can find each other")
        config = pmetal.DistributedConfig(nodes=nodes, rank=args.rank)
    with pmetal.DistributedContext(pmetal.RingBackend(config)) as ctx:
        train(args, ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
