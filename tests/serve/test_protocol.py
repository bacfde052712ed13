"""The OpenAI API's rules (pmetal.serve.protocol) and stop strings
(pmetal.serve.text), without a server."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pmetal.serve.protocol import APIError, parse_chat, parse_completion
from pmetal.serve.text import StopStrings

USER = [{"role": "user", "content": "hi"}]


def test_defaults_are_openai_s() -> None:
    s = parse_chat({"model": "m", "messages": USER}).sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (1.0, 1.0, 0, None, ())
    assert s.max_tokens is None and not s.stream and not s.include_usage


def test_parameters_are_read() -> None:
    chat = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                   "text": "b"}]}],
        "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": -1,
        "stop": "x", "stream": True, "stream_options": {"include_usage": True},
        "user": "me", "presence_penalty": 0, "n": 1})
    assert chat.messages == ({"role": "system", "content": "be brief"},
                             {"role": "user", "content": "ab"})
    s = chat.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.stop) == (7, 0.0, 0.5, 3, ("x",))
    assert s.seed == 2**64 - 1 and s.stream and s.include_usage
    assert parse_chat({"model": "m", "messages": USER, "top_p": 0}).sampling.temperature == 0
    assert parse_completion({"model": "m", "prompt": [1, 2]}).prompt == (1, 2)
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": USER}, "model"),
    ({"model": "m", "messages": USER, "max_tokens": 2, "max_completion_tokens": 3},
     "max_completion_tokens"),
    ({"model": "m", "messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": "m", "messages": USER, "logprobs": True}, "logprobs"),
    ({"model": "m", "messages": USER, "top_k": -1}, "top_k"),
    ({"model": "m", "messages": USER, "stop": [""]}, "stop"),
    ({"model": "m", "messages": USER, "temperature": float("nan")}, "temperature"),
    ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0]"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
])
def test_bad_chat_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.body()["error"]["param"] == param


def test_bad_completion_prompts() -> None:
    for prompt in ("", [], [-1], ["a", "b"], [1.5], None):
        with pytest.raises(APIError) as caught:
            parse_completion({"model": "m", "prompt": prompt})
        assert caught.value.param == "prompt"


def test_a_stop_string_split_over_pieces_is_caught() -> None:
    stops = StopStrings(["END"])
    assert stops.push("hello E") == ("hello ", False)    # "E" may start END: held
    assert stops.push("N") == ("", False)
    assert stops.push("D and more") == ("", True)
    stops = StopStrings(["END"])
    assert stops.push("hello E") == ("hello ", False)
    assert stops.push("x") == ("Ex", False)             # it did not: released
    assert stops.push("E") == ("", False) and stops.flush() == "E"


@given(st.text(alphabet="abc", max_size=30), st.lists(st.text(alphabet="abc", min_size=1,
                                                              max_size=3), max_size=4),
       st.lists(st.integers(1, 5), max_size=30))
def test_stop_strings_cut_before_the_first_occurrence(text: str, stops: list[str],
                                                      cuts: list[int]) -> None:
    # The first stop string to be complete (generation stops there) cuts it.
    found = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    want = text[:min(found)[1]] if found else text
    matcher, out, at, stopped = StopStrings(stops), [], 0, False
    for size in [*cuts, len(text)]:
        piece, at = text[at:at + size], at + size
        shown, stopped = matcher.push(piece)
        out.append(shown)
        if stopped or at >= len(text):
            break
    if not stopped:
        out.append(matcher.flush())
    assert "".join(out) == want and stopped == bool(found)
