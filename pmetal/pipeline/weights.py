"""Where a stage's weights come from: its own node's model store.

A driver names a GGUF model to its stages by the sha256 of the file and
the digest of its manifest (``PipelineStageConfig.model = "sha256:<hex>"``,
``manifest``), never by a path: home clusters share no filesystem. A stage
opens its node's store (``$PMETAL_HOME/models/<sha256>/``, see
:mod:`pmetal.store.folder`); when the pieces it reads are missing it pulls
exactly those (the GGUF header first, which says what the layers are, then
its layers' tensors and the embedding, norm and head it needs, as
:func:`~pmetal.pipeline.loader.stage_tensors` lists them) from the members
in ``sources`` (the driver's node first), checked piece by piece
(:mod:`pmetal.store.pull`). The loaders then open the store's sparse file as
any GGUF file and read only the stage's tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pmetal.config import pmetal_home
from pmetal.store import ModelError, PieceStore
from pmetal.store.pull import Puller, PullProgress

if TYPE_CHECKING:
    from pmetal.pipeline.stage import PipelineStageConfig

__all__ = ["StageWeights", "is_store_model", "stage_weights"]

log = logging.getLogger(__name__)

_PREFIX = "sha256:"


def is_store_model(model: str) -> bool:
    return model.startswith(_PREFIX)


@dataclass(frozen=True)
class StageWeights:
    """The stage's model file in its node's store, and what was pulled."""

    path: Path
    pulled: int = 0
    seconds: float = 0.0
    sources: tuple[tuple[str, int], ...] = ()


def stage_weights(config: PipelineStageConfig, client: Any,
                  root: Path | None = None) -> StageWeights:
    """The path of ``config.model`` in this node's store, holding every
    piece the stage reads (pulled from ``config.sources`` when missing).
    Raises :class:`~pmetal.store.ModelError` naming the model, the stage and
    what to do when they cannot be had."""
    from pmetal.pipeline import loader

    sha = config.model[len(_PREFIX):]
    store = PieceStore(root if root is not None else pmetal_home() / "models")
    own = getattr(client, "node_address", "")
    sources = [s for s in config.sources if s != own]
    where = f"stage {config.index} (layers {config.start}-{config.end - 1})"
    shown = [-1]

    def progress(p: PullProgress) -> None:
        tenth = 10 * p.done // max(1, p.total)
        if p.note:
            log.warning("%s: %s", where, p.note)
        elif tenth != shown[0]:
            shown[0] = tenth
            log.info("%s: pulled %.1f of %.1f MB of model %s from %s", where, p.done / 1e6,
                     p.total / 1e6, sha[:12], p.source)

    with Puller(store, sources, namespace=client.namespace, config=client.config,
                progress=progress) as puller:
        try:
            header = puller.pull(sha, [], digest=config.manifest or None)
            folder = header.folder
            model = loader.load_config(folder.path)
            names = loader.stage_tensors(folder.manifest.by_name, model, config.start,
                                         config.end)
            body = puller.pull(sha, names, digest=config.manifest or None)
        except ModelError as exc:
            raise type(exc)(f"{where} on this node (store {store.root}): {exc}") from exc
    moved = {**header.sources}
    for address, count in body.sources.items():
        moved[address] = moved.get(address, 0) + count
    if moved:
        log.info("%s: pulled %d bytes of model %s (%s) in %.2f s", where,
                 header.pulled + body.pulled, sha[:12], folder.manifest.filename,
                 header.seconds + body.seconds)
    return StageWeights(folder.path, header.pulled + body.pulled, header.seconds + body.seconds,
                        tuple(sorted(moved.items())))
