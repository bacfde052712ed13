"""Loading a Llama-family model's shape and the weights of a range of its
layers from a GGUF file or a Hugging Face folder.

What it owns: :func:`load_config` (a :class:`LlamaConfig` from GGUF
``{arch}.*`` metadata or ``config.json``) and :func:`load_weights`, which
reads and converts ONLY the tensors a stage running layers ``[start, end)``
needs: those layers, the token embedding when ``start == 0`` (or when the
range ends at the last layer and the embeddings are tied: the LM head is the
embedding then), the final norm and LM head when ``end`` is the last layer.
Both formats are memory-mapped, so a stage touches only its own pages.
Every array is float32, C-contiguous, shaped ``(out, in)`` as
:class:`LayerWeights` expects.

GGUF: dequantized with the ``gguf`` package. ``general.architecture`` is
``llama`` (Llama, and Mistral, which llama.cpp converts as Llama), ``qwen2``
or ``qwen3``; anything else is refused by name before a weight loads, and so
is a file holding a tensor its architecture does not have (Llama 3's
``rope_freqs``, an expert), which would otherwise be ignored. For ``llama``
files llama.cpp's converter (``convert_hf_to_gguf.py``,
``LlamaModel.permute``) reorders the rows of ``attn_q`` and ``attn_k`` of
each head from Hugging Face's "rotate half" layout to the interleaved pairs
its rotary kernel uses; this loader applies the inverse, so the decoder
(which follows Hugging Face) computes the same logits from either format.
Qwen files keep Hugging Face's rows (llama.cpp rotates them NEOX-style,
which is rotate half). Qwen2's biases (``attn_q.bias``...) and Qwen3's
``attn_q_norm``/``attn_k_norm`` are float32 vectors.

Hugging Face: ``config.json`` plus ``model.safetensors`` or the shards named
by ``model.safetensors.index.json``, parsed here with numpy (an 8-byte
little-endian header length, a JSON header of ``dtype``, ``shape``,
``data_offsets``, then the raw tensors); F32, F16 and BF16.
"""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pmetal.errors import ConfigError
from pmetal.model.kernels import KernelError, QMatrix
from pmetal.model.quantized import QuantizedLayer, QuantizedWeights
from pmetal.pipeline.assignment import ModelProfile
from pmetal.pipeline.gguf_file import GGUFFile
from pmetal.pipeline.llama import LayerWeights, LlamaConfig, LlamaWeights
from pmetal.pipeline.models import ModelFormatError, UnknownModelError

__all__ = ["load_config", "load_quantized", "load_weights", "quantized_profile",
           "stage_tensors"]

F32 = np.float32

# LayerWeights field -> (GGUF name in block i, Hugging Face name in layer i)
_LAYER_TENSORS = {
    "attn_norm": ("attn_norm", "input_layernorm"),
    "wq": ("attn_q", "self_attn.q_proj"),
    "wk": ("attn_k", "self_attn.k_proj"),
    "wv": ("attn_v", "self_attn.v_proj"),
    "wo": ("attn_output", "self_attn.o_proj"),
    "mlp_norm": ("ffn_norm", "post_attention_layernorm"),
    "w_gate": ("ffn_gate", "mlp.gate_proj"),
    "w_up": ("ffn_up", "mlp.up_proj"),
    "w_down": ("ffn_down", "mlp.down_proj"),
}
# The vectors some architectures add: field -> (GGUF name in block i, Hugging
# Face name in layer i), wanted when the config's switch says so.
_LAYER_VECTORS = {
    "q_bias": ("attn_q.bias", "self_attn.q_proj.bias"),
    "k_bias": ("attn_k.bias", "self_attn.k_proj.bias"),
    "v_bias": ("attn_v.bias", "self_attn.v_proj.bias"),
    "q_norm": ("attn_q_norm.weight", "self_attn.q_norm.weight"),
    "k_norm": ("attn_k_norm.weight", "self_attn.k_norm.weight"),
}
_LAYER_NAMES = {**{field: (f"{g}.weight", f"{h}.weight")
                   for field, (g, h) in _LAYER_TENSORS.items()}, **_LAYER_VECTORS}
# GGUF general.architecture -> the architecture it holds. Mistral's files say
# llama; llama.cpp's newer "mistral3" adds YaRN and Llama 4's attention
# temperature, which the decoder does not compute.
_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Architectures whose q and k rows llama.cpp's converter permutes
# (LlamaModel and its subclasses); Qwen's are written as Hugging Face has them.
_PERMUTED = frozenset({"llama", "mistral"})
# (GGUF, Hugging Face) names of the embedding, final norm and untied LM head
_EMBED = ("token_embd.weight", "model.embed_tokens.weight")
_NORM = ("output_norm.weight", "model.norm.weight")
_HEAD = ("output.weight", "lm_head.weight")


class _Source(Protocol):
    config: LlamaConfig

    def layer_tensor(self, layer: int, field: str) -> np.ndarray: ...
    def tensor(self, names: tuple[str, str]) -> np.ndarray: ...
    def close(self) -> None: ...


def is_gguf(path: Path) -> bool:
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


def _open(path: str | Path) -> _Source:
    path = Path(path)
    if is_gguf(path):
        return _GGUFSource(path)
    if path.is_dir():
        return _HFSource(path)
    if not path.exists():
        raise UnknownModelError(f"no model at {path}: no such file or folder")
    raise ModelFormatError(f"{path} is neither a GGUF file nor a Hugging Face model folder")


def load_config(path: str | Path) -> LlamaConfig:
    """The shape of the model at ``path`` (a ``.gguf`` file or a Hugging Face
    folder). Raises :class:`ModelFormatError` for a model the decoder does not
    compute."""
    source = _open(path)
    try:
        return source.config
    finally:
        source.close()


def load_weights(path: str | Path, start: int = 0, end: int | None = None) -> LlamaWeights:
    """The weights of layers ``[start, end)`` (default: all) of the model at
    ``path``, plus the embedding, final norm and LM head the range needs."""
    source = _open(path)
    try:
        config = source.config
        end = config.num_hidden_layers if end is None else end
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ConfigError(f"layer range [{start}, {end}) is not a non-empty range of the "
                              f"model's {config.num_hidden_layers} layers")
        layers = tuple(
            LayerWeights(**{field: source.layer_tensor(i, field) for field in _shapes(config)})
            for i in range(start, end))
        is_last = end == config.num_hidden_layers
        embed = norm = head = None
        if start == 0 or (is_last and config.tie_word_embeddings):
            embed = source.tensor(_EMBED)
        if is_last:
            norm = source.tensor(_NORM)
            head = embed if config.tie_word_embeddings else source.tensor(_HEAD)
        try:
            return LlamaWeights(config=config, start=start, layers=layers,
                                embed_tokens=embed if start == 0 else None,
                                norm=norm, lm_head=head)
        except ConfigError:
            raise
        except ValueError as exc:  # a tensor of the wrong shape
            raise ModelFormatError(f"{path}: {exc}") from exc
    finally:
        source.close()


def stage_tensors(names: Any, config: LlamaConfig, start: int, end: int) -> list[str]:
    """The GGUF tensors of ``names`` that a stage running layers ``[start,
    end)`` reads (:func:`load_weights` and :func:`load_quantized` read no
    others): its layers', the embedding when it embeds or is the last stage
    of a tied model, the final norm and the head when it is the last."""
    is_last = end == config.num_hidden_layers
    wanted = {f"blk.{i}." for i in range(start, end)}
    out = [n for n in names if n.startswith("blk.") and n[:n.index(".", 4) + 1] in wanted]
    if start == 0 or (is_last and config.tie_word_embeddings):
        out.append(_EMBED[0])
    if is_last:
        out.append(_NORM[0])
        if not config.tie_word_embeddings:
            out.append(_HEAD[0])
    return [n for n in out if n in names]


def load_quantized(path: str | Path, start: int = 0, end: int | None = None
                   ) -> QuantizedWeights:
    """The weights of layers ``[start, end)`` (default: all) of the GGUF file
    at ``path`` for the quantized engine: every matrix a view of the file's
    blocks (the map stays open while the weights live), norms and biases
    float32. Only the stage's own pages are ever read."""
    path = Path(path)
    if not is_gguf(path):
        if path.is_dir() or path.exists():
            raise ModelFormatError(
                f"{path}: the quantized backend reads GGUF files; for a Hugging Face folder "
                "choose the reference backend (or convert it with llama.cpp's "
                "convert_hf_to_gguf.py)")
        raise UnknownModelError(f"no model at {path}: no such file or folder")
    source = _GGUFSource(path)
    try:
        config = source.config
        end = config.num_hidden_layers if end is None else end
        if not 0 <= start < end <= config.num_hidden_layers:
            raise ConfigError(f"layer range [{start}, {end}) is not a non-empty range of the "
                              f"model's {config.num_hidden_layers} layers")
        layers = tuple(source.quantized_layer(i) for i in range(start, end))
        is_last = end == config.num_hidden_layers
        table = (config.vocab_size, config.hidden_size)
        embed = source.matrix(_EMBED[0], table) if start == 0 or (
            is_last and config.tie_word_embeddings) else None
        head = None
        if is_last:
            head = embed if config.tie_word_embeddings else source.matrix(_HEAD[0], table)
        try:
            return QuantizedWeights(
                config=config, start=start, layers=layers,
                embed_tokens=embed if start == 0 else None,
                norm=source.tensor(_NORM) if is_last else None, lm_head=head,
                rotary=source.rotary, keepalive=source.file)
        except ValueError as exc:
            raise ModelFormatError(f"{path}: {exc}") from exc
    except BaseException:
        source.close()
        raise


def quantized_profile(path: str | Path, *, max_len: int) -> ModelProfile:
    """The memory the quantized engine holds for the GGUF file at ``path``:
    each layer's tensor bytes as stored, plus one sequence's KV cache of
    ``max_len`` positions for it; the embedding and the head as stored."""
    with GGUFFile(path) as file:
        config = gguf_config(file.metadata, Path(path), set(file.tensors))
        per_layer = [0] * config.num_hidden_layers
        for name, info in file.tensors.items():
            if name.startswith("blk."):
                layer = int(name.split(".")[1])
                if 0 <= layer < config.num_hidden_layers:
                    per_layer[layer] += info.nbytes
        kv = 2 * config.kv_size * max_len * 4
        embed = file.tensors[_EMBED[0]].nbytes if _EMBED[0] in file.tensors else 0
        head = (file.tensors[_NORM[0]].nbytes if _NORM[0] in file.tensors else 0) + (
            embed if config.tie_word_embeddings else file.tensors[_HEAD[0]].nbytes)
    cost = [2.0 * (config.layer_parameters())] * config.num_hidden_layers
    return ModelProfile(n_layers=config.num_hidden_layers,
                        layer_bytes=[b + kv for b in per_layer], hidden_size=config.hidden_size,
                        embedding_bytes=embed, head_bytes=head,
                        tied_embeddings=config.tie_word_embeddings, layer_cost=cost,
                        head_cost=2.0 * config.vocab_size * config.hidden_size)


def _expect(path: Path, name: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if array.shape != shape:
        raise ModelFormatError(f"{path}: tensor {name} has shape {array.shape}, the model's "
                               f"config needs {shape}")
    return array


def _shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of one of the config's layers: field -> shape."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm": (h,), "wq": (config.q_size, h), "wk": (config.kv_size, h),
        "wv": (config.kv_size, h), "wo": (h, config.q_size), "mlp_norm": (h,),
        "w_gate": (i, h), "w_up": (i, h), "w_down": (h, i)}
    if config.attention_bias:
        shapes.update(q_bias=(config.q_size,), k_bias=(config.kv_size,),
                      v_bias=(config.kv_size,))
    if config.qk_norm:
        shapes.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
    return shapes


# ------------------------------------------------------------------- GGUF

def _short_float(value: float) -> float:
    """A float32 metadata value as the decimal it was written from
    (9.999999747378752e-06 -> 1e-05), so configs compare equal."""
    return float(str(np.float32(value)))


MAX_CONTEXT_LENGTH = 1 << 24
"""Largest ``{arch}.context_length`` a GGUF file may give (16,777,216; the
longest-context models published claim 10M). A stage builds its rotary
tables for the whole context, so a crafted 2**60 would be an allocation
of that size rather than a clear error."""

# LlamaConfig field -> the GGUF key it comes from, to name the key when
# LlamaConfig refuses a combination (heads not a multiple of kv heads, ...).
_CONFIG_KEYS = {
    "vocab_size": "{arch}.vocab_size", "hidden_size": "{arch}.embedding_length",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_hidden_layers": "{arch}.block_count",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "head_dim": "{arch}.attention.key_length",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "rope_theta": "{arch}.rope.freq_base", "max_position_embeddings": "{arch}.context_length",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
}


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class _Metadata:
    """Typed reads of GGUF metadata: a value of the wrong type, out of range,
    infinite or NaN is a :class:`ModelFormatError` naming its key."""

    def __init__(self, metadata: dict[str, Any], path: Path) -> None:
        self.metadata, self.path = metadata, path

    def raw(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise ModelFormatError(f"{self.path}: GGUF metadata lacks {key}")
        return value

    def int(self, key: str, default: int | None = None, *, low: int = 1,
            high: int | None = None) -> int:
        value = self.raw(key, default)
        if type(value) is not int or value < low or (high is not None and value > high):
            bounds = f"{low}..{high}" if high is not None else f">= {low}"
            raise ModelFormatError(f"{self.path}: GGUF {key} is {value!r}, not an integer "
                                   f"{bounds}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.raw(key, default)
        # Finite as the float32 the decoder computes in, not only as a double.
        if type(value) not in (int, float) or not abs(value) <= _FLOAT32_MAX:
            raise ModelFormatError(f"{self.path}: GGUF {key} is {value!r}, not a finite number")
        return _short_float(value)


def gguf_config(metadata: dict[str, Any], path: Path,
                tensor_names: set[str] | None = None) -> LlamaConfig:
    """A :class:`LlamaConfig` from GGUF metadata; ``tensor_names`` tells
    whether the file has its own LM head (no ``output.weight``: tied)."""
    arch = metadata.get("general.architecture")
    architecture = _GGUF_ARCHITECTURES.get(arch) if isinstance(arch, str) else None
    if architecture is None:
        raise ModelFormatError(f"{path} holds a {arch!r} model; pmetal's decoder computes "
                               f"{', '.join(_GGUF_ARCHITECTURES)} GGUF models (Mistral's "
                               "files are llama)")
    meta = _Metadata(metadata, path)
    if meta.raw(f"{arch}.expert_count", 0):
        raise ModelFormatError(f"{path} is a mixture-of-experts model ({arch}.expert_count="
                               f"{metadata[f'{arch}.expert_count']!r}); pmetal's decoder is "
                               "dense only")
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "") and meta.float(f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise ModelFormatError(f"{path} asks for rope scaling {scaling!r}, which pmetal's "
                               "decoder does not implement")
    heads = meta.int(f"{arch}.attention.head_count")
    hidden = meta.int(f"{arch}.embedding_length")
    head_dim = meta.int(f"{arch}.attention.key_length", hidden // heads)
    rotary = meta.int(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ModelFormatError(f"{path} rotates {rotary} of {head_dim} head dimensions; "
                               "pmetal's decoder rotates them all")
    if f"{arch}.vocab_size" in metadata:
        vocab = meta.int(f"{arch}.vocab_size")
    else:
        tokens = metadata.get("tokenizer.ggml.tokens", ())
        if not isinstance(tokens, list) or not tokens:
            raise ModelFormatError(f"{path}: GGUF metadata gives no vocabulary size (neither "
                                   f"{arch}.vocab_size nor a tokenizer.ggml.tokens list)")
        vocab = len(tokens)
    # Each layer is at least nine tensors of the file: no more layers than tensors.
    most_layers = len(tensor_names) if tensor_names is not None else None
    token_ids = {key: meta.int(key, low=0, high=vocab - 1)
                 for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
                 if key in metadata}
    try:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=meta.int(f"{arch}.feed_forward_length"),
            num_hidden_layers=meta.int(f"{arch}.block_count", high=most_layers),
            num_attention_heads=heads,
            num_key_value_heads=meta.int(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=meta.float(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=meta.float(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=meta.int(f"{arch}.context_length", high=MAX_CONTEXT_LENGTH),
            tie_word_embeddings=tensor_names is not None and _HEAD[0] not in tensor_names,
            bos_token_id=token_ids.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=token_ids.get("tokenizer.ggml.eos_token_id"),
            architecture=architecture,
        )
    except ConfigError as exc:
        keys = [key.format(arch=arch) for field, key in _CONFIG_KEYS.items() if field in str(exc)]
        raise ModelFormatError(f"{path}: GGUF metadata ({', '.join(keys) or f'{arch}.*'}) "
                               f"does not describe a model pmetal computes: {exc}") from exc


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute(weights, n_head)`` of q/k rows: per head it
    stored rows (pair, half) interleaved where Hugging Face has (half, pair)."""
    rows, cols = weight.shape
    return np.ascontiguousarray(
        weight.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def permute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: Hugging Face q/k rows to GGUF's."""
    rows, cols = weight.shape
    return np.ascontiguousarray(
        weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols))


class _GGUFSource:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        try:
            self.config = gguf_config(self.file.metadata, path, set(self.file.tensors))
            self._shapes = _shapes(self.config)
            self._refuse_unknown_tensors()
        except BaseException:
            self.file.close()
            raise
        # Llama's q and k rows are stored permuted for interleaved rotary pairs.
        self.rotary = "interleaved" if self.config.architecture in _PERMUTED else "half"

    def _refuse_unknown_tensors(self) -> None:
        """A tensor the architecture does not have would be ignored, and the
        logits silently wrong: Llama 3's ``rope_freqs`` (its rope scaling), a
        bias, an expert. Refuse the file instead, naming the tensor."""
        known = {_EMBED[0], _NORM[0], _HEAD[0]}
        for layer in range(self.config.num_hidden_layers):
            known.update(f"blk.{layer}.{_LAYER_NAMES[field][0]}" for field in self._shapes)
        unknown = sorted(set(self.file.tensors) - known)
        if unknown:
            more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
            raise ModelFormatError(
                f"{self.path} has {', '.join(unknown[:3])}{more}, which a "
                f"{self.config.architecture} model as pmetal computes it does not have "
                "(rope_freqs is Llama 3's rope scaling)")

    def _get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.file.tensors:
            raise ModelFormatError(f"{self.path} has no tensor {name}: an incomplete GGUF "
                                   f"file, or not a {self.config.architecture} model")
        return _expect(self.path, name, self.file.tensor(name), shape)

    def layer_tensor(self, layer: int, field: str) -> np.ndarray:
        name = f"blk.{layer}.{_LAYER_NAMES[field][0]}"
        array = self._get(name, self._shapes[field])
        if self.rotary == "interleaved" and field == "wq":
            return unpermute_rotary(array, self.config.num_attention_heads)
        if self.rotary == "interleaved" and field == "wk":
            return unpermute_rotary(array, self.config.num_key_value_heads)
        return array

    def tensor(self, names: tuple[str, str]) -> np.ndarray:
        c = self.config
        shape = (c.hidden_size,) if names is _NORM else (c.vocab_size, c.hidden_size)
        return self._get(names[0], shape)

    def matrix(self, name: str, shape: tuple[int, int]) -> QMatrix:
        """Tensor ``name`` as a view of its blocks in the file."""
        info = self.file.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path} has no tensor {name}: an incomplete GGUF "
                                   f"file, or not a {self.config.architecture} model")
        if info.shape != shape:
            raise ModelFormatError(f"{self.path}: tensor {name} has shape {info.shape}, the "
                                   f"model's config needs {shape}")
        try:
            return QMatrix(self.file.raw(name).reshape(shape[0], -1), info.ggml_type, *shape)
        except KernelError as exc:
            raise ModelFormatError(f"{self.path}: tensor {name}: {exc}") from exc

    def quantized_layer(self, layer: int) -> QuantizedLayer:
        """Layer ``layer``: matrices as views of their blocks, the norms,
        biases and q/k norms float32 vectors."""
        tensors = {}
        for field, shape in self._shapes.items():
            name = f"blk.{layer}.{_LAYER_NAMES[field][0]}"
            tensors[field] = self.matrix(name, shape) if len(shape) == 2 \
                else self._get(name, shape)
        return QuantizedLayer(**tensors)

    def close(self) -> None:
        self.file.close()


# ------------------------------------------------------- Hugging Face folder

_SAFETENSOR_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


class _SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped; tensors converted on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelFormatError(f"cannot read {path}: {exc}") from exc
        try:
            (length,) = struct.unpack("<Q", self._map[:8])
            header = json.loads(self._map[8:8 + length])
        except (struct.error, ValueError) as exc:  # JSONDecodeError is a ValueError
            self._map.close()
            raise ModelFormatError(f"{path} is not a safetensors file: {exc}") from exc
        if not isinstance(header, dict):
            self._map.close()
            raise ModelFormatError(f"{path} is not a safetensors file: its header is not a "
                                   "JSON object")
        header.pop("__metadata__", None)
        self.header: dict[str, Any] = header
        self._data = 8 + length

    def tensor(self, name: str) -> np.ndarray:
        entry = self.header[name]
        dtype = _SAFETENSOR_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ModelFormatError(f"{self.path}: tensor {name} is {entry.get('dtype')}; pmetal "
                                   "reads F32, F16 and BF16 safetensors")
        first, last = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if last - first != count * dtype.itemsize or self._data + last > len(self._map):
            raise ModelFormatError(f"{self.path}: tensor {name}'s offsets do not match its "
                                   "shape or run past the end of the file")
        raw = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._data + first)
        if entry["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            out = (raw.astype(np.uint32) << 16).view(F32)
        else:
            out = raw.astype(F32)  # a copy: the result must outlive the map
        return out.reshape(shape)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            # An array still views the map (a traceback holding a frame); the
            # map closes when that array is collected.
            pass


class _HFSource:
    def __init__(self, folder: Path) -> None:
        self.path = folder
        config_file = folder / "config.json"
        try:
            data = json.loads(config_file.read_text())
        except FileNotFoundError as exc:
            raise ModelFormatError(f"{folder} has no config.json: not a Hugging Face model "
                                   "folder") from exc
        except ValueError as exc:
            raise ModelFormatError(f"{config_file} is not valid JSON: {exc}") from exc
        try:
            self.config = LlamaConfig.from_hf_dict(data)
        except ConfigError as exc:
            raise ModelFormatError(f"{folder}: {exc}") from exc
        self._shapes = _shapes(self.config)
        self._where = self._weight_map(folder)
        self._files: dict[str, _SafetensorsFile] = {}

    @staticmethod
    def _weight_map(folder: Path) -> dict[str, str]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                return dict(json.loads(index.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ModelFormatError(f"{index} has no valid weight_map: {exc}") from exc
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelFormatError(f"{folder} has no *.safetensors weights (pytorch .bin "
                                   "checkpoints are not read: convert them to safetensors)")
        where: dict[str, str] = {}
        for file in files:
            st = _SafetensorsFile(file)
            where.update(dict.fromkeys(st.header, file.name))
            st.close()
        return where

    def _get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        filename = self._where.get(name)
        if filename is None:
            raise ModelFormatError(f"{self.path} has no tensor {name}: an incomplete "
                                   f"checkpoint, or not a {self.config.architecture} model")
        if filename not in self._files:
            self._files[filename] = _SafetensorsFile(self.path / filename)
        return _expect(self.path, name, self._files[filename].tensor(name), shape)

    def layer_tensor(self, layer: int, field: str) -> np.ndarray:
        return self._get(f"model.layers.{layer}.{_LAYER_NAMES[field][1]}", self._shapes[field])

    def tensor(self, names: tuple[str, str]) -> np.ndarray:
        c = self.config
        shape = (c.hidden_size,) if names is _NORM else (c.vocab_size, c.hidden_size)
        return self._get(names[1], shape)

    def close(self) -> None:
        for file in self._files.values():
            file.close()
