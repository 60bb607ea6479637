"""Tokenizer loading: the checkpoint's own, or — for config-only directories used with dummy
weights — a synthetic word-level tokenizer with one token per id ("<123>"), so token-id traffic
(benchmarks) gets non-empty text for every token and text round-trips through /tokenize."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in TOKENIZER_FILES)


def synthetic_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is heavy: only to build one
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()                   # "<1> <2>" -> "<1>", "<2>"
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)           # joins with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token="<1>", pad_token="<0>")
    fast.chat_template = ("{%- for m in messages -%}{{ m['content'] }} {% endfor -%}")
    return fast


def load_tokenizer(path: str | Path, vocab_size: int | None = None):
    """The model directory's tokenizer; a synthetic one when it has none (dummy-weight configs)."""
    p = Path(path)
    if not has_tokenizer(p):
        if vocab_size is None:
            cfg = p / "config.json"
            hf = json.loads(cfg.read_text()) if cfg.is_file() else {}
            vocab_size = hf.get("vocab_size") or (hf.get("text_config") or {}).get("vocab_size")   # glm5_next nests it
        if vocab_size is None:
            raise FileNotFoundError(f"{path}: no tokenizer files and no config.json to size a synthetic one")
        logger.warning("%s has no tokenizer: using a synthetic one-token-per-id tokenizer (%d ids)", path, vocab_size)
        return synthetic_tokenizer(vocab_size)
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy: only to load one
    try:
        return AutoTokenizer.from_pretrained(str(p))
    except Exception as e:   # e.g. an older transformers that rejects newer config.json fields
        if not (p / "tokenizer.json").is_file():
            raise
        logger.warning("AutoTokenizer failed for %s (%s); loading tokenizer.json directly", path, e)
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers is heavy: fallback path
        tc = json.loads((p / "tokenizer_config.json").read_text()) if (p / "tokenizer_config.json").is_file() else {}
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p / "tokenizer.json"),
                                      **{k: tc[k] for k in ("eos_token", "pad_token", "bos_token") if tc.get(k)})
        if (p / "chat_template.jinja").is_file():
            tok.chat_template = (p / "chat_template.jinja").read_text()
        return tok
