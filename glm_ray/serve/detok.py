"""Token ids -> display strings and raw bytes, for logprobs and /tokenize.

The engine detokenizes generated text itself (stop strings need it); the ingress only needs the
string of *one* token at a time, for logprob entries (`tokens`, `top_logprobs`, chat `bytes`) and
for `/tokenize?return_token_strs`. `decode([id])` per token is slow and loses information for
byte-level BPE tokens that hold part of a multi-byte character, so for byte-level tokenizers (the
GLM family's) we map the vocabulary string back to its bytes with the GPT-2 byte<->unicode table.
Everything is cached per id; the cache is bounded by the vocabulary.
"""
from __future__ import annotations

from typing import Any


def _byte_level_alphabet() -> dict[str, int]:
    """unicode char -> byte, the inverse of the byte-level BPE byte->printable-char table.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes are shifted to 256+n in
    byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table: dict[str, int] = {}
    shift = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shift)] = b
            shift += 1
    return table


_BYTE_DECODER = _byte_level_alphabet()


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return False
    return "ByteLevel" in repr(decoder)


class TokenStrings:
    """Cached `id -> str` and `id -> bytes` for one tokenizer.

    `text(id)` is the token as a user would read it (" hello", "\\n"); for a token that is only
    part of a UTF-8 character the undecodable bytes become U+FFFD. `bytes(id)` is the exact byte
    string the token contributes to the output (OpenAI's chat logprob `bytes`).
    Special/added tokens are returned by their literal content ("<|user|>").
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        try:
            self._added: dict[int, str] = {int(i): str(getattr(t, "content", t))
                                           for i, t in tokenizer.added_tokens_decoder.items()}
        except Exception:  # noqa: BLE001 - any tokenizer type: no added-token table, decode them instead
            self._added = {}
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            b = self._compute_bytes(token_id)
            self._bytes[token_id] = b
        return b

    def text(self, token_id: int) -> str:
        s = self._text.get(token_id)
        if s is None:
            s = self.bytes(token_id).decode("utf-8", errors="replace")
            self._text[token_id] = s
        return s

    def texts(self, token_ids: list[int]) -> list[str]:
        return [self.text(t) for t in token_ids]

    def _compute_bytes(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode("utf-8")
        if self.byte_level:
            try:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
            except Exception:  # noqa: BLE001 - any tokenizer type: fall back to decode() below
                piece = None
            if isinstance(piece, str) and piece and all(c in _BYTE_DECODER for c in piece):
                return bytes(_BYTE_DECODER[c] for c in piece)
        try:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - an undecodable id renders as "", never fails the response
            s = ""
        return s.encode("utf-8")
