"""The official `openai` SDK against `deepinfer serve`: Chat Completions and
Responses, streamed and not, a tool definition, and `json_schema` output
validated with `jsonschema` over many seeds.

Run by tests/sdk.rs with DEEPINFER_BASE_URL and DEEPINFER_MODEL set.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
from openai import OpenAI

BASE = os.environ["DEEPINFER_BASE_URL"]
MODEL = os.environ["DEEPINFER_MODEL"]
SEEDS = int(os.environ.get("DEEPINFER_SDK_SEEDS", "48"))
client = OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=120)
NO_THINKING = {"thinking": {"type": "disabled"}}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": ["string", "null"]},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "tags", "address"],
    "additionalProperties": False,
}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def models():
    ids = [m.id for m in client.models.list().data]
    check(ids == [MODEL], f"models: {ids}")


def chat_plain_and_streamed():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, extra_body=NO_THINKING
    )
    choice = plain.choices[0]
    check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
    check(isinstance(choice.message.content, str), "content is a string")
    check(plain.usage.prompt_tokens > 0 and 0 < plain.usage.completion_tokens <= 16, f"usage {plain.usage}")

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check(text == choice.message.content, f"streamed {text!r} != plain {choice.message.content!r}")
    check(finish == choice.finish_reason, "same finish reason")
    check(usage is not None and usage.completion_tokens == plain.usage.completion_tokens, f"usage {usage}")

    # Thinking mode (the default): the reasoning comes as `reasoning_content`.
    thought = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, seed=1)
    extra = thought.choices[0].message.model_extra or {}
    check("reasoning_content" in extra, f"reasoning_content in {thought.choices[0].message}")


def chat_with_tools():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather of a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    first = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        max_tokens=24,
        seed=2,
        extra_body=NO_THINKING,
    )
    check(first.choices[0].finish_reason in ("stop", "length", "tool_calls"), str(first.choices[0]))
    # A conversation that already called the tool and got its result.
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL, messages=history, tools=tools, max_tokens=16, stream=stream, seed=3, extra_body=NO_THINKING
        )
        if stream:
            check(sum(1 for _ in r) >= 2, "streamed chunks")
        else:
            check(r.choices[0].message.role == "assistant", str(r))
    # A named tool choice is rejected in thinking mode, as by DeepSeek's API.
    try:
        client.chat.completions.create(
            model=MODEL,
            messages=history[:1],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=8,
            extra_body={"thinking": {"type": "enabled"}},
        )
        raise AssertionError("named tool choice in thinking mode was accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, str(e))


def json_schema_one(seed):
    thinking = {"type": "enabled" if seed % 4 == 0 else "disabled"}
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a user of our system."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        temperature=1.0,
        seed=seed,
        max_tokens=160,
        extra_body={"thinking": thinking},
    )
    content = r.choices[0].message.content
    try:
        value = json.loads(content)
        jsonschema.validate(value, PERSON)
    except Exception as e:  # report the seed and the text
        raise AssertionError(f"seed {seed}: {e}: {content!r}")
    return r.choices[0].finish_reason


def json_schema_many_seeds():
    with ThreadPoolExecutor(max_workers=16) as pool:
        reasons = list(pool.map(json_schema_one, range(SEEDS)))
    check(all(r == "stop" for r in reasons), f"finish reasons {reasons}")
    # The same seed gives the same document.
    again = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a user of our system."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        seed=1,
        max_tokens=160,
        extra_body=NO_THINKING,
    )
    check(json.loads(again.choices[0].message.content) == json.loads(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a user of our system."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
            seed=1,
            max_tokens=160,
            extra_body=NO_THINKING,
        ).choices[0].message.content
    ), "seeded structured output repeats")


def responses():
    # Responses has no `seed`; the extra field keeps runs repeatable.
    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=12, extra_body={"seed": 1})
    check(r.object == "response" and r.status in ("completed", "incomplete"), f"{r.status}")
    check(r.usage.input_tokens > 0 and r.usage.output_tokens <= 12, f"{r.usage}")
    r = client.responses.create(
        model=MODEL,
        instructions="Be brief.",
        input="Hello",
        max_output_tokens=12,
        reasoning={"effort": "none"},
        extra_body={"seed": 2},
    )
    check(isinstance(r.output_text, str), "output_text")
    events = client.responses.create(model=MODEL, input="Hello", max_output_tokens=8, stream=True, extra_body={"seed": 3})
    kinds = [e.type for e in events]
    check(kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete"), str(kinds))
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 20}, "confidence": {"type": "number"}},
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    }
    for seed in range(4):
        r = client.responses.create(
            model=MODEL,
            input="Answer in JSON.",
            max_output_tokens=64,
            reasoning={"effort": "none"},
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
            extra_body={"seed": seed},
        )
        jsonschema.validate(json.loads(r.output_text), schema)


def errors():
    try:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        check(e.status_code == 404, str(e))
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=9)
        raise AssertionError("temperature 9 accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400, str(e))


if __name__ == "__main__":
    for test in (models, chat_plain_and_streamed, chat_with_tools, json_schema_many_seeds, responses, errors):
        test()
        print(f"ok {test.__name__}", flush=True)
