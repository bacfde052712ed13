"""The OpenAI API as ``pmetal serve`` speaks it: requests checked into frozen
values, errors shaped as OpenAI's, and the response and chunk objects.

What it owns: the rules a request body must follow (:func:`parse_chat`,
:func:`parse_completion`), each broken rule an :class:`APIError` naming the
parameter at fault (OpenAI's ``{"error": {"message", "type", "param",
"code"}}`` with its HTTP status), and the JSON objects a client gets back
(:func:`completion_object`, :func:`chunk_object`, :func:`usage_object`).
Nothing here touches the network or the model; :mod:`pmetal.serve.server`
does.

The parameters and their bounds follow OpenAI's API reference:
``temperature`` 0-2 (default 1), ``top_p`` 0-1 (default 1; 0 is greedy),
``max_tokens`` (or ``max_completion_tokens``) >= 1, ``stop`` a string or
up to 4, ``seed`` an integer, ``n`` 1 only, ``stream`` and
``stream_options.include_usage``. ``top_k`` (>= 0, 0: off) and
``ignore_eos`` (generate ``max_tokens`` whatever the model says: for
benchmarks) are extensions, as in vLLM and llama.cpp's server. A parameter OpenAI defines whose effect
pmetal does not have is refused when it asks for that effect (a non-zero
``presence_penalty``, ``logprobs``); an unknown parameter is refused, as
OpenAI refuses it ("Unrecognized request argument supplied").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [  # noqa: RUF022 - plain sorted order
    "APIError", "ChatRequest", "CompletionRequest", "MAX_STOP_STRINGS", "Sampling",
    "chunk_object", "completion_object", "error_object", "parse_chat", "parse_completion",
    "usage_object",
]

MAX_STOP_STRINGS = 4
_ROLES = ("system", "developer", "user", "assistant")
# Defined by OpenAI, accepted when they ask for nothing pmetal lacks.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
    "logprobs": (False, None), "top_logprobs": (None, 0), "logit_bias": (None,),
    "user": (), "best_of": (1, None), "echo": (False, None), "suffix": (None, ""),
    "parallel_tool_calls": (), "store": (False, None), "metadata": (), "service_tier": (),
    "response_format": (None, {"type": "text"}),
}


class APIError(Exception):
    """A request the server answers with an OpenAI-style error."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_object(self.message, type=self.type, param=self.param, code=self.code)


def error_object(message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Sampling:
    """The sampling and stopping parameters both endpoints share."""

    model: str
    max_tokens: int | None        # None: up to the model's context
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False


@dataclass(frozen=True)
class ChatRequest:
    """A checked ``/v1/chat/completions`` body."""

    messages: tuple[dict[str, str], ...]
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    """A checked ``/v1/completions`` body: ``prompt`` is text or token ids."""

    prompt: str | tuple[int, ...]
    sampling: Sampling


def parse_chat(body: Any) -> ChatRequest:
    """A chat request from a decoded JSON body, or :class:`APIError` (400)."""
    body = _object(body)
    known = {"messages", "max_completion_tokens"}
    sampling = _sampling(body, known, "max_completion_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _invalid("'messages' must be a non-empty array of {role, content} objects",
                       "messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(f"{where} must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if role not in _ROLES:
            raise _invalid(f"{where}.role {role!r} must be one of {', '.join(_ROLES)}",
                           f"{where}.role")
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise _invalid(f"{where} has fields pmetal does not support: "
                           f"{', '.join(unknown)} (tool calls are not supported)", where)
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content(message.get("content"), f"{where}.content")})
    return ChatRequest(tuple(messages), sampling)


def parse_completion(body: Any) -> CompletionRequest:
    """A completion request from a decoded JSON body, or :class:`APIError` (400)."""
    body = _object(body)
    sampling = _sampling(body, {"prompt"}, None)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]          # a batch of one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise _invalid("'prompt' must not be empty", "prompt")
        return CompletionRequest(prompt, sampling)
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return CompletionRequest(tuple(prompt), sampling)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list))
                                                            for p in prompt):
        raise _invalid("a batch of several prompts is not supported: send one request per "
                       "prompt (they run batched together)", "prompt")
    raise _invalid("'prompt' must be a string or an array of token ids (ints >= 0), not "
                   f"{_kind(prompt)}", "prompt")


def _sampling(body: dict[str, Any], own: set[str], alias: str | None) -> Sampling:
    fields = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
              "stream_options", "n", "ignore_eos", *own, *_NEUTRAL}
    unknown = sorted(set(body) - fields)
    if unknown:
        raise _invalid(f"Unrecognized request argument supplied: {', '.join(unknown)}",
                       unknown[0])
    for name, allowed in _NEUTRAL.items():
        if name in body and allowed and body[name] not in allowed:
            raise _invalid(f"'{name}' {body[name]!r:.60} is not supported by pmetal serve "
                           f"(leave it out)", name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("'model' is required: a string naming the model (GET /v1/models "
                       "lists it)", "model")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise _invalid(f"'n' {n!r:.40} is not supported: pmetal serve makes one choice per "
                       "request (send several requests: they are batched together)", "n",
                       code="unsupported_parameter")
    max_tokens = _optional_int(body, "max_tokens", 1)
    if alias is not None:
        other = _optional_int(body, alias, 1)
        if other is not None:
            if max_tokens is not None and max_tokens != other:
                raise _invalid(f"'max_tokens' {max_tokens} and '{alias}' {other} disagree: "
                               "give one", alias)
            max_tokens = other
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    top_k = _optional_int(body, "top_k", 0) or 0
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and -2**63 <= seed < 2**64):
        raise _invalid(f"'seed' must be an integer, not {_kind(seed)}", "seed")
    if top_p == 0.0:
        temperature = 0.0            # only the most likely token is left: greedy
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid(f"'stream' must be a boolean, not {_kind(stream)}", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _invalid("'stream_options' is only allowed when 'stream' is true",
                           "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _invalid("'stream_options' must be an object with 'include_usage' only",
                           "stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _invalid("'stream_options.include_usage' must be a boolean",
                           "stream_options.include_usage")
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise _invalid(f"'ignore_eos' must be a boolean, not {_kind(ignore_eos)}", "ignore_eos")
    return Sampling(model=model, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p if top_p > 0 else 1.0, top_k=top_k,
                    seed=None if seed is None else seed % 2**64, stop=_stops(body.get("stop")),
                    stream=bool(stream), include_usage=include_usage,
                    ignore_eos=bool(ignore_eos))


def _stops(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _invalid(f"'stop' must be a string or an array of strings, not {_kind(stop)}",
                       "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid(f"'stop' has {len(stop)} strings: at most {MAX_STOP_STRINGS}", "stop")
    if any(not s for s in stop):
        raise _invalid("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(stop))


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise _invalid(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) "
                               "are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise _invalid(f"{where} must be a string or an array of text parts, not "
                   f"{_kind(content)}", where)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise _invalid(f"the request body must be a JSON object, not {_kind(body)}", None)
    return body


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise _invalid(f"'{name}' must be a number, not {_kind(value)}", name)
    if not low <= value <= high:
        raise _invalid(f"'{name}' {value} is out of range: {low:g} to {high:g}", name,
                       code="invalid_value")
    return float(value)


def _optional_int(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _invalid(f"'{name}' must be an integer, not {_kind(value)}", name)
    if value < low:
        raise _invalid(f"'{name}' {value} must be at least {low}", name, code="invalid_value")
    return int(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _invalid(message: str, param: str | None, *, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ------------------------------------------------------------- responses

def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(*, chat: bool, id: str, created: int, model: str, text: str,
                      finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
    """The whole answer of a request that did not stream."""
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": id, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": None,
            "choices": [choice], "usage": usage}


def chunk_object(*, chat: bool, id: str, created: int, model: str, text: str | None,
                 finish_reason: str | None, first: bool = False,
                 usage: dict[str, int] | None = None, with_usage: bool = False,
                 no_choices: bool = False) -> dict[str, Any]:
    """One server-sent event of a streamed answer. ``no_choices``: the last
    chunk of ``include_usage``, with the usage and an empty choice list."""
    choices: list[dict[str, Any]] = []
    if not no_choices:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choices = [{"index": 0, "delta": delta, "logprobs": None,
                        "finish_reason": finish_reason}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None,
                        "finish_reason": finish_reason}]
    chunk: dict[str, Any] = {"id": id,
                             "object": "chat.completion.chunk" if chat else "text_completion",
                             "created": created, "model": model, "system_fingerprint": None,
                             "choices": choices}
    if with_usage:
        chunk["usage"] = usage
    return chunk
