"""The numpy Llama decoder against an independent float64 reference that
recomputes the whole sequence at every step (no cache, no fused matrices,
Hugging Face's formulas written out), and against itself split into stages."""

from __future__ import annotations


import numpy as np
import pytest

from pmetal.errors import ConfigError, PMetalValueError
from pmetal.model.config import ARCHITECTURES
from pmetal.pipeline.llama import (
    SMOLLM2_135M,
    KVCache,
    LlamaConfig,
    LlamaStage,
    LlamaWeights,
)

TINY = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_id=2)
PROMPT = [1, 17, 42, 5, 99, 3, 64]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def weights(request: pytest.FixtureRequest) -> LlamaWeights:
    config = LlamaConfig(**{**TINY.__dict__, "tie_word_embeddings": request.param})
    return LlamaWeights.random(config, seed=3)


def reference_logits(w: LlamaWeights, tokens: list[int]) -> np.ndarray:
    """Logits (T, vocab) of the whole sequence in float64, from scratch."""
    c = w.config
    t = len(tokens)
    hd, nh, nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads

    def d(array: np.ndarray) -> np.ndarray:
        return array.astype(np.float64)

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_norm_eps) * d(g)

    inv_freq = 1.0 / c.rope_theta ** (np.arange(0, hd, 2) / hd)
    freqs = np.outer(np.arange(t), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, hd)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]

    def rotate_half(x: np.ndarray) -> np.ndarray:
        return np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], axis=-1)

    x = d(w.embed_tokens)[tokens]
    mask = np.triu(np.full((t, t), -np.inf), k=1)
    for layer in w.layers:
        h = rms(x, layer.attn_norm)
        q = (h @ d(layer.wq).T).reshape(t, nh, hd)
        k = (h @ d(layer.wk).T).reshape(t, nkv, hd)
        v = (h @ d(layer.wv).T).reshape(t, nkv, hd)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=1)  # repeat_kv: head i uses kv head i // group
        v = np.repeat(v, nh // nkv, axis=1)
        out = np.empty((t, nh, hd))
        for head in range(nh):
            s = q[:, head] @ k[:, head].T / np.sqrt(hd) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, head] = p @ v[:, head]
        x = x + out.reshape(t, nh * hd) @ d(layer.wo).T
        h = rms(x, layer.mlp_norm)
        g, u = h @ d(layer.w_gate).T, h @ d(layer.w_up).T
        x = x + (g / (1 + np.exp(-g)) * u) @ d(layer.w_down).T
    return rms(x, w.norm) @ d(w.lm_head).T


def close(ours: np.ndarray, ref: np.ndarray) -> None:
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 1e-4 * scale, np.abs(ours - ref).max() / scale


def test_prefill_and_cached_decode_match_the_reference(weights: LlamaWeights) -> None:
    stage = LlamaStage(weights)
    cache = stage.new_cache(32)
    tokens = list(PROMPT)
    close(stage.logits(stage.forward(stage.embed(tokens), cache)), reference_logits(weights, tokens))
    rng = np.random.default_rng(0)
    for _ in range(8):
        token = int(rng.integers(TINY.vocab_size))
        tokens.append(token)
        logits = stage.logits(stage.forward(stage.embed([token]), cache))
        close(logits[0], reference_logits(weights, tokens)[-1])
    assert cache.length == len(tokens)


def test_prefill_in_chunks_matches_the_reference(weights: LlamaWeights) -> None:
    """A prefill continued on a non-empty cache: the causal mask must be
    offset by the cached length."""
    stage = LlamaStage(weights)
    cache = stage.new_cache(32)
    stage.forward(stage.embed(PROMPT[:3]), cache)
    logits = stage.logits(stage.forward(stage.embed(PROMPT[3:]), cache))
    close(logits, reference_logits(weights, PROMPT)[3:])


def test_two_stages_equal_one_bit_for_bit(weights: LlamaWeights) -> None:
    whole = LlamaStage(weights)
    first, second = LlamaStage(weights.slice(0, 2)), LlamaStage(weights.slice(2, 4))
    assert (first.start, first.end, second.start, second.end) == (0, 2, 2, 4)
    caches = [whole.new_cache(32), first.new_cache(32), second.new_cache(32)]
    tokens = list(PROMPT)
    for step in range(6):
        feed = tokens if step == 0 else tokens[-1:]
        one = whole.logits(whole.forward(whole.embed(feed), caches[0]))
        two = second.logits(second.forward(first.forward(first.embed(feed), caches[1]),
                                           caches[2]))
        np.testing.assert_array_equal(one, two)
        tokens.append(int(one[-1].argmax()))


def test_a_stage_holds_only_its_own_parts(weights: LlamaWeights) -> None:
    middle = weights.slice(1, 3)
    assert (middle.embed_tokens, middle.norm, middle.lm_head) == (None, None, None)
    assert len(middle.layers) == 2 and middle.layers[0] is weights.layers[1]
    stage = LlamaStage(middle)
    with pytest.raises(PMetalValueError, match="not the first stage"):
        stage.embed([1])
    with pytest.raises(PMetalValueError, match="not the last stage"):
        stage.logits(np.zeros((1, TINY.hidden_size), np.float32))
    first, last = weights.slice(0, 1), weights.slice(3, 4)
    assert first.embed_tokens is weights.embed_tokens and first.lm_head is None
    assert last.embed_tokens is None and last.lm_head is weights.lm_head
    with pytest.raises(PMetalValueError, match="cannot slice"):
        middle.slice(0, 2)
    with pytest.raises(PMetalValueError, match="empty"):
        weights.slice(2, 2)


def greedy(weights: LlamaWeights, prompt: list[int], steps: int, cached: bool) -> list[int]:
    stage = LlamaStage(weights)
    tokens = list(prompt)
    cache = stage.new_cache(64)
    for step in range(steps):
        if cached:
            feed = tokens if step == 0 else tokens[-1:]
        else:
            cache = stage.new_cache(64)
            feed = tokens
        tokens.append(int(stage.logits(stage.forward(stage.embed(feed), cache))[-1].argmax()))
    return tokens[len(prompt):]


def test_greedy_with_the_cache_equals_greedy_without(weights: LlamaWeights) -> None:
    with_cache = greedy(weights, PROMPT, 12, cached=True)
    assert with_cache == greedy(weights, PROMPT, 12, cached=False)
    assert len(set(with_cache)) > 1  # the random model does not just repeat one token


def test_batched_decode_equals_one_sequence_at_a_time(weights: LlamaWeights) -> None:
    """Four sequences at different positions, decoded together, give each
    the logits it gets alone."""
    stage = LlamaStage(weights)
    prompts = [PROMPT, PROMPT[:2], [5, 6, 7, 8, 9], [42]]
    alone = [stage.new_cache(32) for _ in prompts]
    together = [stage.new_cache(32) for _ in prompts]
    nexts = []
    for prompt, a, b in zip(prompts, alone, together):
        stage.forward(stage.embed(prompt), b)
        nexts.append(int(stage.logits(stage.forward(stage.embed(prompt), a))[-1].argmax()))
    for _ in range(4):
        batch = stage.logits(stage.forward_batch(stage.embed(nexts), together))
        single = np.concatenate([stage.logits(stage.forward(stage.embed([n]), a))
                                 for n, a in zip(nexts, alone)])
        np.testing.assert_allclose(batch, single, rtol=1e-5, atol=1e-5 * np.abs(single).max())
        nexts = [int(i) for i in single.argmax(-1)]
    assert [c.length for c in together] == [c.length for c in alone] == [11, 6, 9, 5]


def test_logits_of_a_few_rows_equal_logits_row_by_row() -> None:
    """A few rows take the sliced path (shared by every matrix): 2 MB slices
    of a 64-wide table hold 8,192 words, so 20,000 words make two full
    slices and a partial one; each row's logits are bitwise those it gets
    alone."""
    config = LlamaConfig(**{**TINY.__dict__, "vocab_size": 20000, "num_hidden_layers": 1})
    stage = LlamaStage(LlamaWeights.random(config, seed=5))
    hidden = np.random.default_rng(1).standard_normal((5, config.hidden_size), dtype=np.float32)
    together = stage.logits(hidden)
    assert together.shape == (5, 20000)
    alone = np.concatenate([stage.logits(hidden[i:i + 1]) for i in range(5)])
    np.testing.assert_array_equal(together, alone)


def _prefilled(stage: LlamaStage, prompts: list[list[int]]) -> list[KVCache]:
    caches = []
    for prompt in prompts:
        cache = stage.new_cache(40)
        stage.forward(stage.embed(prompt), cache)
        caches.append(cache)
    return caches


def test_a_decode_row_is_bitwise_independent_of_its_batch(weights: LlamaWeights) -> None:
    """A pipeline groups sequences differently from one process; greedy
    output stays identical only if a sequence's decode step gives the same
    bits alone (forward of one row), in a batch of four, and in any other
    grouping, at whatever positions the others are."""
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(TINY.vocab_size, size=n)] for n in (7, 2, 11, 4)]
    stage = LlamaStage(weights)
    alone, quad, pairs = (_prefilled(stage, prompts) for _ in range(3))
    tokens = [3, 14, 15, 92]
    for step in range(5):
        ones = [stage.forward(stage.embed([t]), c) for t, c in zip(tokens, alone)]
        four = stage.forward_batch(stage.embed(tokens), quad)
        order = [(2, 0), (3, 1)] if step % 2 else [(1, 3), (0, 2)]
        two = {}
        for pair in order:
            rows = stage.forward_batch(stage.embed([tokens[i] for i in pair]),
                                       [pairs[i] for i in pair])
            two.update({i: rows[k:k + 1] for k, i in enumerate(pair)})
        for i in range(4):
            np.testing.assert_array_equal(four[i:i + 1], ones[i])
            np.testing.assert_array_equal(two[i], ones[i])
        logits = [stage.logits(h) for h in ones]
        np.testing.assert_array_equal(stage.logits(four), np.concatenate(logits))
        tokens = [int(x[0].argmax()) for x in logits]


def test_at_the_default_widths_neither_batch_nor_threads_change_the_bits() -> None:
    """The SmolLM2 widths (hidden 576, intermediate 1536), where OpenBLAS's
    kernel choice depends on a GEMM's size: a sequence's decode step gives
    the same bits alone, in chunks of a batch of 6 (4 + 2) or 5 (4 + 1),
    and on 1 or 2 compute threads (a pipeline's stage processes run one
    each while a single process uses two)."""
    from pmetal.pipeline.threads import compute_threads, set_compute_threads
    before = compute_threads()
    if before is None:
        pytest.skip("numpy's BLAS is not an OpenBLAS whose thread count pmetal can set")
    config = LlamaConfig(**{**SMOLLM2_135M.__dict__, "vocab_size": 4096,
                            "num_hidden_layers": 2, "head_dim": 0})
    stage = LlamaStage(LlamaWeights.random(config, seed=2))
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(4096, size=n)] for n in (5, 9, 2, 7, 3, 6)]
    tokens = [11, 12, 13, 14, 15, 16]
    results = []
    try:
        for threads in (1, 2):
            assert set_compute_threads(threads) == threads
            alone = [stage.logits(stage.forward(stage.embed([t]), c))
                     for t, c in zip(tokens, _prefilled(stage, prompts))]
            six = stage.logits(stage.forward_batch(stage.embed(tokens), _prefilled(stage, prompts)))
            five = stage.logits(stage.forward_batch(stage.embed(tokens[1:]),
                                                    _prefilled(stage, prompts[1:])))
            np.testing.assert_array_equal(six, np.concatenate(alone))
            np.testing.assert_array_equal(five, six[1:])
            results.append(six)
    finally:
        set_compute_threads(before)
        stage.close()
    np.testing.assert_array_equal(results[0], results[1])


def test_thirty_layers_split_twelve_and_eighteen_equal_one_stage_bitwise() -> None:
    """The default model's depth, split where a 2-stage pipeline might cut
    it: prefill, decode and batched decode give the same bits as one stage
    holding all 30 layers."""
    config = LlamaConfig(**{**TINY.__dict__, "num_hidden_layers": 30})
    weights = LlamaWeights.random(config, seed=11)
    whole = LlamaStage(weights)
    first, second = LlamaStage(weights.slice(0, 12)), LlamaStage(weights.slice(12, 30))
    one_caches = [whole.new_cache(32) for _ in range(2)]
    two_caches = [(first.new_cache(32), second.new_cache(32)) for _ in range(2)]
    for c1, (a, b), prompt in zip(one_caches, two_caches, (PROMPT, PROMPT[2:])):
        one = whole.forward(whole.embed(prompt), c1)
        two = second.forward(first.forward(first.embed(prompt), a), b)
        np.testing.assert_array_equal(one, two)
    tokens = [9, 10]
    for _ in range(3):
        one = whole.forward_batch(whole.embed(tokens), one_caches)
        hidden = first.forward_batch(first.embed(tokens), [a for a, _ in two_caches])
        two = second.forward_batch(hidden, [b for _, b in two_caches])
        np.testing.assert_array_equal(one, two)
        np.testing.assert_array_equal(whole.logits(one), second.logits(two))
        tokens = [int(t) for t in whole.logits(one).argmax(-1)]


def test_everything_stays_float32(weights: LlamaWeights) -> None:
    stage = LlamaStage(weights)
    assert stage._rotate.cos.dtype == stage._rotate.sin.dtype == np.float32
    assert all(m.dtype == np.float32 and m.flags.c_contiguous
               for m in stage._wqkv + stage._wo + stage._wgu + stage._wdown)
    cache = stage.new_cache(16)
    assert cache.keys.dtype == cache.values.dtype == np.float32
    hidden = stage.embed(PROMPT)
    assert hidden.dtype == np.float32
    out = stage.forward(hidden, cache)
    assert out.dtype == np.float32 and stage.logits(out).dtype == np.float32
    out = stage.forward_batch(stage.embed([3]), [cache])
    assert out.dtype == np.float32 and stage.logits(out).dtype == np.float32
    with pytest.raises(PMetalValueError, match="float32"):
        stage.forward(hidden.astype(np.float64), cache)


def test_the_cache_refuses_to_overflow(weights: LlamaWeights) -> None:
    stage = LlamaStage(weights)
    cache = stage.new_cache(8)
    stage.forward(stage.embed(PROMPT), cache)
    with pytest.raises(PMetalValueError, match="beyond its KV cache of 8"):
        stage.forward(stage.embed([1, 2]), cache)
    with pytest.raises(PMetalValueError, match="max_position_embeddings"):
        stage.new_cache(TINY.max_position_embeddings + 1)
    with pytest.raises(PMetalValueError, match="token ids"):
        stage.embed([TINY.vocab_size])


@pytest.mark.parametrize(("changes", "message"), [
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 66}, "not divisible"),
    ({"head_dim": 7}, "even"),
    ({"num_hidden_layers": 0}, "positive integer"),
    ({"vocab_size": True}, "positive integer"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
    ({"eos_token_id": 100}, "outside the vocabulary"),
])
def test_bad_configs_raise(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LlamaConfig(**{**TINY.__dict__, "head_dim": 0, **changes})


SMOLLM2_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 576,
    "initializer_range": 0.041666666666666664, "intermediate_size": 1536,
    "max_position_embeddings": 8192, "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 49152,
}


def test_from_hf_dict_reads_a_config_json() -> None:
    config = LlamaConfig.from_hf_dict(SMOLLM2_CONFIG_JSON)
    assert config == SMOLLM2_135M
    assert config.head_dim == 64 and config.q_size == 576 and config.kv_size == 192
    assert isinstance(config.rope_theta, float)
    listed = LlamaConfig.from_hf_dict({**SMOLLM2_CONFIG_JSON, "eos_token_id": [2, 0]})
    assert listed.eos_token_id == 2


def test_the_default_config_has_the_published_parameter_count() -> None:
    """134.5M parameters, the figure the issue measured by dequantizing the
    GGUF file: 30 layers, the tied embedding counted once, the final norm."""
    c = SMOLLM2_135M
    total = c.num_hidden_layers * c.layer_parameters() + c.vocab_size * c.hidden_size + c.hidden_size
    assert total == 134_515_008
    for architecture in ARCHITECTURES:
        config = LlamaConfig(**{**TINY.__dict__, "architecture": architecture})
        tiny = LlamaWeights.random(config)
        counted = sum(a.size for layer in tiny.layers for a in layer.__dict__.values()
                      if a is not None)
        assert counted == config.num_hidden_layers * config.layer_parameters(), architecture


@pytest.mark.parametrize(("changes", "message"), [
    ({"model_type": "mistral"}, "model_type='mistral' architectures=\\['LlamaForCausalLM'\\]"),
    ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]}, "Gemma2ForCausalLM"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"attention_bias": True}, "biases"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_from_hf_dict_refuses_what_it_cannot_compute(changes: dict, message: str) -> None:
    data = {k: v for k, v in {**SMOLLM2_CONFIG_JSON, **changes}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        LlamaConfig.from_hf_dict(data)


def test_weights_of_the_wrong_shape_or_dtype_are_refused(weights: LlamaWeights) -> None:
    layer = weights.layers[0]
    bad = type(layer)(**{**layer.__dict__, "wq": layer.wq.astype(np.float64)})
    with pytest.raises(PMetalValueError, match="layer 0 wq: expected float32"):
        LlamaWeights(config=weights.config, start=0, layers=(bad,))
    with pytest.raises(PMetalValueError, match="embed_tokens"):
        LlamaWeights(config=weights.config, start=0, layers=weights.layers[:1])
    assert isinstance(LlamaStage(weights).new_cache(4), KVCache)
