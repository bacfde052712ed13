"""The protocol every model engine follows, so that a pipeline stage does
not care which one computes.

An engine runs layers ``[start, end)`` of one model. Hidden states go in
and out as float32 numpy ``(T, hidden)`` whatever the engine computes on,
so activation codecs and stage actors are the same for all of them. The
engines: the quantized engine (:class:`pmetal.model.quantized.QuantizedStage`),
the MLX engine (:class:`pmetal.model.mlx.MlxQuantizedStage`) and the float32
reference (:class:`pmetal.pipeline.llama.LlamaStage`).
``tests/model/test_engine_conformance.py`` holds them all to this contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pmetal.model.config import LlamaConfig

__all__ = ["StageEngine"]


@runtime_checkable
class StageEngine(Protocol):
    """What a pipeline stage asks of its engine.

    * ``embed(tokens)``: hidden states of token ids (first stage only; a
      ``PMetalValueError`` elsewhere or for an id outside the vocabulary).
    * ``forward(hidden, cache)``: the next T tokens of one sequence.
    * ``forward_batch(hidden, caches)``: one decode token of each of several
      sequences, each at its own position; a row's result is that of
      ``forward`` of the row alone.
    * ``logits(hidden)``: after the final norm (last stage only).
    * ``new_cache(max_len)``: an empty cache of one sequence.
    * ``rest()``: the stage will wait for input; ``close()``: release what
      the engine started (threads, processes). Both may do nothing.
    """

    config: LlamaConfig
    start: int
    end: int

    def embed(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray: ...
    def forward(self, hidden: np.ndarray, cache: Any) -> np.ndarray: ...
    def forward_batch(self, hidden: np.ndarray, caches: Sequence[Any]) -> np.ndarray: ...
    def logits(self, hidden: np.ndarray) -> np.ndarray: ...
    def new_cache(self, max_len: int | None = None) -> Any: ...
    def rest(self) -> None: ...
    def close(self) -> None: ...
