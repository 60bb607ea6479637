"""What structured outputs cost a decode step: a batch of `--batch` requests decoding together, of which
0 / 16 / 64 (`--constrained`) follow a JSON schema, through the offline engine.

    python -m glm_ray.bench.structured                                   # the tiny model on CPU
    python -m glm_ray.bench.structured glm5-flash-31b --load-format dummy --quant fp8 --device cuda \\
        --scheduling sync async --json structured.jsonl

Per row: the median wall time of a pure-decode step at full batch (`decode_step_ms`), the worker's
sampling time (`sample_ms`: bitmask fill + copy + apply + sampling; on CUDA it also waits for the
forward), the host time filling the constrained rows' bitmask (`mask_fill_ms`, part of sample_ms, overlapping
the device's forward), and `step_overhead`, the step time over the unconstrained row's. The schema is an
array of at least 1000 objects with typed fields (integers in a range, short strings, an enum,
numbers, booleans), so constrained requests never finish early and each step's mask covers every kind
of JSON state; unconstrained requests ignore EOS.

Grammars need a vocabulary: the model's tokenizer, or (`--vocab synthetic`, the default for a directory
without one, e.g. a `--load-format dummy` config) a deterministic byte-level vocabulary of the model's
size built from words and word pieces of Python's standard library sources, so mask computation sees a
realistic mix of short and long, word and punctuation tokens.
"""
from __future__ import annotations

import argparse
import random
import re
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import xgrammar as xgr

from glm_ray.bench.decode import model_dir_for
from glm_ray.bench.offline import _measure
from glm_ray.bench.table import append_rows, print_rows
from glm_ray.engine.sampling_params import SamplingParams, StructuredOutputsParams
from glm_ray.engine.structured import GrammarRuntime
from glm_ray.engine.tokenizer import has_tokenizer
from glm_ray.llm import LLM

SCHEMA = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "score", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                   "name": {"type": "string", "maxLength": 12},
                   "kind": {"enum": ["alpha", "beta", "gamma"]},
                   "score": {"type": "number"}, "ok": {"type": "boolean"}}}}


def synthetic_vocab(vocab_size: int, eos_ids) -> xgr.TokenizerInfo:
    """A byte-level-like vocabulary of `vocab_size` tokens: the 256 bytes, then words, ' word' and word
    pieces of the standard library's sources (deterministic), the EOS ids as stop tokens."""
    pieces: set[str] = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        for w in re.findall(r"\w+|[^\w\s]{1,3}|\s+", path.read_text(errors="ignore")):
            pieces.update((w, " " + w, *(w[:i] for i in range(1, min(len(w), 6))), *(w[i:] for i in range(1, min(len(w), 6)))))
        if len(pieces) > 2 * vocab_size:
            break
    order = sorted(pieces)
    random.Random(0).shuffle(order)
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    for p in order:
        if len(vocab) >= vocab_size:
            break
        b = p.encode()
        if b not in seen:
            seen.add(b)
            vocab.append(b)
    vocab += [f"<pad{i}>".encode() for i in range(vocab_size - len(vocab))]
    for e in eos_ids:
        vocab[e] = f"<eos{e}>".encode()
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(eos_ids))


def run(model: str | None, batch: int, constrained: list[int], input_len: int, output_len: int,
        scheduling=("sync",), vocab: str = "auto", **engine_kw) -> list[dict]:
    llm = LLM(model, max_num_seqs=batch, **engine_kw)
    runner = llm.engine.executor.worker.runner
    V, eos = llm.engine.model_cfg.vocab_size, llm.engine.model_cfg.eos_token_ids
    if vocab == "synthetic" or (vocab == "auto" and not has_tokenizer(llm.config.model)):
        info = synthetic_vocab(V, eos)
        runner.grammars = GrammarRuntime(lambda: info, V, eos)
        vocab = "synthetic"
    else:
        vocab = "model"
    rt = runner.grammar_runtime()
    fill = []
    orig_bitmask = rt.bitmask

    def timed_bitmask(*a, **kw):
        t0 = time.perf_counter()
        out = orig_bitmask(*a, **kw)
        fill.append(time.perf_counter() - t0)
        return out
    rt.bitmask = timed_bitmask
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, V, (input_len,), generator=g).tolist()} for _ in range(batch)]
    spec = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(max_tokens=output_len, temperature=1.0, seed=1, ignore_eos=True)
    llm.generate(prompts[:2], [free, SamplingParams(max_tokens=4, structured_outputs=spec)], use_tqdm=False)  # warm-up
    rows = []
    for mode in scheduling:
        base = None
        for k in constrained:
            k = min(k, batch)
            params = [SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, structured_outputs=spec)
                      for i in range(k)] + [free] * (batch - k)
            fill.clear()
            r = _measure(llm, prompts, params, mode)
            done = [n for n in fill if n > 0]
            r |= {"batch": batch, "constrained": k, "vocab": vocab, "vocab_size": V,
                  "mask_fill_ms": (sorted(done)[len(done) // 2] * 1e3) if done and k else 0.0}
            base = base if base is not None else r["decode_step_ms"]
            r["step_overhead"] = r["decode_step_ms"] / base - 1.0
            rows.append(r)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="checkpoint or config directory (default: the tiny model)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--constrained", type=int, nargs="+", default=[0, 16, 64],
                   help="how many of the batch's requests follow the schema (the first value is the baseline)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--vocab", choices=["auto", "model", "synthetic"], default="auto")
    p.add_argument("--scheduling", nargs="+", choices=["sync", "async"], default=["sync"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quant", choices=["fp8", "bf16"], default=None,
                   help="a config-only model's quantization for dummy weights (as bench.decode)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--json", default=None, help="also write the rows to this JSONL file")
    a = p.parse_args(argv)
    kw = dict(dtype=a.dtype, device=a.device, load_format=a.load_format, kv_cache_memory_bytes=a.kv_cache_memory_bytes,
              max_num_batched_tokens=max(2048, a.input_len * a.batch))
    model = a.model
    if a.quant:
        model = str(model_dir_for(model or "tiny", a.quant, Path(tempfile.mkdtemp(prefix="glm-ray-structured-"))))
    rows = run(model, a.batch, a.constrained, a.input_len, a.output_len, tuple(a.scheduling), a.vocab, **kw)
    print_rows(rows, ["scheduling", "batch", "constrained", "decode_step_ms", "sample_ms", "mask_fill_ms",
                      "forward_ms", "step_overhead"])
    append_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
