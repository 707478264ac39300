#!/usr/bin/env python3
"""CPU throughput of DeepSeek's DeepSeek-V4.1-Flash reference (``inference/model.py`` with
its CPU kernel port, from the directory given by ``--reference``; not copied here) on a
checkpoint directory in the published format (e.g. ``deepinfer model init --preset
small-v41``), as the baseline for deepinfer on the same CPU.

    python tools/oracle/bench_v41.py --reference REF MODEL_DIR [--prefill-len 128]
        [--new-tokens 16] [--threads 1] [--reps 2]

The reference runs as shipped (bf16 default dtype, its own arithmetic; none of
make_v41.py's deviations). Measures, batch 1, greedy:
  * prefill tokens/s: one start_pos-0 forward of --prefill-len tokens;
  * decode tokens/s: --new-tokens single-token steps after that prefill.
The best of --reps runs is reported. The Engram compressed vocabulary is the directory's
``engram_token_map.json`` (handed to the reference in place of a tokenizer).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file

PACKAGE = "models.demos.deepseek_v3_d_p.reference.deepseek_v41"


def load(reference: Path, model_dir: Path, max_seq_len: int):
    for p in (reference / "_site", reference):
        if p.is_dir():
            sys.path.insert(0, str(p))
    v41 = importlib.import_module(f"{PACKAGE}.model")
    engram = importlib.import_module(f"{PACKAGE}.engram")
    cfg = json.loads((model_dir / "config.json").read_text())
    names = {f.name for f in fields(v41.ModelArgs)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in names}
    kwargs["max_seq_len"] = max_seq_len
    kwargs["max_batch_size"] = 1
    kwargs["temperature"] = 0.0
    args = v41.ModelArgs(**kwargs)
    tokenizer = None
    map_file = model_dir / "engram_token_map.json"
    if args.engram_layer_ids:
        data = json.loads(map_file.read_text())
        engram.build_compressed_token_map = lambda _tok: (data["token_map"], data["compressed_vocab_size"])
        v41.NgramHashState.__init__.__globals__["build_compressed_token_map"] = engram.build_compressed_token_map
    with v41.set_dtype(torch.bfloat16):
        model = v41.Transformer(args, tokenizer)
    state = load_file(str(model_dir / "model.safetensors"))
    own = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if name not in own and name.endswith(".scale"):
                continue  # consumed with its weight below
            p = own[name]
            if t.dtype == torch.float8_e4m3fn and p.dtype == torch.bfloat16:
                # FP8 in the file where the reference holds bf16 (wo_a): dequantise as its convert.py does
                s = state[name[: -len("weight")] + "scale"].float()
                s = s.repeat_interleave(32, 0)[: t.size(0)].repeat_interleave(32, 1)[:, : t.size(1)]
                p.copy_((t.float() * s).to(torch.bfloat16))
                continue
            if p.dtype == torch.float4_e2m1fn_x2:
                p.view(torch.uint8).copy_(t.view(torch.uint8))
            elif p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
                p.view(torch.uint8).copy_(t.view(torch.uint8))
            else:
                p.copy_(t.to(p.dtype))
    for m in model.mtp:  # DSpark shares the main embedding and head
        m.embed, m.head = model.embed, model.head
    model.eval()
    return v41, model, args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    v41, model, args = load(a.reference.resolve(), a.model_dir, a.prefill_len + a.new_tokens + 8)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, args.vocab_size - 1, (1, a.prefill_len), generator=gen)
    best_prefill, best_decode = 0.0, 0.0
    with v41.set_dtype(torch.bfloat16):
        for _ in range(a.reps):
            t0 = time.perf_counter()
            tok, _, _ = model(prompt, 0)
            t1 = time.perf_counter()
            for i in range(a.new_tokens):
                tok, _, _ = model(tok.view(1, 1), a.prefill_len + i)
            t2 = time.perf_counter()
            best_prefill = max(best_prefill, a.prefill_len / (t1 - t0))
            best_decode = max(best_decode, a.new_tokens / (t2 - t1))
    print(json.dumps({
        "model": str(a.model_dir), "threads": a.threads, "prefill_len": a.prefill_len,
        "prefill_tokens_per_s": round(best_prefill, 2), "decode_tokens_per_s": round(best_decode, 2),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
