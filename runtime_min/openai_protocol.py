"""The OpenAI API's request bodies and response objects, as `dsneuron serve` speaks them.

Follows the OpenAI API reference (Completions: POST /v1/completions; Chat: POST
/v1/chat/completions; streaming as server-sent events of `text_completion` /
`chat.completion.chunk` objects ending with `data: [DONE]`; errors as {"error": {message, type,
param, code}}), with vLLM's OpenAI server where the reference leaves a choice open:

- max_tokens defaults to 16 for completions (the reference's default) and to the rest of the
  context capacity for chat; `max_completion_tokens` is the newer chat name of max_tokens;
- temperature and top_p default to 1 (the reference's defaults); temperature is in 0..2 (the
  reference's range; 0 is greedy, runtime_min/sampling.py);
- types are strict ("2" is not an integer, true is not 1) and an explicit null is the default;
- seed: an integer in 0..2**64-1; a request without one gets a fresh one;
- stop: a string or at most 4 strings, cut from the text;
- prompt: a string, a list of strings, a list of token ids, or a list of token-id lists (one
  choice each, `index` in order);
- fields the bundle cannot honour are refused by name unless they hold their neutral value
  (n > 1, best_of > 1, echo, suffix, logprobs, presence/frequency penalties, logit_bias, tools,
  a response_format other than text); unknown fields are ignored, as the reference's clients
  send newer ones.

Pydantic validates the types; `ProtocolError` (status 400) names the field and the limit.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from dsneuron import UserError

from .scheduler import MAX_STOP

#: the OpenAI API's largest temperature
MAX_TEMPERATURE = 2.0


class ProtocolError(UserError):
    """An HTTP error in the OpenAI format: status, type, param (the field at fault) and code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.type, self.code = status, param, type, code

    def body(self) -> dict:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _Sampling(BaseModel):
    # strict: "2" is not an integer and true is not 1, as the OpenAI API's schema says
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def check_neutral(self) -> None:
        """ProtocolError for a field this server cannot honour (module docstring)."""
        for name, neutral in self._neutral().items():
            value = getattr(self, name)
            if value not in neutral:
                raise ProtocolError(f"{name}={value!r:.80} is not supported by this server (only {neutral[0]!r})",
                                    param=name)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ProtocolError(f"temperature must be in 0..{MAX_TEMPERATURE} (the OpenAI API's range; 0 = greedy), "
                                f"got {self.temperature}", param="temperature")
        if len(self.stops()) > MAX_STOP:
            raise ProtocolError(f"stop: at most {MAX_STOP} sequences, got {len(self.stops())}", param="stop")

    def _neutral(self) -> dict[str, tuple]:
        return {"n": (1,), "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {})}


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    suffix: Optional[str] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None

    def _neutral(self) -> dict[str, tuple]:
        return {**super()._neutral(), "echo": (False,), "suffix": (None,), "logprobs": (None,), "best_of": (None, 1)}


class ChatRequest(_Sampling):
    """POST /v1/chat/completions. messages are checked by runtime_min/chat.py."""

    messages: list[Any]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    functions: Optional[list[Any]] = None
    tool_choice: Any = None
    response_format: Optional[dict[str, Any]] = None

    def _neutral(self) -> dict[str, tuple]:
        return {**super()._neutral(), "logprobs": (False,), "top_logprobs": (None,), "tools": (None, []), "functions": (None, []),
                "tool_choice": (None, "none"), "response_format": (None, {"type": "text"})}


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` (decoded JSON) as `model`, its neutral-value rules checked; ProtocolError naming the
    first field at fault otherwise."""
    if not isinstance(body, dict):
        raise ProtocolError(f"the request body must be a JSON object, got {type(body).__name__}")
    try:  # an explicit null is the field's default, as the OpenAI API's schema has it
        req = model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        # of a union's failed branches, the one that got furthest into the value names the place
        err = max(e.errors(), key=lambda x: sum(isinstance(p, int) for p in x["loc"]))
        # the path to the field: names and list positions, not pydantic's union branch tags
        field = err["loc"][0] + "".join(f"[{p}]" for p in err["loc"][1:] if isinstance(p, int)) if err["loc"] else None
        got = f" (got {err['input']!r:.80})" if err["type"] != "missing" else ""
        raise ProtocolError(f"{field}: {err['msg']}{got}", param=field) from None
    req.check_neutral()
    return req


def prompt_lists(prompt: Any) -> list[Union[str, list[int]]]:
    """The prompts of a completion request, each a string or a token-id list."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if not prompt:
        raise ProtocolError("prompt: the list is empty", param="prompt")
    return list(prompt)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Reply:
    """The response objects of one request: `id` ("cmpl-..." or "chatcmpl-..."), `created`
    (Unix seconds), model name, chat or completion kind."""

    def __init__(self, model: str, chat: bool):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _obj(self, kind: str, choices: list, usage_: dict | None) -> dict:
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def full(self, texts: list[str], reasons: list[str], usage_: dict) -> dict:
        """The whole (non-streamed) response."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                        "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
            return self._obj("chat.completion", choices, usage_)
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
                   for i, (t, r) in enumerate(zip(texts, reasons))]
        return self._obj("text_completion", choices, usage_)

    def chunk(self, index: int, piece: str, reason: str | None, first: bool = False) -> dict:
        """One streamed chunk of choice `index` (a chat chunk's first delta carries the role)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": piece} if first else (
                {"content": piece} if piece or reason is None else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            return self._obj("chat.completion.chunk", [choice], None)
        return self._obj("text_completion", [{"index": index, "text": piece, "logprobs": None,
                                              "finish_reason": reason}], None)

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return self._obj("chat.completion.chunk" if self.chat else "text_completion", [], usage_)
