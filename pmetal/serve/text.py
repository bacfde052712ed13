"""An answer's text as its tokens arrive: decoded, cut at a stop string.

:class:`AnswerText` turns the token ids of one sequence into the text a
client sees, piece by piece, as :class:`~pmetal.pipeline.tokenizer.StreamDecoder`
decodes them (never half a UTF-8 character). The model's own stop tokens
(end of turn) are not shown, as :meth:`Pipeline.generate` does not show
them. Stop strings (OpenAI's ``stop``) end the answer before the first of
them, which is not shown either (the first to be complete, as generation
would have stopped there); a piece that could be the start of a stop
string is held back until the next one tells, so a stop string split over
several tokens is still caught and never streamed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["AnswerText", "StopStrings"]


class StopStrings:
    """Text cut before the first of ``stops`` (see the module docstring)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """The text that can be shown now, and whether a stop string ended it."""
        text = self._held + piece
        # The stop string that completes first ends the answer (generation
        # would have stopped there), whatever the pieces were.
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            self._held = ""
            return text[:min(found)[1]], True
        keep = max((k for s in self.stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """What was held back, at the end of the answer (no stop string came)."""
        rest, self._held = self._held, ""
        return rest


class AnswerText:
    """One answer's tokens in, its text out (see the module docstring)."""

    def __init__(self, tokenizer: Any, stop_token_ids: Collection[int],
                 stops: Sequence[str]) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = StopStrings(stops)
        self.tokens = 0          # the completion's tokens so far, a stop token included
        self.stopped = False     # a stop string ended it

    def push(self, token: int) -> str:
        """The new text after ``token`` (often empty); :attr:`stopped` tells
        whether a stop string ended the answer with it."""
        self.tokens += 1
        if token in self._stop_ids:
            return ""
        text, self.stopped = self._stops.push(self._decoder.push(token))
        return text

    def finish(self) -> str:
        """The text left when the sequence ended (a stop token or its length)."""
        text, self.stopped = self._stops.push(self._decoder.flush())
        return text if self.stopped else text + self._stops.flush()
