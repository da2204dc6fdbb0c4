"""`response_format` json_schema / json_object on the micro bundle (the DeepSeek-V4 tokenizer,
random weights) through the `openai` client: every seeded sampled output parses and validates
against its schema (runtime_min/grammar.py's mask in the scheduler's sampling), and a schema
xgrammar cannot compile is a 400 naming response_format."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from dsneuron.runtime_min.session import Session
from in_process import client, served

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "tag"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "s": {"type": "string", "maxLength": 3}},
     "required": ["n", "s"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
]
ASK = [{"role": "user", "content": "JSON?"}]  # a short prompt: micro's prefill bucket holds 16 tokens


@pytest.fixture(scope="module")
def session(micro_bundle) -> Session:
    return Session.load(micro_bundle.path)


def test_50_seeded_sampled_requests_validate_against_their_schema(session):
    with served(session) as (url, _):
        c = client(url)
        for seed in range(50):
            schema = SCHEMAS[seed % len(SCHEMAS)]
            got = c.chat.completions.create(
                model="bundle", messages=ASK, max_tokens=40, temperature=1.0, seed=seed, stream=seed % 5 == 4,
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
            text = ("".join(ch.choices[0].delta.content or "" for ch in got if ch.choices) if seed % 5 == 4
                    else got.choices[0].message.content)
            jsonschema.validate(json.loads(text), schema)


def test_a_json_object_is_an_object_and_a_bad_schema_is_a_400(session):
    with served(session) as (url, _):
        c = client(url)
        got = c.chat.completions.create(model="bundle", messages=ASK, max_tokens=40, temperature=0,
                                        response_format={"type": "json_object"})
        text = got.choices[0].message.content
        assert text.startswith("{") and (got.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
        for fmt, words in [({"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#/nowhere"}}},
                            "cannot be compiled"),
                           ({"type": "yaml"}, "response_format must be")]:
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="bundle", messages=ASK, max_tokens=4, response_format=fmt)
            assert e.value.body["param"] == "response_format" and words in e.value.body["message"]
