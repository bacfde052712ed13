"""Every architecture pmetal computes (llama, mistral, qwen2, qwen3) on every
backend, from both file formats, against a float64 reference written here
from Hugging Face's formulas; and everything else refused by name before a
weight is read.

The reference recomputes the whole sequence from the raw weights the
tiny-model writers return (Hugging Face's layout: q and k rows unpermuted)
with the Hugging Face semantics of each family: rotate-half rotary
embeddings, Qwen2's biases added after the q, k and v products, Qwen3's
RMSNorm of each q and k head before the rotary embedding. The GGUF files
are written as llama.cpp's converter writes them (Mistral as ``llama``, q
and k permuted in llama files only), so a loader that unpermutes a Qwen
file, or forgets a bias or a norm, is off by tens of percent here.

Tolerances: the reference decoder computes in float32, 1e-4 of the logits'
scale from float64 (tests/pipeline/test_llama.py); the quantized engine
rounds activations to 8 bits, within the bound tests/model/test_quantized.py
gives the engine against the reference on the same Q8_0 file (6% of the
scale; a dropped Qwen2 bias is off by ~30% here, a dropped Qwen3 k norm by
~50%); the MLX engine is float32 in another order, on float weights and
on a file's Q8_0 blocks (which it keeps exact), 2e-4
(tests/model/test_mlx_engine.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pmetal.errors import ConfigError
from pmetal.model.config import ARCHITECTURES, LlamaConfig
from pmetal.model.quantized import QuantizedStage
from pmetal.pipeline import loader
from pmetal.pipeline.generation import generate_single_process
from pmetal.pipeline.gguf_file import GGUFFile
from pmetal.pipeline.llama import LlamaStage, LlamaWeights
from pmetal.pipeline.llama_mlx import MlxLlamaStage, mlx_available
from pmetal.pipeline.loader import load_config, load_quantized, load_weights
from pmetal.pipeline.models import ModelFormatError
from pmetal.pipeline.sampling import SamplingConfig
from pmetal.pipeline.tokenizer import Tokenizer
from tests.model.test_quantized import AGREEMENT
from tests.pipeline.tinymodel import tiny_config, write_tiny_gguf, write_tiny_hf

ARCHS = tuple(ARCHITECTURES)
PROMPT = [5, 17, 42, 9, 100, 3, 77, 12]
FLOAT32 = 1e-4
QUANTIZED = AGREEMENT
MLX = 2e-4


def arch_config(architecture: str) -> LlamaConfig:
    """The tiny model in ``architecture``: the small Qwen models tie their
    embeddings, Qwen3 gives head_dim explicitly (q wider than hidden)."""
    qwen = architecture.startswith("qwen")
    return LlamaConfig(**{**tiny_config(tied=qwen).__dict__, "architecture": architecture,
                          "head_dim": 24 if architecture == "qwen3" else 0})


def test_every_architecture_is_tested() -> None:
    assert set(ARCHS) == {"llama", "mistral", "qwen2", "qwen3"}
    switches = {a: (arch_config(a).attention_bias, arch_config(a).qk_norm) for a in ARCHS}
    assert switches == {"llama": (False, False), "mistral": (False, False),
                        "qwen2": (True, False), "qwen3": (False, True)}


# ------------------------------------------------------- float64 reference

def hf_logits(w: LlamaWeights, tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) of the whole sequence in float64, from scratch, as
    Hugging Face's Llama, Mistral, Qwen2 and Qwen3 compute them."""
    c = w.config
    t = len(tokens)
    hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def d(array: np.ndarray) -> np.ndarray:
        return np.asarray(array, dtype=np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * d(g)

    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rope(x: np.ndarray) -> np.ndarray:
        rotated = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)
        return x * cos + rotated * sin

    assert w.embed_tokens is not None and w.norm is not None and w.lm_head is not None
    x = d(w.embed_tokens)[tokens]
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for layer in w.layers:
        h = rms(x, layer.attn_norm)
        q, k, v = h @ d(layer.wq).T, h @ d(layer.wk).T, h @ d(layer.wv).T
        if c.attention_bias:  # Qwen2: nn.Linear(bias=True) on q, k and v
            q, k, v = q + d(layer.q_bias), k + d(layer.k_bias), v + d(layer.v_bias)
        q, k, v = q.reshape(t, nh, hd), k.reshape(t, nkv, hd), v.reshape(t, nkv, hd)
        if c.qk_norm:  # Qwen3: Qwen3RMSNorm(head_dim) of each head, then rotary
            q, k = rms(q, layer.q_norm), rms(k, layer.k_norm)
        q, k = rope(q), rope(k)
        out = np.empty((t, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, head] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(t, nh * hd) @ d(layer.wo).T
        h = rms(x, layer.mlp_norm)
        g, u = h @ d(layer.w_gate).T, h @ d(layer.w_up).T
        x = x + (g / (1 + np.exp(-g)) * u) @ d(layer.w_down).T
    return rms(x, w.norm) @ d(w.lm_head).T


def within(got: np.ndarray, want: np.ndarray, fraction: float) -> None:
    scale = float(np.abs(want).max())
    error = float(np.abs(got - want).max())
    assert error <= fraction * scale, f"error {error:.4g} beyond {fraction} of {scale:.4g}"


def cached_logits(stage: object, tokens: list[int], decoded: int = 3) -> np.ndarray:
    """Logits of every position: a prefill of all but the last ``decoded``
    tokens, then one decode step each (the cache's positions)."""
    cache = stage.new_cache(32)  # type: ignore[attr-defined]
    split = len(tokens) - decoded
    rows = [stage.logits(stage.forward(stage.embed(tokens[:split]), cache))]  # type: ignore[attr-defined]
    for token in tokens[split:]:
        hidden = stage.forward_batch(stage.embed([token]), [cache])  # type: ignore[attr-defined]
        rows.append(stage.logits(hidden))  # type: ignore[attr-defined]
    return np.concatenate(rows)


# ---------------------------------------------------------------- models

@pytest.fixture(scope="module", params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def f32_gguf(arch: str, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, LlamaWeights]:
    path = tmp_path_factory.mktemp(arch) / "f32.gguf"
    return path, write_tiny_gguf(path, arch_config(arch), seed=5)


@pytest.fixture(scope="module")
def q8_gguf(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(arch) / "q8.gguf"
    write_tiny_gguf(path, arch_config(arch), seed=5, quantize=True)
    return path


@pytest.fixture(scope="module")
def hf_folder(arch: str, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[Path, LlamaWeights]:
    folder = tmp_path_factory.mktemp(arch) / "hf"
    return folder, write_tiny_hf(folder, arch_config(arch), seed=5)


def test_the_gguf_file_names_the_architecture_as_llama_cpp_does(
        arch: str, f32_gguf: tuple[Path, LlamaWeights]) -> None:
    path, _ = f32_gguf
    with GGUFFile(path) as file:
        named = file.metadata["general.architecture"]
        has_bias = "blk.0.attn_q.bias" in file.tensors
        has_norm = "blk.0.attn_q_norm.weight" in file.tensors
    assert named == ("llama" if arch == "mistral" else arch)
    assert (has_bias, has_norm) == (arch == "qwen2", arch == "qwen3")
    config = load_config(path)
    # A Mistral GGUF file is a llama file: nothing in it tells them apart.
    assert config.architecture == named
    assert config.head_dim == arch_config(arch).head_dim


def test_reference_decoder_on_the_gguf_file_matches_float64(
        f32_gguf: tuple[Path, LlamaWeights]) -> None:
    path, written = f32_gguf
    stage = LlamaStage(load_weights(path))
    within(cached_logits(stage, PROMPT), hf_logits(written, PROMPT), FLOAT32)


def test_reference_decoder_on_the_hf_folder_matches_float64(
        arch: str, hf_folder: tuple[Path, LlamaWeights]) -> None:
    folder, written = hf_folder
    weights = load_weights(folder)
    assert weights.config == arch_config(arch)
    within(cached_logits(LlamaStage(weights), PROMPT), hf_logits(written, PROMPT), FLOAT32)


def test_the_quantized_engine_agrees_with_the_reference_on_the_same_file(q8_gguf: Path) -> None:
    engine = QuantizedStage(load_quantized(q8_gguf))
    reference = LlamaStage(load_weights(q8_gguf))
    within(cached_logits(engine, PROMPT), cached_logits(reference, PROMPT), QUANTIZED)


def test_the_quantized_engine_rotates_as_the_file_is_laid_out(arch: str, q8_gguf: Path) -> None:
    assert load_quantized(q8_gguf).rotary == ("interleaved" if arch in ("llama", "mistral")
                                              else "half")


@pytest.mark.parametrize("cut", [1, 3])
def test_two_quantized_stages_give_the_single_stage_bits(q8_gguf: Path, cut: int) -> None:
    whole = QuantizedStage(load_quantized(q8_gguf))
    first = QuantizedStage(load_quantized(q8_gguf, 0, cut))
    second = QuantizedStage(load_quantized(q8_gguf, cut, whole.end))
    one = whole.new_cache(32)
    two = first.new_cache(32), second.new_cache(32)
    hidden = whole.forward(whole.embed(PROMPT), one)
    split = second.forward(first.forward(first.embed(PROMPT), two[0]), two[1])
    assert np.array_equal(whole.logits(hidden), second.logits(split))
    token = [int(whole.logits(hidden[-1:])[0].argmax())]
    hidden = whole.forward_batch(whole.embed(token), [one])
    split = second.forward_batch(first.forward_batch(first.embed(token), [two[0]]), [two[1]])
    assert np.array_equal(whole.logits(hidden), second.logits(split))


needs_mlx = pytest.mark.skipif(not mlx_available(), reason="mlx is not installed (pip install "
                               "mlx, or 'mlx[cpu]' on Linux): the MLX backend is not tested")


@needs_mlx
def test_the_mlx_engine_on_float_weights_matches_float64(
        f32_gguf: tuple[Path, LlamaWeights]) -> None:
    path, written = f32_gguf
    stage = MlxLlamaStage(load_weights(path))
    within(cached_logits(stage, PROMPT), hf_logits(written, PROMPT), MLX)


@needs_mlx
def test_the_mlx_engine_on_the_files_blocks_matches_the_reference(q8_gguf: Path) -> None:
    """What backend mlx runs for a GGUF file: the file's q/k rows as they
    are (interleaved rotary for llama files only), Q8_0 kept exact."""
    from pmetal.model.mlx import MlxQuantizedStage

    stage = MlxQuantizedStage(load_quantized(q8_gguf))
    within(cached_logits(stage, PROMPT), cached_logits(LlamaStage(load_weights(q8_gguf)), PROMPT),
           MLX)


def test_transformers_computes_the_same_logits_from_the_hf_folder(
        hf_folder: tuple[Path, LlamaWeights]) -> None:
    torch = pytest.importorskip("torch", reason="the transformers check needs torch and "
                                                "transformers (not pmetal dependencies)")
    transformers = pytest.importorskip("transformers", reason="the transformers check needs "
                                       "torch and transformers (not pmetal dependencies)")
    folder, _ = hf_folder
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder),
                                                              dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        theirs = model(torch.tensor([PROMPT])).logits[0].double().numpy()
    stage = LlamaStage(load_weights(folder))
    within(cached_logits(stage, PROMPT), theirs, FLOAT32)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_pmetal_generate_runs_qwen_files_over_two_stages(tmp_path: Path, family: str) -> None:
    """The architecture reaches every stage actor through the file: the
    streamed answer is the single-process greedy one."""
    path = tmp_path / f"{family}.gguf"
    write_tiny_gguf(path, arch_config(family), seed=7, quantize=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMETAL_")}
    env["PMETAL_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, "-m", "pmetal", "generate", "--model", str(path), "--prompt",
         "what is the capital", "--max-tokens", "10", "--stages", "2", "--backend",
         "quantized", "--max-len", "64"],
        env=env, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tok = Tokenizer.from_model(path)
    prompt = tok.encode_prompt("what is the capital")
    stops = tuple(tok.stop_token_ids)
    expected = generate_single_process(
        QuantizedStage(load_quantized(path)), [prompt],
        SamplingConfig(max_tokens=10, stop_token_ids=stops), max_len=64)[0]
    assert done.stdout == tok.decode([t for t in expected.tokens if t not in stops]) + "\n"


# ------------------------------------------------------------ config.json

# The fields of published config.json files that the decoder reads.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "use_sliding_window": False, "vocab_size": 151936}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768}


def test_config_json_of_each_family() -> None:
    qwen2 = LlamaConfig.from_hf_dict(QWEN25_05B)
    assert (qwen2.architecture, qwen2.attention_bias, qwen2.qk_norm) == ("qwen2", True, False)
    assert qwen2.head_dim == 64 and qwen2.tie_word_embeddings
    assert qwen2.max_position_embeddings == 32768  # its window is off
    qwen3 = LlamaConfig.from_hf_dict(QWEN3_06B)
    assert (qwen3.architecture, qwen3.attention_bias, qwen3.qk_norm) == ("qwen3", False, True)
    assert qwen3.head_dim == 128 and qwen3.q_size == 2048 != qwen3.hidden_size
    assert qwen3.rope_theta == 1e6 and isinstance(qwen3.rope_theta, float)
    mistral = LlamaConfig.from_hf_dict(MISTRAL_7B_V03)
    assert mistral.architecture == "mistral" and mistral.max_position_embeddings == 32768
    assert not mistral.tie_word_embeddings
    # transformers 5 writes rope_theta inside rope_parameters
    moved = {k: v for k, v in QWEN3_06B.items() if k != "rope_theta"}
    moved["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert LlamaConfig.from_hf_dict(moved).rope_theta == 5e5


def test_a_sliding_window_that_would_bite_limits_the_context(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pmetal.model.config"):
        v01 = LlamaConfig.from_hf_dict({**MISTRAL_7B_V03, "sliding_window": 4096})
    assert v01.max_position_embeddings == 4096
    assert "sliding window of 4096 positions" in caplog.text
    on = LlamaConfig.from_hf_dict({**QWEN25_05B, "use_sliding_window": True,
                                   "sliding_window": 4096})
    assert on.max_position_embeddings == 4096
    # A window as long as the context never bites.
    assert LlamaConfig.from_hf_dict({**QWEN25_05B, "use_sliding_window": True}
                                    ).max_position_embeddings == 32768


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"}, "Qwen2MoeForCausalLM"),
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen3"}, "model_type='qwen3'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32768}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({"attention_bias": True}, "biases"),
    ({"mlp_bias": True}, "biases"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
])
def test_config_json_the_decoder_cannot_compute_is_refused(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf_dict({**QWEN3_06B, **changes})


# ----------------------------------------------- refused before any weight

@pytest.fixture
def no_weight_is_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any read of a tensor's data fails the test."""
    def read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a weight was read before the model was refused")

    monkeypatch.setattr(GGUFFile, "tensor", read)
    monkeypatch.setattr(GGUFFile, "raw", read)
    monkeypatch.setattr(loader._SafetensorsFile, "tensor", read)
    yield


def refused_everywhere(path: Path, message: str) -> None:
    with pytest.raises(ModelFormatError, match=message):
        load_config(path)
    with pytest.raises(ModelFormatError, match=message):
        load_weights(path)
    if path.is_file():
        with pytest.raises(ModelFormatError, match=message):
            load_quantized(path)


@pytest.mark.usefixtures("no_weight_is_read")
@pytest.mark.parametrize("named", ["gemma2", "phi3", "qwen2moe", "qwen3moe", "mistral3"])
def test_an_unsupported_gguf_architecture_is_refused_by_name(
        tmp_path: Path, named: str) -> None:
    path = tmp_path / f"{named}.gguf"
    write_tiny_gguf(path, tiny_config(), architecture=named)
    refused_everywhere(path, f"holds a '{named}' model; pmetal's decoder computes llama, "
                             "qwen2, qwen3 GGUF models")


@pytest.mark.usefixtures("no_weight_is_read")
def test_a_gguf_file_with_tensors_its_architecture_lacks_is_refused(tmp_path: Path) -> None:
    # Llama 3's rope scaling lives in a tensor, not in the metadata.
    llama3 = tmp_path / "llama3.gguf"
    write_tiny_gguf(llama3, tiny_config(), extra={"rope_freqs.weight": np.ones(8, np.float32)})
    refused_everywhere(llama3, r"has rope_freqs\.weight, which a llama model")
    # Qwen2's biases in a file that says llama: they would be ignored.
    biased = tmp_path / "biased.gguf"
    write_tiny_gguf(biased, arch_config("qwen2"), architecture="llama")
    refused_everywhere(biased, r"has blk\.0\.attn_k\.bias, blk\.0\.attn_q\.bias, "
                               r"blk\.0\.attn_v\.bias and \d+ more, which a llama model")
    # A router: a mixture of experts whose metadata forgot expert_count.
    experts = tmp_path / "moe.gguf"
    write_tiny_gguf(experts, tiny_config(), extra={"blk.0.ffn_gate_inp.weight":
                                                   np.zeros((4, 64), np.float32)})
    refused_everywhere(experts, r"blk\.0\.ffn_gate_inp\.weight")


def test_a_gguf_file_missing_its_architectures_tensors_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "qwen3.gguf"
    write_tiny_gguf(path, arch_config("qwen3"), skip=("blk.2.attn_k_norm.weight",))
    load_quantized(path, 0, 2)  # the stages that do not need it load
    for load in (load_weights, load_quantized):
        with pytest.raises(ModelFormatError, match=r"no tensor blk\.2\.attn_k_norm\.weight: "
                                                   "an incomplete GGUF file, or not a qwen3"):
            load(path, 2, 4)


@pytest.mark.usefixtures("no_weight_is_read")
@pytest.mark.parametrize(("config_json", "message"), [
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
     "Qwen3MoeForCausalLM"),
    ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}, "Phi3ForCausalLM"),
])
def test_an_unsupported_hf_architecture_is_refused_by_name(
        tmp_path: Path, config_json: dict, message: str) -> None:
    folder = tmp_path / "m"
    write_tiny_hf(folder, tiny_config())
    data = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**data, **config_json}))
    refused_everywhere(folder, message)
