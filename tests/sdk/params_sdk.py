"""Request fields through the official SDKs: each is honoured, or refused with a
400 that names it. Token-limit aliases, penalties, logit bias, min-p, thinking
switches, Anthropic structured output and refused fields.

Run by tests/sdk.rs with DEEPINFER_BASE_URL and DEEPINFER_MODEL set.
"""

import json

import anthropic
import jsonschema
import urllib.error
import urllib.request
import openai

from sdk_common import BASE, MODEL, NO_THINKING, check, clients, refused

oa, an = clients()
PROMPTS = ["Once upon a time", "The weather today", "List three colours", "Hello there"]


def tokens(prompt, max_tokens=40, **kw):
    """Greedy output tokens (as strings, via logprobs) of a chat request."""
    extra = dict(NO_THINKING, **kw.pop("extra_body", {}))
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=kw.pop("temperature", 0),
        logprobs=True,
        extra_body=extra,
        **kw,
    )
    return [t.token for t in r.choices[0].logprobs.content], r


def repeats(toks):
    return len(toks) - len(set(toks))


def max_completion_tokens():
    for n in (1, 5):
        r = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], max_completion_tokens=n,
            temperature=0, extra_body=NO_THINKING,
        )
        check(r.usage.completion_tokens <= n, f"max_completion_tokens={n}: {r.usage}")
        check(r.choices[0].finish_reason == "length", f"finish {r.choices[0].finish_reason}")
    refused(lambda: oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"max_completion_tokens": "5"}),
        "max_completion_tokens")
    refused(lambda: oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, max_completion_tokens=5),
        "max_completion_tokens", "max_tokens")


def penalties():
    base = frequency = presence = repetition = 0
    for p in PROMPTS:
        toks, _ = tokens(p)
        base += repeats(toks)
        frequency += repeats(tokens(p, frequency_penalty=2.0)[0])
        presence += repeats(tokens(p, presence_penalty=2.0)[0])
        repetition += repeats(tokens(p, extra_body={"repetition_penalty": 5.0})[0])
        encouraged = repeats(tokens(p, frequency_penalty=-2.0)[0])
        check(encouraged >= repeats(toks), f"negative frequency_penalty repeats less on {p!r}")
    print(f"repeated tokens over {len(PROMPTS)} prompts: none {base}, frequency {frequency}, "
          f"presence {presence}, repetition {repetition}")
    check(base > 0, "the greedy baseline repeats itself")
    for name, n in (("frequency_penalty", frequency), ("presence_penalty", presence), ("repetition_penalty", repetition)):
        check(n < base, f"{name} did not reduce repeats: {n} vs {base}")
    refused(lambda: tokens("x", frequency_penalty=3.0), "frequency_penalty")
    refused(lambda: tokens("x", extra_body={"repetition_penalty": 0}), "repetition_penalty")


def logit_bias():
    seen = set()
    for token_id in (300, 301, 302):
        toks, _ = tokens("Hello", max_tokens=6, logit_bias={str(token_id): 100})
        check(len(set(toks)) == 1, f"logit_bias +100 on {token_id} gave {toks}")
        seen.add(toks[0])
    check(len(seen) == 3, f"three biased ids gave {seen}")
    refused(lambda: tokens("x", logit_bias={"not-a-token": 1}), "logit_bias")
    refused(lambda: tokens("x", logit_bias={"5": 101}), "logit_bias")


def min_p():
    greedy, _ = tokens("Once upon a time", max_tokens=16)
    for seed in range(6):
        sampled, _ = tokens("Once upon a time", max_tokens=16, temperature=1.0, seed=seed, extra_body={"min_p": 1.0})
        check(sampled == greedy, f"min_p=1 seed {seed}: {sampled} != greedy {greedy}")
    spread = {tuple(tokens("Once upon a time", max_tokens=16, temperature=1.0, seed=s)[0]) for s in range(6)}
    check(len(spread) > 1, "without min_p the seeds differ")
    refused(lambda: tokens("x", extra_body={"min_p": 1.5}), "min_p")


def refusals():
    msgs = [{"role": "user", "content": "Hi"}]
    refused(lambda: oa.chat.completions.create(model=MODEL, messages=msgs, store=True), "store")
    refused(lambda: oa.chat.completions.create(model=MODEL, messages=msgs, extra_body={"best_of": 3}), "best_of")
    refused(lambda: oa.chat.completions.create(model=MODEL, messages=msgs, extra_body={"echo": True}), "echo")
    refused(lambda: oa.chat.completions.create(model=MODEL, messages=msgs, extra_body={"colour": "red"}), "colour")
    refused(lambda: oa.chat.completions.create(
        model=MODEL, messages=msgs, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"}), "audio")
    refused(lambda: oa.responses.create(model=MODEL, input="Hi", previous_response_id="resp_x"), "previous_response_id")
    refused(lambda: an.messages.create(model=MODEL, max_tokens=8, messages=msgs, extra_body={"mcp_servers": []}),
            "mcp_servers")
    # Accepted identifiers and neutral values.
    r = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, n=1, store=False, user="u-1",
                                   extra_body=NO_THINKING)
    check(r.choices[0].message.content is not None, "neutral values accepted")
    # Anthropic requires max_tokens (the SDK would refuse to send it: go below it).
    body = json.dumps({"model": MODEL, "messages": msgs}).encode()
    request = urllib.request.Request(BASE + "/v1/messages", data=body, headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60)
        raise AssertionError("a Messages request without max_tokens was accepted")
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        check(e.code == 400 and "max_tokens" in text, text)


def thinking_switches():
    r = oa.responses.create(model=MODEL, input="Hi", max_output_tokens=24, extra_body={"thinking": {"type": "disabled"}, "seed": 1})
    check(all(item.type != "reasoning" for item in r.output), f"reasoning with thinking disabled: {r.output}")
    check((r.usage.output_tokens_details.reasoning_tokens or 0) == 0, f"{r.usage}")
    refused(lambda: oa.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"},
                                        extra_body={"thinking": {"type": "disabled"}}), "thinking")


def anthropic_output_format():
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    for seed in range(4):
        m = an.messages.create(
            model=MODEL, max_tokens=80, messages=[{"role": "user", "content": "Plan a trip as JSON."}],
            thinking={"type": "disabled"},
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}, "seed": seed},
        )
        text = "".join(b.text for b in m.content if b.type == "text")
        jsonschema.validate(json.loads(text), schema)


def post(path, body):
    request = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def endpoints():
    check(oa.models.retrieve(MODEL).id == MODEL, "openai models.retrieve")
    check(an.models.retrieve(MODEL).id == MODEL, "anthropic models.retrieve")
    try:
        oa.models.retrieve("gpt-4o")
        raise AssertionError("unknown model retrieved")
    except openai.NotFoundError:
        pass
    with urllib.request.urlopen(BASE + "/version", timeout=30) as r:
        check("version" in json.loads(r.read()), "/version")
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    counted = an.messages.count_tokens(model=MODEL, messages=msgs).input_tokens
    m = an.messages.create(model=MODEL, max_tokens=1, messages=msgs)
    check(counted == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), f"count_tokens {counted} vs {m.usage}")
    t = post("/tokenize", {"model": MODEL, "messages": msgs})
    chat = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    check(t["count"] == chat.usage.prompt_tokens == len(t["tokens"]), f"tokenize {t['count']} vs {chat.usage}")
    raw = post("/tokenize", {"prompt": "Hello, DeepSeek", "add_special_tokens": False})
    back = post("/detokenize", {"tokens": raw["tokens"]})
    check(back["prompt"] == "Hello, DeepSeek", f"round trip {back}")


def usage_exact():
    """Tokens are tokens whatever their bytes: a run cut by max_tokens reports
    exactly max_tokens, with one logprob each, even when it ends inside a UTF-8
    character; reasoning never exceeds the completion."""
    cut_inside = 0
    for seed in range(40):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=16, seed=seed, temperature=1,
                  logprobs=True, top_logprobs=2, extra_body=NO_THINKING)
        r = oa.chat.completions.create(**kw)
        c = r.choices[0]
        if c.finish_reason != "length":
            continue
        cut_inside += c.message.content.endswith("\ufffd")
        streamed = sum(len(ch.choices[0].logprobs.content or []) for ch in oa.chat.completions.create(stream=True, **kw)
                       if ch.choices and ch.choices[0].logprobs)
        check(r.usage.completion_tokens == 16 and len(c.logprobs.content) == 16 and streamed == 16,
              f"seed {seed}: usage {r.usage.completion_tokens}, logprobs {len(c.logprobs.content)}, streamed {streamed}")
    check(cut_inside > 0, "some run ended inside a character")
    for seed in range(20):
        r = oa.responses.create(model=MODEL, input="Hi", max_output_tokens=16, top_logprobs=2, reasoning={"effort": "none"},
                                extra_body={"seed": seed, "temperature": 1})
        if r.status != "incomplete":
            continue
        n = sum(len(c.logprobs or []) for i in r.output if i.type == "message" for c in i.content if c.type == "output_text")
        check(r.usage.output_tokens == 16 and n == 16, f"responses seed {seed}: {r.usage.output_tokens} tokens, {n} logprobs")
    for seed in range(10):
        r = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=32, seed=seed)
        u = r.usage
        check(u.completion_tokens_details.reasoning_tokens <= u.completion_tokens, f"{u}")


def metric(name):
    with urllib.request.urlopen(BASE + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def several_choices():
    prompt = "Tell me about the history of " + "the old town and its many bridges " * 6
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], n=4, max_tokens=12, seed=7, temperature=1,
              extra_body=NO_THINKING)
    hits = metric("vllm:prefix_cache_hits_total")
    r = oa.chat.completions.create(**kw)
    check([c.index for c in r.choices] == [0, 1, 2, 3], f"{r.choices}")
    texts = [c.message.content for c in r.choices]
    check(len(set(texts)) == 4, f"four distinct completions: {texts}")
    check(r.usage.completion_tokens == 48 and r.usage.prompt_tokens > 64, f"{r.usage}")
    reused = metric("vllm:prefix_cache_hits_total") - hits
    check(reused >= 3 * 64, f"the three later choices reused the first's prompt blocks: {reused} tokens")
    again = [c.message.content for c in oa.chat.completions.create(**kw).choices]
    check(again == texts, "same seed, same four completions")
    streamed, usage, ids = {}, None, set()
    for chunk in oa.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    check([streamed[i] for i in range(4)] == texts, f"streamed choices {streamed} != {texts}")
    check(len(ids) == 1 and usage.completion_tokens == 48, f"one id {ids}, usage {usage}")
    refused(lambda: oa.chat.completions.create(**dict(kw, n=17)), "`n`")


def completions():
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, seed=1, temperature=0)
    r = oa.completions.create(logprobs=2, **kw)
    c = r.choices[0]
    check(r.object == "text_completion" and c.finish_reason == "length", f"{r}")
    check(r.usage.completion_tokens == 12 and len(c.logprobs.tokens) == len(c.logprobs.token_logprobs), f"{r.usage}")
    check(all(len(t) <= 2 for t in c.logprobs.top_logprobs), "two alternatives per token")
    streamed = "".join(ch.choices[0].text for ch in oa.completions.create(stream=True, **kw) if ch.choices)
    check(streamed == c.text, f"streamed {streamed!r} != {c.text!r}")
    echoed = oa.completions.create(echo=True, **kw).choices[0].text
    check(echoed == "Once upon a time" + c.text, f"echo {echoed!r}")
    if len(c.text) > 4:
        stop = c.text[2:4]
        cut = oa.completions.create(stop=[stop], **kw).choices[0]
        check(cut.text == c.text[: c.text.index(stop)] and cut.finish_reason == "stop", f"stop {stop!r}: {cut}")
    chunks = list(oa.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    check(chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12, f"{chunks[-1]}")
    refused(lambda: oa.completions.create(suffix="x", **kw), "suffix")
    refused(lambda: oa.completions.create(n=3, **kw), "`n`")
    refused(lambda: oa.completions.create(echo=True, logprobs=1, **kw), "echo")


def cache_retention():
    """OpenAI's `prompt_cache_retention` and Anthropic's `cache_control` (top
    level and on a block) are taken, the repeated prompt is served from the
    cache, and values the protocols do not define are 400s."""
    text = " ".join(f"fact {i} is worth keeping." for i in range(150))
    msgs = [{"role": "user", "content": text}]
    for retention in ("24h", "in_memory"):
        oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, prompt_cache_retention=retention)
        again = oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, prompt_cache_retention=retention)
        cached = again.usage.prompt_tokens_details.cached_tokens
        check(cached > 0, f"{retention}: the repeat is cached: {again.usage}")
    try:
        oa.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body={"prompt_cache_retention": "7d"})
        raise AssertionError("prompt_cache_retention 7d accepted")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "prompt_cache_retention" in str(e), str(e))
    block = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    amsgs = [{"role": "user", "content": block}]
    an.messages.create(model=MODEL, max_tokens=2, messages=amsgs, cache_control={"type": "ephemeral"})
    m = an.messages.create(model=MODEL, max_tokens=2, messages=amsgs, cache_control={"type": "ephemeral"})
    check((m.usage.cache_read_input_tokens or 0) > 0, f"the repeat is read from the cache: {m.usage}")
    bad = [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]
    try:
        an.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": bad}])
        raise AssertionError("cache_control ttl 2h accepted")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and "ttl" in str(e), str(e))


if __name__ == "__main__":
    for test in (max_completion_tokens, penalties, logit_bias, min_p, refusals, thinking_switches,
                 anthropic_output_format, endpoints, completions, several_choices, usage_exact, cache_retention):
        test()
        print(f"ok {test.__name__}", flush=True)
