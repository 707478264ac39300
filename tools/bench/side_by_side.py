#!/usr/bin/env python3
"""One markdown table of deepinfer beside llama.cpp, from the raw files that
tools/bench/llamacpp.sh leaves in its results folder.

Files read (MODEL, T threads, round R):
  MODEL.tT.rR.llama-bench-pp.json  llama-bench -p 128,512 -n 0 -d 0 -o json
  MODEL.tT.rR.llama-bench-tg.json  llama-bench -p 0 -n 64 -d 128 -o json
  MODEL.tT.rR.batched.jsonl        llama-batched-bench -npp 128 -ntg 32 -npl N -c N*160 --output-format jsonl, N = 1, 8, 32
  MODEL.tT.rR.deepinfer.json       cpu_limits with CPU_LIMITS_JSON (bounds + rows)

Each program's number is its best over the rounds (llama-bench: the best of
its samples; cpu_limits already reports its best run), so both sides are
"best of". The fraction of the bound and the bounds on a row come from the
deepinfer run whose number the row shows.

`python3 side_by_side.py RESULTS_DIR [--json OUT]`
"""

import argparse
import json
import re
import sys
from pathlib import Path

PHASES = [
    # (label, deepinfer row match, llama.cpp source)
    ("prefill 128", ("prefill", 128), ("bench", 128, 0, 0)),
    ("prefill 512", ("prefill", 512), ("bench", 512, 0, 0)),
    ("decode, batch 1", ("decode", 1), ("bench", 0, 64, 128)),
    ("decode, batch 8", ("decode", 8), ("batched", 8)),
    ("decode, batch 32", ("decode", 32), ("batched", 32)),
]

NAME = re.compile(r"^(?P<model>.+)\.t(?P<threads>\d+)\.r(?P<round>\d+)\.(?P<kind>llama-bench-pp\.json|llama-bench-tg\.json|batched\.jsonl|deepinfer\.json)$")


def load_json(path):
    text = path.read_text()
    if not text.strip():
        return None
    return json.loads(text)


def collect(results):
    """{(model, threads): {"bench": {(p, n, d): best ts}, "batched": {pl: best S_TG}, "deepinfer": [report, ...]}}"""
    runs = {}
    for path in sorted(results.iterdir()):
        m = NAME.match(path.name)
        if not m:
            continue
        key = (m["model"], int(m["threads"]))
        entry = runs.setdefault(key, {"bench": {}, "batched": {}, "deepinfer": []})
        kind = m["kind"]
        try:
            if kind.startswith("llama-bench"):
                for test in load_json(path) or []:
                    k = (test["n_prompt"], test["n_gen"], test["n_depth"])
                    best = max(test.get("samples_ts") or [test["avg_ts"]])
                    entry["bench"][k] = max(entry["bench"].get(k, 0.0), best)
            elif kind == "batched.jsonl":
                for line in path.read_text().splitlines():
                    line = line.strip()
                    if not line.startswith("{"):
                        continue
                    row = json.loads(line)
                    pl = row["pl"]
                    entry["batched"][pl] = max(entry["batched"].get(pl, 0.0), row["speed_tg"])
            else:
                report = load_json(path)
                if report:
                    entry["deepinfer"].append(report)
        except (ValueError, KeyError) as e:
            print(f"warning: {path.name}: {e}", file=sys.stderr)
    return runs


def deepinfer_best(reports, match):
    """(tokens/s, fraction of bound, report) of the fastest run for this phase."""
    best = None
    for report in reports:
        for row in report["rows"]:
            phase, size = match
            if row["phase"] != phase:
                continue
            if (phase == "prefill" and row["tokens"] != size) or (phase == "decode" and row["batch"] != size):
                continue
            if best is None or row["tokens_per_s"] > best[0]:
                best = (row["tokens_per_s"], row.get("fraction_of_bound"), report, row.get("fraction_of_kernels"))
    return best


def fmt(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


def table(runs, models_order=None):
    lines = [
        "| model | phase | threads | llama.cpp tok/s | deepinfer tok/s | deepinfer / llama.cpp "
        "| deepinfer, of its bound | bandwidth GB/s | FMA GFLOP/s | matmul ceiling GFLOP/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary = []
    keys = sorted(runs, key=lambda k: ((models_order or []).index(k[0]) if k[0] in (models_order or []) else 99, k[0], k[1]))
    for model, threads in keys:
        entry = runs[(model, threads)]
        for label, di_match, source in PHASES:
            if source[0] == "bench":
                llama = entry["bench"].get(source[1:])
            else:
                llama = entry["batched"].get(source[1])
            di = deepinfer_best(entry["deepinfer"], di_match)
            di_tps, fraction, report, of_kernels = di if di else (None, None, None, None)
            ratio = di_tps / llama if di_tps and llama else None
            bound = None
            if fraction is not None:
                what = "matmul" if di_match[0] == "prefill" else "memory"
                bound = f"{100 * fraction:.0f}% ({what})"
                if of_kernels is not None:
                    # Decode at batch 1 against the one-row kernels' own rate (from L2).
                    bound += f"; {100 * of_kernels:.0f}% (kernels)"
            lines.append(
                f"| {model} | {label} | {threads} | {fmt(llama)} | {fmt(di_tps)} | {fmt(ratio, 2)} "
                f"| {bound or '—'} | {fmt(report and report['bandwidth_gbs'])} "
                f"| {fmt(report and report['fma_gflops'])} | {fmt(report and report['matmul_ceiling_gflops'])} |"
            )
            summary.append({
                "model": model, "phase": label, "threads": threads,
                "llamacpp_tokens_per_s": llama, "deepinfer_tokens_per_s": di_tps, "ratio": ratio,
                "deepinfer_fraction_of_bound": fraction,
                "deepinfer_fraction_of_kernels": of_kernels,
                "bandwidth_gbs": report and report["bandwidth_gbs"],
                "fma_gflops": report and report["fma_gflops"],
                "matmul_ceiling_gflops": report and report["matmul_ceiling_gflops"],
            })
        if 1 in entry["batched"]:
            summary.append({"model": model, "threads": threads, "phase": "llama-batched-bench npl 1 (cross-check)",
                            "llamacpp_tokens_per_s": entry["batched"][1]})
    return "\n".join(lines), summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path)
    ap.add_argument("--models", default="", help="comma-separated order of the models in the table")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    runs = collect(args.results)
    if not runs:
        sys.exit(f"no result files in {args.results}")
    text, summary = table(runs, [m for m in args.models.split(",") if m])
    print(text)
    cross = [s for s in summary if "cross-check" in s["phase"]]
    if cross:
        print()
        print("llama-batched-bench at npl 1 (S_TG, positions 128-159), beside llama-bench's tg64 @ d128 above: "
              + "; ".join(f"{s['model']} t{s['threads']}: {s['llamacpp_tokens_per_s']:.1f} tok/s" for s in cross))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
