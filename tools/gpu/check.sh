#!/usr/bin/env bash
# The first run on a GPU, prepared: runs the device's tests and measurements
# and writes one JSON file.
#
#   tools/gpu/check.sh --bundle            build here: the test binaries and the
#                                          CLI into tools/gpu/bundle/ and, compressed,
#                                          tools/gpu/bundle.tar.xz (copy that and
#                                          this script to the GPU machine; no Rust
#                                          toolchain needed there)
#   tools/gpu/check.sh [--emulated] [--out FILE] [--quick]
#                                          (--emulated implies --quick: tiny-v4 and
#                                          small shapes, as emulation is slow)
#                                          run the bundle: on GPU 0 through CUDA,
#                                          or with --emulated on the emulated device
#                                          (the same kernels compiled for this CPU),
#                                          so that the GPU run tests only the hardware.
#
# What it runs, each step with its own time limit so that the whole stays
# under 8 minutes on a GPU:
#   1. every kernel against the CPU definition (cuda/tests/emulated_*.rs,
#      DEEPINFER_TEST_DEVICE=cuda makes them use the GPU);
#   2. tiny V4 models: the device's greedy tokens and logits against the CPU
#      engine over 64 steps, alone and in a batch (tests/device.rs);
#   3. throughput of the CLI's batch mode on the device: decode at batch
#      1/32/256, prefill of 512-token prompts (small-v4; --quick: tiny-v4);
#   4. the FP8/BF16 linear kernels' TFLOP/s at decode and prefill shapes.
# The JSON has a section per step: passed/failed tests with their messages,
# tokens/s, TFLOP/s beside the datasheet.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=tools/gpu/bundle
mode=cuda
out=tools/gpu/check.json
quick=0
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) mode=bundle ;;
        --emulated) mode=emulated; quick=1 ;;
        --out) out="$2"; shift ;;
        --quick) quick=1 ;;
        *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

build_bundle() {
    rm -rf "$bundle" && mkdir -p "$bundle"
    local list
    list=$(mktemp)
    cargo build --release --bin deepinfer
    cp target/release/deepinfer "$bundle/"
    cargo build --release -p deepinfer-cuda --example linear_bench
    cp target/release/examples/linear_bench "$bundle/"
    cargo test --release -p deepinfer-cuda --tests --no-run --message-format=json >"$list"
    cargo test --release --test device --no-run --message-format=json >>"$list"
    python3 - "$list" "$bundle" <<'PY'
import json, shutil, sys, os
seen = set()
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    exe = m.get("executable")
    if m.get("reason") == "compiler-artifact" and exe and m["target"]["kind"] == ["test"]:
        name = m["target"]["name"]
        if name not in seen:
            seen.add(name)
            shutil.copy(exe, os.path.join(sys.argv[2], "test-" + name))
PY
    rm -f "$list"
    # Symbols and debug info are most of each binary's size, and the bundle
    # travels compressed: what must reach the GPU machine stays under 64 MiB.
    if command -v strip >/dev/null; then strip --strip-all "$bundle"/*; fi
    tar -C tools/gpu -cJf tools/gpu/bundle.tar.xz bundle
    du -sh "$bundle" tools/gpu/bundle.tar.xz
}

if [ "$mode" = bundle ]; then
    build_bundle
    exit 0
fi
if [ ! -x "$bundle/deepinfer" ] && [ -f tools/gpu/bundle.tar.xz ]; then
    tar -C tools/gpu -xJf tools/gpu/bundle.tar.xz
fi
if [ ! -x "$bundle/deepinfer" ]; then
    command -v cargo >/dev/null || { echo "check.sh: no bundle and no cargo: run --bundle on a build machine" >&2; exit 1; }
    build_bundle
fi
export DEEPINFER_TEST_DEVICE="$mode"
# The GPU machine's CUDA toolkit holds libnvrtc (kernels compile at first launch).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    if [ -d "$d" ]; then export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
done
device_flag="$mode"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
limit() { timeout --kill-after=5 "$@"; }

# 1 and 2: the test binaries, each under a limit.
for t in "$bundle"/test-*; do
    name=$(basename "$t")
    per=120
    [ "$name" = test-device ] && per=240
    set +e
    limit "$per" "$t" --test-threads=1 >"$work/$name.log" 2>&1
    echo $? >"$work/$name.rc"
    set -e
done

# 3: throughput through the CLI's batch mode.
model=builtin:small-v4
batches="1 32 256"
prefill_len=512
if [ "$quick" = 1 ]; then model=builtin:tiny-v4; batches="1 8"; prefill_len=64; fi
python3 - "$work" "$batches" "$prefill_len" <<'PY'
import json, sys, random
work, batches, plen = sys.argv[1], sys.argv[2].split(), int(sys.argv[3])
rng = random.Random(7)
words = "the of and to in is that for it as with was on be by at this are from or have an they which one you were all her she there would their we him been has when who will more no if out so said what up its about into than them can only other new some could time these two may then do first any my now such like our over man me even most made after also did many before must through back years where much your way well down should because each just those people how too little state good very make world still own see men work long get here between both life being under never day same another know while last might us great old year off come since against go came right used take three".split()
def text(tokens):
    return " ".join(rng.choice(words) for _ in range(tokens))
for b in batches:
    with open(f"{work}/decode-{b}.jsonl", "w") as f:
        for i in range(int(b)):
            f.write(json.dumps({"prompt": text(12), "max_tokens": 64, "ignore_eos": True}) + "\n")
with open(f"{work}/prefill.jsonl", "w") as f:
    for i in range(8):
        f.write(json.dumps({"prompt": text(plen // 2), "max_tokens": 1}) + "\n")
PY
for b in $batches; do
    set +e
    limit 120 "$bundle/deepinfer" generate --model "$model" --device "$device_flag" --max-batch-size "$b" \
        --input "$work/decode-$b.jsonl" --output "$work/decode-$b.out" >"$work/decode-$b.log" 2>&1
    set -e
done
set +e
limit 120 "$bundle/deepinfer" generate --model "$model" --device "$device_flag" \
    --input "$work/prefill.jsonl" --output "$work/prefill.out" >"$work/prefill.log" 2>&1
set -e

# 4: the linear kernels' throughput.
set +e
limit 120 "$bundle/linear_bench" --device "$device_flag" $([ "$quick" = 1 ] && echo --quick) >"$work/linear.json" 2>"$work/linear.log"
set -e

python3 - "$work" "$out" "$mode" "$model" "$batches" <<'PY'
import json, os, re, subprocess, sys, glob, platform
work, out, mode, model, batches = sys.argv[1:6]
report = {"device": mode, "model_for_throughput": model, "machine": platform.platform()}
try:
    report["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=20).stdout.strip()
except Exception as e:
    report["gpu"] = f"nvidia-smi unavailable: {e}"
tests = {}
for log in sorted(glob.glob(f"{work}/test-*.log")):
    name = os.path.basename(log)[:-4]
    text = open(log, errors="replace").read()
    rc = int(open(log[:-4] + ".rc").read())
    results = dict(re.findall(r"^test (\S+) \.\.\. (ok|FAILED|ignored)$", text, re.M))
    failures = re.findall(r"^---- (\S+) stdout ----\n(.*?)(?=^---- |\Z|^failures:$)", text, re.M | re.S)
    tests[name] = {"exit": rc, "timed_out": rc in (124, 137), "results": results,
                   "failures": {n: m.strip()[-2000:] for n, m in failures}}
report["tests"] = tests
report["tests_passed"] = all(t["exit"] == 0 for t in tests.values()) and bool(tests)
def summary(path):
    try:
        text = open(path).read()
    except OSError:
        return {"error": "no log"}
    m = re.search(r"(\d+) requests \((\d+) failed\) in ([\d.]+) s; prompt (\d+) tokens, generated (\d+) tokens: ([\d.]+) generated tokens/s, ([\d.]+) tokens/s in all", text)
    if not m:
        return {"error": text.strip()[-1500:]}
    return {"requests": int(m[1]), "failed": int(m[2]), "seconds": float(m[3]), "prompt_tokens": int(m[4]),
            "generated_tokens": int(m[5]), "generated_tokens_per_s": float(m[6]), "tokens_per_s": float(m[7])}
report["decode"] = {b: summary(f"{work}/decode-{b}.log") for b in batches.split()}
p = summary(f"{work}/prefill.log")
if "seconds" in p:
    p["prefill_tokens_per_s"] = p["prompt_tokens"] / p["seconds"]
report["prefill"] = p
try:
    report["linear"] = json.load(open(f"{work}/linear.json"))
except Exception:
    report["linear"] = {"error": open(f"{work}/linear.log").read()[-1500:] if os.path.exists(f"{work}/linear.log") else "no output"}
# The cost of batch invariance: the portable kernel's time over a split-K
# variant's whose split size follows the batch (as a speed-first engine's would).
cost = []
for r in report["linear"].get("results", []) if isinstance(report["linear"], dict) else []:
    if "split_k" in r:
        cost.append({"weight": r["weight"], "n": r["n"], "splits": r["split_k"]["splits"],
                     "portable_over_split_time": r.get("invariance_cost")})
report["batch_invariance_cost"] = cost or "no split-K timings in the linear bench output"
json.dump(report, open(out, "w"), indent=1)
print(f"check.sh: wrote {out}; tests passed: {report['tests_passed']}")
PY
