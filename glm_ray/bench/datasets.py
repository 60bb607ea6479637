"""Serving-benchmark workloads: the requests a run sends (prompt token ids, output lengths).

This module owns the three datasets of ``glm-ray bench --dataset-name`` and their length laws; it does
no I/O except reading a ShareGPT file, and takes the tokenizer as an argument (the client passes
either the server's ``POST /tokenize`` or a local tokenizer).

- ``random``: prompts of uniformly random token ids (``[0, vocab)`` minus excluded ids), lengths from
  sglang's law `sample_lengths`. sglang's own ``random`` truncates/repeats ShareGPT text (which it
  downloads); its ``random-ids`` draws ids, which is what this is (``random-ids`` is accepted as a name).
  vLLM's ``--random-prefix-len`` (one shared random prefix before every prompt) is supported.
- ``sharegpt``: a ShareGPT-format JSON file (``[{"conversations": [{"from": "human", "value": ..},
  {"from": "gpt", "value": ..}, ..]}, ..]``; sglang also reads the key ``conversation``). sglang's
  rules: entries with fewer than 2 turns are dropped, turn 0 is the prompt, turn 1's token count is the
  output length (``--sharegpt-output-len`` fixes it, and must be >= 4); the list is shuffled; a pair
  whose prompt or output has fewer than 2 tokens is skipped, and with ``--sharegpt-context-len`` one
  whose prompt + output exceeds it; the first N that pass are used, no oversampling (vLLM: prunes < 4
  tokens, prompts > 1024, totals > 2048, and oversamples). Nothing is downloaded.
- ``generated-shared-prefix`` (sglang's ``--gsp-*``): G groups, each with one random system prompt of
  ``--gsp-system-prompt-len`` tokens shared by its P prompts, each followed by its own random question
  of ``--gsp-question-len`` tokens; N = G x P (``--num-prompts`` does not apply, as in sglang); shuffled.
  sglang builds text (system prompt + "\\n\\n" + question, from decoded random tokens); here the ids are
  sent as they are, so every prompt of a group starts with exactly the same prefix ids.

Length law (sglang's ``compute_random_lens``): ``L * r`` truncated, at least 1, up to ``L`` inclusive,
uniform; r = 0 (sglang's default) gives lengths uniform in [1, L], r = 1 fixed lengths. vLLM's law for
the same flag differs: ``[floor(L * (1 - r)), ceil(L * (1 + r))]`` with r in [0, 1), so its default 0
gives fixed lengths. We follow sglang.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

DATASETS = ("random", "sharegpt", "generated-shared-prefix")
DATASET_ALIASES = {"random-ids": "random"}      # sglang's id-only random dataset is our random


class DatasetError(ValueError):
    """A dataset that cannot be built (bad file, no usable entries, bad lengths)."""


@dataclass(frozen=True)
class DatasetRow:
    """One request of a run."""

    prompt_ids: tuple[int, ...]           # what /v1/completions receives
    output_len: int                       # max_tokens
    text: str | None = None               # the prompt as text, when the dataset has it (ShareGPT)
    group: int | None = None              # generated-shared-prefix: the group (shared prefix) index

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


# ----------------------------------------------------------------------------------------------
# Lengths and random ids

def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> list[int]:
    """sglang's length law: uniform integers in [max(int(L*r), 1), L]; r = 1 gives fixed L."""
    lo = max(int(length * range_ratio), 1)
    if lo >= length:
        return [length] * n
    return [int(x) for x in rng.integers(lo, length + 1, size=n)]


def random_prompts(
    rng: np.random.Generator, lengths: Sequence[int], vocab_size: int, exclude: Sequence[int] = ()
) -> list[list[int]]:
    """Token ids drawn uniformly from [0, vocab_size) minus ``exclude`` (no shared prefixes)."""
    excl = np.asarray(sorted({int(t) for t in exclude if 0 <= int(t) < vocab_size}), dtype=np.int64)
    allowed = vocab_size - excl.size
    if allowed <= 0:
        raise DatasetError(f"no token ids left: vocab_size={vocab_size} with {excl.size} excluded")
    out = []
    for n in lengths:
        ids = rng.integers(0, allowed, size=n, dtype=np.int64)
        if excl.size:
            # map [0, allowed) onto the allowed ids: shift by the number of excluded ids <= id
            for e in excl:
                ids = ids + (ids >= e)
        out.append(ids.tolist())
    return out


def random_rows(
    rng: np.random.Generator, n: int, *, input_len: int, output_len: int, range_ratio: float,
    vocab_size: int, exclude: Sequence[int] = (), prefix_len: int = 0,
) -> list[DatasetRow]:
    """``--dataset-name random``: n prompts; vLLM's ``prefix_len`` shared ids come first (total input =
    prefix + sampled length, as in vLLM)."""
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    prefix = random_prompts(rng, [prefix_len], vocab_size, exclude)[0] if prefix_len > 0 else []
    prompts = random_prompts(rng, in_lens, vocab_size, exclude)
    return [DatasetRow(tuple(prefix + p), o) for p, o in zip(prompts, out_lens)]


def shared_prefix_rows(
    rng: np.random.Generator, *, num_groups: int, prompts_per_group: int, system_prompt_len: int,
    question_len: int, output_len: int, vocab_size: int, exclude: Sequence[int] = (),
    range_ratio: float = 1.0,
) -> list[DatasetRow]:
    """``--dataset-name generated-shared-prefix``: G x P prompts = group prefix + own question, shuffled.
    ``range_ratio`` is sglang's ``--gsp-range-ratio`` (default 1.0: fixed lengths), same law as above."""
    sys_lens = sample_lengths(rng, num_groups, system_prompt_len, range_ratio)
    q_lens = sample_lengths(rng, num_groups * prompts_per_group, question_len, range_ratio)
    out_lens = sample_lengths(rng, num_groups * prompts_per_group, output_len, range_ratio)
    prefixes = random_prompts(rng, sys_lens, vocab_size, exclude)
    questions = random_prompts(rng, q_lens, vocab_size, exclude)
    rows = []
    for g in range(num_groups):
        for p in range(prompts_per_group):
            i = g * prompts_per_group + p
            rows.append(DatasetRow(tuple(prefixes[g] + questions[i]), out_lens[i], group=g))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


# ----------------------------------------------------------------------------------------------
# ShareGPT

def load_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(turn 0, turn 1) text of every entry with at least two turns, in file order."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"cannot read --dataset-path {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} objects")
    pairs = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        conv = entry.get("conversations", entry.get("conversation", []))
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        turns = [t.get("value") if isinstance(t, dict) else None for t in conv[:2]]
        if all(isinstance(t, str) for t in turns):
            pairs.append((turns[0], turns[1]))
    if not pairs:
        raise DatasetError(f"{path}: no conversation with at least two turns")
    return pairs


# texts -> token ids; ``add_special_tokens`` as in HF tokenizers / the /tokenize endpoint
Tokenize = Callable[[list[str], bool], Awaitable[list[list[int]]]]


async def sharegpt_rows(
    pairs: Sequence[tuple[str, str]], n: int, rng: np.random.Generator, tokenize: Tokenize, *,
    fixed_output_len: int | None = None, context_len: int | None = None, batch: int = 64,
) -> list[DatasetRow]:
    """The first ``n`` usable pairs after a seeded shuffle (sglang's filter; see the module doc).

    The prompt is tokenized with the tokenizer's special tokens (what a server adds to a text prompt,
    so the ids sent are the ones the server would have run); the completion without (the number of
    tokens a model generates for it; sglang's count includes the special tokens its tokenizer adds).
    Tokenizes in batches of ``batch`` pairs and stops once ``n`` rows passed. May return fewer than n.
    """
    if fixed_output_len is not None and fixed_output_len < 4:
        raise DatasetError("--sharegpt-output-len must be >= 4 (sglang's rule)")
    order = rng.permutation(len(pairs))
    rows: list[DatasetRow] = []
    for start in range(0, len(order), batch):
        if len(rows) >= n:
            break
        chunk = [pairs[int(i)] for i in order[start:start + batch]]
        prompt_ids = await tokenize([p for p, _ in chunk], True)
        completion_ids = (await tokenize([c for _, c in chunk], False)) if fixed_output_len is None else None
        for k, (prompt, _) in enumerate(chunk):
            if len(rows) >= n:
                break
            ids = prompt_ids[k]
            out = fixed_output_len if fixed_output_len is not None else len(completion_ids[k])
            if len(ids) < 2 or out < 2:
                continue
            if context_len and len(ids) + out > context_len:
                continue
            rows.append(DatasetRow(tuple(int(t) for t in ids), int(out), text=prompt))
    return rows


class LocalCodec:
    """``--tokenizer PATH``: a tokenizer directory on this machine (nothing is downloaded). The client's
    `ServerCodec` is the same interface over the server's ``/tokenize`` and ``/detokenize``."""

    def __init__(self, path: str):
        if not Path(path).is_dir():
            raise DatasetError(f"--tokenizer {path}: not a directory (a local tokenizer is read, "
                               "nothing is downloaded)")
        from transformers import AutoTokenizer  # noqa: PLC0415 - transformers is heavy: only with --tokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise DatasetError(f"--tokenizer {path}: {e}") from None

    async def encode(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        return [list(self.tok.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.tok.decode(list(x)) for x in ids]


def describe(rows: Sequence[DatasetRow]) -> dict[str, Any]:
    """Totals of a built dataset (sglang prints "#Input tokens" / "#Output tokens")."""
    return {"num_prompts": len(rows), "input_tokens": sum(r.prompt_len for r in rows),
            "output_tokens": sum(r.output_len for r in rows)}
