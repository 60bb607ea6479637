"""The grammar that makes `tool_choice` "required" / a named function hold while decoding: the output is
one (or, with `parallel_tool_calls`, more) tool call in GLM markup whose arguments follow the called
tool's JSON Schema,

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

(string values raw, other values JSON; up to `MAX_WHITESPACE` whitespace characters between the
elements, so GLM's newlines fit), as an xgrammar structural tag with its "glm_xml" argument style, the
format xgrammar ships for GLM-4.7/GLM-5. It is built here as plain JSON (this module runs in the
ingress, which does not load the grammar library); the engine compiles and enforces it
(engine/structured.py), and the tests check it against xgrammar's own GLM builder.

"auto" and "none" are not constrained (the model may answer in text). After the call(s) the grammar
allows only a stop token; with several calls allowed, text between calls may follow, so a model that
never stops runs to max_tokens.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from glm_ray.engine.sampling_params import StructuredOutputsParams
from glm_ray.serve.parsers.reasoning import END, START
from glm_ray.serve.parsers.tool_calls import CLOSE, KEY_CLOSE, KEY_OPEN, OPEN, VALUE_CLOSE, VALUE_OPEN

# the markup the parsers read (serve/parsers/), under the names this grammar uses
TOOL_CALL_BEGIN, TOOL_CALL_END = OPEN, CLOSE
THINK_BEGIN, THINK_END = START, END
ARG_MARKERS = [KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE]
MAX_WHITESPACE = 2
# no markup inside free text: thinking holds no tool call; text between calls may only open a call
REASONING_EXCLUDES = [THINK_BEGIN, THINK_END, TOOL_CALL_BEGIN, TOOL_CALL_END, *ARG_MARKERS]
TEXT_EXCLUDES = [THINK_BEGIN, THINK_END, TOOL_CALL_END, *ARG_MARKERS]

Reasoning = Literal["disabled", "enabled", "auto"]


def _call_tag(name: str, schema: Any) -> dict:
    return {"type": "tag", "begin": f"{TOOL_CALL_BEGIN}{name}",
            "content": {"type": "json_schema", "json_schema": True if schema is None else schema, "style": "glm_xml",
                        "any_order": False, "max_whitespace_cnt": MAX_WHITESPACE, "excludes": []},
            "end": TOOL_CALL_END}


def glm_tool_call_format(schemas: Mapping[str, Any], names: tuple[str, ...] | list[str], mode: str,
                         parallel: bool = True, reasoning: Reasoning = "disabled") -> dict | None:
    """The structural tag (a dict) for `mode` "required" (a call of any of `names`, more than one if
    `parallel`) or "named" (one call of `names[0]`); None for "auto" / "none". `schemas`: function name ->
    its `parameters` JSON Schema (None: any arguments). `reasoning`: "disabled" (the answer starts with
    the call), "enabled" (the prompt opened a thinking block: thinking text, `</think>`, then the call),
    "auto" (an optional `<think>...</think>` block first)."""
    if mode not in ("required", "named"):
        return None
    if not names:
        raise ValueError(f'tool_choice "{mode}" needs at least one tool')
    unknown = [n for n in names if n not in schemas]
    if unknown:
        raise ValueError(f"no schema for the tools {unknown}")
    if mode == "named":
        calls: dict = _call_tag(names[0], schemas[names[0]])
    else:
        calls = {"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN],
                 "tags": [_call_tag(n, schemas[n]) for n in names], "at_least_one": True,
                 "stop_after_first": not parallel, "excludes": TEXT_EXCLUDES}
    if reasoning == "disabled":
        fmt = calls
    elif reasoning in ("enabled", "auto"):
        think: dict = {"type": "tag", "begin": "" if reasoning == "enabled" else THINK_BEGIN,
                       "content": {"type": "any_text", "excludes": REASONING_EXCLUDES}, "end": THINK_END}
        if reasoning == "auto":
            think = {"type": "optional", "content": think}
        fmt = {"type": "sequence", "elements": [think, calls]}
    else:
        raise ValueError(f"reasoning must be 'disabled', 'enabled' or 'auto', got {reasoning!r}")
    return {"type": "structural_tag", "format": fmt}


def glm_tool_call_structured_outputs(schemas: Mapping[str, Any], names: tuple[str, ...] | list[str], mode: str,
                                     parallel: bool = True, reasoning: Reasoning = "disabled"
                                     ) -> StructuredOutputsParams | None:
    """`glm_tool_call_format` as a request's `SamplingParams.structured_outputs` (None when unconstrained).
    A schema the grammar cannot enforce is a 400 naming `tools` at the Router's validation."""
    fmt = glm_tool_call_format(schemas, names, mode, parallel, reasoning)
    return None if fmt is None else StructuredOutputsParams(structural_tag=json.dumps(fmt, ensure_ascii=False))
