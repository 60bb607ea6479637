"""OpenAI-compatible response wire types (completions, chat, streaming chunks, models, tokenize) and their
server-sent-event framing. Plain pydantic models, no Ray or FastAPI; the request side (parsing,
validation, `to_sampling_params`) is serve/protocol.py.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, Field


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class PromptLogprob(BaseModel):
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)

    def extend(self, other: "CompletionLogProbs") -> None:
        self.text_offset += other.text_offset
        self.token_logprobs += other.token_logprobs
        self.tokens += other.tokens
        self.top_logprobs += other.top_logprobs


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A stream chunk's choice: the same fields, `text` being the new text only."""


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: Optional[list[ChatLogprobEntry]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str                      # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None     # the thinking block (--reasoning-parser)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    arguments: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)


class DeltaToolCall(BaseModel):
    """OpenAI's stream shape: a call's first delta has id, type and function.name, later ones only
    function.arguments fragments (by `index`)."""
    index: int
    id: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    type: Optional[Literal["function"]] = Field(default=None, exclude_if=lambda v: v is None)
    function: Optional[DeltaFunctionCall] = Field(default=None, exclude_if=lambda v: v is None)


class DeltaMessage(BaseModel):
    role: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    content: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    reasoning_content: Optional[str] = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: Optional[list[DeltaToolCall]] = Field(default=None, exclude_if=lambda v: v is None)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "glm-ray"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    vocab_size: Optional[int] = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(BaseModel):
    prompt: str


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event frame."""
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    else:
        data = json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
