"""The official `anthropic` SDK against `deepinfer serve`: Messages streamed
and not, with a system prompt, thinking, a tool definition and errors.

Run by tests/sdk.rs with DEEPINFER_BASE_URL and DEEPINFER_MODEL set.
"""

import os

import anthropic

BASE = os.environ["DEEPINFER_BASE_URL"]
MODEL = os.environ["DEEPINFER_MODEL"]
client = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=120)
NO_THINKING = {"type": "disabled"}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def plain_and_streamed():
    kwargs = dict(
        model=MODEL,
        max_tokens=16,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hello"}],
        thinking=NO_THINKING,
        # Newer SDKs take sampling parameters only as extra fields.
        extra_body={"temperature": 0},
    )
    m = client.messages.create(**kwargs)
    check(m.type == "message" and m.role == "assistant", str(m))
    check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
    check(m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 16, f"usage {m.usage}")
    text = "".join(b.text for b in m.content if b.type == "text")

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(streamed == text, f"streamed {streamed!r} != plain {text!r}")
    check(final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, str(final))


def thinking():
    m = client.messages.create(
        model=MODEL,
        max_tokens=12,
        messages=[{"role": "user", "content": "Think about it."}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"seed": 1},
    )
    check(m.content and m.content[0].type == "thinking", str(m.content))


def tools():
    weather = {
        "name": "get_weather",
        "description": "Current weather of a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    m = client.messages.create(
        model=MODEL,
        max_tokens=24,
        tools=[weather],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        thinking=NO_THINKING,
        extra_body={"seed": 2},
    )
    check(m.stop_reason in ("end_turn", "max_tokens", "tool_use"), str(m))
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 24 C"}]},
    ]
    with client.messages.stream(
        model=MODEL, max_tokens=16, tools=[weather], messages=history, thinking=NO_THINKING, extra_body={"seed": 3}
    ) as s:
        final = s.get_final_message()
    check(final.role == "assistant", str(final))


def stop_sequences():
    base = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Count"}], thinking=NO_THINKING, extra_body={"temperature": 0})
    text = "".join(b.text for b in client.messages.create(**base).content if b.type == "text")
    if len(text) < 8:
        return
    stop = text[4:7]
    m = client.messages.create(**base, stop_sequences=[stop])
    cut = "".join(b.text for b in m.content if b.type == "text")
    check(cut == text[: text.index(stop)], f"{cut!r} vs {text!r} stop {stop!r}")
    check(m.stop_reason == "stop_sequence" and m.stop_sequence == stop, str(m))


def errors():
    try:
        client.messages.create(model="claude-opus-4", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as e:
        check(e.status_code == 404, str(e))
    try:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 5})
        raise AssertionError("temperature 5 accepted")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400, str(e))


if __name__ == "__main__":
    for test in (plain_and_streamed, thinking, tools, stop_sequences, errors):
        test()
        print(f"ok {test.__name__}", flush=True)
