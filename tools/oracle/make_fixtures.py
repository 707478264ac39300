#!/usr/bin/env python3
"""Build the tiny DeepSeek-V4 oracle fixtures for deepinfer.

What this does (deterministic, seeded, CPU only, well under a minute):

1. Generates a tiny random DeepSeek-V4 checkpoint ("tiny-v4") in DeepSeek's
   *published* tensor naming (``embed.weight``, ``layers.N.attn.wq_a.weight``,
   ``layers.N.ffn.experts.E.w1.weight`` ...) quantised like DeepSeek-V4-Flash:

   * FP8 e4m3 (``float8_e4m3fn``) weights + sibling ``<name>.scale`` UE8M0
     (``float8_e8m0fnu``) block scales over 128x128 blocks (grid
     ceil(rows/128) x ceil(cols/128)) for attn.wq_a / wq_b / wkv / wo_a / wo_b,
     attn.indexer.wq_b, ffn.shared_experts.w1/w2/w3 and mtp.0.e_proj / h_proj;
   * FP4 e2m1 routed experts, packed two per byte in int8 (even column in the
     LOW nibble, shape [rows, cols/2]) with a UE8M0 scale per 1x32 block
     (shape [rows, cols/32]);
   * BF16 for embed, head, the compressor / indexer-compressor wkv / wgate,
     indexer.weights_proj and ffn.gate.weight;
   * F32 for norms, hc_* parameters, attn_sink, ape and gate.bias;
   * I32 for ffn.gate.tid2eid (hash-MoE layers).

   Quantisation: per block, scale = smallest power of two 2^e with
   max|w| / 2^e <= 448 (FP8) or <= 6 (FP4); codes = round-to-nearest(-even) of
   w / 2^e.

2. Writes ``config.json`` (DeepseekV4Config modern keys + the legacy keys
   DeepSeek ships: ``qk_rope_head_dim`` and ``rope_scaling``).

3. Loads the checkpoint with ``DeepseekV4ForCausalLM.from_pretrained`` (float32,
   eager attention, eager experts), so transformers' own conversion mapping
   (published names -> HF names, expert merging) and its FP8/FP4 dequantiser
   are exercised, and checks that EVERY model parameter / buffer equals, bit
   for bit, our own independent numpy decoding of the stored bytes under our own
   independent name mapping; also that the load reports no missing /
   unexpected keys except ``mtp.*``.

4. Records, for 3 seeded prompts (13, 37, 70 tokens): prefill logits with a
   DynamicCache, 8 greedy decode steps with that cache (tokens + logits).
   Cross-checks: prefill with cache == prefill without cache (<= 1e-5), and the
   cached decode logits == a cache-less forward over prompt + decoded tokens.

5. MTP reference (see ``mtp_reference``): transformers does NOT instantiate the
   MTP block, so the composition there is OURS, built from transformers'
   building blocks. It checks the Rust MTP against transformers' modules, not
   against an upstream MTP reference.

6. Checks that the random model is not degenerate at any discrete decision the
   Rust port must reproduce: MoE top-k (gap between k-th and (k+1)-th routing
   score), the lightning indexer's top-k over compressed entries, and greedy
   argmax (gap between top-1 and top-2 logits). Fails loudly if a gap is
   smaller than the thresholds below.

Design note on the random weights: with only 2 indexer heads, ReLU(q.k) is
often exactly 0 for both heads, producing exact ties in the indexer's top-k
(torch's tie-break is unspecified, so the reference would be ill-defined).
To avoid that, hidden dimension 0 is a constant "bias feature": embed[:, 0] is a
constant, and every block writes 0 into it (wo_b row 0, experts/shared w2 row 0
are zero), so it survives the hyper-connection mixing (comb is doubly
stochastic). On CSA layers wq_a, the indexer's wq_b and the indexer-compressor
wkv get a rank-1 boost along that feature so that indexer q.k is positive.
Nothing else about the architecture is special-cased.

Outputs (tests/fixtures/oracle/tiny-v4/): config.json, model.safetensors,
reference.safetensors, reference.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

SEED = 32  # chosen with --seed for comfortable decision margins (see reference.json "checks")
REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "oracle" / "tiny-v4"
PROMPT_LENGTHS = (13, 37, 70)
N_DECODE = 8
MTP_PROMPT = 1  # index of the 37-token prompt

# Discrete-decision margins the fixtures must satisfy (absolute gaps).
MIN_ROUTER_GAP = 1e-4
MIN_INDEXER_GAP = 1e-4  # relative: gap / max(1, |k-th score|)
MIN_ARGMAX_GAP = 1e-3
PREFILL_CACHE_TOL = 1e-5
DECODE_CONSISTENCY_TOL = 1e-4

BIAS_DIM = 0  # constant "bias feature" of the residual stream (see module docstring)
BIAS_VALUE = 4.0

# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------

LAYER_TYPES = [
    "sliding_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
]
MLP_LAYER_TYPES = ["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]

CONFIG = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 1024,
    "hidden_size": 64,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 32,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 8,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 2,
    "layer_types": LAYER_TYPES,
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "mlp_layer_types": MLP_LAYER_TYPES,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "expert_dtype": "fp4",
        "dequantize": True,
    },
}

# ----------------------------------------------------------------------------
# Number formats (independent numpy implementations; torch is only used to
# round float32 -> float8_e4m3fn, which we verify is round-to-nearest below)
# ----------------------------------------------------------------------------

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float64)
E2M1_LUT = np.concatenate([E2M1_MAGS, -E2M1_MAGS]).astype(np.float32)  # code -> value


def ue8m0_exponent(amax: float, qmax: float) -> int:
    """Smallest integer e with amax / 2**e <= qmax (exact, powers of two)."""
    if amax == 0.0:
        return 0
    e = math.ceil(math.log2(amax / qmax))
    while amax / 2.0**e > qmax:
        e += 1
    while amax / 2.0 ** (e - 1) <= qmax:
        e -= 1
    assert -127 <= e <= 127, e
    return e


def decode_e4m3(u8: np.ndarray) -> np.ndarray:
    u8 = u8.astype(np.int64)
    s = (u8 >> 7) & 1
    e = (u8 >> 3) & 0xF
    m = u8 & 0x7
    val = np.where(e == 0, (m / 8.0) * 2.0**-6, (1.0 + m / 8.0) * np.exp2(e - 7.0))
    val = np.where((e == 15) & (m == 7), np.nan, val)
    return np.where(s == 1, -val, val).astype(np.float32)


def decode_e8m0(u8: np.ndarray) -> np.ndarray:
    u8 = u8.astype(np.float64)
    return np.where(u8 == 255, np.nan, np.exp2(u8 - 127.0)).astype(np.float32)


def decode_fp4_packed(packed_i8: np.ndarray) -> np.ndarray:
    u8 = packed_i8.view(np.uint8)
    lo = E2M1_LUT[u8 & 0xF]
    hi = E2M1_LUT[u8 >> 4]
    return np.stack([lo, hi], axis=-1).reshape(*u8.shape[:-1], 2 * u8.shape[-1])


def decode_bf16(t: torch.Tensor) -> np.ndarray:
    bits = t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32)


def expand_scales(scale: np.ndarray, bm: int, bn: int, rows: int, cols: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, bm, axis=0), bn, axis=1)[:rows, :cols]


def quant_fp8(w: np.ndarray, block=(128, 128)):
    """-> (codes float8_e4m3fn [R,C], scale float8_e8m0fnu [ceil(R/128), ceil(C/128)], dequant f32)."""
    rows, cols = w.shape
    bm, bn = block
    gr, gc = -(-rows // bm), -(-cols // bn)
    exps = np.zeros((gr, gc), dtype=np.int64)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            exps[i, j] = ue8m0_exponent(float(np.abs(blk).max()), FP8_MAX)
    scaled = (w.astype(np.float64) / np.exp2(expand_scales(exps, bm, bn, rows, cols))).astype(np.float32)
    assert np.abs(scaled).max() <= FP8_MAX
    codes = torch.from_numpy(scaled).to(torch.float8_e4m3fn)  # round to nearest even
    scale = torch.from_numpy((exps + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    # verify round-to-nearest with our own decoder
    dec = decode_e4m3(codes.view(torch.uint8).numpy())
    grid = decode_e4m3(np.arange(256, dtype=np.uint8))
    grid = np.unique(grid[np.isfinite(grid)])
    nearest = grid[np.abs(scaled.reshape(-1, 1) - grid[None, :]).argmin(1)].reshape(scaled.shape)
    assert np.array_equal(np.abs(dec - scaled), np.abs(nearest - scaled)), "fp8 cast is not round-to-nearest"
    deq = dequant_fp8(codes, scale, block)
    return codes, scale, deq


def dequant_fp8(codes: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> np.ndarray:
    rows, cols = codes.shape
    q = decode_e4m3(codes.view(torch.uint8).numpy())
    s = decode_e8m0(scale.view(torch.uint8).numpy())
    assert s.shape == (-(-rows // block[0]), -(-cols // block[1]))
    return q * expand_scales(s, block[0], block[1], rows, cols)


def quant_fp4(w: np.ndarray, block=32):
    """-> (packed int8 [R, C/2], scale float8_e8m0fnu [R, C/32], dequant f32)."""
    rows, cols = w.shape
    assert cols % block == 0
    blocks = w.astype(np.float64).reshape(rows, cols // block, block)
    amax = np.abs(blocks).max(-1)
    exps = np.vectorize(lambda a: ue8m0_exponent(float(a), FP4_MAX), otypes=[np.int64])(amax)
    x = blocks / np.exp2(exps)[..., None]
    assert np.abs(x).max() <= FP4_MAX
    mag = np.abs(x)
    d = np.abs(mag[..., None] - E2M1_MAGS)
    idx = d.argmin(-1)
    # ties: round to the even code (mantissa bit 0)
    nxt = np.minimum(idx + 1, 7)
    tie = (idx % 2 == 1) & (np.take_along_axis(d, nxt[..., None], -1)[..., 0] == np.take_along_axis(d, idx[..., None], -1)[..., 0])
    idx = np.where(tie, nxt, idx)
    codes = (idx + np.where((x < 0) & (idx > 0), 8, 0)).astype(np.uint8).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    packed_t = torch.from_numpy(packed.view(np.int8).copy())
    scale = torch.from_numpy((exps + 127).astype(np.uint8)).view(torch.float8_e8m0fnu)
    return packed_t, scale, dequant_fp4(packed_t, scale)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, block=32) -> np.ndarray:
    q = decode_fp4_packed(packed.numpy())
    s = decode_e8m0(scale.view(torch.uint8).numpy())
    rows, cols = q.shape
    assert s.shape == (rows, cols // block)
    return q * expand_scales(s, 1, block, rows, cols)


# ----------------------------------------------------------------------------
# Checkpoint generation (DeepSeek published naming)
# ----------------------------------------------------------------------------


class Builder:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, torch.Tensor] = {}  # what goes into model.safetensors
        self.values: dict[str, np.ndarray] = {}  # our decoding of each logical weight (published name)
        self.formats: dict[str, str] = {}

    def normal(self, shape, std):
        return (self.rng.standard_normal(shape) * std).astype(np.float32)

    def norm_w(self, n):
        return (1.0 + 0.1 * self.rng.standard_normal(n)).clip(0.5, 1.5).astype(np.float32)

    def f32(self, name, arr):
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        self.tensors[name] = torch.from_numpy(arr.copy())
        self.values[name] = arr
        self.formats[name] = f"F32 {list(arr.shape)}"

    def bf16(self, name, arr):
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(torch.bfloat16)
        self.tensors[name] = t
        self.values[name] = decode_bf16(t)
        self.formats[name] = f"BF16 {list(t.shape)}"

    def fp8(self, name, arr):
        assert name.endswith(".weight")
        codes, scale, deq = quant_fp8(arr)
        self.tensors[name] = codes
        self.tensors[name[: -len(".weight")] + ".scale"] = scale
        self.values[name] = deq
        self.formats[name] = f"F8_E4M3 {list(codes.shape)} + .scale F8_E8M0 {list(scale.shape)} (128x128 blocks)"

    def fp4(self, name, arr):
        assert name.endswith(".weight")
        packed, scale, deq = quant_fp4(arr)
        self.tensors[name] = packed
        self.tensors[name[: -len(".weight")] + ".scale"] = scale
        self.values[name] = deq
        self.formats[name] = f"FP4 e2m1 packed I8 {list(packed.shape)} + .scale F8_E8M0 {list(scale.shape)} (1x32 blocks)"

    def i32(self, name, arr):
        arr = np.ascontiguousarray(arr, dtype=np.int32)
        self.tensors[name] = torch.from_numpy(arr.copy())
        self.values[name] = arr
        self.formats[name] = f"I32 {list(arr.shape)}"


def build_checkpoint(seed: int) -> Builder:
    c = CONFIG
    D, V = c["hidden_size"], c["vocab_size"]
    H, hd, rd = c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
    qr, og, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, inter, k = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    hc = c["hc_mult"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    b = Builder(seed)

    emb = b.normal((V, D), 1.0)
    emb[:, BIAS_DIM] = BIAS_VALUE
    b.bf16("embed.weight", emb)
    b.bf16("head.weight", b.normal((V, D), 0.3))
    b.f32("norm.weight", b.norm_w(D))
    b.f32("hc_head_fn", b.normal((hc, hc * D), 1.0 / math.sqrt(hc * D)))
    b.f32("hc_head_base", b.normal(hc, 0.5))
    b.f32("hc_head_scale", b.rng.uniform(0.5, 1.5, 1).astype(np.float32))

    def block(p: str, layer_type: str, mlp_type: str, bias_feature: bool):
        n_mix = (2 + hc) * hc
        for hcn in ("hc_attn", "hc_ffn"):
            b.f32(f"{p}{hcn}_fn", b.normal((n_mix, hc * D), 1.0 / math.sqrt(hc * D)))
            b.f32(f"{p}{hcn}_base", b.normal(n_mix, 0.5))
            b.f32(f"{p}{hcn}_scale", b.rng.uniform(0.5, 1.5, 3).astype(np.float32))
        b.f32(f"{p}attn_norm.weight", b.norm_w(D))
        b.f32(f"{p}ffn_norm.weight", b.norm_w(D))

        a = f"{p}attn."
        csa = layer_type == "compressed_sparse_attention"
        wq_a = b.normal((qr, D), 1.0 / math.sqrt(D))
        q_norm = b.norm_w(qr)
        if csa:  # common q_residual direction for the indexer (see module docstring)
            u = b.normal(qr, 1.0)
            wq_a[:, BIAS_DIM] += 2.0 * u
            r_hat = q_norm * u / np.linalg.norm(q_norm * u)
        b.fp8(f"{a}wq_a.weight", wq_a)
        b.f32(f"{a}q_norm.weight", q_norm)
        wq_b = b.normal((H * hd, qr), 1.0 / math.sqrt(qr))
        wq_b[128:] *= 0.25  # the only multi-block FP8 grid (2x1): give the blocks different scales
        b.fp8(f"{a}wq_b.weight", wq_b)
        b.fp8(f"{a}wkv.weight", b.normal((hd, D), 1.0 / math.sqrt(D)))
        b.f32(f"{a}kv_norm.weight", b.norm_w(hd))
        b.fp8(f"{a}wo_a.weight", b.normal((og * olr, H * hd // og), 1.0 / math.sqrt(H * hd // og)))
        wo_b = b.normal((D, og * olr), 1.0 / math.sqrt(og * olr))
        if bias_feature:
            wo_b[BIAS_DIM, :] = 0.0
        b.fp8(f"{a}wo_b.weight", wo_b)
        b.f32(f"{a}attn_sink", b.normal(H, 1.0))

        if layer_type != "sliding_attention":
            ratio = c["compress_rates"][layer_type]
            width = 2 * hd if csa else hd  # CSA: two overlapping series Ca | Cb
            b.bf16(f"{a}compressor.wkv.weight", b.normal((width, D), 1.0 / math.sqrt(D)))
            b.bf16(f"{a}compressor.wgate.weight", b.normal((width, D), 1.0 / math.sqrt(D)))
            b.f32(f"{a}compressor.ape", b.normal((ratio, width), 0.5))
            b.f32(f"{a}compressor.norm.weight", b.norm_w(hd))
        if csa:
            nope = ihd - rd
            v = np.abs(b.normal(nope, 1.0)) + 0.2
            v /= np.linalg.norm(v)
            iwq_b = b.normal((ih * ihd, qr), 1.0 / math.sqrt(qr))
            for h in range(ih):
                iwq_b[h * ihd : h * ihd + nope, :] += 1.5 * np.outer(v, r_hat)
            b.fp8(f"{a}indexer.wq_b.weight", iwq_b)
            b.bf16(f"{a}indexer.weights_proj.weight", b.normal((ih, D), 1.0 / math.sqrt(D)))
            iwkv = b.normal((2 * ihd, D), 1.0 / math.sqrt(D))
            for half in (0, ihd):
                iwkv[half : half + nope, BIAS_DIM] += 10.0 * v
            b.bf16(f"{a}indexer.compressor.wkv.weight", iwkv)
            b.bf16(f"{a}indexer.compressor.wgate.weight", b.normal((2 * ihd, D), 1.0 / math.sqrt(D)))
            b.f32(f"{a}indexer.compressor.ape", b.normal((c["compress_rates"][layer_type], 2 * ihd), 0.5))
            b.f32(f"{a}indexer.compressor.norm.weight", b.norm_w(ihd))

        f = f"{p}ffn."
        b.bf16(f"{f}gate.weight", b.normal((E, D), 2.0 / math.sqrt(D)))
        if mlp_type == "hash_moe":
            tid2eid = np.stack([b.rng.choice(E, size=k, replace=False) for _ in range(V)])
            b.i32(f"{f}gate.tid2eid", tid2eid)
        else:
            b.f32(f"{f}gate.bias", b.normal(E, 0.5))
        for e in range(E):
            # large gate/up weights so that the swiglu clamp (limit 10) is exercised
            b.fp4(f"{f}experts.{e}.w1.weight", b.normal((inter, D), 0.5))
            w2 = b.normal((D, inter), 0.025)
            if bias_feature:
                w2[BIAS_DIM, :] = 0.0
            b.fp4(f"{f}experts.{e}.w2.weight", w2)
            b.fp4(f"{f}experts.{e}.w3.weight", b.normal((inter, D), 0.5))
        b.fp8(f"{f}shared_experts.w1.weight", b.normal((inter, D), 1.0 / math.sqrt(D)))
        w2 = b.normal((D, inter), 1.0 / math.sqrt(inter))
        if bias_feature:
            w2[BIAS_DIM, :] = 0.0
        b.fp8(f"{f}shared_experts.w2.weight", w2)
        b.fp8(f"{f}shared_experts.w3.weight", b.normal((inter, D), 1.0 / math.sqrt(D)))

    for i in range(c["num_hidden_layers"]):
        block(f"layers.{i}.", LAYER_TYPES[i], MLP_LAYER_TYPES[i], bias_feature=True)

    # MTP block (num_nextn_predict_layers = 1): sliding-window, non-hash MoE.
    b.f32("mtp.0.enorm.weight", b.norm_w(D))
    b.f32("mtp.0.hnorm.weight", b.norm_w(D))
    b.fp8("mtp.0.e_proj.weight", b.normal((D, D), 1.0 / math.sqrt(D)))
    b.fp8("mtp.0.h_proj.weight", b.normal((D, D), 1.0 / math.sqrt(D)))
    b.f32("mtp.0.norm.weight", b.norm_w(D))
    b.f32("mtp.0.hc_head_fn", b.normal((hc, hc * D), 1.0 / math.sqrt(hc * D)))
    b.f32("mtp.0.hc_head_base", b.normal(hc, 0.5))
    b.f32("mtp.0.hc_head_scale", b.rng.uniform(0.5, 1.5, 1).astype(np.float32))
    block("mtp.0.", "sliding_attention", "moe", bias_feature=False)
    return b


# ----------------------------------------------------------------------------
# Our own (independent) published-name -> transformers-name mapping
# ----------------------------------------------------------------------------

_LEAF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def expected_hf_state(values: dict[str, np.ndarray], n_layers: int, n_experts: int, layer_prefix="layers.") -> dict:
    """Our decoded weights under transformers' parameter names (experts merged)."""
    out = {}
    for src, dst in _TOP.items():
        if src in values:
            out[dst] = values[src]
    for i in range(n_layers):
        p = f"{layer_prefix}{i}." if layer_prefix == "layers." else layer_prefix
        for src, dst in _LEAF.items():
            if p + src in values:
                out[f"model.layers.{i}.{dst}"] = values[p + src]
        gu = [np.concatenate([values[f"{p}ffn.experts.{e}.w1.weight"], values[f"{p}ffn.experts.{e}.w3.weight"]], 0) for e in range(n_experts)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = np.stack(gu)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = np.stack([values[f"{p}ffn.experts.{e}.w2.weight"] for e in range(n_experts)])
    return out


def check_model_against(model, expected: dict, what: str):
    sd = model.state_dict()
    got_keys, exp_keys = set(sd), set(expected)
    if got_keys != exp_keys:
        raise SystemExit(
            f"[{what}] state_dict keys differ from our mapping:\n  only in model: {sorted(got_keys - exp_keys)}\n"
            f"  only in ours: {sorted(exp_keys - got_keys)}"
        )
    for name, exp in expected.items():
        t = sd[name]
        if exp.dtype == np.int32:
            ok = t.dtype in (torch.int64, torch.int32) and np.array_equal(t.numpy().astype(np.int64), exp.astype(np.int64))
        else:
            ok = t.dtype == torch.float32 and tuple(t.shape) == exp.shape and np.array_equal(t.numpy(), exp)
        if not ok:
            raise SystemExit(f"[{what}] {name}: transformers' loaded tensor {tuple(t.shape)} {t.dtype} != our decoding {exp.shape} {exp.dtype}")
    return len(expected)


# ----------------------------------------------------------------------------
# Degeneracy monitors (forward hooks; they only read)
# ----------------------------------------------------------------------------


class Monitor:
    def __init__(self):
        self.router_gap = math.inf
        self.router_n = 0
        self.indexer_gap = math.inf
        self.indexer_rel_gap = math.inf
        self.indexer_n = 0
        self.indexer_zero_scores = 0
        self.indexer_scores = 0
        self.clamped = 0
        self.preacts = 0
        self._pos = None
        self.handles = []

    def attach(self, model):
        for mod in model.modules():
            if isinstance(mod, mdl.DeepseekV4TopKRouter):
                self.handles.append(mod.register_forward_hook(self._router_hook))
            elif isinstance(mod, mdl.DeepseekV4Indexer):
                self.handles.append(mod.register_forward_pre_hook(self._indexer_pre))
                self.handles.append(mod.scorer.register_forward_hook(self._scorer_hook))
            elif isinstance(mod, mdl.DeepseekV4Experts):
                orig = mod._apply_gate

                def counted(gate_up, _orig=orig, _mod=mod):
                    g, u = gate_up.chunk(2, dim=-1)
                    self.clamped += int((g > _mod.limit).sum()) + int((u.abs() > _mod.limit).sum())
                    self.preacts += g.numel() + u.numel()
                    return _orig(gate_up)

                mod._apply_gate = counted  # instance attribute: wraps, does not change the maths
        return self

    def detach(self):
        for h in self.handles:
            h.remove()

    @torch.no_grad()
    def _router_hook(self, mod, inputs, output):
        flat = inputs[0].reshape(-1, mod.hidden_dim)
        s = mod.score_fn(torch.nn.functional.linear(flat, mod.weight)) + mod.e_score_correction_bias
        top = s.sort(dim=-1, descending=True).values
        self.router_gap = min(self.router_gap, float((top[:, mod.top_k - 1] - top[:, mod.top_k]).min()))
        self.router_n += flat.shape[0]

    def _indexer_pre(self, mod, args):
        self._pos = args[2]
        self._idx = mod

    @torch.no_grad()
    def _scorer_hook(self, mod, inputs, scores):
        idx = self._idx
        pos = self._pos[0]
        sc = scores[0]  # [S, T]
        k = idx.index_topk
        T = sc.shape[-1]
        for s in range(sc.shape[0]):
            n_valid = min(T, (int(pos[s]) + 1) // idx.compress_rate)
            vals = sc[s, :n_valid]
            self.indexer_scores += n_valid
            self.indexer_zero_scores += int((vals == 0).sum())
            if n_valid > k:
                top = vals.sort(descending=True).values
                gap = float(top[k - 1] - top[k])
                self.indexer_gap = min(self.indexer_gap, gap)
                self.indexer_rel_gap = min(self.indexer_rel_gap, gap / max(1.0, float(top[k - 1].abs())))
                self.indexer_n += 1


# ----------------------------------------------------------------------------
# MTP reference
# ----------------------------------------------------------------------------


def mtp_reference(model, ckpt: Builder, cfg_dict: dict, input_ids: torch.Tensor, last_hc: torch.Tensor, monitor: Monitor):
    """MTP logits for one prompt. THIS COMPOSITION IS OURS: transformers 5.23 does
    not instantiate the MTP block (``mtp.*`` is ignored on load), so we assemble it
    from transformers' building blocks:

    * the decoder block is a real ``DeepseekV4DecoderLayer`` (sliding_attention,
      non-hash moe) inside a 1-layer ``DeepseekV4ForCausalLM`` loaded with
      ``from_pretrained`` from a temporary checkpoint in which ``mtp.0.<x>`` is
      renamed ``layers.0.<x>`` (so transformers' conversion mapping and FP8/FP4
      dequantiser handle the MTP weights exactly like a main layer's), with
      ``mtp.0.norm`` / ``mtp.0.hc_head_*`` as that model's final norm / hc head and
      the shared ``embed`` / ``head``;
    * ``enorm`` / ``hnorm`` are ``DeepseekV4RMSNorm``; ``e_proj`` / ``h_proj`` are
      ``nn.Linear`` holding our (bit-identical to transformers') dequantisation.

    Semantics, for main-model position t in 0..S-2:
        x_t[j] = e_proj(enorm(embed(token[t+1]))) + h_proj(hnorm(H_t[j]))  for hc stream j
    where H_t = output of the main model's last decoder layer at t, shape
    [hc_mult, hidden] (before hc_head). The block runs over positions 0..S-2 with a
    fresh cache, then mtp hc_head -> mtp.0.norm -> shared head gives logits [S-1, V].
    """
    c = cfg_dict
    mtp_cfg = dict(c)
    mtp_cfg.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"], num_nextn_predict_layers=0)
    tensors = {}
    for name, t in ckpt.tensors.items():
        if name.startswith("mtp.0."):
            sub = name[len("mtp.0.") :]
            if sub.startswith(("enorm", "hnorm", "e_proj", "h_proj")):
                continue
            if sub.startswith(("norm.", "hc_head_")):
                tensors[sub] = t
            else:
                tensors["layers.0." + sub] = t
    tensors["embed.weight"] = ckpt.tensors["embed.weight"]
    tensors["head.weight"] = ckpt.tensors["head.weight"]
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as fh:
            json.dump(mtp_cfg, fh)
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        mtp_model, info = DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if bad:
        raise SystemExit(f"MTP block load not clean: {bad}")
    mtp_model.float().eval()  # same BF16-stays-BF16 loader quirk as the main model
    vals = {}
    for name, v in ckpt.values.items():
        if name.startswith("mtp.0."):
            sub = name[len("mtp.0.") :]
            if sub.startswith(("norm.", "hc_head_")):
                vals[sub] = v
            elif not sub.startswith(("enorm", "hnorm", "e_proj", "h_proj")):
                vals["mtp.0." + sub] = v
    vals["embed.weight"] = ckpt.values["embed.weight"]
    vals["head.weight"] = ckpt.values["head.weight"]
    n = check_model_against(mtp_model, expected_hf_state(vals, 1, c["n_routed_experts"], layer_prefix="mtp.0."), "mtp")
    monitor.attach(mtp_model)

    D, eps = c["hidden_size"], c["rms_norm_eps"]
    enorm, hnorm = mdl.DeepseekV4RMSNorm(D, eps), mdl.DeepseekV4RMSNorm(D, eps)
    enorm.weight.data = torch.from_numpy(ckpt.values["mtp.0.enorm.weight"].copy())
    hnorm.weight.data = torch.from_numpy(ckpt.values["mtp.0.hnorm.weight"].copy())
    e_proj, h_proj = torch.nn.Linear(D, D, bias=False), torch.nn.Linear(D, D, bias=False)
    e_proj.weight.data = torch.from_numpy(ckpt.values["mtp.0.e_proj.weight"].copy())
    h_proj.weight.data = torch.from_numpy(ckpt.values["mtp.0.h_proj.weight"].copy())

    S = input_ids.shape[0]
    with torch.no_grad():
        emb_next = model.model.embed_tokens(input_ids[1:])  # [S-1, D] (shared embedding)
        x = e_proj(enorm(emb_next))[:, None, :] + h_proj(hnorm(last_hc[: S - 1]))  # [S-1, hc, D]
        x = x[None].contiguous()

        calls = []

        def substitute(mod, args, kwargs):
            calls.append(1)
            return (x,) + tuple(args[1:]), kwargs

        h = mtp_model.model.layers[0].register_forward_pre_hook(substitute, with_kwargs=True)
        dummy = torch.zeros(1, S - 1, D)
        logits = mtp_model(inputs_embeds=dummy, use_cache=True).logits[0]
        logits_nc = mtp_model(inputs_embeds=dummy, use_cache=False).logits[0]
        h.remove()
    assert len(calls) == 2
    diff = float((logits - logits_nc).abs().max())
    if diff > PREFILL_CACHE_TOL:
        raise SystemExit(f"MTP cached vs uncached mismatch {diff}")
    return logits, {"mtp_block_tensors_checked": n, "mtp_cache_vs_nocache_max_abs_diff": diff}


def summarize_formats(formats: dict[str, str]) -> dict[str, list[str]]:
    """{published-name pattern (layers.N / experts.E): sorted distinct formats}."""
    out: dict[str, set] = {}
    for name, fmt in formats.items():
        pat = re.sub(r"experts\.\d+\.", "experts.E.", re.sub(r"^layers\.\d+\.", "layers.N.", name))
        out.setdefault(pat, set()).add(fmt)
    return {k: sorted(v) for k, v in sorted(out.items())}


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED, help="only for searching a non-degenerate seed")
    args = ap.parse_args()
    seed = args.seed
    t0 = time.time()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    ckpt = build_checkpoint(seed)
    with open(out / "config.json", "w") as fh:
        json.dump(CONFIG, fh, indent=2)
        fh.write("\n")
    save_file(ckpt.tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    # ---- load with transformers (conversion mapping + dequantiser) ----
    cfg = DeepseekV4Config.from_pretrained(out)
    rp = cfg.rope_parameters
    assert rp["main"]["rope_type"] == "default" and rp["compress"]["rope_type"] == "yarn", rp
    assert cfg.layer_types == LAYER_TYPES and cfg.mlp_layer_types == MLP_LAYER_TYPES
    assert cfg.qk_rope_head_dim == 16 and cfg.compress_rates == CONFIG["compress_rates"]
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", output_loading_info=True
    )
    model.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        bad = [k for k in info.get(key, []) if not str(k).startswith("mtp.")]
        if bad:
            raise SystemExit(f"load reported {key}: {bad}")
    # transformers 5.23 quirk: every `*.weight` of a pre-quantized checkpoint goes through
    # the FP8 dequantize converter, which skips the cast to `dtype` — so tensors stored in
    # BF16 without a `.scale` (embed, head, gate, compressor/indexer projections) stay BF16
    # while dequantized FP8/FP4 ones come out float32, and the forward then fails with a
    # dtype mismatch. Upcast them (BF16 -> F32 is exact). With dequantize=True transformers
    # also drops its quantizer after loading; the exact comparison below is what proves its
    # dequantiser read our FP8/FP4 bytes.
    bf16_left = sorted(n for n, p in model.named_parameters() if p.dtype == torch.bfloat16)
    model.float()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    n_checked = check_model_against(
        model, expected_hf_state(ckpt.values, CONFIG["num_hidden_layers"], CONFIG["n_routed_experts"]), "main"
    )
    print(f"loaded; {n_checked} parameters/buffers bit-identical to our decoding of the checkpoint")

    # a few dequantised weights as transformers holds them, for Rust dequantiser unit tests
    sd = model.state_dict()
    dequant_refs = {
        "dequant.layers.2.attn.wq_b.weight": sd["model.layers.2.self_attn.q_b_proj.weight"],
        "dequant.layers.3.ffn.shared_experts.w2.weight": sd["model.layers.3.mlp.shared_experts.down_proj.weight"],
        "dequant.layers.3.ffn.experts.5.w1.weight": sd["model.layers.3.mlp.experts.gate_up_proj"][5, : CONFIG["moe_intermediate_size"]],
        "dequant.layers.3.ffn.experts.5.w3.weight": sd["model.layers.3.mlp.experts.gate_up_proj"][5, CONFIG["moe_intermediate_size"] :],
        "dequant.layers.3.ffn.experts.5.w2.weight": sd["model.layers.3.mlp.experts.down_proj"][5],
    }
    for k, v in dequant_refs.items():
        assert np.array_equal(v.numpy(), ckpt.values[k[len("dequant.") :]]), k

    monitor = Monitor().attach(model)
    last_hc = {}
    model.model.layers[-1].register_forward_hook(lambda m, a, o: last_hc.__setitem__("h", o.detach().clone()))

    prng = np.random.default_rng(seed + 1)
    refs: dict[str, torch.Tensor] = {k: v.clone() for k, v in dequant_refs.items()}
    meta_prompts = []
    checks = {"argmax_min_gap": math.inf}
    V = CONFIG["vocab_size"]
    with torch.no_grad():
        for i, S in enumerate(PROMPT_LENGTHS):
            ids = torch.from_numpy(prng.integers(2, V, size=S).astype(np.int64))
            out_c = model(ids[None], use_cache=True)
            prefill = out_c.logits[0].float().clone()
            hc_states = last_hc["h"][0]
            cache = out_c.past_key_values
            prefill_nc = model(ids[None], use_cache=False).logits[0]
            d_nc = float((prefill - prefill_nc).abs().max())
            if d_nc > PREFILL_CACHE_TOL:
                raise SystemExit(f"prompt {i}: prefill with cache vs without differs by {d_nc}")

            def pick(logits_row):
                top = logits_row.topk(2).values
                checks["argmax_min_gap"] = min(checks["argmax_min_gap"], float(top[0] - top[1]))
                return int(logits_row.argmax())

            toks, dl = [], []
            nxt = pick(prefill[-1])
            for _ in range(N_DECODE):
                toks.append(nxt)
                step = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1].clone()
                dl.append(step)
                nxt = pick(step) if len(toks) < N_DECODE else int(step.argmax())
            dl = torch.stack(dl)
            full = model(torch.cat([ids, torch.tensor(toks)])[None], use_cache=False).logits[0]
            d_dec = float((full[S:] - dl).abs().max())
            d_pre = float((full[:S] - prefill).abs().max())
            checks["decode_vs_full_max_abs_diff"] = max(checks.get("decode_vs_full_max_abs_diff", 0.0), d_dec, d_pre)
            refs[f"p{i}.input_ids"] = ids
            refs[f"p{i}.prefill_logits"] = prefill
            refs[f"p{i}.decode_tokens"] = torch.tensor(toks, dtype=torch.int64)
            refs[f"p{i}.decode_logits"] = dl
            meta_prompts.append(
                {
                    "length": S,
                    "prefill_cache_vs_nocache_max_abs_diff": d_nc,
                    "decode_cache_vs_full_forward_max_abs_diff": d_dec,
                    "decode_tokens": toks,
                }
            )
            if i == MTP_PROMPT:
                mtp_hc = hc_states
                mtp_ids = ids

        mtp_logits, mtp_meta = mtp_reference(model, ckpt, CONFIG, mtp_ids, mtp_hc, monitor)
        refs[f"p{MTP_PROMPT}.mtp_logits"] = mtp_logits.float().contiguous()

    monitor.detach()
    checks.update(
        router_min_gap=monitor.router_gap,
        router_decisions=monitor.router_n,
        indexer_min_gap=monitor.indexer_gap,
        indexer_min_rel_gap=monitor.indexer_rel_gap,
        indexer_decisions_with_choice=monitor.indexer_n,
        indexer_zero_scores=monitor.indexer_zero_scores,
        indexer_scores=monitor.indexer_scores,
        routed_expert_preacts_clamped=monitor.clamped,
        routed_expert_preacts=monitor.preacts,
        **mtp_meta,
    )
    print(json.dumps(checks, indent=1))
    problems = []
    if checks["router_min_gap"] < MIN_ROUTER_GAP:
        problems.append("MoE top-k gap")
    if checks["indexer_min_rel_gap"] < MIN_INDEXER_GAP or checks["indexer_decisions_with_choice"] == 0:
        problems.append("indexer top-k gap")
    if checks["argmax_min_gap"] < MIN_ARGMAX_GAP:
        problems.append("greedy argmax gap")
    if checks["decode_vs_full_max_abs_diff"] > DECODE_CONSISTENCY_TOL:
        problems.append("cached decode vs cache-less forward mismatch")
    if checks["routed_expert_preacts_clamped"] == 0:
        problems.append("swiglu clamp never exercised")
    if problems:
        raise SystemExit(f"degenerate random model ({', '.join(problems)}); change SEED")

    refs = {k: v.contiguous() for k, v in refs.items()}
    save_file(refs, str(out / "reference.safetensors"), metadata={"format": "pt"})
    meta = {
        "generator": "tools/oracle/make_fixtures.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "seed": seed,
        "prompt_lengths": list(PROMPT_LENGTHS),
        "n_decode": N_DECODE,
        "mtp_prompt": MTP_PROMPT,
        "semantics": {
            "prefill_logits": "logits [S, V] of one forward over the prompt (DynamicCache, position 0..S-1)",
            "decode_tokens": "decode_tokens[0] = argmax(prefill_logits[-1]); decode_tokens[j] = argmax(decode_logits[j-1])",
            "decode_logits": "decode_logits[j] = logits after feeding decode_tokens[j] at position S+j, one token at a time on the prefill cache",
            "mtp_logits": "see mtp_reference() docstring: our composition from transformers blocks; row t predicts token t+2 from H_t and token t+1",
            "dequant.*": "f32 dequantised weights exactly as transformers holds them after loading (published names; experts sliced out of gate_up_proj/down_proj)",
        },
        "dtype": "float32 compute on CPU, weights dequantised exactly from the FP8/FP4/BF16 checkpoint",
        "max_abs_logit": {k: float(v.abs().max()) for k, v in refs.items() if k.endswith("_logits")},
        "checks": checks,
        "prompts": meta_prompts,
        "rope_parameters_in_transformers": rp,
        "transformers_left_in_bf16_after_load_then_upcast": bf16_left,
        "tensor_formats": summarize_formats(ckpt.formats),
    }
    with open(out / "reference.json", "w") as fh:
        json.dump(meta, fh, indent=1)
        fh.write("\n")
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"wrote {out}: {sizes} total {sum(sizes.values())} bytes in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
