"""DeepSeek-V4 chat prompts: OpenAI chat messages (and tools) -> prompt text, in chat or thinking mode.

DeepSeek-V4 ships no Jinja chat template (its tokenizer_config.json, which the bundle copies, has
none): the model repository's `encoding/encoding_dsv4.py` `encode_messages(messages,
thinking_mode)` is the format (deepseek-ai/DeepSeek-V4-Flash:encoding/encoding_dsv4.py). This
module re-implements the part an OpenAI request can reach:

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜></think>

- a system message is its content as is; the request's `tools` are rendered after the content of
  the first message when it is a system message (a system message with empty content is put
  first otherwise), as "\\n\\n" + the encoder's tools section (TOOLS_TEMPLATE: the DSML call
  format, then one JSON line per function);
- a developer message is rendered as a user message;
- a `tool` message becomes a `<tool_result>{content}</tool_result>` block of a user message: tool
  results after an assistant turn, and the user text after them, are one user message whose
  blocks are joined by "\\n\\n", the results in the order of the assistant's `tool_calls` (by
  `tool_call_id`); consecutive user messages are merged the same way;
- a user message is `<｜User｜>` + content, followed by `<｜Assistant｜>` and the mode's thinking
  marker when the next message is an assistant's or it is the last one: `</think>` in chat mode
  (an empty thinking block), `<think>` in thinking mode for the last user message, and for every
  one when the request has tools (the encoder then keeps all reasoning);
- an assistant message is [its `reasoning_content` + `</think>`, thinking mode only, for the
  turns whose reasoning is kept] + content + [its tool calls as a DSML block, dsml.render_calls]
  + `<｜end▁of▁sentence｜>`. In thinking mode without tools, reasoning and developer messages
  before the last user message are dropped, as the encoder's default drop_thinking does.

`render` returns the text after the BOS; the server puts the bundle's BOS id in front of its
tokens, as `encode_messages(add_default_bos_token=True)` puts the BOS text. The encoder's internal
task tokens, `latest_reminder` role and reasoning-effort prompts are not reachable from the API.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from dsneuron import UserError

from . import dsml

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
ROLES = ("system", "developer", "user", "assistant", "tool")

#: the encoder's tools section (TOOLS_TEMPLATE of encoding_dsv4.py), {schemas}: one JSON line a function
TOOLS_SECTION = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by "
    f'writing a "{dsml.CALLS_OPEN}" block like the following:\n\n'
    f"{dsml.CALLS_OPEN}\n{dsml.INVOKE}" ' name="$TOOL_NAME">\n'
    f'{dsml.PARAM} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{dsml.PARAM_CLOSE}\n...\n'
    f"{dsml.INVOKE_CLOSE}\n{dsml.INVOKE}" ' name="$TOOL_NAME2">\n...\n'
    f"{dsml.INVOKE_CLOSE}\n{dsml.CALLS_CLOSE}\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
    'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    f"If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete reasoning inside "
    f"{THINK_START}...{THINK_END} BEFORE any tool calls or final response.\n\n"
    f"Otherwise, output directly after {THINK_END} with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_SECTION_END = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"


class ChatError(UserError):
    """A message the chat format cannot render; `param` names it (e.g. "messages[2].role")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def content_text(content: Any, where: str, sep: str = "\n") -> str:
    """A message's content as text: a string, or a list of OpenAI content parts of type "text"
    joined by `sep` (newlines as vLLM joins them; a tool result's by blank lines, as the encoder's
    tool_result blocks). Raises ChatError naming `where` otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}[{i}]: only text content parts are supported, got {kind!r}", f"{where}[{i}]")
            texts.append(part["text"])
        return sep.join(texts)
    raise ChatError(f"{where}: expected a string or a list of text parts", where)


def render(messages: Sequence[Any], tools: Sequence[Any] | None = None, thinking: bool = False) -> str:
    """The prompt text of OpenAI chat `messages` and `tools` (module docstring), without the BOS.
    Raises ChatError as `segments`."""
    return "".join(text for text, _ in segments(messages, tools, thinking))


def encode(messages: Sequence[Any], tokenizer, plain, tools: Sequence[Any] | None = None,
           thinking: bool = False) -> list[int]:
    """The token ids of `render(messages, tools, thinking)` (without the BOS): the format's markers
    by `tokenizer`, the messages' own text by `plain` (`plain_tokenizer(tokenizer)`), so text that
    spells a marker stays text and a message cannot fake a turn. Raises ChatError as `segments`."""
    ids: list[int] = []
    for text, control in segments(messages, tools, thinking):
        ids += (tokenizer if control else plain).encode(text, add_special_tokens=False).ids
    return ids


def plain_tokenizer(tokenizer):
    """A copy of a `tokenizers.Tokenizer` without its added tokens (DeepSeek-V4's role markers are
    added tokens, not all marked special): every character is read as text."""
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def functions(tools: Sequence[Any] | None) -> list[dict]:
    """The function objects of OpenAI `tools` ([{"type": "function", "function": {name, ...}}]).
    Raises ChatError naming the tool that is not one."""
    out = []
    for i, t in enumerate(tools or ()):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"]):
            raise ChatError(f"tools[{i}]: expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                            f"tools[{i}]")
        out.append(f)
    return out


def segments(messages: Sequence[Any], tools: Sequence[Any] | None = None,
             thinking: bool = False) -> list[tuple[str, bool]]:
    """The prompt of OpenAI chat `messages` and `tools` as (text, is_marker) pieces in order: the
    format's markers and fixed text (role tokens, EOS, thinking markers, the tools section, DSML
    tags) and the request's own text (contents, schemas, arguments) (module docstring).

    Raises ChatError naming the message for: no messages, a message that is not an object, a role
    outside ROLES, content that is not text, a malformed tool call, a bad tool, or a last message
    that is not the user's or a tool result (the reply follows a user turn)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects", "messages")
    msgs = [_checked(i, m) for i, m in enumerate(messages)]
    if msgs[-1]["role"] not in ("user", "developer", "tool"):
        raise ChatError(f"messages[{len(msgs) - 1}].role: the last message must be the user's or a tool result, got "
                        f"{msgs[-1]['role']!r}", f"messages[{len(msgs) - 1}].role")
    fns = functions(tools)
    if fns:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        msgs[0]["tools"] = fns
    msgs = _merge_tool_results(msgs)
    last_user = max(i for i, m in enumerate(msgs) if m["role"] in ("user", "developer"))
    keep_reasoning = bool(fns)  # the encoder keeps every turn's reasoning when tools are defined
    if thinking and not keep_reasoning:
        msgs = [m for i, m in enumerate(msgs) if m["role"] != "developer" or i >= last_user]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] in ("user", "developer"))
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(msgs):
        if m["role"] == "system":
            out.append((m["content"], False))
            if m.get("tools"):
                out.append(("\n\n" + TOOLS_SECTION, True))
                out.append(("\n".join(json.dumps(f, ensure_ascii=False) for f in m["tools"]), False))
                out.append((TOOLS_SECTION_END, True))
        elif m["role"] == "assistant":
            if thinking and (keep_reasoning or i > last_user):
                out += [(m["reasoning"], False), (THINK_END, True)]
            out.append((m["content"], False))
            if m["tool_calls"]:
                out.append(("\n\n", True))
                out += dsml.render_calls(m["tool_calls"])
            out.append((EOS, True))
        else:  # user or developer, tool results merged in
            out.append((USER, True))
            for k, (text, is_result) in enumerate(m["blocks"]):
                if k:
                    out.append(("\n\n", True))
                out += [(dsml.RESULT_OPEN, True), (text, False), (dsml.RESULT_CLOSE, True)] if is_result else [
                    (text, False)]
            if i + 1 == len(msgs) or msgs[i + 1]["role"] == "assistant":
                opens = thinking and (keep_reasoning or i >= last_user)
                out += [(ASSISTANT, True), (THINK_START if opens else THINK_END, True)]
    return [(t, control) for t, control in out if t]


def _checked(i: int, m: Any) -> dict:
    """Message i as {role, content (text), reasoning, tool_calls, tool_call_id}; ChatError naming
    the field at fault."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ChatError(f"{where}: expected an object with role and content", where)
    role = m.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}.role: {role!r} is not supported (one of {', '.join(ROLES)})", f"{where}.role")
    calls = m.get("tool_calls") or []
    if calls and role != "assistant":
        raise ChatError(f"{where}.tool_calls: only an assistant message has tool calls", f"{where}.tool_calls")
    if not isinstance(calls, list):
        raise ChatError(f"{where}.tool_calls: expected a list", f"{where}.tool_calls")
    parsed = []
    for k, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("arguments"), str)):
            raise ChatError(f"{where}.tool_calls[{k}]: expected {{\"type\": \"function\", \"function\": {{\"name\": "
                            "string, \"arguments\": string}}}}", f"{where}.tool_calls[{k}]")
        parsed.append((c.get("id") or "", f["name"], f["arguments"]))
    reasoning = m.get("reasoning_content") or ""
    if not isinstance(reasoning, str):
        raise ChatError(f"{where}.reasoning_content: expected a string", f"{where}.reasoning_content")
    call_id = m.get("tool_call_id") or ""
    if not isinstance(call_id, str):
        raise ChatError(f"{where}.tool_call_id: expected a string", f"{where}.tool_call_id")
    if "content" not in m and not (role == "assistant" and calls):  # as OpenAI's API: only a call may omit it
        raise ChatError(f"{where}.content: required for a {role} message", f"{where}.content")
    text = content_text(m.get("content") or "", f"{where}.content", "\n\n" if role == "tool" else "\n")
    return {"role": role, "content": text, "reasoning": reasoning,
            "tool_calls": parsed, "tool_call_id": call_id}


def _merge_tool_results(msgs: list[dict]) -> list[dict]:
    """The encoder's merge_tool_messages and sort_tool_results_by_call_order: user messages carry
    `blocks` [(text, is_tool_result)]; tool results join the user message before them (or start
    one), and so does user text after a user message; the results of one user message follow
    the order of the last assistant's tool calls."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in msgs:
        if m["role"] == "assistant" and m["tool_calls"]:
            order = {cid: k for k, (cid, _, _) in enumerate(m["tool_calls"]) if cid}
        if m["role"] in ("tool", "user"):
            block = (m["content"], m["role"] == "tool", order.get(m["tool_call_id"], 0))
            if out and out[-1]["role"] == "user":
                out[-1]["blocks"].append(block)
            else:
                out.append({**m, "role": "user", "blocks": [block]})
        else:
            out.append({**m, "blocks": [(m["content"], False, 0)]})
    for m in out:
        results = sorted((b for b in m["blocks"] if b[1]), key=lambda b: b[2])  # stable: ties keep their order
        it = iter(results)
        m["blocks"] = [(next(it) if b[1] else b)[:2] for b in m["blocks"]]
    return out
