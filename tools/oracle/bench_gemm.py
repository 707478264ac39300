#!/usr/bin/env python3
"""The fastest float32 matmul this machine's vendor BLAS gives (torch on CPU:
oneDNN/MKL, free to order its sums however it likes), as the non-invariant
peer of deepinfer's batch-invariant kernel in `cargo bench --bench cpu_limits`.

    python tools/oracle/bench_gemm.py [--threads 1] [--rows 4096] [--cols 4096]

Prints GFLOP/s of `x[n, cols] @ W[rows, cols].T` for n = 1, 32 and 256, best of
several runs after a warm-up.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w = torch.randn(args.rows, args.cols, dtype=torch.float32)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, W {args.rows} x {args.cols} float32")
    print("| n | GFLOP/s |\n|---:|---:|")
    for n in (1, 32, 256):
        x = torch.randn(n, args.cols, dtype=torch.float32)
        out = x @ w.T
        best = float("inf")
        for _ in range(7):
            reps = max(1, 64 // n)
            started = time.perf_counter()
            for _ in range(reps):
                out = torch.matmul(x, w.T)
            best = min(best, (time.perf_counter() - started) / reps)
        assert out.shape == (n, args.rows)
        print(f"| {n} | {2 * n * args.rows * args.cols / best / 1e9:.1f} |")


if __name__ == "__main__":
    main()
