"""Tokenizer loading: any HF `tokenizer.json` (via `tokenizers`) wrapped for chat use.

This module owns the mapping between text and token ids for the harness and the TITO assembler:

- `encode_text` never produces a control-token id: text that spells a control token (a file
  containing `<|im_end|>`) is cut so that the added-token matcher cannot fire. Control tokens
  enter a stream only from the chat template (`encode_pieces`) or from the sampler.
- `decode_bytes` is exact for byte-level BPE tokenizers (Qwen's, and the project's): every id maps
  to the bytes it stands for, so text-space comparisons at turn boundaries are byte-exact even
  when a boundary splits a multi-byte character. For other decoders it falls back to
  `Tokenizer.decode` per id (`exact_bytes` is False).
- The chat control tokens named in `chat_template.CONTROL_TOKENS` must exist in the vocabulary;
  a tokenizer file that lacks one is rejected at load time with the file and token named.

`PROJECT_TOKENIZER_PATH` is the project's own 2048-id byte-level BPE (trained by
`t1jax.agent.train_tokenizer` on generated shell text); `load_project_tokenizer()` loads it.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from t1jax.agent.chat_template import CONTROL_TOKENS, END_OF_TEXT, IM_END, IM_START, Piece

_REPLACEMENT = "\ufffd".encode()
PROJECT_TOKENIZER_PATH = Path(__file__).resolve().parent / "assets" / "t1jax-bpe-2048.json"


@functools.cache
def _byte_level_decoding_table() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable bytes stand for themselves, the other 68
    bytes are shifted to code points 256.. in byte order (the GPT-2 byte-level convention)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    )
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + shift)] = b
            shift += 1
    return table


def _is_byte_level(tokenizer_json: dict) -> bool:
    decoder = tokenizer_json.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return True
    return any(d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) or [])


class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the chat control tokens and exact byte decoding."""

    def __init__(self, tokenizer: Tokenizer, *, source: str = "<memory>") -> None:
        self.hf = tokenizer
        self.source = source
        missing = [t for t in CONTROL_TOKENS if tokenizer.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer {source}: missing chat control tokens {missing}")
        self._control_ids = {t: int(tokenizer.token_to_id(t)) for t in CONTROL_TOKENS}
        added = tokenizer.get_added_tokens_decoder()
        self._added_contents = sorted({tok.content for tok in added.values()}, key=len, reverse=True)
        self._added_pattern = (
            re.compile("|".join(re.escape(c) for c in self._added_contents)) if self._added_contents else None
        )
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.exact_bytes = _is_byte_level(json.loads(tokenizer.to_str()))
        self._bytes_table = self._build_bytes_table(added)

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # tokenizers raises a bare Exception on malformed JSON
            raise ValueError(f"tokenizer file {path} could not be parsed: {error}") from error
        return cls(tokenizer, source=str(path))

    # ---- control tokens -------------------------------------------------------------------

    def token_id(self, control_token: str) -> int:
        try:
            return self._control_ids[control_token]
        except KeyError:
            raise KeyError(f"{control_token!r} is not a chat control token of {self.source}") from None

    @property
    def im_start_id(self) -> int:
        return self._control_ids[IM_START]

    @property
    def im_end_id(self) -> int:
        return self._control_ids[IM_END]

    @property
    def end_of_text_id(self) -> int:
        return self._control_ids[END_OF_TEXT]

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: `<|im_end|>` (the template's) and `<|endoftext|>`."""
        return (self.im_end_id, self.end_of_text_id)

    # ---- encoding --------------------------------------------------------------------------

    def encode_text(self, text: str) -> list[int]:
        """Encode untrusted text; never yields a control-token id (see module docstring)."""
        text = _valid_unicode(text)
        if not text:
            return []
        chunks = [text]
        if self._added_pattern is not None and self._added_pattern.search(text):
            chunks, start = [], 0
            for match in self._added_pattern.finditer(text):
                cut = match.start() + 1  # split inside the spelling so the matcher cannot fire
                chunks.append(text[start:cut])
                start = cut
            chunks.append(text[start:])
        ids: list[int] = []
        for chunk in chunks:
            if chunk:
                ids.extend(self.hf.encode(chunk, add_special_tokens=False).ids)
        return ids

    def encode_as_model_output(self, text: str) -> list[int]:
        """Encode text the way a model would emit it, control-token spellings becoming control
        ids. Only for scripted policies and tests; environment text goes through `encode_text`."""
        return list(self.hf.encode(_valid_unicode(text), add_special_tokens=False).ids)

    def encode_pieces(self, pieces: Iterable[Piece]) -> np.ndarray:
        ids: list[int] = []
        for piece in pieces:
            if piece.control:
                ids.append(self.token_id(piece.text))
            else:
                ids.extend(self.encode_text(piece.text))
        return np.asarray(ids, dtype=np.int32)

    # ---- decoding --------------------------------------------------------------------------

    def _build_bytes_table(self, added) -> list[bytes]:
        table: list[bytes] = []
        decode_char = _byte_level_decoding_table()
        for token_id in range(self.vocab_size):
            if token_id in added:
                table.append(added[token_id].content.encode("utf-8"))
                continue
            piece = self.hf.id_to_token(token_id)
            if piece is None:
                table.append(b"")
            elif self.exact_bytes and all(ch in decode_char for ch in piece):
                table.append(bytes(decode_char[ch] for ch in piece))
            else:
                table.append(self.hf.decode([token_id], skip_special_tokens=False).encode("utf-8"))
        return table

    def token_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(
                f"token id {token_id} outside the vocabulary of {self.source} (size {self.vocab_size})"
            )
        return self._bytes_table[token_id]

    def decode_bytes(self, ids: Sequence[int] | np.ndarray) -> bytes:
        """Bytes of `ids`; an id outside the vocabulary (a padded model vocabulary can sample one)
        decodes to U+FFFD instead of raising."""
        table, size = self._bytes_table, self.vocab_size
        return b"".join(table[i] if 0 <= i < size else _REPLACEMENT for i in map(int, ids))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of `ids`, control tokens spelled out; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _valid_unicode(text: str) -> str:
    """`tokenizers` needs valid UTF-8; lone surrogates (from `surrogateescape` decoding of binary
    output) become U+FFFD rather than raising."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= ch <= "\udfff" else ch for ch in text)


def load_tokenizer(path: str | Path | None = None) -> ChatTokenizer:
    """Load `path` (any HF tokenizer.json with the chat control tokens), or the project tokenizer."""
    return ChatTokenizer.from_file(PROJECT_TOKENIZER_PATH if path is None else path)


@functools.cache
def load_project_tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_file(PROJECT_TOKENIZER_PATH)
