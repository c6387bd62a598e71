"""Text <-> token ids for litekv models.

A model is only usable if we feed it exactly the ids it was trained on, so this module builds a
`tokenizers.Tokenizer` that reproduces the checkpoint's own tokenizer:

* from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json` + friends),
* from the metadata of a GGUF file, which carries no `tokenizer.json` but llama.cpp's description of
  the vocabulary (tokens, merges or scores, token types, special ids, chat template),
* from a litekv bundle written by `Tokenizer.save`.

The GGUF builders mirror what llama.cpp runs and what transformers' GGUF converter produces, and the
tests compare the ids against transformers on real checkpoints.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from .atomic_file import write_atomic
from .errors import ChatTemplateError, CheckpointError, CheckpointNotFound, ConfigError, UnsupportedTokenizerError
from .validation import is_int

__all__ = ["Tokenizer", "StreamDecoder"]

META_FILE = "tokenizer_meta.json"
TOKENIZER_FILE = "tokenizer.json"
_META_FORMAT = "litekv-tokenizer"
_META_VERSION = 1

# llama.cpp's `tokenizer.ggml.token_type` values.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp treats these control tokens as "end of generation" even when the file names only one EOS:
# a chat model that ends its turn with `<end_of_turn>` must stop there, not run on to `<eos>`.
_END_OF_TURN_TOKENS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
)

# ---------------------------------------------------------------------------------------------------
# Pre-tokenizer regexes for byte-level BPE vocabularies, keyed by GGUF `tokenizer.ggml.pre`.
# A vocabulary's merges only reproduce the training tokenization if text is split the same way.

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-2's own regex (what ByteLevel(use_regex=True) runs), alone or after splitting off every digit.
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_SPLIT_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
    "tekken": _TEKKEN_SPLIT,
}

# Sentencepiece architectures whose GGUF needs Gemma's fix-ups (see `_sentencepiece_backend`).
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n")


class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special tokens and chat template in one object.

    Encoding goes through `tokenizers` (Rust), so it is fast and its `tokenizer.json` can be saved into
    a bundle and reloaded without the original checkpoint.
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Wrap a built `tokenizers.Tokenizer`; BOS/EOS insertion is whatever its post-processor does."""
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._chat_template = chat_template or None
        ids = list(eos_token_ids or ())
        eos_id = self.token_to_id(eos_token) if eos_token is not None else None
        if eos_id is not None:
            ids.insert(0, eos_id)
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in ids))
        bos_id = self.bos_token_id
        # Ask the backend instead of trusting a flag: the post-processor is what actually runs.
        probe = backend.encode("", add_special_tokens=True).ids
        self._add_bos = bos_id is not None and bool(probe) and probe[0] == bos_id

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (needs `tokenizer.json`; the rest is optional)."""
        root = Path(path)
        tokenizer_file = root / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointNotFound(
                f"{tokenizer_file} does not exist; litekv needs the fast-tokenizer file tokenizer.json "
                "(save the tokenizer with a recent transformers to produce it)."
            )
        try:
            backend = _Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{tokenizer_file} is not a valid tokenizer.json: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        bos = _token_content(config.get("bos_token"))
        eos = _token_content(config.get("eos_token"))

        # BOS/EOS insertion comes from tokenizer.json's post-processor alone: like transformers 5, we
        # ignore tokenizer_config's add_bos_token/add_eos_token when a tokenizer.json exists.
        eos_ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            data = _read_json(root / name)
            for section in (data, data.get("text_config") or {}):
                eos_ids.extend(_as_id_list(section.get("eos_token_id")))

        template: str | None = None
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = _pick_template(config.get("chat_template"))
            if template is None:
                template = _pick_template(_read_json(root / "chat_template.json").get("chat_template"))
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids, chat_template=template)

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes, from its metadata (GGUF key -> python value)."""
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta or kind is None:
            raise UnsupportedTokenizerError(
                "The GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens are missing); "
                "load the tokenizer from the model's Hugging Face directory instead."
            )
        tokens = [_as_str(t) for t in meta["tokenizer.ggml.tokens"]]
        types = _gguf_array(meta, "tokenizer.ggml.token_type", len(tokens), int) or [_NORMAL] * len(tokens)
        arch = str(meta.get("general.architecture", ""))
        special_ids = {
            key: int(meta[f"tokenizer.ggml.{key}_token_id"])
            for key in ("bos", "eos", "unknown", "padding", "eot", "eom")
            if meta.get(f"tokenizer.ggml.{key}_token_id") is not None
        }
        special_ids = {k: v for k, v in special_ids.items() if 0 <= v < len(tokens)}

        if kind == "gpt2":
            backend = _byte_level_backend(tokens, meta)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        elif kind in ("llama", "gemma4"):
            backend = _sentencepiece_backend(tokens, meta, arch, kind)
            # llama.cpp adds BOS to sentencepiece vocabularies unless told otherwise. Gemma 4's chat
            # template writes `<bos>` itself, so its reference tokenizer adds none despite the flag.
            add_bos = kind != "gemma4" and bool(meta.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer model {kind!r} (architecture {arch!r}) is not supported; litekv handles "
                "'gpt2' (byte-level BPE) and 'llama'/'gemma4' (sentencepiece BPE). Convert the model from its "
                "Hugging Face directory instead, which carries a tokenizer.json."
            )

        _add_gguf_added_tokens(backend, tokens, types, special_ids.values())
        bos = tokens[special_ids["bos"]] if "bos" in special_ids else None
        eos = tokens[special_ids["eos"]] if "eos" in special_ids else None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        _set_bos_eos_template(backend, bos if add_bos else None, eos if add_eos else None)

        eos_ids = [special_ids[k] for k in ("eos", "eot", "eom") if k in special_ids]
        for text in _END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(text)
            if token_id is not None and token_id < len(types) and types[token_id] == _CONTROL:
                eos_ids.append(token_id)
        template = meta.get("tokenizer.chat_template")
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=eos_ids,
            chat_template=_as_str(template) if template is not None else None,
        )

    @classmethod
    def from_json(cls, tokenizer_json: str, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild from the two pieces `save` writes (the `tokenizer.json` text and `to_dict()`).

        Both come from a bundle, so both are checked: a wrong field raises CheckpointError."""
        return cls._from_parts(tokenizer_json, meta, "tokenizer metadata", "tokenizer.json in bundle")

    @classmethod
    def _from_parts(cls, tokenizer_json: str, meta: Mapping[str, Any], meta_name: str, json_name: str) -> Tokenizer:
        fields = _sidecar_fields(meta, meta_name)
        try:
            backend = _Backend.from_str(tokenizer_json)
        except Exception as exc:
            raise CheckpointError(f"invalid {json_name}: {exc}; reconvert the model.") from exc
        size = backend.get_vocab_size(with_added_tokens=True)
        bad = [i for i in fields["eos_token_ids"] if not 0 <= i < size]
        if bad:
            raise CheckpointError(f"{meta_name}: eos_token_ids holds {bad[0]}, outside the vocabulary of {size} ids; "
                                  "reconvert the model.")
        return cls(backend, **fields)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer written by `save` (`tokenizer.json` + `tokenizer_meta.json`)."""
        root = Path(directory)
        for name in (TOKENIZER_FILE, META_FILE):
            if not (root / name).is_file():
                raise CheckpointNotFound(f"{root / name} does not exist; was this directory written by Tokenizer.save?")
        meta = _read_json(root / META_FILE)
        try:
            text = (root / TOKENIZER_FILE).read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{root / TOKENIZER_FILE} is not readable UTF-8 text ({exc}); reconvert the model.") \
                from exc
        return cls._from_parts(text, meta, str(root / META_FILE), str(root / TOKENIZER_FILE))

    # -- persistence -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The sidecar metadata (JSON-serialisable) that `tokenizer.json` cannot hold."""
        return {
            "format": _META_FORMAT,
            "version": _META_VERSION,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "eos_token_ids": list(self._eos_token_ids),
            "add_bos": self._add_bos,  # informational: the post-processor in tokenizer.json is authoritative
            "chat_template": self._chat_template,
        }

    def to_json(self) -> str:
        """The backend serialised as `tokenizer.json` text."""
        return self._backend.to_str()

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write `tokenizer.json` and `tokenizer_meta.json` into `directory`, each atomically."""
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        write_atomic(root / TOKENIZER_FILE, self.to_json())
        write_atomic(root / META_FILE, json.dumps(self.to_dict(), ensure_ascii=False, indent=1))

    # -- encoding ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS only if the checkpoint asks for it."""
        if not isinstance(text, str):
            hint = " (decode bytes first, e.g. data.decode('utf-8'))" if isinstance(text, (bytes, bytearray)) else ""
            raise ConfigError(f"encode takes text as a str, got {type(text).__name__}{hint}.")
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError as exc:  # tokenizers takes only valid Unicode: a lone surrogate is refused
            raise ConfigError(_invalid_text_message(text)) from exc

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` [n] ints; bytes of a character split across the ids are joined before decoding.

        Ids past the vocabulary (a model's padding rows) give no text, as in transformers."""
        return self._backend.decode(_token_ids(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary (e.g. `<|im_end|>`), or None."""
        if not isinstance(token, str):
            raise ConfigError(f"token_to_id takes a token's text as a str, got {type(token).__name__}.")
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary spelling of an id (byte-level or `▁` form, not display text), or None."""
        token_id = _token_id(token_id)
        return self._backend.id_to_token(token_id) if 0 <= token_id <= _MAX_ID else None

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (what the embedding table must cover)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> _Backend:
        """The underlying `tokenizers.Tokenizer` (shared, not a copy)."""
        return self._backend

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self._bos_token) if self._bos_token is not None else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: the EOS first, then end-of-turn ids the checkpoint names."""
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends BOS."""
        return self._add_bos

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    # -- chat --------------------------------------------------------------------------------------

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = ..., tokenize: Literal[True] = ...
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = ..., *, tokenize: Literal[False]
    ) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int] | str:
        """Render `messages` with the checkpoint's chat template, as transformers does, and tokenize it.

        The rendered text already contains every special token the model expects (including BOS when
        the template writes it), so it is encoded with `add_special_tokens=False`, like transformers.
        """
        if self._chat_template is None:
            raise ChatTemplateError(
                "This tokenizer has no chat template (base models usually ship none). Use encode() on a plain "
                "prompt instead, or load a checkpoint that provides tokenizer.chat_template / chat_template.jinja."
            )
        # As transformers: a key whose value is None is left out (OpenAI-style `"tool_calls": None` would
        # render as the text "None"), and templates see `tools` and `documents` as none, not undefined.
        variables: dict[str, Any] = {
            "messages": [{k: v for k, v in m.items() if v is not None} for m in _messages(messages)],
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        for name in ("bos_token", "eos_token"):
            value = getattr(self, name)
            if value is not None:
                variables[name] = value
        try:
            text = _compile_template(self._chat_template).render(**variables)
        except Exception as exc:  # template code can fail in any way; all of it is a template error
            raise ChatTemplateError(f"Rendering the chat template failed: {exc}") from exc
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        """A fresh `StreamDecoder` for one generation."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self._bos_token!r}, eos={self._eos_token!r}, "
            f"add_bos={self._add_bos}, chat_template={'yes' if self._chat_template else 'no'})"
        )


class StreamDecoder:
    """Turns generated ids into text as they arrive, never emitting half a character.

    A byte-level or byte-fallback token can hold only part of a UTF-8 character, so decoding token by
    token would print replacement characters. We keep a small window of ids (the last emitted ones
    for context, since decoders such as the sentencepiece space-strip depend on it) and emit the
    window's new text only once it no longer ends in U+FFFD. The concatenation of everything `push`
    and `flush` return equals `decode(all_ids)` for valid UTF-8 output.

    Bytes that never form a character (a model can emit lone continuation bytes forever) would keep
    the window growing, and each push decoding all of it. Once more than HELD ids wait, all but the
    last HELD are emitted as the decoder spells them, U+FFFD for the invalid bytes: with a byte-level
    vocabulary that is still exactly `decode(all_ids)`. A byte-fallback decoder spells a whole run of
    byte tokens as one U+FFFD per byte once any byte of it is invalid, changing a run that was valid
    so far after the fact; the stream keeps what it emitted and can give a few U+FFFDs more or fewer
    than `decode(all_ids)` (so did the unbounded window).
    """

    # A UTF-8 character has at most 4 bytes and a token at least one, so a character begun in a held
    # id is decided 3 ids later; 8 leave room for skipped special tokens, which have no bytes.
    HELD = 8
    # Byte-level BPE can merge bytes of two characters into one token, so valid text can end in an
    # unfinished character at several pushes in a row; it is held, exactly, up to this many ids. Past
    # that (a character cut at 64 token boundaries in a row), the one cut comes out as U+FFFD.
    MAX_HELD = 64

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # everything before this has been emitted
        self._context: str | None = ""  # decode(ids[prefix:read]), None until needed after a move

    @property
    def ids(self) -> tuple[int, ...]:
        """All ids pushed so far."""
        return tuple(self._ids)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(_token_ids((token_id,))[0])  # checked first: a bad id would stay in the window
        context, full = self._window_texts()
        if len(full) > len(context) and not full.endswith("\ufffd"):
            self._move(len(self._ids))
            return full[len(context):]
        if len(self._ids) - self._read > self.HELD:
            return self._release(context, full)
        return ""

    def flush(self) -> str:
        """Return whatever is still held back (e.g. at the end of generation)."""
        context, full = self._window_texts()
        self._read, self._context = len(self._ids), full
        return full[len(context):] if len(full) > len(context) else ""

    def _release(self, context: str, full: str) -> str:
        """Emit the held ids but the last HELD once their text is final: when the window's text still
        starts with it, their last character did not become part of a longer one."""
        cut = len(self._ids) - self.HELD
        text = self._decode(self._ids[self._prefix:cut])
        if not full.startswith(text) and len(self._ids) - self._read <= self.MAX_HELD:
            return ""
        # The cut can fall inside a byte sequence, and a window starting there would decode its other
        # bytes on their own (one U+FFFD each); HELD ids of context reach past any such sequence.
        self._prefix, self._read, self._context = max(self._prefix, cut - self.HELD), cut, None
        return text[len(context):]

    def _move(self, read: int) -> None:
        """Make the ids up to `read` emitted; the ones emitted last become the context."""
        self._prefix, self._read, self._context = self._read, read, None

    def _window_texts(self) -> tuple[str, str]:
        """(text of the context, text of the whole window); the context's is decoded once per move."""
        if self._context is None:
            self._context = self._decode(self._ids[self._prefix:self._read])
        return self._context, self._decode(self._ids[self._prefix:])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, self._skip)


# ---------------------------------------------------------------------------------------------------
# GGUF builders


def _byte_level_backend(tokens: list[str], meta: Mapping[str, Any]) -> _Backend:
    """GPT-2 style byte-level BPE (SmolLM, Llama 3, Qwen, ...)."""
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre in _GPT2_PRE:
        pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _DIGITS_THEN_GPT2_PRE:
        # llama.cpp splits off every digit before the GPT-2 regex; this is also what these models'
        # tokenizer.json says (transformers' GGUF loader skips the digit split).
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _SPLIT_PRE:
        pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        known = sorted({*_GPT2_PRE, *_DIGITS_THEN_GPT2_PRE, *_SPLIT_PRE})
        raise UnsupportedTokenizerError(
            f"GGUF byte-level tokenizer with pre-tokenizer {pre!r} is not supported (known: {', '.join(known)}). "
            "Its text-splitting regex is unknown, so ids would silently differ from the model's; convert the "
            "model from its Hugging Face directory instead."
        )

    # Byte-level vocabularies spell every byte as one printable character. A few converters store some
    # tokens as raw text instead; respell those so the merges (which use the byte spelling) find them.
    alphabet = _byte_alphabet()
    alphabet_set = set(alphabet)
    spelled = [
        t if set(t) <= alphabet_set else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
    ]
    vocab = {t: i for i, t in enumerate(spelled)}
    if meta.get("tokenizer.ggml.merges") is not None:
        merges = [_split_merge(_as_str(m)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _derive_merges(vocab, None)
    backend = _Backend(_bpe(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(
    tokens: list[str], meta: Mapping[str, Any], arch: str, kind: str
) -> _Backend:
    """Sentencepiece-style BPE with byte fallback (Llama 2, Gemma, Phi-3, ...).

    GGUF stores no merges for these, only scores. A sentencepiece BPE merges the pair whose result
    has the best score, so every split of every token into two vocabulary tokens becomes a merge,
    ranked by the merged token's score.

    Gemma (1-3) files need two fix-ups, matching transformers: tokens made only of spaces are stored
    with real spaces ("  ") but looked up as "▁▁", and the merge order follows the token order in the
    file rather than the scores (they agree for normal tokens; they differ for user-defined ones).
    """
    gemma = kind == "llama" and arch in _GEMMA_ARCHS
    if gemma:
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges") is not None:
        merges = [_split_merge(_as_str(m)) for m in meta["tokenizer.ggml.merges"]]
    elif gemma:
        merges = _derive_merges(vocab, [-float(i) for i in range(len(tokens))])
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise UnsupportedTokenizerError(
                "GGUF sentencepiece tokenizer has neither tokenizer.ggml.merges nor tokenizer.ggml.scores; "
                "its merge order cannot be recovered."
            )
        merges = _derive_merges(vocab, _gguf_array(meta, "tokenizer.ggml.scores", len(tokens), float))

    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    backend = _Backend(_bpe(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    # Gemma never prepends a space; others follow the file (llama.cpp's default is to prepend).
    add_prefix = not (gemma or kind == "gemma4") and bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if arch == "phi3" and add_prefix:
        # Phi-3 prepends "▁" in the normalizer, i.e. to every chunk between special tokens, not only
        # to the start of the text.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if add_prefix else "never", split=False
        )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_gguf_added_tokens(
    backend: _Backend, tokens: list[str], types: list[int], special_ids: Iterable[int]
) -> None:
    """Make control and user-defined tokens match whole in text, as llama.cpp does.

    Control tokens (and the BOS/EOS/UNK/PAD ids) become special tokens, so `<|im_start|>` is one id and
    `skip_special_tokens` drops it; user-defined ones (e.g. Gemma's `<table>`, runs of newlines) are
    plain added tokens. A token is only added under the spelling the vocabulary knows it by: one the
    builder had to respell (a byte-level "control" token in raw text, Gemma's "  ") would otherwise
    become a new id past the model's vocabulary.
    """
    def whole(ids: Iterable[int], special: bool) -> list[AddedToken]:
        return [
            AddedToken(tokens[i], special=special, normalized=False)
            for i in ids
            if 0 <= i < len(tokens) and tokens[i] and backend.token_to_id(tokens[i]) == i
        ]

    special = whole(sorted({i for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)} | set(special_ids)), True)
    if special:
        backend.add_special_tokens(special)
    user = whole((i for i, t in enumerate(types) if t == _USER_DEFINED), False)
    if user:
        backend.add_tokens(user)


def _bpe(**options: Any) -> models.BPE:
    try:
        return models.BPE(**options)
    except Exception as exc:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise CheckpointError(f"the GGUF tokenizer's merges do not fit its vocabulary ({exc}); the file is "
                              "damaged: download it again.") from exc


def _gguf_array(meta: Mapping[str, Any], key: str, length: int, kind: type) -> list[Any] | None:
    """GGUF array `key` with one number per token, as `kind`; None when the file has none."""
    values = meta.get(key)
    if values is None:
        return None
    try:
        out = [kind(v) for v in values]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"GGUF metadata {key} must hold numbers ({exc}); the file is damaged: download it "
                              "again.") from exc
    if len(out) != length:
        raise CheckpointError(f"GGUF metadata {key} has {len(out)} entries for {length} tokens; the file is "
                              "damaged: download it again.")
    return out


def _derive_merges(vocab: Mapping[str, int], priority: Sequence[float] | None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: every split of a token into two vocabulary tokens.

    With `priority` (higher merges first), ties prefer the longer left piece, then the earlier token;
    without it the token id orders them, shorter left piece first. This is the order transformers'
    `generate_merges` produces, so both tokenizers agree id for id.
    """
    found: list[tuple[tuple[float, ...], str, str]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                if priority is None:
                    key: tuple[float, ...] = (index, cut, len(right))
                else:
                    key = (-priority[index], -cut, -len(right), index)
                found.append((key, left, right))
    found.sort(key=lambda item: item[0])
    return [(left, right) for _, left, right in found]


def _set_bos_eos_template(backend: _Backend, bos: str | None, eos: str | None) -> None:
    """Install a post-processor adding `bos` before and `eos` after each sequence (None = don't)."""
    specials = []
    single, pair_tail = ["$A:0"], ["$B:1"]
    for name, token in (("BOS", bos), ("EOS", eos)):
        if token is None:
            continue
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"special token {token!r} is not in the vocabulary")
        # Template names stay "BOS"/"EOS": the token text may contain spaces or ':' the template syntax uses.
        specials.append({"id": name, "ids": [token_id], "tokens": [token]})
        if name == "BOS":
            single.insert(0, "BOS:0")
            pair_tail.insert(0, "BOS:1")
        else:
            single.append("EOS:0")
            pair_tail.append("EOS:1")
    pair = single + pair_tail
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )


@lru_cache(maxsize=1)
def _byte_alphabet() -> str:
    """GPT-2's byte -> printable character table, as a 256-char string indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in range(256))


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise CheckpointError(f"malformed GGUF merge {merge!r} (expected 'left right')")
    return left, right


# ---------------------------------------------------------------------------------------------------
# Chat templates


@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in the same sandbox, with the same helpers, as transformers."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(Extension):
        """`{% generation %}` only marks assistant text for training masks; render its body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps output.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------------
# Small helpers


# tokenizers takes ids as unsigned 32-bit ints.
_MAX_ID = 2**32 - 1


def _token_id(value: Any) -> int:
    if type(value) is not int and not is_int(value):
        raise ConfigError(f"token ids must be ints, got {value!r}.")
    return int(value)


def _token_ids(ids: Any) -> list[int]:
    """`ids` (a sequence or 1-D integer array of token ids) as the list of ints tokenizers takes."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"token ids must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}; "
                              "decode each row of a batch on its own.")
        out = ids.tolist()
    elif isinstance(ids, (str, bytes, bytearray, memoryview)) or not isinstance(ids, Iterable):
        raise ConfigError(f"expected a sequence of token ids, got {type(ids).__name__}; encode() turns text into ids.")
    else:
        out = [i if type(i) is int else _token_id(i) for i in ids]
    if out and not 0 <= min(out) <= max(out) <= _MAX_ID:
        bad = next(i for i in out if not 0 <= i <= _MAX_ID)
        hint = " (a cancelled generation's last chunk has token_id -1: leave it out)" if bad == -1 else ""
        raise ConfigError(f"token id {bad} is not a vocabulary id{hint}.")
    return out


def _sidecar_fields(meta: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The constructor's arguments from a `to_dict()` sidecar, each checked for its type."""
    if meta.get("format") != _META_FORMAT:
        raise CheckpointError(f"{where} is not a litekv tokenizer sidecar (format={meta.get('format')!r}).")
    version = meta.get("version", 0)
    if not is_int(version):
        raise CheckpointError(f"{where}: version must be an int, got {version!r}; reconvert the model.")
    if version > _META_VERSION:
        raise CheckpointError(f"{where}: version {version} is newer than this litekv understands "
                              f"({_META_VERSION}); upgrade litekv.")
    fields = {name: meta.get(name) for name in ("bos_token", "eos_token", "chat_template")}
    for name, value in fields.items():
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{where}: {name} must be a string or null, got {value!r}; reconvert the model.")
    ids = meta.get("eos_token_ids") or []
    if not isinstance(ids, list) or not all(is_int(i) for i in ids):
        raise CheckpointError(f"{where}: eos_token_ids must be a list of ints, got {ids!r}; reconvert the model.")
    return {**fields, "eos_token_ids": ids}


def _messages(messages: Any) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Iterable):
        raise ConfigError(f"messages must be a list of dicts such as {{'role': 'user', 'content': 'Hi'}}, got "
                          f"{type(messages).__name__}.")
    messages = list(messages)
    for message in messages:
        if not isinstance(message, Mapping):
            raise ConfigError(f"each message must be a dict such as {{'role': 'user', 'content': 'Hi'}}, got "
                              f"{message!r}.")
    return messages


def _invalid_text_message(text: str) -> str:
    at = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if at is None:
        return "tokenizers could not encode this text as Unicode."
    return (f"the text holds a lone surrogate U+{ord(text[at]):04X} at index {at}, which is not valid Unicode (e.g. "
            "from bytes decoded with errors='surrogateescape', or half of a JSON \\ud83d escape); replace it "
            "first, e.g. text.encode('utf-8', 'replace').decode('utf-8').")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} should hold a JSON object, not {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """tokenizer_config writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template is a string, or a list of named templates (use "default")."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _as_str(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)
