"""Incremental detokenization and stop-string handling for one request.

Text is produced with the offset trick (decode a short window and emit only what became stable; a
trailing U+FFFD means an incomplete UTF-8 sequence, so wait). When stop strings are set, the last
`max_stop_len - 1` characters are held back from streaming until they cannot start a stop string.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    CONTEXT = 6   # prompt tokens used as left context (leading-space handling of some tokenizers)

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str], include_stop: bool,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.sent = 0                                  # chars of `text` already emitted
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special = skip_special_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; returns the matched stop string if the text now contains one."""
        if self.tok is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            old_len = len(self.text)
            self.text += new
            return self._check_stop(old_len) if check_stop else None
        return None

    def _check_stop(self, old_len: int) -> str | None:
        if not self.stop:
            return None
        lo = max(0, old_len - self.hold)
        best = None
        for s in self.stop:
            i = self.text.find(s, lo)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        return s

    def take(self, finished: bool) -> str:
        """Text not yet emitted that is safe to emit now."""
        upto = len(self.text) if finished else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:upto]
        self.sent = upto
        return out
