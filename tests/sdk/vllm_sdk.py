"""vLLM's request fields, OpenAI's `developer` role, json_schema's wider forms,
attachments and forced tool inputs through the official SDKs. Each vLLM field
goes in `extra_body`, as a vLLM client sends it; every answer is checked, and
since tiny-v4's weights are random, validity must come from the grammar.

Run by tests/sdk.rs with DEEPINFER_BASE_URL and DEEPINFER_MODEL set.
"""

import datetime
import json
import re
import uuid
from typing import Literal

import jsonschema
from pydantic import BaseModel, Field

from sdk_common import MODEL, NO_THINKING, check, clients, refused, seeds

SEEDS = seeds(50)
oa, an = clients()
EOS = 1  # the built-in tokenizer's end of sentence
USER = [{"role": "user", "content": "Tell me a story about a fox"}]


def chat(extra=None, **kw):
    kw.setdefault("messages", USER)
    kw.setdefault("max_tokens", 24)
    kw.setdefault("temperature", 0)
    return oa.chat.completions.create(model=MODEL, extra_body=dict(NO_THINKING, **(extra or {})), **kw)


def token_ids(r):
    return [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]


def developer_role():
    r = chat(messages=[{"role": "developer", "content": "Answer briefly."}] + USER)
    s = chat(messages=[{"role": "system", "content": "Answer briefly."}] + USER)
    check(r.choices[0].message.content == s.choices[0].message.content, "developer is system")
    check(r.usage.prompt_tokens == s.usage.prompt_tokens, "same prompt")


def template_kwargs():
    for key in ("thinking", "enable_thinking"):
        off = oa.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=16, temperature=0, extra_body={"chat_template_kwargs": {key: False}}
        )
        check(getattr(off.choices[0].message, "reasoning_content", None) in (None, ""), f"{key}: no thinking")
        on = oa.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=16, temperature=0, extra_body={"chat_template_kwargs": {key: True}}
        )
        check(on.usage.prompt_tokens != off.usage.prompt_tokens, f"{key}: the prompt opens thinking")
    refused(lambda: chat({"chat_template_kwargs": {"tools_in_user_message": True}}),
            "chat_template_kwargs.tools_in_user_message")


def structured_outputs():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    forms = [
        ({"structured_outputs": {"json": schema}}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"guided_json": schema}, lambda t: jsonschema.validate(json.loads(t), schema)),
        ({"structured_outputs": {"regex": "[a-c]{2,4}"}}, lambda t: check(re.fullmatch("[a-c]{2,4}", t), t)),
        ({"guided_regex": "(cat|dog)s?"}, lambda t: check(re.fullmatch("(cat|dog)s?", t), t)),
        ({"structured_outputs": {"choice": ["yes", "no", "a.b"]}}, lambda t: check(t in ("yes", "no", "a.b"), t)),
        ({"guided_choice": ["left", "right"]}, lambda t: check(t in ("left", "right"), t)),
        ({"structured_outputs": {"grammar": 'start: "x" "y"+'}}, lambda t: check(re.fullmatch("xy+", t), t)),
    ]
    for extra, valid in forms:
        for seed in range(4):
            r = chat(dict(extra, seed=seed), max_tokens=60, temperature=1)
            valid(r.choices[0].message.content)
    refused(lambda: chat({"structured_outputs": {"structural_tag": "{}"}}), "structured_outputs.structural_tag")
    refused(lambda: chat({"guided_regex": "a", "guided_choice": ["b"]}), "guided_regex", "guided_choice")


def min_tokens_and_stops():
    eos_now = {"logit_bias": {str(EOS): 100}}
    check(chat(eos_now).usage.completion_tokens <= 1, "EOS first without min_tokens")
    r = chat(dict(eos_now, min_tokens=6))
    check(r.usage.completion_tokens >= 6, f"min_tokens: {r.usage}")
    refused(lambda: chat({"min_tokens": 50}, max_tokens=10), "min_tokens")

    plain = chat({"return_tokens_as_token_ids": True}, logprobs=True, max_tokens=24)
    ids = token_ids(plain)
    check(all(re.fullmatch(r"token_id:\d+", t.token) for t in plain.choices[0].logprobs.content), "token_id:N")
    text = plain.choices[0].message.content
    # A stop token id ends the output there, its text left out (or kept on request).
    at = 3
    r = chat({"stop_token_ids": [ids[at]], "return_tokens_as_token_ids": True}, logprobs=True, max_tokens=24)
    check(r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == ids.index(ids[at]) + 1, f"{r}")
    # A stop string: cut before it; kept with include_stop_str_in_output; not before min_tokens.
    words = [w for w in re.findall(r"\w{2,}", text)]
    if words:
        stop = words[0]
        cut = chat(stop=[stop], max_tokens=24).choices[0].message.content
        check(stop not in cut and text.startswith(cut), f"cut {cut!r} of {text!r} at {stop!r}")
        kept = chat({"include_stop_str_in_output": True}, stop=[stop], max_tokens=24).choices[0].message.content
        check(kept.endswith(stop) and text.startswith(kept), f"kept {kept!r} of {text!r}")
        late = chat({"min_tokens": 24}, stop=[stop], max_tokens=24)
        check(late.usage.completion_tokens == 24, f"min_tokens holds the stop string back: {late.usage}")


def prompt_fields():
    base = chat()
    r = chat({"truncate_prompt_tokens": 5})
    check(r.usage.prompt_tokens == 5, f"truncate_prompt_tokens: {r.usage}")
    r = chat({"add_generation_prompt": False})
    check(r.usage.prompt_tokens == base.usage.prompt_tokens - 2, f"add_generation_prompt: {r.usage} vs {base.usage}")
    prefill = USER + [{"role": "assistant", "content": "Once upon a time"}]
    r = chat({"continue_final_message": True, "add_generation_prompt": False}, messages=prefill)
    check(r.choices[0].message.content is not None, "continued")
    refused(lambda: chat({"continue_final_message": True}), "continue_final_message")
    refused(lambda: chat({"continue_final_message": True, "add_generation_prompt": True}, messages=prefill),
            "add_generation_prompt")
    check(chat({"skip_special_tokens": True}).choices[0].message.content is not None, "skip_special_tokens")
    refused(lambda: chat({"skip_special_tokens": False}), "skip_special_tokens")
    check(chat({"priority": -3}).choices[0].finish_reason in ("stop", "length"), "priority")
    refused(lambda: chat({"priority": "high"}), "priority")
    r = chat({"request_id": "abc-123"})
    check(r.id == "chatcmpl-abc-123", f"request_id: {r.id}")
    refused(lambda: chat(tool_choice="required"), "tool_choice", "tools")


class Meeting(BaseModel):
    title: str = Field(max_length=24)
    starts: datetime.datetime
    day: datetime.date
    kind: Literal["call", "visit", "lunch"]
    seats: int


def pydantic_parse():
    for seed in range(30):
        r = oa.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Plan a meeting as JSON"}], response_format=Meeting,
            max_tokens=160, temperature=1, seed=seed, extra_body=NO_THINKING,
        )
        m = r.choices[0].message
        check(m.parsed is not None and isinstance(m.parsed.starts, datetime.datetime), f"seed {seed}: {m.content}")


def wide_json_schema():
    schema = {
        "type": "object",
        "properties": {
            "version": {"const": "v1"},
            "level": {"enum": ["low", 2, None]},
            "id": {"type": "string", "format": "uuid"},
            "at": {"type": "string", "format": "date-time"},
            "time": {"type": "string", "format": "time"},
            "mail": {"type": "string", "format": "email"},
            "site": {"type": "string", "format": "uri"},
            "ratio": {"type": "number"},
        },
        "required": ["version", "level", "id", "at", "time", "mail", "site", "ratio"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "strict": True, "schema": schema}}
    for seed in range(10):
        r = chat({"seed": seed}, response_format=fmt, max_tokens=300, temperature=1)
        v = json.loads(r.choices[0].message.content)
        jsonschema.validate(v, schema)
        uuid.UUID(v["id"])
        datetime.datetime.fromisoformat(v["at"].replace("z", "Z").replace("Z", "+00:00"))
        check(re.fullmatch(r"[^@\s]+@[^@\s]+", v["mail"]) and ":" in v["site"], f"seed {seed}: {v}")
    array = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
    fmt = {"type": "json_schema", "json_schema": {"name": "list", "strict": True, "schema": array}}
    for seed in range(5):
        r = chat({"seed": seed}, response_format=fmt, max_tokens=60, temperature=1)
        jsonschema.validate(json.loads(r.choices[0].message.content), array)
    # Strict and non-strict tools together.
    tools = [
        {"type": "function", "function": {"name": "a", "strict": True, "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}},
        {"type": "function", "function": {"name": "b", "parameters": {"type": "object", "properties": {"y": {"type": "string", "maxLength": 8}}}}},
    ]
    r = chat(tools=tools, tool_choice="required", max_tokens=80, temperature=1)
    check(r.choices[0].message.tool_calls, f"mixed strict tools: {r}")


PDF = "data:application/pdf;base64,JVBERi0xLjQKJcOkw7zDtsOfCjIgMCBvYmoKPDwvTGVuZ3RoIDMgMCBSPj4Kc3RyZWFtCg=="


def attachments():
    part = {"type": "file", "file": {"filename": "report.pdf", "file_data": PDF}}
    refused(lambda: chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Summarise"}, part]}]),
            "messages[0].content[1]", "`file`")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    refused(lambda: chat(messages=[{"role": "user", "content": [image]}]), "image_url")
    doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF.split(",")[1]}}
    refused(lambda: an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [doc]}]),
            "document")
    text_doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "A fox."}}
    m = an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [text_doc]}],
                           thinking={"type": "disabled"})
    check(m.usage.input_tokens > 5, "a plain-text document is read")


NUMBERS = {
    "type": "object",
    "properties": {
        "amount": {"type": "number"},
        "count": {"type": "integer"},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "when": {"type": "string", "format": "date-time"},
        "mode": {"enum": ["fast", "slow"]},
    },
    "required": ["amount", "count", "when", "mode"],
}


def anthropic_tools():
    tools = [{"name": "pay", "description": "pay", "input_schema": NUMBERS}]
    for seed in range(SEEDS):
        m = an.messages.create(
            model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "Pay the bill"}], tools=tools,
            tool_choice={"type": "any"}, thinking={"type": "disabled"}, extra_body={"seed": seed},
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        check(m.stop_reason == "tool_use" and uses, f"seed {seed}: {m}")
        for u in uses:
            check(u.id.startswith("toolu_"), f"id {u.id}")
            jsonschema.validate(u.input, NUMBERS)
    # At most one call with `auto`; the ids come back in history.
    for seed in range(6):
        m = an.messages.create(
            model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Pay the bill"}], tools=tools,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True}, thinking={"type": "disabled"},
            extra_body={"seed": seed},
        )
        check(len([b for b in m.content if b.type == "tool_use"]) <= 1, f"one call: {m}")


def thinking_budget():
    r = oa.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=120, temperature=1, seed=5,
        extra_body={"thinking": {"type": "enabled", "budget_tokens": 12}, "logit_bias": {str(EOS): -100}},
    )
    reasoning = r.usage.completion_tokens_details.reasoning_tokens
    check(reasoning is not None and reasoning <= 13, f"budget_tokens: {r.usage}")


def main():
    for test in (developer_role, template_kwargs, structured_outputs, min_tokens_and_stops, prompt_fields,
                 pydantic_parse, wide_json_schema, attachments, anthropic_tools, thinking_budget):
        test()
        print(f"ok: {test.__name__}")


if __name__ == "__main__":
    main()
