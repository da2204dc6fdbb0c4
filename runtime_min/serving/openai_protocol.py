"""The OpenAI API's request bodies and response objects, as `dsneuron serve` speaks them.

Follows the OpenAI API reference (Completions: POST /v1/completions; Chat: POST
/v1/chat/completions; streaming as server-sent events of `text_completion` /
`chat.completion.chunk` objects ending with `data: [DONE]`; errors as {"error": {message, type,
param, code}}), with vLLM's OpenAI server where the reference leaves a choice open:

- max_tokens defaults to 16 for completions (the reference's default) and to the rest of the
  context capacity for chat; `max_completion_tokens` is the newer chat name of max_tokens;
- temperature and top_p default to 1 (the reference's defaults); temperature is in 0..2 (the
  reference's range; 0 is greedy, runtime_min/core/sampling.py);
- types are strict ("2" is not an integer, true is not 1) and an explicit null is the default;
- seed: an integer in 0..2**64-1; a request without one gets a fresh one;
- stop: a string or at most 4 strings, cut from the text;
- prompt: a string, a list of strings, a list of token ids, or a list of token-id lists (one
  choice each, `index` in order);
- chat `tools` with `tool_choice` "none" (the tools are left out of the prompt), "auto" (the
  default with tools), "required" or {"type": "function", "function": {"name": ...}} (the reply
  is constrained to a call, runtime_min/serving/grammar.py); tool calls come back as the message's
  `tool_calls` (finish_reason "tool_calls"), streamed as `delta.tool_calls`, one whole call a
  delta (runtime_min/serving/dsml.py parses the model's markup);
- thinking mode per request by `chat_template_kwargs: {"thinking": true}` (as vLLM passes a chat
  template's arguments); the reasoning comes back as `reasoning_content` (message and delta), as
  DeepSeek's API and vLLM's reasoning parsers return it;
- `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
  ...}}: the reply is constrained to JSON (of the schema) by runtime_min/serving/grammar.py;
- fields the bundle cannot honour are refused by name unless they hold their neutral value
  (n > 1, best_of > 1, echo, suffix, logprobs, presence/frequency penalties, logit_bias, the
  legacy `functions`); unknown fields are ignored, as the reference's clients send newer ones.

Pydantic validates the types; `ProtocolError` (status 400) names the field and the limit.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from dsneuron import UserError

from ..core.scheduler import MAX_STOP
from .dsml import Event, ReplyParser

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
    """POST /v1/chat/completions. messages are checked by runtime_min/serving/chat.py."""

    messages: list[Any]
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[Any]] = None
    functions: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def _neutral(self) -> dict[str, tuple]:
        return {**super()._neutral(), "logprobs": (False,), "top_logprobs": (None,), "functions": (None, [])}

    def check_neutral(self) -> None:
        super().check_neutral()
        self.forced_tool()
        self.json_schema()
        thinking = (self.chat_template_kwargs or {}).get("thinking", False)
        if not isinstance(thinking, bool):
            raise ProtocolError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r:.40}",
                                param="chat_template_kwargs.thinking")

    @property
    def thinking(self) -> bool:
        """Thinking mode (`chat_template_kwargs.thinking`)."""
        return bool((self.chat_template_kwargs or {}).get("thinking", False))

    @property
    def prompt_tools(self) -> list[Any]:
        """The tools rendered into the prompt: none when tool_choice is "none"."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def forced_tool(self) -> Union[bool, str]:
        """What tool_choice forces: False (none or auto), True (required: some call) or the name
        of the function to call. ProtocolError naming tool_choice when it is none of the OpenAI
        forms or names a function that `tools` lacks."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return False
        if not self.tools:
            raise ProtocolError(f"tool_choice={choice!r:.60} needs tools", param="tool_choice")
        if choice == "required":
            return True
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise ProtocolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                                f'{{"name": ...}}}}, got {choice!r:.80}', param="tool_choice")
        names = [t.get("function", {}).get("name") for t in self.tools if isinstance(t, dict)]
        if name not in names:
            raise ProtocolError(f"tool_choice names the function {name!r}, which is not in tools ({names!r:.80})",
                                param="tool_choice")
        return name

    def json_schema(self) -> Union[None, bool, dict]:
        """What response_format asks: None (text), True (any JSON object: json_object) or the JSON
        schema of json_schema. ProtocolError naming response_format otherwise."""
        rf = self.response_format
        kind = rf.get("type") if isinstance(rf, dict) else None
        if rf is None or kind == "text":
            return None
        if kind == "json_object":
            return True
        spec = rf.get("json_schema")
        if kind == "json_schema" and isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict):
            return spec.get("schema", {})  # the reference makes the schema optional: any JSON then
        raise ProtocolError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                            f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}, got {rf!r:.80}',
                            param="response_format")


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

    def full(self, texts: list[str], reasons: list[str], usage_: dict, choices: list["ChatChoice"] | None = None) -> dict:
        """The whole (non-streamed) response; a chat's messages are its `choices`, fed whole."""
        if self.chat:
            out = []
            for i, (c, t, r) in enumerate(zip(choices, texts, reasons)):
                c.deltas(t)
                c.finish(r)
                out.append({"index": i, "message": c.message(), "logprobs": None, "finish_reason": c.reason(r)})
            return self._obj("chat.completion", out, usage_)
        out = [{"index": i, "text": t, "logprobs": None, "finish_reason": r}
               for i, (t, r) in enumerate(zip(texts, reasons))]
        return self._obj("text_completion", out, usage_)

    def chunk(self, index: int, piece: str, reason: str | None) -> dict:
        """One streamed chunk of completion choice `index`."""
        return self._obj("text_completion", [{"index": index, "text": piece, "logprobs": None,
                                              "finish_reason": reason}], None)

    def delta_chunk(self, index: int, delta: dict, reason: str | None = None) -> dict:
        """One streamed chunk of chat choice `index`."""
        return self._obj("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": None,
                                                    "finish_reason": reason}], None)

    def usage_chunk(self, usage_: dict) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        return self._obj("chat.completion.chunk" if self.chat else "text_completion", [], usage_)


class ChatChoice:
    """The assistant message of one chat choice, built as its text arrives: runtime_min/serving/dsml.py's
    parser splits it into `content`, `reasoning_content` and `tool_calls` (each call an id
    "call_<hex>" of its own). `deltas(piece)` and then `finish()` give the chunk deltas,
    `message()` the whole message, `reason(finish_reason)` the OpenAI finish reason ("tool_calls"
    when the reply ended with calls)."""

    def __init__(self, thinking: bool = False, tools: bool = False):
        self._parser = ReplyParser(thinking=thinking, tools=tools)
        self.content, self.reasoning = "", ""
        self.calls: list[dict] = []

    @property
    def error(self) -> str | None:
        """The malformed markup of the reply (runtime_min/serving/dsml.py ReplyParser.error), if any."""
        return self._parser.error

    def deltas(self, piece: str) -> list[dict]:
        return self._deltas(self._parser.feed(piece))

    def finish(self, finish_reason: str = "stop") -> list[dict]:
        """The last deltas; a reply cut off ("length", "abort") drops a tool-call marker it was
        writing (runtime_min/serving/dsml.py ReplyParser.finish)."""
        return self._deltas(self._parser.finish(cut=finish_reason in ("length", "abort")))

    def _deltas(self, events: list[Event]) -> list[dict]:
        out = []
        for e in events:
            if e.kind == "content":
                self.content += e.text
                out.append({"content": e.text})
            elif e.kind == "reasoning":
                self.reasoning += e.text
                out.append({"reasoning_content": e.text})
            else:
                call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": e.name, "arguments": e.text}}
                out.append({"tool_calls": [{"index": len(self.calls), **call}]})
                self.calls.append(call)
        return out

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def reason(self, finish_reason: str) -> str:
        return "tool_calls" if self.calls and finish_reason == "stop" else finish_reason
