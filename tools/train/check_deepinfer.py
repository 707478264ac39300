#!/usr/bin/env python3
"""Greedy decoding of the trained tiny-v4 checkpoint: deepinfer vs transformers.

For each prompt, runs ``deepinfer generate --model DIR --prompt P --max-tokens N
--show-tokens`` (greedy) and transformers' ``DeepseekV4ForCausalLM.generate``
(``do_sample=False``, same ids: bos + the prompt's tokens) on the same checkpoint, and
reports how many generated tokens agree, where they first differ and transformers'
top-1 / top-2 logit gap there (a small gap means the two only round differently).

    OMP_NUM_THREADS=1 nice -n 19 /work/venv-train/bin/python tools/train/check_deepinfer.py
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_v4 as tt  # noqa: E402

import transformers  # noqa: E402

PROMPTS = [
    "fn main() {",
    "impl<T> Iterator for",
    "/// Returns the number of",
    "use std::collections::HashMap;\n\npub struct",
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=tt.DEFAULT_OUT)
    ap.add_argument("--deepinfer", type=Path, default=REPO / "target" / "release" / "deepinfer")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    from tokenizers import Tokenizer

    cfg = json.loads((args.model / "config.json").read_text())
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    model, _ = tt.load_exported(args.model, cfg)
    results = []
    for prompt in PROMPTS:
        proc = subprocess.run(
            [str(args.deepinfer), "generate", "--model", str(args.model), "--prompt", prompt,
             "--max-tokens", str(args.max_tokens), "--show-tokens"],
            check=True, capture_output=True, text=True,
        )
        m = re.search(r"^tokens: \[([0-9, ]*)\]$", proc.stdout, re.M)
        ours = [int(x) for x in m.group(1).split(",") if x.strip()]
        ids = torch.tensor([[cfg["bos_token_id"]] + tok.encode(prompt, add_special_tokens=False).ids])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=0,
                                 eos_token_id=cfg["eos_token_id"], pad_token_id=cfg["eos_token_id"])
        ref = out[0, ids.shape[1]:].tolist()
        n = min(len(ours), len(ref))
        first = next((i for i in range(n) if ours[i] != ref[i]), None)
        gap = None
        if first is not None:
            with torch.no_grad():
                logits = model(torch.tensor([ids[0].tolist() + ref[:first]]), use_cache=False).logits[0, -1]
            top = logits.topk(2).values
            gap = float(top[0] - top[1])
        agree = n if first is None else first
        results.append({"prompt": prompt, "deepinfer": ours, "transformers": ref, "agree_prefix": agree,
                        "compared": n, "first_difference": first, "transformers_top2_gap_there": gap,
                        "deepinfer_text": tok.decode(ours), "transformers_text": tok.decode(ref)})
        print(f"{prompt!r}: {agree}/{n} tokens agree" + ("" if first is None else
              f" (first difference at {first}, transformers' top-2 gap {gap:.2e})"))
        print("  deepinfer:    " + json.dumps(prompt + tok.decode(ours)))
        print("  transformers: " + json.dumps(prompt + tok.decode(ref)))
    total = sum(r["agree_prefix"] for r in results)
    compared = sum(r["compared"] for r in results)
    print(f"identical greedy prefix: {total}/{compared} tokens")


if __name__ == "__main__":
    main()
