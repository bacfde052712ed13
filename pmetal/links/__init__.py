"""Links between ranks: the messages collectives and pipeline hops travel on.

:class:`~pmetal.links.memory.RankLinks` is the protocol (buffered ``send``,
``recv`` first in first out per peer and operation, ``dead`` peers known);
its implementations are the in-memory links (:mod:`pmetal.links.memory`,
the test double), a full TCP mesh formed by a PSK handshake
(:mod:`pmetal.links.tcplinks`, :mod:`pmetal.links.tcphandshake`; sealed
with AES-256-GCM by :mod:`pmetal.links.seal` unless both ends allow clear
text) and
shared-memory rings between processes of one machine
(:mod:`pmetal.links.shmlinks`, :mod:`pmetal.links.shmrendezvous`). The
collectives (:mod:`pmetal.collectives`) and the pipeline
(:mod:`pmetal.pipeline`) both build on it; it imports neither.
"""

from pmetal.links.memory import MemoryLinks, MemoryNetwork, RankLinks

__all__ = ["MemoryLinks", "MemoryNetwork", "RankLinks"]
