"""Tiny random Llama-family models (the config's architecture: llama,
mistral, qwen2, qwen3) written to disk as a Hugging Face folder or a GGUF
file, for tests of the loaders, the backends, the tokenizer and the store.

Both writers return the :class:`LlamaWeights` they wrote, so a test can
compare what a loader reads with what was written. The GGUF writer names
the architecture as llama.cpp's converter does (Mistral as ``llama``) and,
for ``llama`` files only, permutes ``attn_q``/``attn_k`` exactly as that
converter's ``LlamaModel.permute`` does (its code is restated here, not
imported from pmetal), so a loader that forgot to undo the permutation, or
undid one that Qwen files do not have, fails the tests. Both carry the same byte-level BPE
vocabulary (the 256 byte symbols, a few merges, ChatML special tokens) and a
ChatML chat template.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from pmetal.pipeline.llama import LlamaConfig, LlamaWeights

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Merges in priority order; each adds the concatenation to the vocabulary.
MERGES = ("Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a p", "i t",
          "Ġc ap", "Ġcap it", "a l", "Ġcapit al", "Ġ o", "Ġo f", "i s", "Ġ is", "Ġ w", "Ġw h",
          "Ġwh a", "Ġwha t", "W h", "Wh a", "Wha t", "Ã ©", "l l", "e ll")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] not in ('system', 'user', 'assistant') %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def tiny_vocab(size: int | None = None) -> list[str]:
    """Token strings by id: special tokens, the 256 byte symbols, merges;
    padded with unreachable ``<|pad_N|>`` tokens up to ``size``."""
    tokens = [*SPECIAL_TOKENS, *_bytes_to_unicode(), *(m.replace(" ", "") for m in MERGES)]
    if size is not None and size < len(tokens):
        raise ValueError(f"the tiny tokenizer needs a vocabulary of at least {len(tokens)} "
                         f"tokens, the config has {size}: use tiny_config()")
    return tokens + [f"<|pad_{i}|>" for i in range(len(tokens), size or 0)]


def tiny_config(*, tied: bool = True, layers: int = 4) -> LlamaConfig:
    """A 4-layer model whose vocabulary is exactly the tiny tokenizer's."""
    return LlamaConfig(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=96,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                       tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, as llama.cpp writes it."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


# ---------------------------------------------------------------- GGUF

# Hugging Face class of each architecture (config.json's "architectures")
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def gguf_architecture(config: LlamaConfig) -> str:
    """general.architecture as llama.cpp's converter writes it: MistralForCausalLM
    goes through its LlamaModel."""
    return "llama" if config.architecture == "mistral" else config.architecture


def write_tiny_gguf(path: str | Path, config: LlamaConfig, seed: int = 0, *,
                    architecture: str | None = None, skip: tuple[str, ...] = (),
                    quantize: bool = False, chat_template: str | None = CHAT_TEMPLATE,
                    types: Mapping[str, int] | None = None,
                    extra: dict[str, np.ndarray] | None = None) -> LlamaWeights:
    """A GGUF file of random weights (F32, or Q8_0 matrices with
    ``quantize``, or each matrix in the type ``types`` gives its GGUF base
    name, ``attn_q`` or ``token_embd``: F32 for names it lacks; vectors stay
    F32); ``architecture`` overrides general.architecture (default: the
    config's, as llama.cpp names it), ``skip`` leaves out tensors by GGUF
    name, ``extra`` adds some."""
    import gguf

    from tests.pipeline.kquants import quantize as encode

    weights = LlamaWeights.random(config, seed)
    architecture = architecture or gguf_architecture(config)
    writer = gguf.GGUFWriter(str(path), architecture)
    c = config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.head_dim)
    if c.head_dim != c.hidden_size // c.num_attention_heads:  # Qwen3's explicit head_dim
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    tokens = tiny_vocab(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(list(MERGES))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    def put(name: str, array: np.ndarray) -> None:
        if name in skip:
            return
        array = np.ascontiguousarray(array, dtype=np.float32)
        kind = None
        if array.ndim == 2 and types is not None:
            kind = types.get(name.removesuffix(".weight").split(".")[-1])
        elif array.ndim == 2 and quantize:
            kind = gguf.GGMLQuantizationType.Q8_0
        if kind is not None and kind != gguf.GGMLQuantizationType.F32:
            kind = gguf.GGMLQuantizationType(kind)
            writer.add_tensor(name, encode(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)

    def permute(rows: np.ndarray, n_head_kv: int) -> np.ndarray:
        if architecture != "llama":  # Qwen2Model, Qwen3Model: rows as Hugging Face has them
            return rows
        return llama_cpp_permute(rows, c.num_attention_heads, n_head_kv)

    assert weights.embed_tokens is not None and weights.norm is not None
    put("token_embd.weight", weights.embed_tokens)
    for i, layer in enumerate(weights.layers):
        put(f"blk.{i}.attn_norm.weight", layer.attn_norm)
        put(f"blk.{i}.attn_q.weight", permute(layer.wq, c.num_attention_heads))
        put(f"blk.{i}.attn_k.weight", permute(layer.wk, c.num_key_value_heads))
        put(f"blk.{i}.attn_v.weight", layer.wv)
        for name, vector in (("attn_q.bias", layer.q_bias), ("attn_k.bias", layer.k_bias),
                             ("attn_v.bias", layer.v_bias), ("attn_q_norm.weight", layer.q_norm),
                             ("attn_k_norm.weight", layer.k_norm)):
            if vector is not None:
                put(f"blk.{i}.{name}", vector)
        put(f"blk.{i}.attn_output.weight", layer.wo)
        put(f"blk.{i}.ffn_norm.weight", layer.mlp_norm)
        put(f"blk.{i}.ffn_gate.weight", layer.w_gate)
        put(f"blk.{i}.ffn_up.weight", layer.w_up)
        put(f"blk.{i}.ffn_down.weight", layer.w_down)
    put("output_norm.weight", weights.norm)
    if not c.tie_word_embeddings:
        assert weights.lm_head is not None
        put("output.weight", weights.lm_head)
    for name, array in (extra or {}).items():
        put(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


# ------------------------------------------------------ Hugging Face folder

def _hf_tensors(weights: LlamaWeights) -> dict[str, np.ndarray]:
    assert weights.embed_tokens is not None and weights.norm is not None
    out = {"model.embed_tokens.weight": weights.embed_tokens, "model.norm.weight": weights.norm}
    for i, layer in enumerate(weights.layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": layer.attn_norm,
                    p + "self_attn.q_proj.weight": layer.wq,
                    p + "self_attn.k_proj.weight": layer.wk,
                    p + "self_attn.v_proj.weight": layer.wv,
                    p + "self_attn.o_proj.weight": layer.wo,
                    p + "post_attention_layernorm.weight": layer.mlp_norm,
                    p + "mlp.gate_proj.weight": layer.w_gate,
                    p + "mlp.up_proj.weight": layer.w_up,
                    p + "mlp.down_proj.weight": layer.w_down})
        for name, vector in (("self_attn.q_proj.bias", layer.q_bias),
                             ("self_attn.k_proj.bias", layer.k_bias),
                             ("self_attn.v_proj.bias", layer.v_bias),
                             ("self_attn.q_norm.weight", layer.q_norm),
                             ("self_attn.k_norm.weight", layer.k_norm)):
            if vector is not None:
                out[p + name] = vector
    if not weights.config.tie_word_embeddings:
        assert weights.lm_head is not None
        out["lm_head.weight"] = weights.lm_head
    return out


def to_dtype(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` stored as safetensors ``dtype`` and read back as float32."""
    if dtype == "F16":
        return array.astype(np.float16).astype(np.float32)
    if dtype == "BF16":  # truncation toward zero, as the writer below stores it
        return (array.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return array


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "F32") -> None:
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        array = np.ascontiguousarray(array, dtype=np.float32)
        if dtype == "F16":
            blob = array.astype("<f2").tobytes()
        elif dtype == "BF16":
            blob = (array.view(np.uint32) >> 16).astype("<u2").tobytes()
        else:
            blob = array.astype("<f4").tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


def tiny_tokenizer_json(size: int | None = None) -> str:
    """The tiny vocabulary as a Hugging Face tokenizer.json (built the way
    SmolLM2's is: digits split, then GPT-2 byte level)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = tiny_vocab(size)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                   merges=[tuple(m.split(" ")) for m in MERGES]))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    return str(backend.to_str())


def write_tiny_hf(folder: str | Path, config: LlamaConfig, seed: int = 0, *,
                  dtype: str = "F32", shards: int = 1, model_type: str | None = None,
                  skip: tuple[str, ...] = ()) -> LlamaWeights:
    """A Hugging Face model folder of random weights: config.json (as the
    config's architecture writes it, or ``model_type`` with the class
    ``X`` when it names none), safetensors (``shards`` files with an index
    when more than one), tokenizer.json, tokenizer_config.json. ``skip``
    leaves out tensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = LlamaWeights.random(config, seed)
    c = config
    model_type = model_type or c.architecture
    # What each family's config.json adds (Qwen2's biases have no switch there).
    family: dict[str, object] = {
        "mistral": {"sliding_window": None},
        "qwen2": {"use_sliding_window": False, "sliding_window": c.max_position_embeddings,
                  "max_window_layers": c.num_hidden_layers},
        "qwen3": {"attention_bias": False, "head_dim": c.head_dim,
                  "use_sliding_window": False, "sliding_window": None},
    }.get(model_type, {})
    (folder / "config.json").write_text(json.dumps({
        "architectures": [HF_CLASSES.get(model_type, "X")], **family,
        "model_type": model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id, "hidden_act": "silu", "torch_dtype": "float32"}))
    tensors = {k: v for k, v in _hf_tensors(weights).items() if k not in skip}
    names = list(tensors)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", tensors, dtype)
    else:
        weight_map = {}
        for shard in range(shards):
            filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            part = names[shard::shards]
            write_safetensors(folder / filename, {k: tensors[k] for k in part}, dtype)
            weight_map.update(dict.fromkeys(part, filename))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "tokenizer.json").write_text(tiny_tokenizer_json(c.vocab_size))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "chat_template": CHAT_TEMPLATE}))
    return weights
