#!/usr/bin/env python3
"""Steady streaming load on a cluster's API front end, and what failed.

Runs `--clients` threads, each sending streaming chat completions one after
another through the official `openai` SDK (no SDK retries: a failure is
counted, not hidden), for `--seconds`. Each request is recorded with its
start, end and outcome: `completed`, or `failed` with the HTTP status or the
error that ended its stream. Prints sent, completed, failed and the outage
window: the longest span in which no request completed while requests were
failing (the gap between two consecutive completions with a failure in it),
and the longest stall: the longest span with no completion at all (requests
held up but none failed), with the slowest request.

    tools/cluster/chaos_load.py --base-url http://127.0.0.1:8000/v1 [--seconds 60] [--clients 20] [--out FILE]

`tools/cluster/chaos_local4.py` uses it to kill and drain nodes of
`cluster-configs/local-4.toml` under this load.
"""

import argparse
import json
import threading
import time

import openai
from openai import OpenAI


class Load:
    """`clients` threads sending requests until `stop()`; `records` grows as they end."""

    def __init__(self, base_url, clients=20, max_tokens=32, model="tiny-v4"):
        self.base_url = base_url
        self.clients = clients
        self.max_tokens = max_tokens
        self.model = model
        self.records = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = []

    def start(self):
        for c in range(self.clients):
            t = threading.Thread(target=self._client, args=(c,), daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self, wait_s=120):
        """No new requests; wait for the running ones to end."""
        self.stopping.set()
        end = time.time() + wait_s
        for t in self.threads:
            t.join(max(0.0, end - time.time()))

    def _client(self, c):
        client = OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)
        n = 0
        while not self.stopping.is_set():
            self._one(client, f"Client {c} request {n}: tell me about the sea.", n)
            n += 1

    def _one(self, client, prompt, seed):
        start = time.time()
        outcome, error, tokens = "failed", None, 0
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                temperature=0.8,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            finish = None
            for chunk in stream:
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    finish = choice.finish_reason or finish
            if finish is None:
                error = "stream ended without a finish reason"
            else:
                outcome = "completed"
        except openai.APIStatusError as e:
            error = f"HTTP {e.status_code}: {str(e)[:200]}"
        except Exception as e:  # a stream that ends with an error event, a reset connection
            error = f"{type(e).__name__}: {str(e)[:200]}"
        record = {"start": start, "end": time.time(), "outcome": outcome, "tokens": tokens}
        if error:
            record["error"] = error
        with self.lock:
            self.records.append(record)


def summarize(records, since=None, until=None):
    """Figures of the requests in [since, until): sent by start time, the
    outcomes by end time, and the outage window among those outcomes."""
    since = min((r["start"] for r in records), default=0) if since is None else since
    until = max((r["end"] for r in records), default=0) + 0.001 if until is None else until
    sent = sum(1 for r in records if since <= r["start"] < until)
    ended = [r for r in records if since <= r["end"] < until]
    done = sorted(r["end"] for r in ended if r["outcome"] == "completed")
    fails = sorted(r["end"] for r in ended if r["outcome"] != "completed")
    # Gaps between consecutive completions (the window's bounds close the
    # first and last) that hold a failure: nothing served while requests failed.
    marks = [since] + done + [until]
    outage, at = 0.0, None
    for a, b in zip(marks, marks[1:]):
        if any(a <= f <= b for f in fails) and b - a > outage:
            outage, at = b - a, a
    errors = {}
    for r in ended:
        if r["outcome"] != "completed":
            key = r["error"].split(":")[0] if r.get("error") else "failed"
            errors[key] = errors.get(key, 0) + 1
    stall = max((b - a for a, b in zip(marks, marks[1:])), default=0.0)
    slowest = max((r["end"] - r["start"] for r in ended), default=0.0)
    return {
        "stall_s": round(stall, 2),
        "slowest_s": round(slowest, 2),
        "sent": sent,
        "completed": len(done),
        "failed": len(fails),
        "outage_s": round(outage, 2),
        "outage_from": at,
        "errors": errors,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", help="write one JSON record per request here")
    a = ap.parse_args()
    load = Load(a.base_url, a.clients, a.max_tokens)
    load.start()
    time.sleep(a.seconds)
    load.stop()
    if a.out:
        with open(a.out, "w") as f:
            for r in load.records:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(summarize(load.records)))


if __name__ == "__main__":
    main()
