"""Output parsers of /v1/chat/completions, chosen by `--reasoning-parser` / `--tool-call-parser` (vLLM's flag
names and values): the thinking block -> `reasoning_content` (reasoning.py), GLM tool-call markup ->
`tool_calls` (tool_calls.py), as typed events (base.py) that the ingress renders as one message or as
stream deltas.

Names: tool calls "glm47" (GLM-4.7 / GLM-5 layout) and "glm45" (GLM-4.5 / 4.6) share one parser that
reads both; reasoning "glm45" (every GLM thinking model). "auto" (the default) picks them from the
checkpoint's `model_type`, "none" turns a parser off. Per request: reasoning is split whenever the parser
is on (where the output starts is read from the prompt: reasoning.initial_state); tool calls are parsed
when the request has `tools` and `tool_choice` is not "none".
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from glm_ray.serve.parsers.base import (
    Content,
    Event,
    ParsedMessage,
    ParsedToolCall,
    Reasoning,
    ToolCallArgs,
    ToolCallStart,
)
from glm_ray.serve.parsers.reasoning import ReasoningParser, initial_state
from glm_ray.serve.parsers.tool_calls import ToolCallParser, new_call_id

__all__ = ["Content", "Event", "ParsedMessage", "ParsedToolCall", "Reasoning", "ToolCallArgs", "ToolCallStart",
           "ReasoningParser", "ToolCallParser", "ToolChoice", "OutputParser", "TOOL_CALL_PARSERS",
           "REASONING_PARSERS", "resolve_parsers", "new_call_id"]

logger = logging.getLogger(__name__)

TOOL_CALL_PARSERS = ("auto", "none", "glm45", "glm47")
REASONING_PARSERS = ("auto", "none", "glm45")

# model_type (config.json) -> (tool-call parser, reasoning parser) for "auto"
_AUTO: dict[str, tuple[str, str]] = {
    "glm_moe_dsa": ("glm47", "glm45"),          # GLM-5 / 5.1 / 5.2
    "glm5_next": ("glm47", "glm45"),            # GLM-5.3-Flash
    "glm5_next_text": ("glm47", "glm45"),
    "glm4_moe_lite": ("glm47", "glm45"),        # GLM-4.7-Flash
    "glm4_moe": ("glm45", "glm45"),             # GLM-4.5 / 4.6 / 4.7
}


def resolve_parsers(tool_call_parser: str, reasoning_parser: str, model_type: str | None) -> tuple[str, str]:
    """The flags' values with "auto" resolved from the model type (an unknown type: "none")."""
    tool, reasoning = _AUTO.get(model_type or "", ("none", "none"))
    return (tool if tool_call_parser == "auto" else tool_call_parser,
            reasoning if reasoning_parser == "auto" else reasoning_parser)


@dataclass(frozen=True)
class ToolChoice:
    """A request's tools and `tool_choice`, validated (serve/protocol.py builds it).

    mode: "none" (markup stays text), "auto", "required" (a call is expected), "named" (a call of
    `names[0]` is expected). Only the parser acts on it here: constraining decoding so that "required" /
    "named" always produce a call is the structured-outputs grammar's job (issue 21 item 4), which can
    read `constrained`, `names` and `schemas`.
    """
    mode: Literal["none", "auto", "required", "named"] = "auto"
    schemas: Mapping[str, Any] = field(default_factory=dict)     # function name -> parameters schema
    names: tuple[str, ...] = ()                                   # the names a call may use
    parallel: bool = True                                         # parallel_tool_calls

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


class OutputParser:
    """One choice's text -> events: the reasoning split first, tool calls in the rest.

    A parser that fails (a bug, never expected) is contained: the rest of the text passes through as
    content, and the request goes on.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolCallParser | None = None):
        self.reasoning, self.tools = reasoning, tools
        self._broken = False

    @classmethod
    def create(cls, reasoning_parser: str, tool_call_parser: str, prompt_text: str,
               tool_choice: ToolChoice | None) -> "OutputParser":
        reasoning = ReasoningParser(initial_state(prompt_text)) if reasoning_parser != "none" else None
        tools = None
        if tool_call_parser != "none" and tool_choice is not None and tool_choice.mode != "none":
            tools = ToolCallParser(tool_choice.schemas, tool_choice.names or None,
                                   max_calls=None if tool_choice.parallel else 1)
        return cls(reasoning, tools)

    @property
    def called(self) -> bool:
        """Whether a tool call was reported (finish_reason "tool_calls")."""
        return self.tools is not None and self.tools.called

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        return self._guard(lambda: self._route(self.reasoning.feed(text) if self.reasoning else [Content(text)]),
                           text)

    def finish(self) -> list[Event]:
        def run():
            out = self._route(self.reasoning.finish()) if self.reasoning else []
            return out + (self.tools.finish() if self.tools else [])
        return self._guard(run, "")

    def parse(self, text: str) -> ParsedMessage:
        """The whole text at once (a non-streaming response)."""
        return ParsedMessage.of(self.feed(text) + self.finish())

    def _route(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for e in events:
            out.extend(self.tools.feed(e.text) if isinstance(e, Content) else [e])
        return out

    def _guard(self, run, text: str) -> list[Event]:
        if self._broken:
            return [Content(text)] if text else []
        try:
            return run()
        except Exception:  # noqa: BLE001 - a parser bug must not fail the request: pass the text through
            logger.exception("output parser failed; the rest of this choice is returned as plain content")
            self._broken = True
            return [Content(text)] if text else []
