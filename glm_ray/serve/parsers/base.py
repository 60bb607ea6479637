"""What the output parsers produce: typed events (streaming) and the message they add up to.

A parser is fed the generated text in whatever pieces the engine emits (`feed`) and closed once
(`finish`); each call returns the events that became certain. The non-streaming response is the same
parser fed the whole text at once, so a streamed response adds up to the non-streamed one by
construction, however the text was split (tests/serve/test_tool_parser.py checks every split).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union


@dataclass(frozen=True)
class Reasoning:
    """Text of the thinking block (`message.reasoning_content` / `delta.reasoning_content`)."""
    text: str


@dataclass(frozen=True)
class Content:
    """Answer text (`content`)."""
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call whose function name is certain: OpenAI's first delta of a call (id, type, name)."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    """The next fragment of call `index`'s `arguments` JSON string."""
    index: int
    fragment: str


Event = Union[Reasoning, Content, ToolCallStart, ToolCallArgs]


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""          # a JSON object, as a string (OpenAI's wire form)


@dataclass
class ParsedMessage:
    """The events of one choice added up: what a non-streaming response carries."""
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    @classmethod
    def of(cls, events: list[Event]) -> "ParsedMessage":
        msg = cls()
        reasoning: list[str] = []
        content: list[str] = []
        for e in events:
            if isinstance(e, Reasoning):
                reasoning.append(e.text)
            elif isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, ToolCallStart):
                msg.tool_calls.append(ParsedToolCall(e.id, e.name))
            else:
                msg.tool_calls[e.index].arguments += e.fragment
        msg.content = "".join(content)
        msg.reasoning_content = "".join(reasoning) or None
        return msg


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text to hold back while
    the tag may still be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
