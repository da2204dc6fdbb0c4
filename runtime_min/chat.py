"""DeepSeek-V4 chat prompts: OpenAI chat messages -> prompt text, in chat (non-thinking) mode.

DeepSeek-V4 ships no Jinja chat template (its tokenizer_config.json, which the bundle copies, has
none; reference/deepseek_v4_arch.md section 8): the model repository's `encoding/encoding_dsv4.py`
`encode_messages(messages, thinking_mode="chat")` is the format. For system, user and assistant
messages without tools it renders

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{assistant}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜></think>

- a system message is its content as is; a developer message is rendered as a user message;
- a user message is `<｜User｜>` + content, followed by `<｜Assistant｜></think>` when the next
  message is an assistant's or it is the last one (chat mode: an empty thinking block);
- an assistant message is its content + `<｜end▁of▁sentence｜>` (chat mode keeps no reasoning).

`render` returns the text after the BOS; the server puts the bundle's BOS id in front of its
tokens, as `encode_messages(add_default_bos_token=True)` puts the BOS text. Tools, tool results,
thinking mode and the encoder's internal task tokens are not supported (refused by name).
"""

from __future__ import annotations

from typing import Any, Sequence

from dsneuron import UserError

USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_END = "</think>"
ROLES = ("system", "developer", "user", "assistant")


class ChatError(UserError):
    """A message the chat format cannot render; `param` names it (e.g. "messages[2].role")."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of OpenAI content parts of type "text"
    joined by newlines (as vLLM joins them). Raises ChatError naming `where` otherwise."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatError(f"{where}[{i}]: only text content parts are supported, got {kind!r}", f"{where}[{i}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatError(f"{where}: expected a string or a list of text parts", where)


def render(messages: Sequence[Any]) -> str:
    """The chat-mode prompt text of OpenAI chat `messages` (module docstring), without the BOS.
    Raises ChatError as `segments`."""
    return "".join(text for text, _ in segments(messages))


def encode(messages: Sequence[Any], tokenizer, plain) -> list[int]:
    """The token ids of `render(messages)` (without the BOS): the format's markers by `tokenizer`,
    the messages' own text by `plain` (`plain_tokenizer(tokenizer)`), so text that spells a marker
    stays text and a message cannot fake a turn. Raises ChatError as `segments`."""
    ids: list[int] = []
    for text, control in segments(messages):
        ids += (tokenizer if control else plain).encode(text, add_special_tokens=False).ids
    return ids


def plain_tokenizer(tokenizer):
    """A copy of a `tokenizers.Tokenizer` without its added tokens (DeepSeek-V4's role markers are
    added tokens, not all marked special): every character is read as text."""
    import json

    from tokenizers import Tokenizer

    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def segments(messages: Sequence[Any]) -> list[tuple[str, bool]]:
    """The chat-mode prompt of OpenAI chat `messages` as (text, is_marker) pieces in order: the
    format's markers (role tokens, EOS, `</think>`) and the messages' own text (module docstring).

    Raises ChatError naming the message for: no messages, a message that is not an object, a role
    outside system/developer/user/assistant, content that is not text, tool calls, or a last
    message that is not the user's (the reply follows a user turn)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatError("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatError(f"messages[{i}]: expected an object with role and content", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise ChatError(f"messages[{i}].role: {m.get('role')!r} is not supported (one of {', '.join(ROLES)})",
                            f"messages[{i}].role")
        if m.get("tool_calls"):
            raise ChatError(f"messages[{i}].tool_calls: tool calls are not supported", f"messages[{i}].tool_calls")
    if messages[-1]["role"] not in ("user", "developer"):
        raise ChatError(f"messages[{len(messages) - 1}].role: the last message must be the user's, got "
                        f"{messages[-1]['role']!r}", f"messages[{len(messages) - 1}].role")
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(messages):
        text = content_text(m.get("content") or "", f"messages[{i}].content")
        if m["role"] == "system":
            out.append((text, False))
        elif m["role"] == "assistant":
            out += [(text, False), (EOS, True)]
        else:
            out += [(USER, True), (text, False)]
            if i + 1 == len(messages) or messages[i + 1]["role"] == "assistant":
                out += [(ASSISTANT, True), (THINK_END, True)]
    return [(t, control) for t, control in out if t]
