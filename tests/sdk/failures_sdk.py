"""The official `openai` and `anthropic` SDKs against a server that cannot
serve (a cluster front end whose only node was killed, or a model whose
logits are not finite): every API, streamed and not, raises in the SDK and
none reports a finished answer.

Run by tests/api_failures.rs with DEEPINFER_BASE_URL, DEEPINFER_MODEL and
DEEPINFER_EXPECT_STATUS (503: retryable, with Retry-After; 500: internal).
"""

import json
import os
import urllib.error
import urllib.request

import anthropic
import openai

BASE = os.environ["DEEPINFER_BASE_URL"]
MODEL = os.environ["DEEPINFER_MODEL"]
STATUS = int(os.environ["DEEPINFER_EXPECT_STATUS"])
# No retries: the SDKs retry a 5xx by default, which would only slow the test.
oai = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=60)
ant = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=60)
MESSAGES = [{"role": "user", "content": "Hello"}]
NO_THINKING = {"thinking": {"type": "disabled"}}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(what, call, error_type):
    """`call()` raises `error_type`; returns the exception."""
    try:
        got = call()
    except error_type as e:
        print(f"{what}: {type(e).__name__}: {str(e)[:120]}")
        return e
    raise AssertionError(f"{what}: no exception, got {got!r:.300}")


def plain_status(what, e):
    check(e.status_code == STATUS, f"{what}: status {e.status_code}, want {STATUS}")
    retry_after = e.response.headers.get("retry-after")
    check((retry_after is not None) == (STATUS == 503), f"{what}: Retry-After {retry_after!r}")


def openai_apis():
    for what, call in [
        ("chat", lambda: oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=NO_THINKING)),
        ("responses", lambda: oai.responses.create(model=MODEL, input="Hello", max_output_tokens=8)),
        ("completions", lambda: oai.completions.create(model=MODEL, prompt="Hello", max_tokens=8)),
    ]:
        plain_status(what, raises(what, call, openai.APIStatusError))

    # Streamed chat and completions: the SDK raises on the error chunk, after no finish reason.
    def chat_stream():
        stream = oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, stream=True, extra_body=NO_THINKING
        )
        for chunk in stream:
            check(all(c.finish_reason is None for c in chunk.choices), f"a finish reason before the error: {chunk}")

    def completions_stream():
        for chunk in oai.completions.create(model=MODEL, prompt="Hello", max_tokens=8, stream=True):
            check(all(c.finish_reason is None for c in chunk.choices), f"a finish reason before the error: {chunk}")

    raises("chat stream", chat_stream, openai.APIError)
    raises("completions stream", completions_stream, openai.APIError)

    # Responses ends a failed stream with `response.failed` (the protocol's
    # terminal failure event), never `response.completed`; the SDK yields it
    # as an event, and its stream helper raises for want of a completed response.
    events = [e.type for e in oai.responses.create(model=MODEL, input="Hello", max_output_tokens=8, stream=True)]
    check(events and events[-1] == "response.failed", f"responses stream events {events}")
    check("response.completed" not in events and "response.incomplete" not in events, f"events {events}")

    def responses_helper():
        with oai.responses.stream(model=MODEL, input="Hello", max_output_tokens=8) as stream:
            for event in stream:
                if event.type == "response.failed":
                    check(event.response.status == "failed" and event.response.error, f"{event}")
            return stream.get_final_response()

    raises("responses stream helper", responses_helper, RuntimeError)


def anthropic_api():
    kwargs = dict(model=MODEL, max_tokens=8, messages=MESSAGES, thinking={"type": "disabled"})
    e = raises("messages", lambda: ant.messages.create(**kwargs), anthropic.APIStatusError)
    plain_status("messages", e)
    kind = "overloaded_error" if STATUS == 503 else "api_error"
    check(e.body["error"]["type"] == kind, f"messages error body {e.body}")

    def stream():
        for event in ant.messages.create(stream=True, **kwargs):
            check(event.type not in ("message_delta", "message_stop"), f"a stop before the error: {event}")

    e = raises("messages stream", stream, anthropic.APIStatusError)
    check(e.body["error"]["type"] == kind, f"messages stream error body {e.body}")

    def helper():
        with ant.messages.stream(**kwargs) as s:
            return s.get_final_message()

    raises("messages stream helper", helper, anthropic.APIStatusError)


def health():
    """`/health` (readiness) is 503 with a reason only where the failures are retryable."""
    try:
        with urllib.request.urlopen(BASE + "/health") as r:
            status, body = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, body = e.code, json.loads(e.read())
    print(f"/health: {status} {body}")
    if STATUS == 503:
        check(status == 503 and body["status"] == "unavailable" and body["reason"], f"/health {status} {body}")
    else:
        check(status == 200, f"/health {status} {body}: a model fault is no reason to take the server out")


openai_apis()
anthropic_api()
health()
print("failures_sdk: ok")
