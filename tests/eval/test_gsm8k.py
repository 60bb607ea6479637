"""`glm-ray eval gsm8k`: extraction rules on tricky outputs; the whole command against a stub
OpenAI-compatible server that answers right / wrong / with no number (accuracy 1.0 / 0.0 / invalid);
the prompt is sglang's few-shot format; `--compare`; and a live run against the tiny app (plumbing)."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
from aiohttp import web

from glm_ray.cli import main
from glm_ray.eval import gsm8k

ROWS = [{"question": f"Q{i}: what is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i:,}"}
        for i in range(1, 13)] + [{"question": "How much is a 1,000 and 234?", "answer": "#### 1,234"}]


@pytest.mark.parametrize("text,sglang,strict", [
    (" The answer is 18.", 18, 18),
    ("She makes $1,234 a week", 1234, 1234),
    ("It costs $12.50 in total.", 50, 12.5),
    ("The change is -3 degrees", 3, -3),
    ("5 apples and 7 pears, so 12.", 12, 12),
    ("no idea", None, None),
    ("", None, None),
    ("Answer: 007", None, 7),                    # sglang's ast.literal_eval("007") is a SyntaxError
    ("1,000,000.", 1000000, 1000000),
    ("2.0", 0, 2),
])
def test_extraction_rules(text, sglang, strict):
    assert gsm8k.extract(text, "sglang") == sglang
    assert gsm8k.extract(text, "strict") == strict


def test_reference_and_prompt_follow_sglang():
    assert gsm8k.reference(ROWS[0]) == 2 and gsm8k.reference(ROWS[-1]) == 1234
    prefix = gsm8k.few_shot_prefix(ROWS, 2)
    assert prefix == (f"Question: {ROWS[0]['question']}\nAnswer: {ROWS[0]['answer']}\n\n"
                      f"Question: {ROWS[1]['question']}\nAnswer: {ROWS[1]['answer']}\n\n")
    assert gsm8k.example(ROWS[3], False) == f"Question: {ROWS[3]['question']}\nAnswer:"
    assert gsm8k.same(2, 2.0) and not gsm8k.same(None, 2) and not gsm8k.same(2, 3)


class StubServer:
    """/v1/models and /v1/completions + /v1/chat/completions answering the *last* question of the
    prompt by `mode`: "right" (its reference), "wrong" (reference + 1), "none" (no number)."""

    def __init__(self, mode: str):
        self.mode, self.bodies = mode, []
        self.answers = {r["question"]: gsm8k.reference(r) for r in ROWS}
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()
        assert self._ready.wait(10)

    def _answer(self, prompt: str) -> str:
        q = re.findall(r"Question: (.*?)\nAnswer:", prompt)[-1]
        ref = self.answers[q]
        return {"right": f" So the answer is {ref:,}.", "wrong": f" It is {ref + 1}.", "none": " I am not sure."}[self.mode]

    def _serve(self):
        async def models(_):
            return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

        async def completions(req):
            body = await req.json()
            self.bodies.append(body)
            text = self._answer(body["prompt"])
            return web.json_response({"choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                                      "usage": {"completion_tokens": 5}})

        async def chat(req):
            body = await req.json()
            self.bodies.append(body)
            text = self._answer(body["messages"][-1]["content"])
            return web.json_response({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}],
                                      "usage": {"completion_tokens": 5}})

        async def start():
            app = web.Application()
            app.router.add_get("/v1/models", models)
            app.router.add_post("/v1/completions", completions)
            app.router.add_post("/v1/chat/completions", chat)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self._ready.set()

        loop = asyncio.new_event_loop()
        loop.run_until_complete(start())
        loop.run_forever()


@pytest.fixture
def data(tmp_path):
    p = tmp_path / "gsm8k.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return p


@pytest.mark.parametrize("mode,api,acc,invalid", [("right", "completions", 1.0, 0.0), ("wrong", "completions", 0.0, 0.0),
                                                  ("none", "completions", 0.0, 1.0), ("right", "chat", 1.0, 0.0)])
def test_command_against_a_stub_server(mode, api, acc, invalid, data, tmp_path, capsys):
    stub = StubServer(mode)
    out = tmp_path / "run.jsonl"
    rc = main(["eval", "gsm8k", "--base-url", stub.url, "--data", str(data), "--num-questions", "10",
               "--num-shots", "3", "--parallel", "4", "--api", api, "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert f"Accuracy: {acc:.3f}" in text and f"Invalid: {invalid:.3f}" in text
    rows, summary = gsm8k.read_jsonl(out)
    assert sorted(rows) == list(range(10)) and summary["model"] == "stub-model" and summary["accuracy"] == acc
    assert all(r["correct"] == (acc == 1.0) for r in rows.values())
    body = stub.bodies[0]
    assert body["temperature"] == 0 and body["max_tokens"] == 512 and body["stop"] == gsm8k.STOP
    prompt = body["prompt"] if api == "completions" else body["messages"][0]["content"]
    assert prompt.startswith(gsm8k.few_shot_prefix(ROWS, 3)) and prompt.count("Question:") == 4


def test_compare_lists_the_flips(data, tmp_path, capsys):
    paths = {}
    for mode in ("right", "wrong"):
        stub = StubServer(mode)
        paths[mode] = tmp_path / f"{mode}.jsonl"
        assert main(["eval", "gsm8k", "--base-url", stub.url, "--data", str(data), "--num-questions", "6",
                     "--num-shots", "2", "--json", str(paths[mode]), "--no-progress"]) == 0
    c = gsm8k.compare(paths["right"], paths["wrong"])
    assert c["questions"] == 6 and c["delta"] == -1.0 and c["became_wrong"] == list(range(6)) and not c["became_right"]
    capsys.readouterr()
    assert main(["eval", "gsm8k", "--compare", str(paths["right"]), str(paths["wrong"])]) == 0
    assert "delta B-A -1.0000" in capsys.readouterr().out


def test_unreachable_server_is_a_usage_error(data, capsys):
    rc = main(["eval", "gsm8k", "--base-url", "http://127.0.0.1:9", "--data", str(data), "--no-progress"])
    assert rc == 2 and "cannot evaluate" in capsys.readouterr().err


def test_default_data_is_the_shipped_test_split():
    rows = gsm8k.load_rows(None)
    assert len(rows) == 1319 and gsm8k.reference(rows[0]) == 18


def test_live_run_against_the_tiny_app(tiny_server, tmp_path, capsys):
    """Plumbing only: 20 questions through the served tiny model (random weights: accuracy is whatever)."""
    out = tmp_path / "live.jsonl"
    rc = main(["eval", "gsm8k", "--base-url", tiny_server.base_url, "--model", tiny_server.model,
               "--num-questions", "20", "--num-shots", "1", "--max-tokens", "8", "--parallel", "8",
               "--json", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr()
    rows, summary = gsm8k.read_jsonl(out)
    assert len(rows) == 20 and summary["errors"] == 0 and summary["output_tokens"] > 0
    assert 0.0 <= summary["accuracy"] <= 1.0
