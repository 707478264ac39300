#!/usr/bin/env python3
"""Live expert re-placement under load, measured.

Launches four single-device node processes (one instance, expert parallel 4,
EPLB every few steps with redundant expert copies) and the API front end,
streams completions through the official `openai` SDK from several threads
for a while, and polls `deepinfer status` meanwhile. Reports the table
switches seen, the expert weight bytes read and freed, and inter-token
latency (p50/p99) of the gaps that overlap a switch against the others.

    tools/cluster/eplb_under_load.py --model DIR [--seconds 60] [--clients 6]
"""

import argparse
import os
import re
import subprocess
import sys
import threading
import time

from openai import OpenAI


def topology(path, model, base_port, every_steps, redundant, eplb=True):
    nodes = "".join(
        f'\n[[node]]\nname = "node{i}"\naddress = "127.0.0.1:{base_port + i}"\ndevices = 1\nbackend = "cpu"\n'
        for i in range(4)
    )
    with open(path, "w") as f:
        f.write(
            f'[cluster]\nname = "eplb-live"\nmodel = "{model}"\napi_listen = "127.0.0.1:{base_port + 99}"\n'
            f'certs_dir = "certs-eplb"\n'
            + (f"\n[cluster.eplb]\nevery_steps = {every_steps}\nredundant_experts = {redundant}\n" if eplb else "")
            + f"{nodes}\n[[instance]]\nname = \"main\"\nrole = \"both\"\n"
            'nodes = ["node0", "node1", "node2", "node3"]\nattention_dp = 4\nexpert_parallel = 4\n'
        )


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/deepinfer")
    ap.add_argument("--model", required=True, help="checkpoint directory (deepinfer model init)")
    ap.add_argument("--work", default="/tmp/deepinfer-eplb-live")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--every-steps", type=int, default=16)
    ap.add_argument("--redundant", type=int, default=8)
    ap.add_argument("--base-port", type=int, default=7400)
    ap.add_argument("--no-eplb", action="store_true", help="the same load without rebalancing (the baseline)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    topo = os.path.join(a.work, "cluster.toml")
    topology(topo, os.path.abspath(a.model), a.base_port, a.every_steps, a.redundant, not a.no_eplb)
    if not os.path.isdir(os.path.join(a.work, "certs-eplb")):
        subprocess.run([a.bin, "cluster", "init-certs", "--topology", topo, "--out",
                        os.path.join(a.work, "certs-eplb")], check=True, stdout=subprocess.DEVNULL)
    log = open(os.path.join(a.work, "launch.log"), "w")
    launcher = subprocess.Popen([a.bin, "launch", topo], stdout=log, stderr=subprocess.STDOUT)
    try:
        run(a, topo)
    finally:
        launcher.terminate()
        launcher.wait(timeout=60)


def mib(value, unit):
    return float(value) * {"B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30}[unit] / (1 << 20)


def status(a, topo):
    out = subprocess.run([a.bin, "status", "--topology", topo, "--wait-ms", "1000"],
                         capture_output=True, text=True).stdout
    epoch = None
    read = freed = 0.0
    for line in out.splitlines():
        m = re.search(r"table epoch (\d+)", line)
        if m and epoch is None:
            epoch = int(m.group(1))
        m = re.search(r"read ([\d.]+) (B|KiB|MiB|GiB), freed ([\d.]+) (B|KiB|MiB|GiB)", line)
        if m:
            read += mib(m.group(1), m.group(2))
            freed += mib(m.group(3), m.group(4))
    return epoch, read, freed


def run(a, topo):
    client = OpenAI(base_url=f"http://127.0.0.1:{a.base_port + 99}/v1", api_key="none", max_retries=0)
    deadline = time.time() + 120
    while True:
        try:
            model = client.models.list().data[0].id
            if status(a, topo)[0] is not None:
                break
        except Exception:
            pass
        if time.time() > deadline:
            sys.exit("the cluster did not come up: see launch.log")
        time.sleep(1)
    _, read0, _ = status(a, topo)
    stop = time.time() + a.seconds
    gaps = []  # (start, end)
    failures = []
    lock = threading.Lock()

    def stream(k):
        n = 0
        while time.time() < stop:
            n += 1
            last = None
            try:
                for chunk in client.completions.create(model=model, prompt=f"Client {k} request {n} about experts",
                                                       max_tokens=48, temperature=0, stream=True):
                    now = time.time()
                    if chunk.choices and chunk.choices[0].text:
                        if last is not None:
                            with lock:
                                gaps.append((last, now))
                        last = now
            except Exception as e:  # noqa: BLE001 - every failure is reported
                with lock:
                    failures.append(repr(e))

    polls = []

    def poll():
        while time.time() < stop + 2:
            t = time.time()
            polls.append((t, *status(a, topo)))
            time.sleep(0.2)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(a.clients)]
    poller = threading.Thread(target=poll)
    for t in threads + [poller]:
        t.start()
    for t in threads + [poller]:
        t.join()
    windows = []
    for (t0, e0, _, _), (t1, e1, _, _) in zip(polls, polls[1:]):
        if e0 is not None and e1 is not None and e1 > e0:
            windows.append((t0, t1, e1 - e0))
    during, outside = [], []
    for s, e in gaps:
        (during if any(s <= w1 and e >= w0 for w0, w1, _ in windows) else outside).append((e - s) * 1000)
    _, read1, freed1 = polls[-1][1:] if polls else (None, 0, 0)
    print(f"load: {a.clients} streaming clients for {a.seconds:.0f} s, {len(gaps)} inter-token gaps, "
          f"{len(failures)} failed requests")
    print(f"table switches seen: {sum(w[2] for w in windows)} (in {len(windows)} status polls of 0.2 s)")
    print(f"expert weights read during the run: {read1 - read0:.1f} MiB, freed: {freed1:.1f} MiB")
    print(f"inter-token latency outside switches: p50 {percentile(outside, 0.5):.1f} ms, "
          f"p99 {percentile(outside, 0.99):.1f} ms ({len(outside)} gaps)")
    print(f"inter-token latency overlapping a switch: p50 {percentile(during, 0.5):.1f} ms, "
          f"p99 {percentile(during, 0.99):.1f} ms ({len(during)} gaps)")
    for f in failures[:5]:
        print("failure:", f)


if __name__ == "__main__":
    main()
