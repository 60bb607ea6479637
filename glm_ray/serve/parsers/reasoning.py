"""The GLM thinking block: `<think>reasoning</think>answer` split into `reasoning_content` and `content`.

Where generation starts is read from the prompt's last assistant turn (thinking on/off per request):
  - it ends inside an open `<think>` (GLM-4.7/5's generation prompt with thinking on, the default):
    the output starts inside the thinking block, everything up to `</think>` is reasoning;
  - its last think tag is `</think>` (thinking off: GLM-4.7/5's `<|assistant|></think>`, GLM-4.5's
    `<think></think>`, `chat_template_kwargs: {"enable_thinking": false}`): the output is all content;
  - no think tag (GLM-4.5's generation prompt with thinking on): a `<think>` at the very start of the
    output (after whitespace) opens the block, otherwise the output is content.
Newlines right after `</think>` are dropped (GLM-4.5 writes `</think>\\n`; the templates strip them
when a turn is replayed). An unclosed block (the output ran out) is all reasoning.
"""
from __future__ import annotations

from glm_ray.serve.parsers.base import Content, Event, Reasoning, partial_tag

START, END = "<think>", "</think>"
ASSISTANT = "<|assistant|>"

# where the output starts
MAYBE = "maybe"            # a leading <think> opens the thinking block
THINKING = "thinking"      # inside the block
ANSWER = "answer"          # content only


def initial_state(prompt_text: str) -> str:
    """Where generation starts, from the rendered prompt (its part after the last assistant role token)."""
    tail = prompt_text[max(prompt_text.rfind(ASSISTANT), 0):]
    opened, closed = tail.rfind(START), tail.rfind(END)
    if opened > closed:
        return THINKING
    return ANSWER if closed >= 0 else MAYBE


class ReasoningParser:
    """Streaming split of one choice's text (see the module docstring)."""

    def __init__(self, state: str = MAYBE):
        self.state = state
        self.buf = ""
        self._after_end = False          # drop newlines right after </think>

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._run(out, final=True)
        if self.buf:
            out.append(Reasoning(self.buf) if self.state == THINKING else Content(self.buf))
            self.buf = ""
        return out

    def _run(self, out: list[Event], final: bool) -> None:
        while self.buf:
            if self.state == MAYBE:
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.state, self.buf = THINKING, head[len(START):]
                    continue
                if not final and (not head or START.startswith(head)):
                    return                                      # a <think> may still be arriving
                self.state = ANSWER
            elif self.state == THINKING:
                i = self.buf.find(END)
                if i < 0:
                    keep = 0 if final else partial_tag(self.buf, END)
                    if len(self.buf) > keep:
                        out.append(Reasoning(self.buf[:len(self.buf) - keep]))
                        self.buf = self.buf[len(self.buf) - keep:]
                    return
                if i:
                    out.append(Reasoning(self.buf[:i]))
                self.state, self.buf, self._after_end = ANSWER, self.buf[i + len(END):], True
            else:
                if self._after_end:
                    self.buf = self.buf.lstrip("\n")
                    if not self.buf:
                        return
                    self._after_end = False
                out.append(Content(self.buf))
                self.buf = ""
