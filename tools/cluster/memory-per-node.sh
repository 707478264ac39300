#!/usr/bin/env bash
# Resident memory per node as expert parallelism grows: for each model and
# each EP in 1 2 4, launch EP single-device node processes on this machine
# (one instance, experts spread over all of them), run a batch through them
# so that every shard computes, and print what `deepinfer status` reports
# per node (experts held, their bytes, RSS).
#
#   tools/cluster/memory-per-node.sh                 # small-v4 and a 128-expert variant
#   MODELS="small" EPS="1 4" tools/cluster/memory-per-node.sh
set -euo pipefail
BIN=${BIN:-target/release/deepinfer}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
MODELS=${MODELS:-"small large"}
EPS=${EPS:-"1 2 4"}
BASE_PORT=${BASE_PORT:-7300}

model_dir() {
  local name=$1 dir="$WORK/ck-$1"
  if [ ! -f "$dir/config.json" ]; then
    case $name in
      small) "$BIN" model init --preset small-v4 --seed 1 --out "$dir" >&2 ;;
      # small-v4 with four times the experts: 128 routed experts per layer.
      large) "$BIN" model init --preset small-v4 --seed 1 --out "$dir" --set n_routed_experts=128 >&2 ;;
    esac
  fi
  echo "$dir"
}

topology() {
  local model=$1 ep=$2 file=$3 nodes="" names=""
  for ((i = 0; i < ep; i++)); do
    nodes+=$'\n'"[[node]]"$'\n'"name = \"node$i\""$'\n'"address = \"127.0.0.1:$((BASE_PORT + i))\""$'\n'"devices = 1"$'\n'"backend = \"cpu\""$'\n'
    names+="\"node$i\", "
  done
  cat > "$file" <<TOML
[cluster]
name = "memory-ep$ep"
model = "$model"
api_listen = "127.0.0.1:$((BASE_PORT + 99))"
certs_dir = "certs-ep$ep"
$nodes
[[instance]]
name = "main"
role = "both"
nodes = [${names%, }]
attention_dp = $ep
expert_parallel = $ep
TOML
}

for i in $(seq 0 15); do
  echo "{\"id\": $i, \"prompt\": \"Request number $i asks about expert parallel memory\", \"max_tokens\": 16}"
done > "$WORK/batch.jsonl"

echo "machine: $(nproc) cores, $(grep MemTotal /proc/meminfo | awk '{print int($2/1048576)}') GiB"
for m in $MODELS; do
  dir=$(model_dir "$m")
  echo "== $m: $(du -sh "$dir/model.safetensors" | cut -f1) checkpoint"
  for ep in $EPS; do
    t="$WORK/$m-ep$ep.toml"
    topology "$dir" "$ep" "$t"
    [ -d "$WORK/certs-ep$ep" ] || "$BIN" cluster init-certs --topology "$t" --out "$WORK/certs-ep$ep" >/dev/null
    "$BIN" launch "$t" --no-api > "$WORK/launch-$m-$ep.log" 2>&1 &
    launcher=$!
    for _ in $(seq 1 120); do
      if "$BIN" status --topology "$t" --wait-ms 1000 > /dev/null 2>&1; then break; fi
      sleep 1
    done
    "$BIN" generate --topology "$t" --input "$WORK/batch.jsonl" --output "$WORK/out-$m-$ep.jsonl" 2>&1 | tail -1
    echo "-- EP $ep"
    "$BIN" status --topology "$t" --wait-ms 2000 | grep -E "^ +node" || true
    kill -TERM $launcher
    wait $launcher || true
  done
done
