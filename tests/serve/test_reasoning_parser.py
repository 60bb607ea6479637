"""The thinking-block parser (glm_ray/serve/parsers/reasoning.py): where the output starts (read from the
rendered prompt), the split into reasoning_content / content against an independent reference split, and
streaming: every way of cutting the text into pieces adds up to the one-piece result."""
from __future__ import annotations

import random

import pytest

from glm_ray.serve.parsers import OutputParser, ParsedMessage, ToolChoice
from glm_ray.serve.parsers.reasoning import ANSWER, MAYBE, THINKING, ReasoningParser, initial_state


def reference(state: str, text: str) -> tuple[str | None, str]:
    """The split as the module docstring states it, written independently (string ops, no state machine)."""
    if state == ANSWER:
        return None, text
    if state == MAYBE:
        head = text.lstrip()
        if not head.startswith("<think>"):
            return None, text
        text = head[len("<think>"):]
    reasoning, sep, content = text.partition("</think>")
    if not sep:
        return reasoning or None, ""
    return reasoning or None, content.lstrip("\n")


def run(state: str, pieces: list[str]) -> ParsedMessage:
    p = ReasoningParser(state)
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    return ParsedMessage.of(events)


@pytest.mark.parametrize("prompt,state", [
    ("[gMASK]<sop><|user|>Hi<|assistant|><think>", THINKING),              # GLM-4.7/5, thinking on
    ("[gMASK]<sop><|user|>Hi<|assistant|></think>", ANSWER),               # GLM-4.7/5, enable_thinking false
    ("[gMASK]<sop><|user|>Hi<|assistant|>\n<think></think>", ANSWER),      # GLM-4.5, thinking off
    ("[gMASK]<sop><|user|>Hi<|assistant|>", MAYBE),                        # GLM-4.5, thinking on
    ("<|user|>what does <think> mean?<|assistant|>", MAYBE),               # a tag in the user's text
    ("<|user|>x<|assistant|><think>so far", THINKING),                     # continue_final_message in thinking
    ("<|user|>x<|assistant|><think>r</think>partial answer", ANSWER),
    ("no role tokens at all", MAYBE),
])
def test_where_generation_starts(prompt, state):
    assert initial_state(prompt) == state


CASES = [
    (THINKING, "Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    (THINKING, "still thinking when the tokens ran out", "still thinking when the tokens ran out", ""),
    (THINKING, "</think>no reasoning at all", None, "no reasoning at all"),
    (THINKING, "plan\n</think>\n\nanswer\n", "plan\n", "answer\n"),
    (THINKING, "a</think>b</think>c", "a", "b</think>c"),
    (THINKING, "a <thin", "a <thin", ""),
    (THINKING, "x</thi", "x</thi", ""),
    (MAYBE, "<think>r</think>c", "r", "c"),
    (MAYBE, "\n<think>\nr\n</think>\nc", "\nr\n", "c"),
    (MAYBE, "hello <think>x</think>", None, "hello <think>x</think>"),
    (MAYBE, "<thin", None, "<thin"),
    (MAYBE, "  ", None, "  "),
    (MAYBE, "", None, ""),
    (ANSWER, "<think>r</think>c", None, "<think>r</think>c"),
    (ANSWER, "plain", None, "plain"),
    (THINKING, "思考</think>答案", "思考", "答案"),
]


@pytest.mark.parametrize("state,text,reasoning,content", CASES)
def test_split_matches_the_table_and_the_reference(state, text, reasoning, content):
    assert reference(state, text) == (reasoning, content)
    msg = run(state, [text])
    assert (msg.reasoning_content, msg.content) == (reasoning, content)


@pytest.mark.parametrize("state,text,reasoning,content", CASES)
def test_every_two_cut_split_streams_the_same(state, text, reasoning, content):
    whole = run(state, [text])
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(state, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert run(state, list(text)) == whole


def test_random_texts_against_the_reference():
    rng = random.Random(7)
    parts = ["<think>", "</think>", "<thi", "</", "\n", " ", "a", "b", "think>", "<", ">"]
    for _ in range(3000):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 8)))
        state = rng.choice([THINKING, MAYBE, ANSWER])
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 4)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        msg = run(state, pieces)
        assert (msg.reasoning_content, msg.content) == reference(state, text), (state, text, pieces)


def test_streamed_reasoning_is_emitted_before_the_end_tag_arrives():
    p = ReasoningParser(THINKING)
    assert ParsedMessage.of(p.feed("step one, ")).reasoning_content == "step one, "
    assert ParsedMessage.of(p.feed("two</thi")).reasoning_content == "two"       # the tag prefix is held
    rest = ParsedMessage.of(p.feed("nk>ok") + p.finish())
    assert (rest.reasoning_content, rest.content) == (None, "ok")


def test_output_parser_routes_only_the_answer_to_the_tool_parser():
    tools = ToolChoice("auto", {"f": None}, ("f",))
    p = OutputParser.create("glm45", "glm47", "<|assistant|><think>", tools)
    msg = p.parse("maybe <tool_call>f</tool_call> here?</think>ok<tool_call>f</tool_call>")
    assert msg.reasoning_content == "maybe <tool_call>f</tool_call> here?"   # a call inside thinking stays text
    assert msg.content == "ok" and [(c.name, c.arguments) for c in msg.tool_calls] == [("f", "{}")]


def test_parsers_off_pass_the_text_through():
    p = OutputParser.create("none", "none", "<|assistant|><think>", ToolChoice("auto", {"f": None}, ("f",)))
    msg = p.parse("r</think><tool_call>f</tool_call>")
    assert (msg.reasoning_content, msg.content, msg.tool_calls) == (None, "r</think><tool_call>f</tool_call>", [])


def test_a_failing_parser_degrades_to_plain_content(monkeypatch):
    p = OutputParser.create("glm45", "none", "<|assistant|><think>", None)
    assert ParsedMessage.of(p.feed("abc")).reasoning_content == "abc"

    def boom(text):
        raise RuntimeError("parser bug")
    monkeypatch.setattr(p.reasoning, "feed", boom)
    assert ParsedMessage.of(p.feed("def") + p.feed("g") + p.finish()).content == "defg"
