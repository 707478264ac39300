"""The same requests through the official SDKs to two servers, one process
(DEEPINFER_REFERENCE_URL) and a cluster's front end (DEEPINFER_BASE_URL):
every answer's text, tool calls, finish reason and log-probabilities must be
identical. Greedy and seeded sampling, streamed and not, JSON schema, forced
tool calls, logit bias, penalties and min-p, Chat Completions, Responses
and Messages.

Run by tests/cluster_serve.rs.
"""

import json
import os

import anthropic
import jsonschema
from openai import OpenAI

MODEL = os.environ["DEEPINFER_MODEL"]
NO_THINKING = {"thinking": {"type": "disabled"}}
SERVERS = {
    name: (
        OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300),
        anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300),
    )
    for name, url in (("one process", os.environ["DEEPINFER_REFERENCE_URL"]),
                      ("cluster", os.environ["DEEPINFER_BASE_URL"]))
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def chat(oa, _an, **kw):
    r = oa.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
    c = r.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in (c.message.tool_calls or [])]
    logprobs = [(t.token, t.logprob) for t in (c.logprobs.content or [])] if c.logprobs else None
    return c.message.content, calls, c.finish_reason, logprobs, r.usage.completion_tokens


def chat_streamed(oa, _an, **kw):
    text, finish = "", None
    for chunk in oa.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def responses(oa, _an, **kw):
    r = oa.responses.create(model=MODEL, input="Tell me about the sea", **kw)
    return r.output_text, r.status, r.usage.output_tokens


def messages(_oa, an, stream=False, **kw):
    if stream:
        with an.messages.stream(model=MODEL, max_tokens=24, messages=MESSAGES, **kw) as s:
            m = s.get_final_message()
    else:
        m = an.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, **kw)
    return [b.model_dump() for b in m.content], m.stop_reason, m.usage.output_tokens


CASES = [
    ("greedy", chat, dict(max_tokens=24, temperature=0, logprobs=True, top_logprobs=3, extra_body=NO_THINKING)),
    ("seeded sampling", chat, dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, logprobs=True,
                                   extra_body=NO_THINKING)),
    ("thinking, seeded", chat, dict(max_tokens=32, temperature=0.8, seed=3)),
    ("streamed", chat_streamed, dict(max_tokens=24, temperature=0.7, seed=11, extra_body=NO_THINKING)),
    ("json schema", chat, dict(max_tokens=80, temperature=0.9, seed=5, extra_body=NO_THINKING,
                               response_format={"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": PERSON,
                                                                "strict": True}})),
    ("forced tool call", chat, dict(max_tokens=80, temperature=0.9, seed=2, extra_body=NO_THINKING,
                                    tools=[WEATHER_TOOL], tool_choice="required")),
    ("logit bias, penalties, min-p", chat, dict(max_tokens=24, temperature=1.0, seed=4, logprobs=True,
                                                logit_bias={"300": 5, "301": -100}, frequency_penalty=1.0,
                                                presence_penalty=0.5,
                                                extra_body=dict(NO_THINKING, repetition_penalty=1.2, min_p=0.05))),
    ("responses", responses, dict(max_output_tokens=24, temperature=0.6, extra_body=dict(NO_THINKING, seed=9))),
    ("messages", messages, dict(extra_body=dict(NO_THINKING, temperature=0.5, seed=12))),
    ("messages streamed", messages, dict(stream=True, extra_body=dict(NO_THINKING, temperature=0.5, seed=13))),
]


def main():
    for name, call, kw in CASES:
        (one_oa, one_an), (cl_oa, cl_an) = SERVERS["one process"], SERVERS["cluster"]
        want = call(one_oa, one_an, **kw)
        got = call(cl_oa, cl_an, **kw)
        if got != want:
            raise AssertionError(f"{name}: the cluster answered\n  {got}\nwhere one process answered\n  {want}")
        if name == "json schema":
            jsonschema.validate(json.loads(got[0]), PERSON)
        if name == "forced tool call":
            assert got[1] and all(n == "get_weather" for n, _ in got[1]), got
        print(f"ok {name}: identical")


main()
