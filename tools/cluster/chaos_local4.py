#!/usr/bin/env python3
"""Node failures under load on `cluster-configs/local-4.toml`, measured.

Copies the file into a temporary directory with free ports and its own
certificates (`deepinfer cluster init-certs`), starts its four nodes and an
API front end (`serve --topology`), runs `chaos_load.py`'s load (20 streaming
chat clients) and meanwhile, in turn: SIGKILLs node0 and starts it again;
drains node1 and starts it again; drains node0 and starts it again. Prints,
for the quiet start and for each event (until the next one), the requests
sent, completed and failed and the outage window, as a Markdown table.

    cargo build --release
    tools/cluster/chaos_local4.py [--bin target/release/deepinfer] [--topology cluster-configs/local-4.toml]
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from chaos_load import Load, summarize  # noqa: E402


def free_ports(n):
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Proc:
    """A child process whose output goes to a log file, read back to wait for lines."""

    def __init__(self, args, log):
        self.log = log
        self.out = open(log, "a")
        self.since = os.path.getsize(log)
        self.p = subprocess.Popen(args, stdout=self.out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def mark(self):
        """Where the log ends now: `wait_for(..., after=mark)` sees only what follows."""
        return os.path.getsize(self.log)

    def text(self, after=None):
        with open(self.log) as f:
            f.seek(self.since if after is None else after)
            return f.read()

    def wait_for(self, pattern, limit=120, after=None):
        end = time.time() + limit
        while time.time() < end:
            m = re.search(pattern, self.text(after))
            if m:
                return m
            if self.p.poll() is not None:
                raise RuntimeError(f"{self.log}: exited ({self.p.returncode}) before `{pattern}`")
            time.sleep(0.05)
        raise RuntimeError(f"{self.log}: no `{pattern}` within {limit} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/deepinfer")
    ap.add_argument("--topology", default="cluster-configs/local-4.toml")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--settle", type=float, default=8, help="seconds of load between events")
    ap.add_argument("--records", help="write one JSON record per request here")
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    work = tempfile.mkdtemp(prefix="deepinfer-chaos-")
    text = open(a.topology).read()
    names = re.findall(r'^name = "(node\d+)"', text, re.M)
    ports = free_ports(len(names) + 1)
    for i, old in enumerate(re.findall(r'^address = "([^"]+)"', text, re.M)):
        text = text.replace(f'"{old}"', f'"127.0.0.1:{ports[i]}"')
    text = re.sub(r'^api_listen = .*$', f'api_listen = "127.0.0.1:{ports[-1]}"', text, flags=re.M)
    text = re.sub(r'^certs_dir = .*$', 'certs_dir = "certs"', text, flags=re.M)
    topo = os.path.join(work, "cluster.toml")
    open(topo, "w").write(text)
    subprocess.run([binary, "cluster", "init-certs", "--topology", topo, "--out", os.path.join(work, "certs")],
                   check=True, stdout=subprocess.DEVNULL)

    def node(name):
        return Proc([binary, "node", "--topology", topo, "--node", name], os.path.join(work, f"{name}.log"))

    nodes = {n: node(n) for n in names}
    front = None
    try:
        for p in nodes.values():
            p.wait_for("cluster ready")
        front = Proc([binary, "serve", "--topology", topo, "--listen", f"127.0.0.1:{ports[-1]}"],
                     os.path.join(work, "front.log"))
        base = front.wait_for(r"on (http://\S+)").group(1) + "/v1"
        load = Load(base, a.clients, a.max_tokens)
        load.start()
        events = [("quiet", time.time())]
        time.sleep(a.settle)

        def restart(name):
            started = time.time()
            marks = {other: p.mark() for other, p in nodes.items() if other != name}
            nodes[name] = node(name)
            nodes[name].wait_for("cluster ready")
            for other, at in marks.items():
                nodes[other].wait_for(f"node {name} up", after=at)
            print(f"  {name} back in {time.time() - started:.1f} s", file=sys.stderr)

        def drain(name):
            events.append((f"drain {name}, start it again", time.time()))
            o = subprocess.run([binary, "drain", name, "--topology", topo], capture_output=True, text=True)
            print(o.stderr.strip(), file=sys.stderr)
            if o.returncode != 0:
                print(f"  drain {name} refused or failed; no restart", file=sys.stderr)
                return
            nodes[name].p.wait(timeout=60)
            restart(name)

        events.append(("SIGKILL node0, start it again", time.time()))
        nodes["node0"].p.send_signal(signal.SIGKILL)
        nodes["node0"].p.wait()
        # Long enough for the survivors to declare it dead and for its work to move.
        time.sleep(3)
        restart("node0")
        time.sleep(a.settle)
        drain("node1")
        time.sleep(a.settle)
        drain("node0")
        time.sleep(a.settle)
        end = time.time()
        load.stop()
    finally:
        for p in list(nodes.values()) + ([front] if front else []):
            if p.p.poll() is None:
                p.p.terminate()
        for p in list(nodes.values()) + ([front] if front else []):
            try:
                p.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.p.kill()

    if a.records:
        with open(a.records, "w") as f:
            for r in load.records:
                f.write(json.dumps(r) + "\n")
    print(f"work directory: {work}", file=sys.stderr)
    print("| event | sent | completed | failed | outage window | longest stall | slowest request | errors |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    # The last event's window runs until its requests have ended.
    bounds = [t for _, t in events] + [max(r["end"] for r in load.records) + 0.001]
    for (name, t), until in zip(events, bounds[1:]):
        s = summarize(load.records, t, until)
        errors = ", ".join(f"{k} × {v}" for k, v in s["errors"].items()) or "none"
        print(f"| {name} | {s['sent']} | {s['completed']} | {s['failed']} | {s['outage_s']:.1f} s "
              f"| {s['stall_s']:.1f} s | {s['slowest_s']:.1f} s | {errors} |")
    s = summarize(load.records)
    print(f"| all ({end - events[0][1]:.0f} s) | {s['sent']} | {s['completed']} | {s['failed']} "
          f"| {s['outage_s']:.1f} s | {s['stall_s']:.1f} s | {s['slowest_s']:.1f} s | |")


if __name__ == "__main__":
    main()
