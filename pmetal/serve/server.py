"""An OpenAI-compatible HTTP server over a pipeline (``pmetal serve``).

What it owns: an aiohttp application (``/v1/models``, ``/v1/chat/completions``,
``/v1/completions``, and ``/health``, ``/stats`` and ``/pipeline`` of its own) and the
:class:`~pmetal.pipeline.batching.ContinuousBatcher` that feeds every request
into one running pipeline: concurrent requests share the stages' batched
decode steps, each joining and leaving between two steps.

A request goes: API key (when one is set: ``Authorization: Bearer KEY``,
compared in constant time), JSON body (at most ``max_request_bytes``),
parameters (:mod:`pmetal.serve.protocol`), the model's name, the prompt's
tokens (the chat template for chat; in a thread, not on the event loop),
the context check (prompt plus ``max_tokens`` within the pipeline's
``max_len``; without ``max_tokens``, whatever room is left), then
:meth:`ContinuousBatcher.submit`. Tokens come back from the batcher's thread
through the event loop to the request, which answers when its sequence ends
or streams each piece of text as server-sent events ending in
``data: [DONE]``. Every failure is an OpenAI error object with its status:
400 bad request, 401 bad key, 404 unknown model or path, 413 body too large,
503 queue full or pipeline broken, 504 no token within ``token_timeout``
(the sequence is cancelled); once a stream has begun, an error is one last
``data: {"error": ...}`` event before ``[DONE]``.

A request whose client goes away (the connection closes mid-stream or while
it waits) has its sequence cancelled: the stages free its caches with the
lane's next hop. The aiohttp server cancels the handler of a closed
connection (``handler_cancellation``), so this holds for answers that do
not stream too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from pmetal.errors import ConfigError, PipelineError, PMetalError, PMetalValueError
from pmetal.pipeline.batching import ContinuousBatcher, QueueFullError
from pmetal.pipeline.generation import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_STOP,
    GenerationResult,
)
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.serve.protocol import (
    APIError,
    Sampling,
    chunk_object,
    completion_object,
    parse_chat,
    parse_completion,
    usage_object,
)
from pmetal.serve.recent import RecentRequests
from pmetal.serve.text import AnswerText
from pmetal.transport import is_loopback

__all__ = ["OpenAIServer", "ServerThread", "check_binding", "is_loopback", "serve_forever",
           "served_name"]

log = logging.getLogger(__name__)

API_KEY_ENV = "PMETAL_API_KEY"
MAX_REQUEST_BYTES = 4 << 20      # a prompt of a million characters fits
_STATUS_TEXT = {404: ("unknown_url", "invalid_request_error"),
                405: ("method_not_allowed", "invalid_request_error"),
                413: ("request_too_large", "invalid_request_error")}


def check_binding(host: str, api_key: str | None) -> None:
    """Refuse to serve beyond loopback without an API key, and a key no
    client could send."""
    if api_key is not None:
        if not api_key or any(c.isspace() or not c.isprintable() for c in api_key):
            raise ConfigError("the API key must be non-empty printable text without spaces "
                              "(clients send it as 'Authorization: Bearer KEY')")
    elif not is_loopback(host):
        raise ConfigError(
            f"--host {host} makes the server reachable beyond this machine, and it has no API "
            f"key: anyone who reaches it could use the model and the machines. Set a key "
            f"with --api-key KEY or {API_KEY_ENV}=KEY (clients then send 'Authorization: "
            "Bearer KEY'), or keep the default --host 127.0.0.1")


def served_name(model: str | None) -> str:
    """The model's id in the API: a known model's name, else the file's or
    folder's name (``tiny.gguf`` is ``tiny``)."""
    from pmetal.pipeline.models import DEFAULT_MODEL, KNOWN_MODELS

    if model is None:
        return DEFAULT_MODEL
    if model in KNOWN_MODELS:
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


class OpenAIServer:
    """The HTTP server over ``pipe`` (a :class:`~pmetal.pipeline.Pipeline`
    with a tokenizer). :meth:`start` binds and starts the batcher,
    :meth:`close` cancels what runs and stops both; the pipeline stays
    the caller's to close."""

    def __init__(self, pipe: Any, *, model_id: str | None = None, api_key: str | None = None,
                 max_running: int = 64, max_waiting: int = 64, token_timeout: float = 60.0,
                 max_request_bytes: int = MAX_REQUEST_BYTES) -> None:
        if pipe.tokenizer is None:
            raise PMetalValueError("pmetal serve needs a model with a tokenizer (a GGUF file "
                                   "or a Hugging Face folder), not random weights")
        if not (isinstance(token_timeout, (int, float)) and 0 < token_timeout < float("inf")):
            raise PMetalValueError(f"token_timeout {token_timeout!r} must be a positive "
                                   "number of seconds")
        self.pipe = pipe
        self.tokenizer = pipe.tokenizer
        self.model_id = model_id or served_name(pipe.model)
        self.api_key = api_key
        self.token_timeout = float(token_timeout)
        self.max_request_bytes = max_request_bytes
        self.batcher = ContinuousBatcher(pipe.loop, max_running=max_running,
                                         max_waiting=max_waiting)
        self.created = int(time.time())
        self.host = ""
        self.port = 0
        self._expected = None if api_key is None else _digest(f"Bearer {api_key}")
        self._runner: web.AppRunner | None = None
        self.recent = RecentRequests()
        self._asking: asyncio.Future[Any] | None = None     # the stages' statistics

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def application(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware],
                              client_max_size=self.max_request_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/pipeline", self._pipeline)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Check the binding rule, start the batcher, listen on ``host:port``
        (port 0: a free one, see :attr:`port`)."""
        check_binding(host, self.api_key)
        runner = web.AppRunner(self.application(), handler_cancellation=True,
                               access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.host = host
        self.port = port or _bound_port(runner)
        self.batcher.start()
        log.info("serving %s on %s", self.model_id, self.url)

    async def close(self) -> None:
        """Cancel every request's sequence, stop the batcher and the server."""
        await asyncio.get_running_loop().run_in_executor(None, self.batcher.close)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------- middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            if self._expected is not None and request.path != "/health":
                self._authorize(request)
            return await handler(request)
        except APIError as exc:
            return _error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code, kind = _STATUS_TEXT.get(exc.status, (None, "invalid_request_error"))
            message = (f"Unknown request URL: {request.method} {request.path}" if exc.status == 404
                       else f"{request.method} is not allowed on {request.path}"
                       if exc.status == 405 else
                       f"the request body is larger than {self.max_request_bytes} bytes"
                       if exc.status == 413 else exc.reason)
            return _error_response(APIError(exc.status, message, type=kind, code=code))
        except Exception as exc:
            # A bug of this server: the client still gets an OpenAI error object.
            log.exception("%s %s failed", request.method, request.path)
            return _error_response(APIError(500, f"the server failed: {type(exc).__name__}: "
                                            f"{exc}", type="server_error"))

    def _authorize(self, request: web.Request) -> None:
        given = request.headers.get("Authorization")
        if given is None:
            raise APIError(401, "You didn't provide an API key: send it as 'Authorization: "
                           "Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(_digest(given), self._expected or b""):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    # -------------------------------------------------------------- routes

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_object()]})

    async def _model(self, request: web.Request) -> web.Response:
        self._check_model(request.match_info["model"], param="model")
        return web.json_response(self._model_object())

    async def _health(self, request: web.Request) -> web.Response:
        broken = self.batcher.statistics().broken
        if broken is not None:
            return web.json_response({"status": "broken", "error": broken}, status=503)
        return web.json_response({"status": "ok"})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({**dataclasses.asdict(self.batcher.statistics()),
                                  "recent": self.recent.summary()})

    async def _pipeline(self, request: web.Request) -> web.Response:
        # Asks every stage over the wire (10 s at most each), in a thread:
        # requests that come meanwhile share that ask rather than pile up
        # threads (dashboards poll this).
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._in_thread(self.pipe.statistics))
            # Its error is the waiting requests' (500); none waits once they left.
            self._asking.add_done_callback(lambda f: f.cancelled() or f.exception())
        stats = await asyncio.shield(self._asking)
        return web.json_response({"model": self.model_id, **stats})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        chat = parse_chat(await _json(request))
        self._check_model(chat.sampling.model)
        if self.tokenizer.chat_template is None:
            raise APIError(400, f"the model {self.model_id} has no chat template (a base "
                           "model): use /v1/completions", param="messages")
        prompt = await self._in_thread(self._encode_chat, list(chat.messages))
        return await self._answer(request, True, prompt, chat.sampling, "messages")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        completion = parse_completion(await _json(request))
        self._check_model(completion.sampling.model)
        if isinstance(completion.prompt, str):
            prompt = await self._in_thread(self.tokenizer.encode, completion.prompt)
        else:
            prompt = list(completion.prompt)
            vocab = self.pipe.config.vocab_size
            if max(prompt) >= vocab:
                raise APIError(400, f"token id {max(prompt)} is outside the vocabulary "
                               f"(0..{vocab - 1})", param="prompt")
        return await self._answer(request, False, prompt, completion.sampling, "prompt")

    # ------------------------------------------------------------ answering

    async def _answer(self, request: web.Request, chat: bool, prompt: list[int],
                      sampling: Sampling, prompt_param: str) -> web.StreamResponse:
        max_tokens = self._budget(len(prompt), sampling.max_tokens, prompt_param,
                                  "max_tokens")
        config = SamplingConfig(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            seed=sampling.seed, max_tokens=max_tokens,
            stop_token_ids=() if sampling.ignore_eos
            else tuple(sorted(self.tokenizer.stop_token_ids)))
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[int | GenerationResult] = asyncio.Queue()
        arrived_at = time.monotonic()
        first: list[float] = []

        def arrived(_sid: int, token: int) -> None:
            loop.call_soon_threadsafe(events.put_nowait, token)

        def ended(result: GenerationResult) -> None:
            loop.call_soon_threadsafe(events.put_nowait, result)

        try:
            sid = self.batcher.submit(prompt, config, max_len=len(prompt) + max_tokens,
                                      on_token=arrived, on_done=ended,
                                      stream=None if sampling.seed is None else 0)
        except QueueFullError as exc:
            raise APIError(503, f"the server is busy: {exc}", type="server_error",
                           code="server_busy", headers={"Retry-After": "1"}) from exc
        except PipelineError as exc:
            raise APIError(503, str(exc), type="server_error",
                           code="pipeline_unavailable") from exc
        except PMetalValueError as exc:
            raise APIError(400, str(exc), param=prompt_param) from exc
        answer = AnswerText(self.tokenizer, config.stop_token_ids, sampling.stop)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        over = False
        try:
            pieces = self._pieces(events, answer, sid, first)
            if sampling.stream:
                response, over = await self._stream(request, chat, ident, pieces, answer,
                                                    len(prompt), sampling.include_usage)
                return response
            text, finish = [], "length"
            async for piece, reason in pieces:
                text.append(piece)
                finish = reason or finish
            response = web.json_response(completion_object(
                chat=chat, id=ident, created=int(time.time()), model=self.model_id,
                text="".join(text), finish_reason=finish,
                usage=usage_object(len(prompt), answer.tokens)))
            over = True
            return response
        finally:
            if not over:
                self.batcher.cancel(sid)   # the client left, or the answer failed
            self.recent.add(answer.tokens, arrived_at, first[0] if first else None,
                            time.monotonic())

    async def _pieces(self, events: asyncio.Queue[int | GenerationResult], answer: AnswerText,
                      sid: int, first: list[float]) -> AsyncIterator[tuple[str, str | None]]:
        """(text, finish reason or None) as the sequence's tokens come;
        ``first`` gets the time the first one came."""
        while True:
            try:
                event = await asyncio.wait_for(events.get(), self.token_timeout)
            except TimeoutError:
                self.batcher.cancel(sid)
                raise APIError(504, f"the pipeline produced no token within "
                               f"{self.token_timeout:g} s (the server is overloaded or a "
                               "stage stalled); the request was cancelled",
                               type="server_error", code="timeout") from None
            if isinstance(event, GenerationResult):
                if event.finish_reason == FINISH_ERROR:
                    raise APIError(500, f"generation failed: {event.error}",
                                   type="server_error", code="generation_failed")
                if event.finish_reason == FINISH_CANCELLED:
                    raise APIError(503, "the server is shutting down: the request was "
                                   "cancelled", type="server_error", code="shutting_down")
                text = answer.finish()
                stop = answer.stopped or event.finish_reason == FINISH_STOP
                yield text, "stop" if stop else "length"
                return
            if not first:
                first.append(time.monotonic())
            text = answer.push(event)
            if answer.stopped:
                self.batcher.cancel(sid)
                yield text, "stop"
                return
            if text:
                yield text, None

    async def _stream(self, request: web.Request, chat: bool, ident: str,
                      pieces: AsyncIterator[tuple[str, str | None]], answer: AnswerText,
                      prompt_tokens: int, include_usage: bool,
                      ) -> tuple[web.StreamResponse, bool]:
        """The answer as server-sent events; False when the client left
        before its end (the caller cancels the sequence)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
        await response.prepare(request)
        created = int(time.time())

        async def send(obj: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(text: str | None, finish: str | None, **extra: Any) -> dict[str, Any]:
            return chunk_object(chat=chat, id=ident, created=created, model=self.model_id,
                                text=text, finish_reason=finish, with_usage=include_usage,
                                **extra)

        try:
            if chat:
                await send(chunk("", None, first=True))
            async for text, finish in pieces:
                if finish is None:
                    await send(chunk(text, None))
                    continue
                if text:
                    await send(chunk(text, None))
                await send(chunk(None if chat else "", finish))
                if include_usage:
                    await send(chunk(None, None, no_choices=True,
                                     usage=usage_object(prompt_tokens, answer.tokens)))
            await response.write(b"data: [DONE]\n\n")
        except APIError as exc:
            try:
                await send(exc.body())
                await response.write(b"data: [DONE]\n\n")
            except ConnectionResetError:
                return response, False
        except ConnectionResetError:
            log.debug("a client left in the middle of its stream")
            return response, False
        await response.write_eof()
        return response, True

    # -------------------------------------------------------------- helpers

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model_id, "object": "model", "created": self.created,
                "owned_by": "pmetal"}

    def _check_model(self, model: str, param: str = "model") -> None:
        if model != self.model_id:
            raise APIError(404, f"The model `{model}` does not exist: this server runs "
                           f"`{self.model_id}`", param=param, code="model_not_found")

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        try:
            # Special tokens' texts in the messages stay plain text.
            return self.tokenizer.encode_chat(messages)
        except PMetalValueError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        except PMetalError as exc:
            raise APIError(500, str(exc), type="server_error") from exc

    def _budget(self, prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                tokens_param: str) -> int:
        """``max_tokens``, or the room the context leaves; 400 when the
        prompt and ``max_tokens`` do not fit in the context."""
        context = self.pipe.max_len
        where = "messages" if prompt_param == "messages" else "prompt"
        if prompt_tokens >= context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. "
                           f"However, your {where} resulted in {prompt_tokens} tokens, which "
                           f"leaves no room for a completion. Please reduce the length of "
                           f"the {where}.", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            return context - prompt_tokens
        if prompt_tokens + max_tokens > context:
            raise APIError(400, f"This model's maximum context length is {context} tokens. "
                           f"However, you requested {prompt_tokens + max_tokens} tokens "
                           f"({prompt_tokens} in the {where}, {max_tokens} in the "
                           f"completion). Please reduce the length of the {where} or "
                           "completion.", param=tokens_param, code="context_length_exceeded")
        return max_tokens

    @staticmethod
    async def _in_thread(function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, function, *args)


async def _json(request: web.Request) -> Any:
    raw = await request.read()      # 413 past client_max_size
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request ({exc}). "
                       "The body must be a JSON object.", code="invalid_json") from exc


def _digest(text: str) -> bytes:
    # Equal lengths for compare_digest, whatever was sent.
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


def _error_response(exc: APIError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status, headers=exc.headers)


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise PipelineError("the server did not report the port it listens on")


def serve_forever(server: OpenAIServer, host: str, port: int, *,
                  ready: Callable[[OpenAIServer], None] | None = None) -> None:
    """Run ``server`` in this thread until SIGINT or SIGTERM, then stop it
    (every request's sequence cancelled, the batcher stopped)."""
    import signal

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start(host, port)
            try:
                if ready is not None:
                    ready(server)
                await stop.wait()
            finally:
                await server.close()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    asyncio.run(main())


class ServerThread:
    """``server`` run by an event loop of its own in a background thread
    (tests, benchmarks): ``with ServerThread(server) as url: ...``."""

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0,
                 timeout: float = 30.0) -> None:
        self.server = server
        self.host, self.port, self.timeout = host, port, timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pmetal-serve", daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        if not self._ready.wait(self.timeout):
            raise PipelineError(f"the server did not start within {self.timeout:g} s")
        if self._failure is not None:
            raise self._failure
        return self.server.url

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server (its requests cancelled) and wait for the thread."""
        if not self._thread.is_alive():
            return
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(self.timeout)

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                await self.server.start(self.host, self.port)
            except BaseException as exc:  # noqa: BLE001 - raised again in __enter__
                self._failure = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await self.server.close()

        asyncio.run(main())

