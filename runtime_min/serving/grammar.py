"""Grammar-constrained decoding with xgrammar: JSON (of a schema) for `response_format`, and the
DSML tool-call block for `tool_choice` "required" or a named function.

    grammars = Grammars(session.tokenizer, session.vocab_size, eos_id)   # once per server
    request.constraint = grammars.json_schema({"type": "object", ...}).constraint()

`Grammars` builds xgrammar's TokenizerInfo from the bundle's `tokenizers.Tokenizer` once (the
byte-level BPE tokens as their bytes, added tokens as their text, special tokens other than EOS
never allowed, EOS the stop token) and compiles grammars on it. A `Constraint` is one request's
matcher: the scheduler's sampling asks it which tokens may come next (`allowed`, a bool mask over
the model's vocabulary) and tells it the token sampled (`accept`); once the grammar is complete
only EOS is allowed. Follows xgrammar's documented use (GrammarCompiler, GrammarMatcher,
fill_next_token_bitmask / accept_token: mlc-ai/xgrammar:docs/start/quick_start.md).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Sequence

import torch

from dsneuron import UserError

from . import dsml


class GrammarError(UserError):
    """A schema or grammar xgrammar cannot compile (the server answers 400 naming the field)."""


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode, which tokenizers' ByteLevel uses):
    character -> byte. Printable bytes stand for themselves, the others for 256 + their rank."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def token_bytes(tokenizer) -> list[bytes]:
    """Each token id's bytes, by id: a byte-level token's bytes, an added token's UTF-8 text, and
    b"" for special tokens (xgrammar never allows an empty token inside a grammar)."""
    decoder = _byte_decoder()
    added = tokenizer.get_added_tokens_decoder()
    out = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        tok = added.get(i)
        if tok is not None:
            out.append(b"" if tok.special else tok.content.encode())
            continue
        piece = tokenizer.id_to_token(i) or ""
        out.append(bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode())
    return out


class Grammars:
    """The grammar compiler of one server: `tokenizer` (tokenizers.Tokenizer), `vocab_size` (the
    model's logits width, >= the tokenizer's), `eos_id` (the stop token)."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(token_bytes(tokenizer), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=[eos_id])
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()  # one compile at a time: the server's threads share the compiler

    def json_schema(self, schema: dict | bool) -> "Grammar":
        """JSON text: any JSON object (`schema` True, response_format json_object) or a value of
        the JSON schema `schema`, without free whitespace (compact, as json.dumps separators
        (", ", ": ")). Raises GrammarError naming what xgrammar could not compile."""
        import xgrammar as xgr

        try:
            with self._lock:
                if schema is True:
                    return Grammar(self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False),
                                   self.vocab_size)
                return Grammar(self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False),
                               self.vocab_size)
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as e:
            raise GrammarError(f"response_format: the JSON schema cannot be compiled to a grammar ({_why(e)})") from None

    def tool_calls(self, functions: Sequence[dict], name: str | None, thinking: bool) -> "Grammar":
        """A reply that is one DSML tool-call block (runtime_min/serving/dsml.py) calling `name` (else any
        of `functions`) one or more times, after the reasoning in thinking mode. Parameter keys
        are the function's declared properties (none for `"properties": {}`, any name when it
        declares no properties); values are text without '<'. Raises GrammarError as json_schema."""
        fns = [f for f in functions if name is None or f["name"] == name]
        rules = ['root ::= ' + ('reasoning ' if thinking else '') + f'"\\n\\n{dsml.CALLS_OPEN}\\n" invoke ("\\n" invoke)* '
                 f'"\\n{dsml.CALLS_CLOSE}"',
                 'invoke ::= ' + " | ".join(f"invoke{k}" for k in range(len(fns))),
                 'flag ::= "true" | "false"', 'value ::= [^<]*', 'anykey ::= [a-zA-Z0-9_.-]+']
        if thinking:
            rules.append(f'reasoning ::= [^<]* "{dsml.THINK_END}"')
        for k, f in enumerate(fns):
            params = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
            props = params.get("properties")
            key = " | ".join(_literal(p) for p in props) if isinstance(props, dict) else "anykey"
            args = f'(param{k} ("\\n" param{k})*)? ' if key else ""  # declared without properties: none
            rules.append(f'invoke{k} ::= "{dsml.INVOKE} name=\\"" {_literal(f["name"])} "\\">\\n" {args}'
                         f'"\\n{dsml.INVOKE_CLOSE}"')
            if key:
                rules.append(f'param{k} ::= "{dsml.PARAM} name=\\"" ({key}) "\\" string=\\"" flag "\\">" value '
                             f'"{dsml.PARAM_CLOSE}"')
        try:
            with self._lock:
                return Grammar(self._compiler.compile_grammar("\n".join(rules)), self.vocab_size)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"tools: the tool-call grammar cannot be compiled ({_why(e)})") from None


def _why(e: Exception) -> str:
    """xgrammar's message without the time and C++ source place it starts with."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())


def _literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    return json.dumps(text, ensure_ascii=False)


class Grammar:
    """A compiled grammar; `constraint()` starts one request's matcher on it."""

    def __init__(self, compiled: Any, vocab_size: int):
        self._compiled, self._vocab_size = compiled, vocab_size

    def constraint(self) -> "Constraint":
        return Constraint(self._compiled, self._vocab_size)


class Constraint:
    """One request's grammar state (module docstring). Not thread-safe: the scheduler's thread
    uses it."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next."""
        import xgrammar as xgr

        self._matcher.fill_next_token_bitmask(self._bitmask)
        logits = torch.zeros(1, self._vocab_size)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask)
        return logits[0] == 0

    def accept(self, token: int) -> None:
        """Advance over the sampled `token` (one the mask allowed)."""
        self._matcher.accept_token(token)
