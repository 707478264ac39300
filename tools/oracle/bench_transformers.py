#!/usr/bin/env python3
"""CPU float32 throughput of the transformers DeepSeek-V4 reference, as a baseline
for deepinfer.

    python tools/oracle/bench_transformers.py CKPT_DIR [--prefill-len 512] [--new-tokens 32]

Measures (torch threads = all cores, eager attention, greedy, with DynamicCache):
  * prefill tokens/s: one prompt of --prefill-len tokens (capped by the model's
    max_position_embeddings), logits of the last position only;
  * decode tokens/s at batch 1 and batch 32: a --decode-prompt-len-token prompt is
    prefilled (not timed), then --new-tokens greedy steps one token at a time
    (timed); tokens/s = batch * new_tokens / seconds.
Each measurement runs --reps times after one warm-up; the best run is reported.

The checkpoint is loaded like tools/oracle/make_fixtures.py does it: a pre-quantized
FP8/FP4 checkpoint is dequantised by transformers at load time, then the whole model
is upcast to float32 (transformers leaves scale-less BF16 tensors in BF16).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import transformers
from transformers import AutoConfig, DeepseekV4ForCausalLM


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_of(reps, fn):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpt", help="checkpoint directory (config.json + *.safetensors)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--decode-prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--experts-implementation", default=None, help="transformers experts backend (default: its own choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = AutoConfig.from_pretrained(args.ckpt)
    kw = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
    t0 = time.perf_counter()
    model = DeepseekV4ForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32, attn_implementation="eager", **kw)
    model = model.float().eval()
    load_s = time.perf_counter() - t0
    V = cfg.vocab_size
    prefill_len = min(args.prefill_len, cfg.max_position_embeddings - args.new_tokens - 1)

    rows = []
    with torch.inference_mode():
        ids = torch.randint(2, V, (1, prefill_len))

        def prefill():
            model(ids, use_cache=True, logits_to_keep=1)

        t = best_of(args.reps, prefill)
        rows.append(("prefill", 1, prefill_len, t, prefill_len / t))

        for batch in [int(b) for b in args.batches.split(",")]:
            prompt = torch.randint(2, V, (batch, args.decode_prompt_len))

            def decode(prompt=prompt):
                out = model(prompt, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                t0 = time.perf_counter()
                for _ in range(args.new_tokens):
                    out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                return time.perf_counter() - t0

            decode()  # warm-up
            t = min(decode() for _ in range(args.reps))
            n = batch * args.new_tokens
            rows.append(("decode", batch, n, t, n / t))

    print(f"checkpoint: {args.ckpt}")
    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpu: {cpu_name()} ({os.cpu_count()} cores), experts impl: {model.config._experts_implementation}, "
        f"load {load_s:.1f}s"
    )
    print(
        f"model: layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, vocab {V}, "
        f"experts {cfg.n_routed_experts} (top-{cfg.num_experts_per_tok}), params {sum(p.numel() for p in model.parameters()):,}"
    )
    print(f"{'phase':<8} {'batch':>5} {'tokens':>7} {'seconds':>9} {'tokens/s':>10}")
    for phase, batch, n, t, tps in rows:
        print(f"{phase:<8} {batch:>5} {n:>7} {t:>9.3f} {tps:>10.1f}")


if __name__ == "__main__":
    main()
