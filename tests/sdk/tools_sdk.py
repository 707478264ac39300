"""Forced tool calls through the official SDKs: `tool_choice` required or a named
function (Chat Completions, Responses) and `any` / `tool` (Messages) always return
tool calls that parse, name a given tool and whose arguments validate against its
schema, streamed and not, over many seeds, even with tiny-v4's random weights.

Run by tests/sdk.rs with DEEPINFER_BASE_URL and DEEPINFER_MODEL set.
"""

import json

import jsonschema

from sdk_common import MODEL, NO_THINKING, check, clients, seeds

SEEDS = seeds(50)
oa, an = clients()

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 16}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}} for n, s in SCHEMAS.items()
]
RESPONSES_TOOLS = [{"type": "function", "name": n, "description": f"{n} tool", "parameters": s} for n, s in SCHEMAS.items()]
ANTHROPIC_TOOLS = [{"name": n, "description": f"{n} tool", "input_schema": s} for n, s in SCHEMAS.items()]
PROMPT = "What is the weather in Paris for the next three days?"


def valid_call(name, arguments, allowed, what):
    check(name in allowed, f"{what}: tool {name!r} not in {allowed}")
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


def chat():
    for choice, allowed in (("required", SCHEMAS), ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])):
        for seed in range(SEEDS):
            r = oa.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=CHAT_TOOLS, tool_choice=choice,
                max_tokens=200, seed=seed, extra_body=NO_THINKING,
            )
            m = r.choices[0].message
            what = f"chat {choice} seed {seed}: {m}"
            check(r.choices[0].finish_reason == "tool_calls", what)
            check(m.tool_calls and len(m.tool_calls) >= 1, what)
            for call in m.tool_calls:
                valid_call(call.function.name, call.function.arguments, allowed, what)
        # One streamed run per seed block: the deltas assemble to the same calls.
        for seed in range(0, SEEDS, 5):
            kwargs = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=CHAT_TOOLS,
                          tool_choice=choice, max_tokens=200, seed=seed, extra_body=NO_THINKING)
            plain = oa.chat.completions.create(**kwargs).choices[0].message.tool_calls
            calls, finish = {}, None
            for chunk in oa.chat.completions.create(stream=True, **kwargs):
                for c in chunk.choices:
                    finish = c.finish_reason or finish
                    for d in c.delta.tool_calls or []:
                        entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        entry["name"] += (d.function.name or "") if d.function else ""
                        entry["arguments"] += (d.function.arguments or "") if d.function else ""
            check(finish == "tool_calls", f"streamed finish {finish}")
            streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
            check(streamed == [(c.function.name, json.loads(c.function.arguments)) for c in plain],
                  f"streamed {streamed} != plain {plain}")
    # parallel_tool_calls=false: exactly one call.
    for seed in range(10):
        r = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=CHAT_TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, seed=seed, extra_body=NO_THINKING,
        )
        check(len(r.choices[0].message.tool_calls) == 1, f"parallel_tool_calls=false gave {r.choices[0].message}")


def responses():
    for choice, allowed in (("required", SCHEMAS), ({"type": "function", "name": "get_weather"}, ["get_weather"])):
        for seed in range(SEEDS):
            r = oa.responses.create(
                model=MODEL, input=PROMPT, tools=RESPONSES_TOOLS, tool_choice=choice, max_output_tokens=200,
                extra_body=dict(NO_THINKING, seed=seed),
            )
            calls = [item for item in r.output if item.type == "function_call"]
            check(calls, f"responses {choice} seed {seed}: {r.output}")
            for call in calls:
                valid_call(call.name, call.arguments, allowed, f"responses seed {seed}")
    events = oa.responses.create(model=MODEL, input=PROMPT, tools=RESPONSES_TOOLS, tool_choice="required",
                                 max_output_tokens=200, stream=True, extra_body=dict(NO_THINKING, seed=1))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    check(done, "streamed function_call_arguments.done events")
    for e in done:
        json.loads(e.arguments)


def messages():
    for choice, allowed in (({"type": "any"}, SCHEMAS), ({"type": "tool", "name": "get_weather"}, ["get_weather"])):
        for seed in range(SEEDS):
            m = an.messages.create(
                model=MODEL, max_tokens=200, messages=[{"role": "user", "content": PROMPT}], tools=ANTHROPIC_TOOLS,
                tool_choice=choice, thinking={"type": "disabled"}, extra_body={"seed": seed},
            )
            uses = [b for b in m.content if b.type == "tool_use"]
            check(m.stop_reason == "tool_use" and uses, f"messages {choice} seed {seed}: {m}")
            for u in uses:
                valid_call(u.name, u.input, allowed, f"messages seed {seed}")
    with an.messages.stream(
        model=MODEL, max_tokens=200, messages=[{"role": "user", "content": PROMPT}], tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"}, thinking={"type": "disabled"}, extra_body={"seed": 2},
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    check(uses, f"streamed tool_use: {final}")
    for u in uses:
        valid_call(u.name, u.input, SCHEMAS, "messages streamed")


if __name__ == "__main__":
    for test in (chat, responses, messages):
        test()
        print(f"ok {test.__name__}", flush=True)
