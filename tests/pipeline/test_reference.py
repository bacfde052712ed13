"""The numpy decoder and the GGUF loader against a reference implementation:
Hugging Face transformers with torch (CPU) loading the same GGUF file (it
dequantizes it and undoes llama.cpp's q/k permutation with its own code).

Runs only where torch and transformers are installed (they are not pmetal
dependencies); docs/pipeline.md, "Reference check", gives the command and
the figures measured.

Tolerance: both sides compute in float32 from the same dequantized weights,
so the logits differ only by summation order and the library kernels
(OpenBLAS against MKL/oneDNN, softmax and RMSNorm written differently): a
few ulps per operation, accumulated over 30 layers, on logits of magnitude
~10-30. 2e-3 absolute is about 100 float32 ulps at that magnitude and two
orders of magnitude below the gap that would change a greedy token; a wrong
permutation, rotary convention or norm gives differences of order 1-10.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pmetal.pipeline.llama import LlamaStage
from pmetal.pipeline.loader import load_weights
from pmetal.pipeline.tokenizer import Tokenizer

torch = pytest.importorskip(
    "torch", reason="the reference check needs torch and transformers: "
                    "pip install torch transformers (CPU wheels are enough)")
transformers = pytest.importorskip(
    "transformers", reason="the reference check needs torch and transformers: "
                           "pip install torch transformers (CPU wheels are enough)")

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Explain in one sentence why the sky is blue."}]
TEXTS = ["What is the capital of France?", "digits 12345 and 3.14159", "héllo wörld 日本語 🤖",
         "  two  spaces\n\n\tand tabs", "def f(x):\n    return x ** 2"]
TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def reference(default_model: Path) -> tuple[object, object]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model.parent), gguf_file=default_model.name, dtype=torch.float32)
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(default_model.parent), gguf_file=default_model.name)
    return model, tokenizer


def test_tokenizer_matches_transformers(default_model: Path,
                                        reference: tuple[object, object]) -> None:
    _, ref = reference
    tok = Tokenizer.from_gguf(default_model)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == \
            ref.encode(text, add_special_tokens=False), text  # type: ignore[attr-defined]
    ours = tok.apply_chat_template(MESSAGES)
    theirs = ref.apply_chat_template(MESSAGES, tokenize=False,  # type: ignore[attr-defined]
                                     add_generation_prompt=True)
    assert ours == theirs


def test_logits_match_transformers(default_model: Path,
                                   reference: tuple[object, object]) -> None:
    model, _ = reference
    tok = Tokenizer.from_gguf(default_model)
    ids = tok.encode(tok.apply_chat_template(MESSAGES), add_special_tokens=False)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].float().numpy()  # type: ignore[operator]
    stage = LlamaStage(load_weights(default_model))
    ours = stage.logits(stage.forward(stage.embed(ids), stage.new_cache(len(ids))))
    diff = np.abs(ours - theirs)
    print(f"\nreference check: {len(ids)} positions x {ours.shape[1]} logits, "
          f"max abs diff {diff.max():.2e}, mean {diff.mean():.2e}, "
          f"logit range {theirs.min():.1f}..{theirs.max():.1f}, "
          f"argmax equal at {(ours.argmax(-1) == theirs.argmax(-1)).sum()}/{len(ids)}")
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    assert diff.max() < TOLERANCE


def test_greedy_answer_matches_transformers_generate(default_model: Path,
                                                     reference: tuple[object, object]) -> None:
    from tests.pipeline.test_default_model import ANSWER_IDS, QUESTION

    model, _ = reference
    tok = Tokenizer.from_gguf(default_model)
    prompt = tok.encode_prompt(QUESTION)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(ANSWER_IDS) + 1,  # type: ignore[attr-defined]
                             do_sample=False, eos_token_id=sorted(tok.stop_token_ids))
    generated = out[0, len(prompt):].tolist()
    assert generated[:len(ANSWER_IDS)] == ANSWER_IDS
