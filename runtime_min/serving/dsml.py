"""DeepSeek-V4's tool-call markup (DSML): rendering a turn's calls into the prompt, and parsing a
reply as it streams into reasoning, content and tool calls.

The format is that of deepseek-ai/DeepSeek-V4-Flash:encoding/encoding_dsv4.py (tool_calls_template,
encode_arguments_to_dsml, parse_tool_calls, parse_message_from_completion_text). A reply is

    [reasoning</think>]content\\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">text as is</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    ...
    </｜DSML｜tool_calls>

(the reasoning part in thinking mode only: the prompt ends with `<think>`), then EOS. A call's
arguments are the JSON object {"KEY": "text as is", "KEY2": JSON value}, written as the encoder's
decode_dsml_to_arguments writes it (`{"KEY": "text", "KEY2": 3}`).

`ReplyParser` is fed the reply's text in pieces of any size and returns events as soon as they are
certain: text that could still be the start of a marker is held back, so no markup ever reaches
reasoning or content, and the events are the same however the text is split. Whitespace between
the elements of a block is not significant. Malformed markup never raises: from the element at
fault on, the rest of the reply is content (the text as the model wrote it) and `error` names the
fault; the calls parsed before it stand.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple, Sequence

DSML = "｜DSML｜"
CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"
THINK_END = "</think>"
#: a tool result in a user turn (the encoder's tool_output_template)
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

_INVOKE_RE = re.compile(rf'{INVOKE}\s+name="([^"\n]*)">\s*(.*?)\s*{INVOKE_CLOSE}', re.S)
_PARAM_RE = re.compile(rf'{PARAM}\s+name="(.*?)"\s+string="(true|false)">(.*?){PARAM_CLOSE}\s*', re.S)


class Event(NamedTuple):
    """One piece of a parsed reply: kind "reasoning" or "content" with its `text`, or kind
    "tool_call" with the function `name` and its `text`: the arguments as JSON text."""

    kind: str
    text: str
    name: str = ""


def arguments_json(params: Sequence[tuple[str, str, bool]]) -> str:
    """The JSON arguments of DSML parameters [(key, value, is_string)]: a string value is quoted,
    any other is its JSON text as written (the encoder's decode_dsml_to_arguments)."""
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False) if s else v}"
                           for k, v, s in params) + "}"


def render_calls(calls: Sequence[tuple[str, str, str]]) -> list[tuple[str, bool]]:
    """An assistant turn's tool calls [(id, name, arguments JSON text)] as a DSML block, in
    (text, is_marker) pieces: the tags are markers, names, keys and values the request's text.
    Arguments that are not a JSON object are one string parameter "arguments", as the encoder's
    encode_arguments_to_dsml does with arguments it cannot load."""
    out: list[tuple[str, bool]] = [(CALLS_OPEN + "\n", True)]
    for k, (_, name, arguments) in enumerate(calls):
        if k:
            out.append(("\n", True))
        out += [(INVOKE + ' name="', True), (name, False), ('">\n', True)]
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
        if not isinstance(args, dict):
            args = {"arguments": arguments}
        for j, (key, value) in enumerate(args.items()):
            is_str = isinstance(value, str)
            text = value if is_str else json.dumps(value, ensure_ascii=False)
            out += [(("\n" if j else "") + PARAM + ' name="', True), (key, False),
                    (f'" string="{"true" if is_str else "false"}">', True), (text, False), (PARAM_CLOSE, True)]
        out.append(("\n" + INVOKE_CLOSE, True))
    out.append(("\n" + CALLS_CLOSE, True))
    return out


def _held(text: str, marker: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `marker` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReplyParser:
    """Incremental parse of one reply (module docstring). thinking: the reply starts with its
    reasoning (the prompt ended with `<think>`); tools: DSML blocks are parsed (else the content
    is the text as is). `feed(text)` and then `finish()` return lists of Event."""

    def __init__(self, thinking: bool = False, tools: bool = True):
        self._state = "reasoning" if thinking else "content"
        self._tools = tools
        self._buf = ""
        #: what was malformed (None while the markup is well formed)
        self.error: str | None = None

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        """The events of the end of the reply: held-back text is released, and an unterminated
        block is an error unless only whitespace is left of it. cut: the reply was stopped before
        its end (max_tokens, a time limit): held-back text that could still be the start of a
        tool-call block was markup being written, and is dropped rather than released as content."""
        out = self.feed("")
        if cut and self._state == "content" and self._tools and CALLS_OPEN.startswith(self._buf.lstrip("\n")):
            self._buf = ""
        if self._state == "calls" and self._buf.strip():
            self._fail(f"the reply ends inside a tool call ({self._buf[:40]!r}...)")
        kind = "reasoning" if self._state == "reasoning" else "content"
        rest, self._buf = ("" if self._state == "calls" else self._buf), ""
        if rest:
            out.append(Event(kind, rest))
        return out

    def _step(self, out: list[Event]) -> bool:
        """Advance over the buffer once; True while there may be more to do."""
        buf = self._buf
        if self._state == "reasoning":
            i = buf.find(THINK_END)
            if i >= 0:
                self._emit(out, "reasoning", buf[:i])
                self._buf, self._state = buf[i + len(THINK_END):], "content"
                return True
            cut = len(buf) - _held(buf, THINK_END)
            self._emit(out, "reasoning", buf[:cut])
            self._buf = buf[cut:]
            return False
        if self._state == "content" and self._tools:
            i = buf.find(CALLS_OPEN)
            if i >= 0:  # the encoder writes "\n\n" before a block: markup, not content
                self._emit(out, "content", buf[:i].removesuffix("\n\n"))
                self._buf, self._state = buf[i + len(CALLS_OPEN):], "calls"
                return True
            cut = len(buf) - _held(buf, CALLS_OPEN)
            cut = len(buf[:cut].rstrip("\n"))  # they may precede a block still to come
            self._emit(out, "content", buf[:cut])
            self._buf = buf[cut:]
            return False
        if self._state != "calls":  # content without tools, or after a malformed block
            self._emit(out, "content", buf)
            self._buf = ""
            return False
        buf = self._buf = buf.lstrip()
        if buf.startswith(CALLS_CLOSE):
            self._buf, self._state = buf[len(CALLS_CLOSE):], "content"
            return True
        if buf.startswith(INVOKE):
            end = buf.find(INVOKE_CLOSE)
            if end < 0:
                return False
            end += len(INVOKE_CLOSE)
            call = self._call(buf[:end])
            if call is None:
                return True
            out.append(call)
            self._buf = buf[end:]
            return True
        if not buf or CALLS_CLOSE.startswith(buf) or INVOKE.startswith(buf):
            return False
        self._fail(f"expected {INVOKE} or {CALLS_CLOSE} in the {CALLS_OPEN} block")
        return True

    def _call(self, text: str) -> Event | None:
        """The tool call of one whole invoke element, or None after `_fail`."""
        m = _INVOKE_RE.fullmatch(text)
        if m is None:
            self._fail(f"malformed invoke element {text[:60]!r}")
            return None
        params, pos, body = [], 0, m.group(2)
        while pos < len(body):
            p = _PARAM_RE.match(body, pos)
            if p is None:
                self._fail(f"malformed parameter in tool call {m.group(1)!r}: {body[pos:pos + 60]!r}")
                return None
            if any(p.group(1) == k for k, _, _ in params):
                self._fail(f"duplicate parameter {p.group(1)!r} in tool call {m.group(1)!r}")
                return None
            params.append((p.group(1), p.group(3), p.group(2) == "true"))
            pos = p.end()
        return Event("tool_call", arguments_json(params), m.group(1))

    def _fail(self, why: str) -> None:
        """Malformed markup: the rest of the reply is content."""
        self.error = self.error or why
        self._state = "broken"

    @staticmethod
    def _emit(out: list[Event], kind: str, text: str) -> None:
        if text:
            out.append(Event(kind, text))
