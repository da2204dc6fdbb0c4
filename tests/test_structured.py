"""`response_format` json_schema / json_object on the micro bundle (the DeepSeek-V4 tokenizer,
random weights) through the `openai` client: every seeded sampled output parses and validates
against its schema (runtime_min/serving/grammar.py's mask in the scheduler's sampling), and a schema
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


def _fifty_seeded_requests_validate(session: Session) -> None:
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


def test_50_seeded_sampled_requests_validate_against_their_schema(session):
    _fifty_seeded_requests_validate(session)


@pytest.mark.slow
def test_50_seeded_sampled_requests_on_tiny_validate(tmp_path):
    """The issue's goal on tiny as `dsneuron compile --config tiny` builds it (its decode batch
    buckets and chunk bucket; from the compile cache after README's main job, else a cold compile
    of several minutes)."""
    from dsneuron.compiler.compile import build_steps_for_config, compile_bundle
    from dsneuron.compiler.config import load_config

    model_cfg, compile_cfg, _ = load_config("tiny")
    parts = build_steps_for_config(model_cfg, compile_cfg, None)
    _fifty_seeded_requests_validate(Session.load(compile_bundle(model_cfg, compile_cfg, tmp_path / "bundle", parts)))


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
