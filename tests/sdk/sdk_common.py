"""What every SDK script shares: the server under test (DEEPINFER_BASE_URL,
DEEPINFER_MODEL), the two official clients without retries, and the checks.
Imported by the scripts beside it (their folder is on the import path when
they run)."""

import os

import anthropic
import openai

BASE = os.environ["DEEPINFER_BASE_URL"]
MODEL = os.environ["DEEPINFER_MODEL"]
NO_THINKING = {"thinking": {"type": "disabled"}}


def seeds(default):
    """How many seeds a sweep runs (DEEPINFER_SDK_SEEDS, else `default`)."""
    return int(os.environ.get("DEEPINFER_SDK_SEEDS", str(default)))


def clients(timeout=120):
    """An `openai` and an `anthropic` client of the server; no retries, which would only hide or slow a failure."""
    oa = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=timeout)
    an = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0, timeout=timeout)
    return oa, an


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def refused(call, *names):
    """`call()` is answered with a 400 whose message names each of `names`."""
    try:
        call()
    except (openai.BadRequestError, anthropic.BadRequestError) as e:
        text = str(e)
        check(e.status_code == 400, text)
        for name in names:
            check(name in text, f"{name!r} not named in {text}")
        return
    raise AssertionError(f"accepted: {names}")
