"""`response_format` through the official `openai` client against a real server on the demo model."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from runtime.engine.request import GenerationRequest, SamplingParams
from tests.server.conftest import RunningServer

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)?$", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z ]+$", "maxLength": 12},
            "maxItems": 2,
        },
    },
    "required": ["name", "age", "colour", "hobbies"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


def person_format(strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}


def test_fifty_sampled_outputs_all_validate_against_the_schema(client: openai.OpenAI, model: str) -> None:
    def ask(seed: int) -> list[Any]:
        reply = client.chat.completions.create(
            model=model,
            messages=ASK,
            response_format=person_format(),  # type: ignore[arg-type]
            n=5,
            temperature=0.8 + 0.02 * seed,  # 0.8 to 0.98
            seed=seed,
            max_tokens=80,
        )
        return list(reply.choices)

    # Two requests of n=5 fill the 10 slots, so the 50 sequences decode in batches of 10.
    with ThreadPoolExecutor(max_workers=2) as pool:
        choices = [c for batch in pool.map(ask, range(10)) for c in batch]
    assert len(choices) == 50
    documents = []
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        document = json.loads(choice.message.content or "")
        jsonschema.validate(document, PERSON)
        documents.append(json.dumps(document, sort_keys=True))
    assert len(set(documents)) > 25  # sampling still samples: the grammar only removes invalid tokens


def test_json_object_mode_gives_an_object(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a banana as a JSON object with a name and a colour."}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0.0,
    )
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)


def test_regex_extension_matches(client: openai.OpenAI, model: str) -> None:
    pattern = r"(yes|no), because [a-z ,]{5,60}\."
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Is the sky blue? Answer yes or no and say why."}],
        response_format={"type": "regex", "regex": pattern},  # type: ignore[arg-type, misc]
        n=3,
        temperature=0.9,
        seed=3,
        max_tokens=40,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        assert re.fullmatch(pattern, choice.message.content or ""), choice.message.content


def test_lark_grammar_and_vllm_guided_choice(client: openai.OpenAI, model: str) -> None:
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is 6 times 7?"}],
        response_format={"type": "grammar", "grammar": lark},  # type: ignore[arg-type, misc]
        max_tokens=20,
        temperature=0.0,
    )
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", reply.choices[0].message.content or "")
    picked = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Which is a fruit?"}],
        extra_body={"guided_choice": ["apple", "chair"]},
        max_tokens=8,
    )
    assert picked.choices[0].message.content in ("apple", "chair")


@pytest.mark.parametrize(
    ("response_format", "problem"),
    [
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "Invalid type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "does not exist"),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "string", "format": "x"}, "strict": True},
            },
            "format",
        ),
        ({"type": "regex", "regex": "(unclosed"}, "unclosed group"),
        ({"type": "grammar", "grammar": "start: missing_rule"}, "missing_rule"),
    ],
)
def test_an_invalid_schema_or_grammar_is_a_400_naming_the_problem(
    client: openai.OpenAI, model: str, response_format: dict[str, Any], problem: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            response_format=response_format,  # type: ignore[arg-type]
            max_tokens=5,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "response_format"
    assert problem in error["message"]


def test_a_missing_schema_name_is_a_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model,
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"schema": PERSON}},  # type: ignore[typeddict-item]
            max_tokens=5,
        )
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "response_format.json_schema.name"


def test_an_unconstrained_request_in_the_same_batch_is_unaffected(server: RunningServer) -> None:
    engine = server.engine
    tokenizer = engine.tokenizer
    plain_prompt = tuple(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Name a city."}])))
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    (alone,) = engine.generate(GenerationRequest("plain-alone", plain_prompt, plain))

    from runtime.engine.constraints import json_schema_grammar

    constrained_prompt = tuple(tokenizer.encode(tokenizer.apply_chat_template(ASK)))
    grammar = json_schema_grammar(PERSON)
    constrained = SamplingParams(max_tokens=24, temperature=0.9, seed=1, n=4, grammar=grammar)
    # Submitted back to back, both are admitted in the same step and decode in one batch.
    together = engine.submit(GenerationRequest("constrained", constrained_prompt, constrained))
    beside = engine.submit(GenerationRequest("plain-beside", plain_prompt, plain))
    beside_ids = [t for output in beside for t in output.token_ids]
    first_sequence = "".join(o.text for o in together if o.index == 0)
    assert beside_ids == list(alone.token_ids)
    assert first_sequence.startswith('{"name": "')
