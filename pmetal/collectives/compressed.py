"""Compressed all-reduce over a formed :class:`~pmetal.collectives.group.Group`.

Each rank compresses its gradients with its own
:class:`~pmetal.collectives.compression.GradientCompressor` (error feedback
included), and the ranks exchange what the compressor produced, never a
sum of encoded bytes:

- **Sparse strategies** (TopK, random-k), and every element-wise strategy
  with two ranks: every rank packs its
  :class:`~pmetal.collectives.compression.Compressed` tensors into one byte
  buffer, the ranks all-gather the buffers, and every rank decompresses
  every rank's tensors and adds them in rank order
  (:func:`~pmetal.collectives.compression.aggregate`). Sparse gradients of
  different ranks do not sum to a sparse one, so there is nothing better
  to do with them: each rank receives the ``world - 1`` others' pairs.
- **Quantizers** (fp16, bf16, int8, 1-bit) with three ranks or more,
  block-wise, as 1-bit Adam and DoubleSqueeze do: every tensor is split
  into ``world`` blocks (:func:`~pmetal.collectives.ops.chunk_bounds`);
  each rank compresses block ``j`` for rank ``j`` (residual under
  ``"name[j/world]"``) and sends it there; rank ``j`` decompresses the
  blocks it received, adds them in rank order, compresses the sum again
  with its own residual (``"name[j/world]:reduced"``), and the ranks
  all-gather the reduced blocks. Each rank sends about
  ``2 (world - 1) / world`` compressed gradients, as a ring all-reduce of
  the dense one sends ``2 (world - 1) / world`` dense ones: the wire saves
  the compressor's full ratio at any world size (an all-gather would save
  ``2 / world`` of it).
- **PowerSGD**: two all-reduces (SUM) of the dense factors P and Q per
  matrix (Vogels et al. 2019); tensors it cannot shrink go through a plain
  all-reduce.
- **NONE**: a plain all-reduce.

Every rank ends with the decompression of the same all-gathered bytes, so
results are bit-identical.

Before the data, the ranks all-gather two int64 per rank: the size of the
buffer they are about to send and a fingerprint of the compression
configuration and of the tensors' names, shapes and dtypes. What a
compressor emits is a function of those alone (TopK always keeps
``ceil(ratio * n)`` pairs, 1-bit one bit per element and one scale per
chunk), so ranks that agree send buffers of one size and one layout, and
each rank reads the others' buffers with its own layout (a reduced
block with the layout of its own compression of that block). Ranks that
disagree (a rank started with another ``--compression``, or another model)
all raise the same :class:`~pmetal.errors.CollectiveError` at once instead
of exchanging mismatched bytes.

What travels, beyond the links' 28-byte message headers: the 16 bytes of
size and fingerprint from each rank to each other rank, and the compressed
arrays (values, indices, scales, PowerSGD factors) exactly as
``Compressed.nbytes`` counts them, each time they cross a link (reduced
blocks padded to the largest block's size, a few bytes). The compressor's
:meth:`~GradientCompressor.statistics` accumulate the bytes before and
after compression (block-wise, both compressions: what a rank keeps for
itself and the reduced block too); :func:`traffic` reads the bytes a
group's links sent and received.

The array data is unauthenticated like every collective's (docs/security.md);
a malformed buffer (indices out of range, a wrong size) is refused by the
decompression checks with :class:`~pmetal.errors.PMetalValueError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pmetal.collectives.compression import (
    Compressed,
    CompressionStrategy,
    GradientCompressor,
    aggregate,
    decompress,
)
from pmetal.collectives.group import Group, _as_array, _op
from pmetal.collectives.ops import ReduceOp, chunk_bounds
from pmetal.errors import CollectiveError, PMetalTypeError, PMetalValueError

__all__ = ["LinkTraffic", "all_reduce_compressed", "all_reduce_compressed_many", "traffic"]

_SLOTS = ("values", "indices", "scales", "factor")


@dataclass(frozen=True)
class LinkTraffic:
    """Bytes a group's links have sent and received since the group formed
    (array payloads; not the 28-byte message headers or TCP's own)."""

    bytes_sent: int
    bytes_received: int


def traffic(group: Group) -> LinkTraffic:
    """What ``group``'s links have moved so far (zeros for links that do not count)."""
    return LinkTraffic(int(getattr(group.links, "bytes_sent", 0)),
                       int(getattr(group.links, "bytes_received", 0)))


def all_reduce_compressed(group: Group, x: Any, compressor: GradientCompressor,
                          op: ReduceOp | str = ReduceOp.SUM, *, name: str,
                          timeout: float | None = None) -> Any:
    """The SUM or MEAN of ``x`` over every rank of ``group``, each rank's
    ``x`` compressed by its ``compressor`` under ``name`` (the key of its
    error-feedback residual: one name per tensor, the same on every rank).

    A numpy ``x`` receives the result in place and is returned; an MLX
    array's result is a new MLX array. Every rank must call with the same
    name, shape, dtype, op and compression configuration."""
    return all_reduce_compressed_many(group, {name: x}, compressor, op, timeout=timeout)[name]


def all_reduce_compressed_many(group: Group, tensors: Mapping[str, Any],
                               compressor: GradientCompressor,
                               op: ReduceOp | str = ReduceOp.SUM, *,
                               timeout: float | None = None) -> dict[str, Any]:
    """:func:`all_reduce_compressed` of several named tensors (a model's
    gradients) in one exchange: every tensor's compressed arrays travel in
    one buffer per message instead of one message per tensor. Returns
    ``{name: result}`` in the order given; numpy arrays are also reduced in
    place."""
    if not isinstance(compressor, GradientCompressor):
        raise PMetalTypeError(f"all_reduce_compressed needs a GradientCompressor, not "
                              f"{type(compressor).__name__}")
    reduce_op = _op(op)
    if reduce_op not in (ReduceOp.SUM, ReduceOp.MEAN):
        raise PMetalValueError(
            f"compressed all-reduce sums gradients: op must be SUM or MEAN, not "
            f"{reduce_op.name}; use group.all_reduce(x, op={reduce_op.name}) uncompressed")
    arrays = {}
    for name, x in tensors.items():
        if not isinstance(name, str):
            raise PMetalTypeError(f"tensor names must be strings, not {name!r}")
        arrays[name] = _as_array(x)
    strategy = compressor.config.strategy
    if strategy is CompressionStrategy.POWERSGD:
        plan = {n: "powersgd" if compressor.powersgd_eligible(a.shape) else "dense"
                for n, (a, _) in arrays.items()}
    elif strategy is CompressionStrategy.NONE:
        plan = dict.fromkeys(arrays, "dense")
    elif strategy.quantization is not None and group.size > 2:
        plan = dict.fromkeys(arrays, "scatter")
    else:
        plan = dict.fromkeys(arrays, "gather")

    # Compress first: a gradient the compressor refuses (NaN, a dtype it
    # does not take) fails on this rank before any byte leaves it.
    sent = {n: compressor.compress(n, a) for n, (a, _) in arrays.items() if plan[n] == "gather"}
    pieces: list[dict[str, Compressed]] = [{} for _ in range(group.size)]
    for name, (array, _) in arrays.items():
        if plan[name] == "scatter":
            flat = array.reshape(-1)
            for j, (lo, hi) in enumerate(chunk_bounds(flat.size, group.size)):
                pieces[j][name] = compressor.compress(f"{name}[{j}/{group.size}]", flat[lo:hi])
    nbytes = sum(c.nbytes for part in (sent, *pieces) for c in part.values())
    _agree(group, nbytes, _fingerprint(compressor, reduce_op, arrays, plan), timeout)

    results: dict[str, np.ndarray] = {}
    if sent:
        gathered = group.all_gather(_pack(list(sent.values())), timeout=timeout)
        parts = [_unpack(gathered[r], sent) for r in range(group.size)]
        for name in sent:
            results[name] = aggregate([p[name] for p in parts],
                                      average=reduce_op is ReduceOp.MEAN)
    if pieces[0]:
        results.update(_scatter_gather(group, compressor, pieces, reduce_op, timeout))
    for name, (array, _) in arrays.items():
        if plan[name] == "powersgd":
            results[name] = _powersgd(group, compressor, name, array, reduce_op, timeout)
        elif plan[name] == "dense":
            # compress() of NONE (or of a tensor PowerSGD cannot shrink)
            # copies the values and counts them in the statistics.
            values = compressor.compress(name, array).values
            group.all_reduce(values, reduce_op, timeout=timeout)
            results[name] = values.reshape(array.shape)
    return {name: _deliver(tensors[name], arrays[name], results[name]) for name in arrays}


def _scatter_gather(group: Group, compressor: GradientCompressor,
                    pieces: list[dict[str, Compressed]], op: ReduceOp,
                    timeout: float | None) -> dict[str, np.ndarray]:
    """Three ranks or more: rank j reduces block j of every tensor, then
    the reduced blocks, compressed again, are all-gathered (see the module
    docstring). ``pieces[j]``: this rank's compressed block j per tensor."""
    world, me = group.size, group.rank
    for j in range(world):
        if j != me:
            group.send(_pack(list(pieces[j].values())), j, timeout=timeout)
    mine = pieces[me]
    contributions = []
    for i in range(world):
        if i == me:
            contributions.append(mine)
            continue
        buffer = np.empty(sum(c.nbytes for c in mine.values()), np.uint8)
        group.recv(buffer, i, timeout=timeout)
        contributions.append(_unpack(buffer, mine))
    # This rank's block, summed in rank order, is compressed once more with
    # its own error feedback (the name's ":reduced" residual).
    reduced = [compressor.compress(f"{block.name}:reduced",
                                   aggregate([c[name] for c in contributions],
                                             average=op is ReduceOp.MEAN))
               for name, block in mine.items()]
    # Blocks differ in size by at most one element, so their compressed
    # forms may differ by a few bytes: pad to the largest. Every rank knows
    # each block's layout from its own compression of that block.
    width = max(sum(c.nbytes for c in piece.values()) for piece in pieces)
    payload = np.zeros(width, np.uint8)
    packed = _pack(reduced)
    payload[:packed.size] = packed
    gathered = group.all_gather(payload, timeout=timeout)
    blocks = [_unpack(gathered[j], pieces[j]) for j in range(world)]
    return {name: np.concatenate([decompress(b[name]).reshape(-1) for b in blocks])
            for name in mine}


def _powersgd(group: Group, compressor: GradientCompressor, name: str, array: np.ndarray,
              op: ReduceOp, timeout: float | None) -> np.ndarray:
    p = compressor.powersgd_p(name, array)
    group.all_reduce(p, ReduceOp.SUM, timeout=timeout)
    q = compressor.powersgd_q(name, p)
    group.all_reduce(q, ReduceOp.SUM, timeout=timeout)
    total = compressor.powersgd_finish(name, q)
    if op is ReduceOp.MEAN:
        total = (total / group.size).astype(total.dtype)
    return total


def _deliver(original: Any, converted: tuple[np.ndarray, Any], result: np.ndarray) -> Any:
    array, back = converted
    result = result.reshape(array.shape).astype(array.dtype, copy=False)
    if array is original and array.flags.writeable:
        array[...] = result
        return array
    return back(result, fresh=True)


# ------------------------------------------------------------ agreement


def _fingerprint(compressor: GradientCompressor, op: ReduceOp,
                 arrays: Mapping[str, tuple[np.ndarray, Any]], plan: Mapping[str, str]) -> int:
    c = compressor.config
    text = repr((c.strategy.value, c.ratio, c.rank, c.error_feedback, c.seed, c.chunk_size,
                 op.value, [(n, a.shape, a.dtype.str, plan[n]) for n, (a, _) in arrays.items()]))
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int(np.frombuffer(digest, np.int64)[0])


def _agree(group: Group, nbytes: int, fingerprint: int, timeout: float | None) -> None:
    """All-gather (size, fingerprint); every rank raises the same error if
    any rank differs, since every rank sees the same table."""
    mine = np.array([nbytes, fingerprint], np.int64)
    table = group.all_gather(mine, timeout=timeout)
    differ = [r for r in range(group.size) if not np.array_equal(table[r], table[0])]
    if differ:
        raise CollectiveError(
            f"compressed all-reduce on group {group.name!r}: rank(s) {differ} compress "
            f"differently from rank 0 (buffer sizes {table[:, 0].tolist()}); every rank "
            "must pass the same tensors (names, shapes, dtypes), the same op and a "
            "compressor with the same CompressionConfig")


# ------------------------------------------------------------ packing


def _pack(parts: list[Compressed]) -> np.ndarray:
    arrays = [np.ascontiguousarray(a).reshape(-1).view(np.uint8)
              for c in parts for a in (getattr(c, slot) for slot in _SLOTS) if a is not None]
    return np.concatenate(arrays) if arrays else np.empty(0, np.uint8)


def _unpack(row: np.ndarray, layout: Mapping[str, Compressed]) -> dict[str, Compressed]:
    """One rank's buffer read with this rank's layout (the same on every
    rank once :func:`_agree` has passed)."""
    buffer = row.tobytes()
    offset = 0
    out = {}
    for name, mine in layout.items():
        fields = {}
        for slot in _SLOTS:
            own = getattr(mine, slot)
            if own is None:
                continue
            fields[slot] = np.frombuffer(buffer, own.dtype, own.size, offset).reshape(own.shape)
            offset += own.nbytes
        out[name] = Compressed(mine.name, mine.strategy, mine.shape, mine.dtype,
                               chunk_size=mine.chunk_size, **fields)
    return out
