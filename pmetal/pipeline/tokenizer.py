"""Text to token ids and back, and chat prompts, for the model a pipeline runs.

What it owns: a :class:`Tokenizer` built with the ``tokenizers`` package
either from a GGUF file's vocabulary (``tokenizer.ggml.*``: a byte-level BPE,
``tokenizer.ggml.model == "gpt2"``, built as Hugging Face's own GGUF
converter builds it) or from a Hugging Face folder's ``tokenizer.json`` (and
``tokenizer_config.json`` for the chat template and special tokens); the
chat template, rendered by :mod:`pmetal.pipeline.chat_template` (a sandboxed
Jinja2 environment set up as ``transformers`` sets it up, with bounds on
output, time and loops); and :class:`StreamDecoder`, which turns
generated ids into text as they come without ever emitting half a UTF-8
character (byte-level BPE tokens often split a multi-byte character).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmetal.errors import PMetalValueError
from pmetal.pipeline.chat_template import (
    ChatTemplate,
    TemplateRaised,
    TemplateTooCostly,
)
from pmetal.pipeline.gguf_file import GGUFFile
from pmetal.pipeline.models import ModelFormatError

__all__ = ["StreamDecoder", "Tokenizer"]

# Tokens that end a turn in common chat formats; those present in a model's
# vocabulary as special tokens stop generation along with its eos token.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
                "</s>")

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# GGUF tokenizer.ggml.pre -> pre-tokenizer (llama.cpp llama-vocab.cpp's regexes):
# "digits" splits every digit on its own before the GPT-2 byte-level split;
# a regex splits the text (each match a piece) before a byte-level mapping
# without GPT-2's own split, as Qwen2's and Llama 3's tokenizer.json do.
_SPLIT_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_LLAMA3 = _SPLIT_QWEN2.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
_PRE_TOKENIZERS = {"default": "gpt2", "gpt2": "gpt2", "smollm": "digits",
                   "starcoder": "digits", "refact": "digits", "qwen2": _SPLIT_QWEN2,
                   "llama-bpe": _SPLIT_LLAMA3, "llama3": _SPLIT_LLAMA3}


@dataclass(frozen=True)
class _Special:
    bos: str | None
    eos: str | None
    add_bos: bool


class Tokenizer:
    """A model's tokenizer: :meth:`from_gguf`, :meth:`from_hf_folder`, or
    :meth:`from_model` for either. ``chat_template`` is None when the model
    has none (a base model)."""

    def __init__(self, backend: Any, *, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, extra_stop_ids: Iterable[int] = ()) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        stops = {self.eos_token_id, *extra_stop_ids,
                 *(backend.token_to_id(t) for t in _END_MARKERS if t in specials)}
        self.stop_token_ids: frozenset[int] = frozenset(i for i in stops if i is not None)
        self._specials = tuple(sorted(s for s in specials if s))
        self._plain_lock = threading.Lock()
        self._template: Any = None

    # ------------------------------------------------------------ building

    @classmethod
    def from_model(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of the model at ``path`` (a GGUF file or a folder)."""
        path = Path(path)
        return cls.from_hf_folder(path) if path.is_dir() else cls.from_gguf(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata."""
        with GGUFFile(path) as file:
            meta = file.metadata
        return cls.from_gguf_metadata(meta, Path(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], path: Path) -> Tokenizer:
        from tokenizers import AddedToken, processors

        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelFormatError(
                f"{path}: tokenizer.ggml.model is {kind!r}; pmetal builds byte-level BPE "
                "('gpt2') and SentencePiece BPE ('llama') tokenizers from GGUF. Use the "
                "model's Hugging Face folder (with tokenizer.json) instead")
        tokens: list[str] = _gguf_list(meta, "tokenizer.ggml.tokens", str, path)
        types: list[int] = _gguf_list(meta, "tokenizer.ggml.token_type", int, path)
        if not tokens:
            raise ModelFormatError(f"{path}: GGUF file has no tokenizer.ggml.tokens")
        if types and len(types) != len(tokens):
            raise ModelFormatError(f"{path}: GGUF tokenizer.ggml.token_type has {len(types)} "
                                   f"entries for {len(tokens)} tokens")
        vocab = {token: index for index, token in enumerate(tokens)}

        def token(key: str) -> str | None:
            index = _gguf_id(meta, f"tokenizer.ggml.{key}_token_id", path)
            return tokens[index] if index is not None and index < len(tokens) else None

        bos, eos = token("bos"), token("eos")
        try:
            backend = _byte_level_bpe(meta, tokens, vocab, path) if kind == "gpt2" else \
                _sentencepiece_bpe(meta, tokens, types, vocab, token("unknown"), path)
            special = [AddedToken(token, special=True, normalized=False)
                       for token, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)]
            backend.add_special_tokens(special)
            if meta.get("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
                backend.post_processor = processors.TemplateProcessing(
                    single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                    special_tokens=[(bos, vocab[bos])])
        except ModelFormatError:
            raise
        except Exception as exc:  # tokenizers raises plain Exception (a merge of unknown tokens)
            raise ModelFormatError(f"{path}: the GGUF vocabulary does not make a BPE "
                                   f"tokenizer: {exc}") from exc
        extra = [_gguf_id(meta, key, path)
                 for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if key in meta]
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise ModelFormatError(f"{path}: GGUF tokenizer.chat_template is not a string")
        return cls(backend, chat_template=template, bos_token=bos, eos_token=eos,
                   extra_stop_ids=[i for i in extra if i is not None])

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> Tokenizer:
        """The tokenizer of a Hugging Face folder: ``tokenizer.json``, with
        ``tokenizer_config.json`` (chat template, bos/eos) when present."""
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises plain Exception for any bad file
            raise ModelFormatError(f"cannot read {folder / 'tokenizer.json'}: {exc}") from exc
        settings = _read_json(folder / "tokenizer_config.json")
        config = _read_json(folder / "config.json")

        def name(key: str) -> str | None:
            value = settings.get(key)
            if isinstance(value, dict):  # {"content": "<s>", ...} in older files
                value = value.get("content")
            if value is None and isinstance(config.get(f"{key}_id"), int):
                value = backend.id_to_token(config[f"{key}_id"])
            return value

        template = settings.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        eos_ids = config.get("eos_token_id")
        extra = eos_ids if isinstance(eos_ids, list) else []
        return cls(backend, chat_template=template, bos_token=name("bos_token"),
                   eos_token=name("eos_token"), extra_stop_ids=extra)

    # ------------------------------------------------------------ using

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model
        puts around a text (a BOS token for some, nothing for SmolLM2)."""
        with self._plain_lock:  # never while _encode_plain has special tokens off
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (``[{"role": ..., "content": ...}]``)."""
        if self.chat_template is None:
            raise PMetalValueError("this model has no chat template (a base model?): "
                                   "give the prompt text as it is (chat=False)")
        from jinja2 import TemplateError

        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        try:
            return self._template.render(
                list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateRaised as exc:
            raise PMetalValueError(f"the model's chat template refused the messages: "
                                   f"{exc}") from exc
        except TemplateTooCostly as exc:
            raise ModelFormatError(f"the model's chat template is broken: it exceeds a "
                                   f"resource limit: {exc}") from exc
        except TemplateError as exc:
            raise ModelFormatError(f"the model's chat template is broken: {exc}") from exc
        except _TEMPLATE_FAILURES as exc:
            raise ModelFormatError(f"the model's chat template is broken: "
                                   f"{type(exc).__name__}: {exc}") from exc

    def encode_prompt(self, prompt: str, *, chat: bool | None = None) -> list[int]:
        """Token ids to feed the model for a user prompt: wrapped in the chat
        template as one user turn when ``chat`` (default: when the model has
        a template), else the text itself with the model's special tokens."""
        if chat is None:
            chat = self.chat_template is not None
        if not chat:
            return self.encode(prompt, add_special_tokens=True)
        turn = [{"role": "user", "content": prompt}]
        if not any(special in prompt for special in self._specials):
            # As transformers does: the template writes the special tokens itself.
            return self.encode(self.apply_chat_template(turn, add_generation_prompt=True),
                               add_special_tokens=False)
        # The user's text spells a special token ("<|im_end|>..."): encoded with
        # the rest it would end the user's turn and open one of its own (a
        # system turn, say). The template's parts keep their special tokens,
        # the user's text is encoded as plain text.
        marker = "\x00pmetal-user-text\x00"
        framed = self.apply_chat_template([{"role": "user", "content": marker}],
                                          add_generation_prompt=True)
        if framed.count(marker) != 1:
            raise PMetalValueError(
                "the prompt contains a special token's text and the model's chat template "
                "does not show the user's text as it is, so it cannot be kept plain: remove "
                f"{', '.join(repr(s) for s in self._specials if s in prompt)} or pass chat=False")
        before, _, after = framed.partition(marker)
        return (self.encode(before, add_special_tokens=False) + self._encode_plain(prompt)
                + self.encode(after, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids to feed the model for a conversation: the chat template
        with the generation prompt, as :meth:`encode_prompt` does for one
        user turn. A message whose text spells a special token's text
        (``"<|im_end|>"``) keeps it as plain text: it cannot end its turn
        and open one of another role."""
        turns = [dict(m) for m in messages]
        if not any(special in str(m.get("content", "")) for m in turns
                   for special in self._specials):
            return self.encode(self.apply_chat_template(turns, add_generation_prompt=True),
                               add_special_tokens=False)
        markers = [f"\x00pmetal-message-{i}\x00" for i in range(len(turns))]
        framed = self.apply_chat_template(
            [{**m, "content": marker} for m, marker in zip(turns, markers, strict=True)],
            add_generation_prompt=True)
        if any(framed.count(marker) != 1 for marker in markers):
            raise PMetalValueError(
                "a message contains a special token's text and the model's chat template "
                "does not show each message's text as it is, so it cannot be kept plain: "
                "remove it from the messages")
        ids: list[int] = []
        for turn, marker in zip(turns, markers, strict=True):
            before, _, framed = framed.partition(marker)
            ids += self.encode(before, add_special_tokens=False)
            ids += self._encode_plain(str(turn.get("content", "")))
        return ids + self.encode(framed, add_special_tokens=False)

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens' texts as ordinary text."""
        with self._plain_lock:
            self._backend.encode_special_tokens = True
            try:
                return list(self._backend.encode(text, add_special_tokens=False).ids)
            finally:
                self._backend.encode_special_tokens = False

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


# What a template that is code from the model file may raise besides jinja2's
# TemplateError (syntax, undefined, sandbox): 1/0, 'a' + 1, a recursive macro.
_TEMPLATE_FAILURES = (ArithmeticError, AttributeError, LookupError, RecursionError, TypeError,
                      ValueError)


def _byte_level_bpe(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int],
                    path: Path) -> Any:
    """A byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the
    pre-tokenizer ``tokenizer.ggml.pre`` names."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    pre = meta.get("tokenizer.ggml.pre", "default")
    if not isinstance(pre, str) or pre not in _PRE_TOKENIZERS:
        raise ModelFormatError(
            f"{path}: GGUF pre-tokenizer {pre!r} is not one pmetal knows "
            f"({', '.join(sorted(_PRE_TOKENIZERS))}); use the model's Hugging Face folder "
            "(with tokenizer.json) instead")
    pairs = []
    for merge in _gguf_list(meta, "tokenizer.ggml.merges", str, path):
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"{path}: malformed BPE merge {merge!r}")
        pairs.append((left, right))
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                 byte_fallback=False))
    split = _PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          use_regex=split in ("gpt2", "digits"))
    if split == "digits":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split == "gpt2":
        backend.pre_tokenizer = byte_level
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: list[str], types: list[int],
                       vocab: dict[str, int], unknown: str | None, path: Path) -> Any:
    """SentencePiece's BPE (``tokenizer.ggml.model == "llama"``: Llama 2,
    Mistral, TinyLlama) as llama.cpp runs it: spaces become U+2581, one is
    put before the text and after each special token, then the adjacent
    pair whose union is the best-scoring piece merges first, and what no
    piece covers falls back to <0xXX> byte tokens. In ``tokenizers`` terms,
    a BPE whose merges are every split of a normal piece into two pieces,
    ranked by the whole piece's score (as transformers converts these
    files)."""
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    scores = _gguf_list(meta, "tokenizer.ggml.scores", float, path)
    if len(scores) != len(tokens):
        raise ModelFormatError(f"{path}: GGUF tokenizer.ggml.scores has {len(scores)} entries "
                               f"for {len(tokens)} tokens")
    normal = [not types or types[i] == _NORMAL for i in range(len(tokens))]
    ranked = []
    for index, piece in enumerate(tokens):
        if not normal[index]:
            continue
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left is not None and right is not None and normal[left] and normal[right]:
                ranked.append((-scores[index], index, left, right))
    ranked.sort()
    merges = [(tokens[left], tokens[right]) for _, _, left, right in ranked]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, unk_token=unknown,
                                 fuse_unk=True, byte_fallback=True))
    space_prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    steps = [normalizers.Prepend("\u2581")] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend


def _gguf_list(meta: Mapping[str, Any], key: str, item: type, path: Path) -> list[Any]:
    """GGUF array ``key`` (empty when absent), refused unless every element
    is an ``item`` (an int: not a bool)."""
    value = meta.get(key, [])
    if not isinstance(value, list) or not all(
            isinstance(v, item) and not isinstance(v, bool) for v in value):
        raise ModelFormatError(f"{path}: GGUF {key} is not an array of {item.__name__}")
    return value


def _gguf_id(meta: Mapping[str, Any], key: str, path: Path) -> int | None:
    value = meta.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise ModelFormatError(f"{path}: GGUF {key} is {value!r}, not a token id")
    return value


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


class StreamDecoder:
    """Text of generated ids as they come. :meth:`push` returns the new text
    (possibly empty: a token that ends in the middle of a UTF-8 character
    waits for the next one); :meth:`flush` returns whatever is left at the
    end. Decoding a window of recent tokens rather than each token alone
    keeps the spaces and merged bytes byte-level BPE encodes across tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0   # start of the window decoded for context
        self._read = 0     # tokens whose text was already returned

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        now = self._tokenizer.decode(self._ids[self._prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """The text not returned yet (a dangling partial character comes out
        as U+FFFD, as a whole decode would give it)."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        now = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return now[len(before):]
