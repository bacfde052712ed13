"""The user's handle on pipeline-parallel inference.

::

    pipe = Pipeline.from_pretrained(stages=2)          # the default model
    for result in pipe.generate(["What is the capital of France?"], max_tokens=32):
        print(result.text)
    pipe.close()

:meth:`Pipeline.from_pretrained` connects to the cluster (or, with none,
starts an embedded local node with a worker per stage, as ``pmetal.init``
does), splits the model's layers over the stages by what each node
measured of its compute rate, free memory and links
(:func:`~pmetal.pipeline.placement.plan_stages`),
creates one :class:`~pmetal.pipeline.stage.PipelineStage` actor per stage
on its node (each loads only its own layers, all at once), joins them and
this driver into a ring of PSK-authenticated TCP links, and loads the
tokenizer here. :meth:`Pipeline.generate` runs a
:class:`~pmetal.pipeline.generation.PipelineGenerationLoop` over the ring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np

from pmetal.actors import context
from pmetal.actors.handles import ActorClass, ActorHandle
from pmetal.links import tcplinks
from pmetal.errors import (
    ActorDiedError,
    AuthenticationError,
    CollectiveError,
    PipelineError,
    PlacementError,
    PMetalError,
    PMetalTypeError,
    PMetalValueError,
)
from pmetal.pipeline.activations import ActivationCodec
from pmetal.pipeline.assignment import ModelProfile
from pmetal.pipeline.backends import resolve_backend
from pmetal.pipeline.generation import GenerationResult, PipelineGenerationLoop
from pmetal.pipeline.llama import LlamaConfig
from pmetal.pipeline.placement import (
    StagePlacement,
    StagePlan,
    cluster_nodes,
    place_stages,
    plan_stages,
)
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.stage import PipelineStage, PipelineStageConfig

__all__ = ["Pipeline", "StagePlacement", "place_stages"]

log = logging.getLogger(__name__)

_CALL_MARGIN = 30.0     # seconds on top of a stage's own deadline for the call carrying it


class Pipeline:
    """A model split over stage actors, and the ring that joins them to
    this process (see the module docstring). Use as a context manager or
    call :meth:`close`."""

    def __init__(self, *, config: LlamaConfig, handles: list[ActorHandle],
                 placements: list[StagePlacement], loop: PipelineGenerationLoop,
                 tokenizer: Any, codec: ActivationCodec, max_len: int, model: str) -> None:
        self.config = config
        self.handles = handles
        self.placements = placements
        self.loop = loop
        self.tokenizer = tokenizer
        self.codec = codec
        self.max_len = max_len
        self.model = model
        self._closed = False
        self._running: list[int] = []
        # How place_stages chose, from which figures (None with placement=).
        self.plan: StagePlan | None = None
        self.loaded: list[dict[str, Any]] = []     # what each stage's load() said

    # ---------------------------------------------------------------- making

    @classmethod
    def from_pretrained(cls, model: str | os.PathLike[str] | None = None, *, stages: int = 2,
                        codec: str = "none",
                        max_len: int = 2048, threads: int | None = None,
                        step_timeout: float = 60.0, connect_timeout: float = 60.0,
                        lanes: int | None = None, random_model: LlamaConfig | None = None,
                        seed: int = 0, progress: Any = None,
                        placement: Sequence[str] | None = None,
                        backend: str = "auto", stage_class: Any = None) -> Pipeline:
        """Build a pipeline of ``stages`` stages for ``model`` (a GGUF file, a
        Hugging Face folder, or a known model's name; None: the default
        model, fetched on first use with a progress line on ``progress``).

        The stages go on the cluster this process is connected to (after
        ``pmetal.init``; without it a local node starts, as for any
        ``.remote()``). ``codec`` encodes the activations between stages
        (none, fp16, bf16, int8). ``max_len`` caps a sequence's context
        (prompt and output). ``threads``: BLAS threads per stage (default:
        every core of its machine while it computes alone, one hop in
        flight; the cores shared out among the stages of the machine while
        several hops keep them busy at once). ``placement``: the node id of
        each stage, instead of :func:`place_stages`. ``random_model``: random weights of that
        config instead of a model file (tests and benchmarks; no tokenizer).
        ``backend``: ``auto`` (default), ``quantized``, ``reference`` or ``mlx``
        (:mod:`pmetal.pipeline.backends`); every backend's pipeline is
        bit-identical to a single process of the same backend.
        ``stage_class``: your own stage actor, a subclass of
        :class:`~pmetal.pipeline.stage.PipelineStage` (plain or decorated with
        ``@pmetal.remote``, whose options it keeps; ``node`` is set per stage).
        """
        stage_actor = _stage_actor(stage_class)
        codec_ = ActivationCodec.parse(codec)
        if type(stages) is not int or stages < 1:
            raise PMetalValueError(f"stages {stages!r} must be an int >= 1")
        path, tokenizer, ref = "", None, None
        if random_model is None:
            from pmetal.pipeline import loader, models  # gguf/tokenizers only when used
            from pmetal.pipeline.tokenizer import Tokenizer
            from pmetal.pipeline.weights import driver_model, is_partial

            # This machine's store, else the cluster's members, else the index.
            path = str(driver_model(model, progress))
            config = loader.load_config(path)
            if loader.is_gguf(Path(path)):
                # Stages on other machines (or of a model this machine holds in
                # part) are told the model's sha256 and take it from their own
                # store or the members' (_stage_model).
                ref = lambda remote: models.ModelStore().reference(
                    path, progress=progress) if remote or is_partial(path) else None
            tokenizer = Tokenizer.from_model(path)
        else:
            config = random_model
        if type(max_len) is not int or max_len < 2:
            raise PMetalValueError(f"max_len {max_len!r} must be an int >= 2")
        for name, value in (("step_timeout", step_timeout),
                            ("connect_timeout", connect_timeout)):
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise PMetalValueError(f"{name} {value!r} must be a positive number of "
                                       "seconds")
        if lanes is not None and (type(lanes) is not int or lanes < 1):
            raise PMetalValueError(f"lanes {lanes!r} must be an int >= 1 (None: one per "
                                   "stage)")
        max_len = min(max_len, config.max_position_embeddings)
        profile = None
        if path and resolve_backend(backend, gguf=loader.is_gguf(Path(path))) == "quantized":
            profile = loader.quantized_profile(path, max_len=max_len)
        pipe = cls._build(config, path, tokenizer, stages, codec_, max_len, threads,
                          step_timeout, connect_timeout, lanes, random_model, seed, placement,
                          backend, stage_actor, profile, ref)
        for p, info in zip(pipe.placements, pipe.loaded, strict=True):
            if info.get("pulled") and progress is not None:
                progress.write(f"pmetal: stage {p.index} pulled {info['pulled'] / 1e6:.1f} MB "
                               f"of its layers in {info['pull_seconds']:.1f} s from "
                               f"{', '.join(info['pulled_from'])}\n")
        return pipe

    @classmethod
    def _build(cls, config: LlamaConfig, path: str, tokenizer: Any, stages: int,
               codec: ActivationCodec, max_len: int, threads: int | None,
               step_timeout: float, connect_timeout: float, lanes: int | None,
               random_model: LlamaConfig | None, seed: int,
               placement: Sequence[str] | None, backend: str,
               stage_actor: ActorClass, profile: ModelProfile | None,
               ref: Any = None) -> Pipeline:
        client = context.current()      # connects, or starts a local node as .remote() does
        nodes = _nodes(client, measure=placement is None)
        plan = None
        if placement is not None:
            if isinstance(placement, str):      # len() would count its characters
                raise PlacementError(f"placement is a list of node ids, one per stage, not "
                                     f"the string {placement!r}")
            known = {n["NodeID"] for n in nodes if n.get("Alive", True)}
            if len(placement) != stages or not set(placement) <= known:
                raise PlacementError(f"placement must name {stages} live node ids (from "
                                     f"pmetal.nodes()), got {list(placement)}")
            even = place_stages(config, stages, [{"NodeID": "x", "Alive": True}])
            placements = [StagePlacement(p.index, node, p.start, p.end)
                          for p, node in zip(even, placement, strict=True)]
        else:
            plan = plan_stages(config, stages, nodes, profile=profile)
            placements = list(plan.placements)
            log.info("pipeline placement, %s", plan.describe())
        cores = os.cpu_count() or 1
        # A GGUF file goes into this machine's store once a stage runs elsewhere.
        ref = ref(any(p.node_id != client.node_id for p in placements)) if ref else None
        handles: list[ActorHandle] = []
        try:
            for p in placements:
                sharing = sum(1 for q in placements if q.node_id == p.node_id)
                stage_config = PipelineStageConfig(
                    start=p.start, end=p.end, index=p.index, num_stages=stages,
                    **_stage_model(ref, path, client, nodes),
                    random_model=None if random_model is None else dict(random_model.__dict__),
                    seed=seed, codec=codec.value, backend=backend,
                    threads=threads if threads is not None else max(1, cores // sharing),
                    threads_alone=threads or 0, name=_metric_name(path))
                handles.append(stage_actor.options(node=p.node_id).remote(
                    stage_config, step_timeout))
            # Every stage loads its layers at once.
            infos = _get(client, [h.load.remote() for h in handles],
                         connect_timeout + _CALL_MARGIN + 600, placements, "loading")
            log.info("pipeline stages loaded: %s", infos)
            addresses = _get(client, [h.open.remote() for h in handles],
                             connect_timeout + _CALL_MARGIN, placements, "opening")
            host = _driver_host(client, addresses)
            listener = tcplinks.listen(host, 0)
            ring = [(host, listener.getsockname()[1]), *[tuple(a) for a in addresses]]
            tag = tcplinks.group_tag(f"pipeline/{secrets.token_hex(8)}", 0, 1)
            joined = [h.connect.remote(ring, rank, tag, connect_timeout)
                      for rank, h in enumerate(handles, 1)]
            try:
                links = tcplinks.connect_mesh(
                    0, ring, listener, key=tcplinks.collective_key(client.namespace.psk),
                    tag=tag, epoch=1, deadline=time.monotonic() + connect_timeout)
            except (CollectiveError, AuthenticationError) as exc:
                # The mesh speaks of ranks; the user knows stages.
                ranks = "; ".join(f"rank {p.index + 1} is stage {p.index} (layers {p.start}-"
                                  f"{p.end - 1} on node {p.node_id[:8]})" for p in placements)
                raise PipelineError(
                    f"the pipeline's ring did not form within {connect_timeout:g} s: {exc} "
                    f"(rank 0 is this driver; {ranks}); a stage stalled or cannot reach this "
                    "driver: build the pipeline again, or raise connect_timeout") from exc
            finally:
                listener.close()
            _get(client, joined, connect_timeout + _CALL_MARGIN, placements, "joining the ring")
        except BaseException:
            _kill(client, handles)
            raise
        loop = PipelineGenerationLoop(links, stages, lanes=lanes, step_timeout=step_timeout)
        loop.name = _metric_name(path)
        pipe = cls(config=config, handles=handles, placements=placements, loop=loop,
                   tokenizer=tokenizer, codec=codec, max_len=max_len,
                   model=path or "random")
        pipe.plan = plan
        pipe.loaded = infos
        # A broken ring's error names the dead stage: the pipeline asks them.
        loop.describe_failure = pipe._describe
        hosts = {n["NodeID"]: n.get("Address", "") for n in nodes}
        if any(p.node_id != client.node_id for p in placements):
            # A stage on another machine whose host is lost silently breaks
            # no link: the cluster's verdict (a long poll on our node) does.
            watch = client.watch
            loop.health = lambda: _dead_stage(watch.dead, placements, hosts)
        return pipe

    # ------------------------------------------------------------ generating

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
                 max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = 0, stop_token_ids: Sequence[int] = (),
                 chat: bool | None = None, stream: Callable[[int, str], None] | None = None,
                 on_token: Callable[[int, int], None] | None = None,
                 logits: bool = False, ignore_eos: bool = False) -> list[GenerationResult]:
        """Generate for each prompt; returns a result per prompt (with its
        ``text`` when the model has a tokenizer). Prompts are strings (the
        chat template applied when the model has one, unless
        ``chat=False``) or lists of token ids; one string or one list of
        ids is one prompt. ``stream(i, text)`` gets the
        text of prompt ``i`` as it comes; ``on_token(i, token)`` the ids.
        All prompts are in flight at once (see the multiplexer).
        ``ignore_eos``: do not stop at the tokenizer's end tokens (only at
        ``stop_token_ids`` and ``max_tokens``; for benchmarks)."""
        if self._closed:
            raise PipelineError("this pipeline is closed")
        if stream is not None and self.tokenizer is None:
            # Else stream would never be called, without a word.
            raise PMetalValueError("stream= gets text, and this pipeline has no tokenizer "
                                   "(random weights): use on_token= for the token ids")
        items = list(prompts) if not isinstance(prompts, str) else [prompts]
        if items and all(isinstance(t, (int, np.integer)) for t in items):
            items = [items]         # one prompt given as its token ids
        token_prompts = [self._encode(p, chat) for p in items]
        stops = tuple(stop_token_ids)
        if self.tokenizer is not None and not ignore_eos:
            stops += tuple(t for t in self.tokenizer.stop_token_ids if t not in stops)
        config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                max_tokens=max_tokens, stop_token_ids=stops)
        index: dict[int, int] = {}
        decoders: dict[int, Any] = {}
        mine: list[int] = []

        def started(ids: list[int]) -> None:
            mine.extend(ids)
            self._running = mine
            for i, sid in enumerate(ids):
                index[sid] = i
                if stream is not None and self.tokenizer is not None:
                    decoders[sid] = self.tokenizer.stream_decoder()

        def token_arrived(sid: int, token: int) -> None:
            if on_token is not None:
                on_token(index[sid], token)
            if sid in decoders:
                piece = decoders[sid].push(token)
                if piece:
                    stream(index[sid], piece)  # type: ignore[misc]

        try:
            results = self.loop.run(token_prompts, config, max_len=self.max_len,
                                    on_token=token_arrived, want_logits=logits,
                                    started=started)
        finally:
            if self._running is mine:   # another thread's generate may run by now
                self._running = []
        for sid, decoder in decoders.items():
            rest = decoder.flush()
            if rest:
                stream(index[sid], rest)  # type: ignore[misc]
        if self.tokenizer is not None:
            for result in results:
                shown = [t for t in result.tokens if t not in stops]
                result.text = self.tokenizer.decode(shown)
        return results

    def cancel(self, index: int) -> bool:
        """Cancel prompt ``index`` of the :meth:`generate` running now (from
        another thread, or from its ``stream``/``on_token`` callback); the
        other prompts go on. False when it is not running."""
        running = self._running
        if not 0 <= index < len(running):
            return False
        return self.loop.cancel(running[index])

    def _encode(self, prompt: Any, chat: bool | None) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise PMetalValueError("this pipeline has no tokenizer (random weights): "
                                       "give prompts as lists of token ids")
            return list(self.tokenizer.encode_prompt(prompt, chat=chat))
        if not (isinstance(prompt, (list, tuple, np.ndarray))
                and all(isinstance(t, (int, np.integer)) for t in prompt)):
            # int() would make 1.5 the token 1 and "7" the token 7 without a word.
            raise PMetalValueError(f"a prompt must be a string or a list of token ids (ints), "
                                   f"not {prompt!r:.80}")
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise PMetalValueError(f"token ids {bad[:5]} are outside the vocabulary "
                                   f"(0..{self.config.vocab_size - 1})")
        return tokens

    # ------------------------------------------------------------- reporting

    def statistics(self) -> dict[str, Any]:
        """The driver's hop counts and bytes, and each stage's counters."""
        client = context.current()
        stages = []
        for placement, handle in zip(self.placements, self.handles, strict=True):
            try:
                stats = client.get_one(handle.statistics.remote(), 10.0)
            except PMetalError as exc:
                stats = {"failure": str(exc)}
            stages.append({"index": placement.index, "node": placement.node_id,
                           "layers": (placement.start, placement.end), **stats})
        return {"driver": self.loop.statistics(), "stages": stages}

    def _describe(self, why: str) -> str:
        """``why`` plus which stages are dead or stopped, and why, found
        by asking each."""
        client = context.current()
        refs = [h.statistics.remote() for h in self.handles]
        dead = []
        for placement, ref in zip(self.placements, refs, strict=True):
            try:
                failure = client.get_one(ref, 2.0).get("failure")
                if failure:
                    dead.append(f"stage {placement.index} (layers {placement.start}-"
                                f"{placement.end - 1} on node {placement.node_id[:8]}) "
                                f"stopped: {failure}")
            except ActorDiedError:
                dead.append(f"stage {placement.index} (layers {placement.start}-"
                            f"{placement.end - 1} on node {placement.node_id[:8]}) died")
            except PMetalError:
                dead.append(f"stage {placement.index} (layers {placement.start}-"
                            f"{placement.end - 1} on node {placement.node_id[:8]}) does "
                            "not answer")
        return f"{'; '.join(dead)} ({why})" if dead else why

    # --------------------------------------------------------------- closing

    def close(self) -> None:
        """Close the ring and end the stage actors."""
        if self._closed:
            return
        self._closed = True
        self.loop.close()
        client = context.current_or_none()
        if client is not None:
            _kill(client, self.handles)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stage_actor(stage_class: Any) -> ActorClass:
    """The actor class of the stages: PipelineStage, or the user's subclass."""
    if stage_class is None:
        return ActorClass(PipelineStage, {})
    if isinstance(stage_class, ActorClass):
        cls, options = stage_class._cls, dict(stage_class._options)
    else:
        cls, options = stage_class, {}
    if not (isinstance(cls, type) and issubclass(cls, PipelineStage)):
        raise PMetalTypeError(
            f"stage_class must be a subclass of pmetal.pipeline.PipelineStage (plain or "
            f"under @pmetal.remote), not {cls!r}: the driver calls its load, open, "
            "connect, statistics and close")
    return ActorClass(cls, options)


def _metric_name(path: str) -> str:
    """The pipeline's name in its nodes' metrics: its model's file or
    folder name ("random" for random weights), at most 64 characters."""
    return (Path(path).name if path else "random")[:64] or "pipeline"


def _stage_model(ref: Any, path: str, client: Any,
                 nodes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How stages are told the model: a model of the store by its sha256,
    with the members to pull missing pieces from (this driver's node first:
    it holds the model); else the path (a Hugging Face folder, or stages
    all on this driver's node)."""
    if ref is None:
        return {"model": path}
    # Our node as the members reach it (not the loopback address we may use).
    own = [n["Address"] for n in nodes if n["NodeID"] == client.node_id and n.get("Address")]
    others = [n["Address"] for n in nodes if n.get("Address") and n.get("Alive", True)]
    return {"model": ref.key, "manifest": ref.digest,
            "sources": tuple(dict.fromkeys([*(own or [client.node_address]), *others]))}


def _nodes(client: Any, measure: bool = False) -> list[dict[str, Any]]:
    """The cluster's members (as :func:`pmetal.nodes` lists them, the
    fields placement needs; with ``measure``, each one's capacity now)."""
    return cluster_nodes(client.status(measure=measure))


def _dead_stage(dead: frozenset[str], placements: Sequence[StagePlacement],
                hosts: dict[str, str]) -> str | None:
    """Why the ring cannot go on when the cluster holds a stage's node dead,
    naming the stage and its host; else None."""
    lost = [p for p in placements if p.node_id in dead]
    if not lost:
        return None
    return "; ".join(
        f"stage {p.index} (layers {p.start}-{p.end - 1}) is on node {p.node_id[:8]}"
        f"{' at ' + hosts[p.node_id] if hosts.get(p.node_id) else ''}, which the cluster "
        "declared dead" for p in lost) + " (its host stopped answering: it was switched off, " \
        "slept or left the network); build the pipeline again on the live nodes"


def _get(client: Any, refs: Sequence[Any], timeout: float,
         placements: Sequence[StagePlacement], doing: str) -> list[Any]:
    """Every stage's answer; a stage that died meanwhile is named."""
    deadline = time.monotonic() + timeout
    out = []
    for ref, p in zip(refs, placements, strict=True):
        try:
            out.append(client.get_one(ref, max(0.0, deadline - time.monotonic())))
        except ActorDiedError as exc:
            raise PipelineError(f"stage {p.index} (layers {p.start}-{p.end - 1} on node "
                                f"{p.node_id[:8]}) died while {doing} ({exc}); the other "
                                "stages are ended: build the pipeline again") from exc
    return out


def _kill(client: Any, handles: Sequence[ActorHandle]) -> None:
    for handle in handles:
        with contextlib.suppress(PMetalError):
            client.kill(handle._actor_id, True, handle._node_id)


def _driver_host(client: Any, addresses: Sequence[Any]) -> str:
    """The host the stages reach this driver on; refused when that is
    loopback but some stage is not (it could not dial back)."""
    host = tcplinks.reachable_host(client)
    remote = sorted({a[0] for a in addresses if not a[0].startswith("127.")})
    if host.startswith("127.") and remote:
        raise PipelineError(
            f"this driver listens on {host}, which stages on {remote} cannot reach: "
            "connect with pmetal.init(address=...) to a node whose address they can reach")
    return host
