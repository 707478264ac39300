#!/usr/bin/env python3
"""Oracle fixtures for a sweep of DeepSeek-V4 configs, not one preset.

For every entry of ``SWEEP`` this writes, under ``tests/fixtures/oracle/sweep/<name>/``,
a random checkpoint in DeepSeek's published tensor naming (``config.json``,
``model.safetensors``) and ``reference.safetensors`` with what transformers 5.23.0
(``DeepseekV4ForCausalLM``, float32, eager) computes on it:

* ``p{i}.input_ids`` i64 [S];
* ``p{i}.prefill_rows`` i64 [R] and ``p{i}.prefill_logits`` f32 [R, V]: prefill logits at
  a subset of positions (every ``PREFILL_STRIDE``-th and the last ``PREFILL_TAIL``; the
  rest are computed by the same forward, only not stored, to keep the fixtures small);
* ``p{i}.decode_tokens`` i64 [N] and ``p{i}.decode_logits`` f32 [N, V]: N greedy decode
  steps on the prefill's cache, ``decode_tokens[0] = argmax(last prefill logits)``.

The configs differ in every dimension the architecture allows (head counts, head and
rope dims, indexer heads / dims / top-k below and above the number of compressed
entries, compress ratios 4/8/16/128, sliding windows 4-128, hash layers 0-3, o_groups,
experts and top-k, routed_scaling_factor, hc_mult, layer orders, FP8 block sizes,
FP8/FP4 vs bf16 vs f32 weights). Prompts of a few hundred tokens make every compressor
emit several entries, so the indexer has to choose.

Each config is checked like the preset oracle (make_fixtures.py): transformers' load is
bit-identical to our decoding of the bytes, prefill with cache == without, cached decode
== a cache-less forward, and no discrete decision (MoE top-k, indexer top-k, greedy
argmax) is closer to a tie than the thresholds — a tie would make the reference
ill-defined, since torch.topk breaks ties in no specified order. ``--search NAME`` finds a
seed whose margins pass for one config; the committed seeds are in ``SWEEP``.

Run: tools/oracle/.venv/bin/python tools/oracle/make_sweep.py [--only NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (shared number formats, name mapping, monitors)

import transformers  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "oracle" / "sweep"
N_DECODE = 16
PREFILL_STRIDE = 9
PREFILL_TAIL = 4

SW, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Each entry overrides the base config below. `weights`: fp8 (FP8 attention / shared
# experts with UE8M0 blocks of `block`, FP4 routed experts, BF16 embeddings and
# compressors, as published), bf16 or f32 (every matrix in that dtype, no quantisation).
# `bias_feature`: the preset oracle's trick that keeps indexer scores positive; most
# configs go without it, so zero scores and negative head weights are exercised.
SWEEP = [
    dict(name="narrow-indexer", seed=103, weights="fp8", block=128, prompts=[211, 37], bias_feature=False,
         cfg=dict(hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=8, q_lora_rank=32,
                  o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16, index_topk=4,
                  sliding_window=16, layer_types=[SW, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16},
                  n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=1)),
    dict(name="single-head", seed=202, weights="bf16", prompts=[150], bias_feature=False,
         cfg=dict(hidden_size=32, num_attention_heads=1, head_dim=32, qk_rope_head_dim=16, q_lora_rank=16,
                  o_groups=1, o_lora_rank=16, index_n_heads=1, index_head_dim=16, index_topk=1,
                  sliding_window=4, layer_types=[CSA, CSA, SW], compress_rates={CSA: 8, HCA: 16},
                  n_routed_experts=4, num_experts_per_tok=1, num_hash_layers=0, routed_scaling_factor=1.0,
                  moe_intermediate_size=32)),
    dict(name="wide", seed=384, weights="fp8", block=128, prompts=[300], bias_feature=False,
         cfg=dict(hidden_size=128, num_attention_heads=8, head_dim=32, qk_rope_head_dim=16, q_lora_rank=64,
                  o_groups=4, o_lora_rank=32, index_n_heads=8, index_head_dim=32, index_topk=16,
                  sliding_window=128, layer_types=[HCA, CSA, SW, CSA], compress_rates={CSA: 4, HCA: 128},
                  n_routed_experts=8, num_experts_per_tok=4, num_hash_layers=3, routed_scaling_factor=2.5,
                  moe_intermediate_size=32)),
    dict(name="topk-above-entries", seed=404, weights="f32", prompts=[120], bias_feature=False,
         cfg=dict(hidden_size=64, num_attention_heads=2, head_dim=48, qk_rope_head_dim=16, q_lora_rank=32,
                  o_groups=2, o_lora_rank=24, index_n_heads=4, index_head_dim=24, index_topk=64,
                  sliding_window=32, layer_types=[CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
                  n_routed_experts=4, num_experts_per_tok=2, num_hash_layers=2)),
    dict(name="ratio-8", seed=508, weights="fp8", block=128, prompts=[250], bias_feature=False,
         cfg=dict(hidden_size=96, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=48,
                  o_groups=4, o_lora_rank=16, index_n_heads=3, index_head_dim=16, index_topk=3,
                  sliding_window=8, layer_types=[SW, SW, CSA, HCA, CSA, SW], compress_rates={CSA: 8, HCA: 16},
                  n_routed_experts=6, num_experts_per_tok=3, num_hash_layers=0, hc_mult=2,
                  moe_intermediate_size=32)),
    dict(name="hca-128", seed=613, weights="bf16", prompts=[280], bias_feature=False,
         cfg=dict(hidden_size=64, num_attention_heads=6, head_dim=16, qk_rope_head_dim=8, q_lora_rank=32,
                  o_groups=3, o_lora_rank=16, index_n_heads=2, index_head_dim=32, index_topk=8,
                  sliding_window=64, layer_types=[HCA, HCA, CSA], compress_rates={CSA: 4, HCA: 128},
                  n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=1)),
    dict(name="tiny-window", seed=708, weights="fp8", block=64, prompts=[180], bias_feature=True,
         cfg=dict(hidden_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, q_lora_rank=32,
                  o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=2,
                  sliding_window=4, layer_types=[CSA, SW, CSA], compress_rates={CSA: 4, HCA: 16},
                  n_routed_experts=12, num_experts_per_tok=2, num_hash_layers=3, routed_scaling_factor=1.0)),
    dict(name="deep", seed=967, weights="fp8", block=128, prompts=[220], bias_feature=False,
         cfg=dict(hidden_size=64, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32,
                  o_groups=1, o_lora_rank=32, index_n_heads=2, index_head_dim=64, index_topk=5,
                  sliding_window=12, layer_types=[SW, CSA, HCA, CSA, SW, HCA, CSA, CSA],
                  compress_rates={CSA: 4, HCA: 16}, n_routed_experts=4, num_experts_per_tok=2,
                  num_hash_layers=2, hc_mult=3, hc_sinkhorn_iters=10)),
]

BASE = {
    "model_type": "deepseek_v4",
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 256,
    "num_key_value_heads": 1,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def full_config(entry: dict) -> dict:
    c = copy.deepcopy(BASE)
    c.update(copy.deepcopy(entry["cfg"]))
    n = len(c["layer_types"])
    c["num_hidden_layers"] = n
    hash_layers = c.pop("num_hash_layers")
    c["mlp_layer_types"] = ["hash_moe"] * hash_layers + ["moe"] * (n - hash_layers)
    if entry["weights"] == "fp8":
        c["torch_dtype"] = "bfloat16"
        c["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
            "weight_block_size": [entry["block"], entry["block"]], "expert_dtype": "fp4", "dequantize": True,
        }
    else:
        c["torch_dtype"] = {"bf16": "bfloat16", "f32": "float32"}[entry["weights"]]
    return c


class Writer:
    """Stores each matrix in the format the config's weight scheme gives its role."""

    def __init__(self, builder: mf.Builder, scheme: str, block: int):
        self.b, self.scheme, self.block = builder, scheme, block

    def _fp8(self, name, arr):
        rows, cols = arr.shape
        for dim in (rows, cols):
            # transformers derives the block from the scale grid (dim // grid), which is
            # only right when a dim fits one block or is a multiple of it.
            assert dim <= self.block or dim % self.block == 0, f"{name}: {arr.shape} vs block {self.block}"
        codes, scale, deq = mf.quant_fp8(arr, (self.block, self.block))
        b = self.b
        b.tensors[name] = codes
        b.tensors[name[: -len(".weight")] + ".scale"] = scale
        b.values[name] = deq
        b.formats[name] = f"F8_E4M3 + .scale F8_E8M0 ({self.block}x{self.block} blocks)"

    def dense(self, name, arr):
        """An FP8 matrix in the published scheme (attention, shared experts)."""
        {"fp8": self._fp8, "bf16": self.b.bf16, "f32": self.b.f32}[self.scheme](name, arr)

    def expert(self, name, arr):
        {"fp8": self.b.fp4, "bf16": self.b.bf16, "f32": self.b.f32}[self.scheme](name, arr)

    def half(self, name, arr):
        """A BF16 matrix in the published scheme (embeddings, compressors, gates)."""
        (self.b.f32 if self.scheme == "f32" else self.b.bf16)(name, arr)


def build_checkpoint(entry: dict, c: dict) -> mf.Builder:
    D, V = c["hidden_size"], c["vocab_size"]
    H, hd = c["num_attention_heads"], c["head_dim"]
    rd = c["qk_rope_head_dim"]
    qr, og, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    E, inter, k = c["n_routed_experts"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    hc = c["hc_mult"]
    ih, ihd = c["index_n_heads"], c["index_head_dim"]
    bias_feature = entry["bias_feature"]
    b = mf.Builder(entry["seed"])
    w = Writer(b, entry["weights"], entry.get("block", 128))

    emb = b.normal((V, D), 1.0)
    if bias_feature:
        emb[:, mf.BIAS_DIM] = mf.BIAS_VALUE
    w.half("embed.weight", emb)
    w.half("head.weight", b.normal((V, D), 0.3))
    b.f32("norm.weight", b.norm_w(D))
    b.f32("hc_head_fn", b.normal((hc, hc * D), 1.0 / math.sqrt(hc * D)))
    b.f32("hc_head_base", b.normal(hc, 0.5))
    b.f32("hc_head_scale", b.rng.uniform(0.5, 1.5, 1).astype(np.float32))

    for i, (layer_type, mlp_type) in enumerate(zip(c["layer_types"], c["mlp_layer_types"])):
        p = f"layers.{i}."
        n_mix = (2 + hc) * hc
        for hcn in ("hc_attn", "hc_ffn"):
            b.f32(f"{p}{hcn}_fn", b.normal((n_mix, hc * D), 1.0 / math.sqrt(hc * D)))
            b.f32(f"{p}{hcn}_base", b.normal(n_mix, 0.5))
            b.f32(f"{p}{hcn}_scale", b.rng.uniform(0.5, 1.5, 3).astype(np.float32))
        b.f32(f"{p}attn_norm.weight", b.norm_w(D))
        b.f32(f"{p}ffn_norm.weight", b.norm_w(D))

        a = f"{p}attn."
        csa = layer_type == CSA
        wq_a = b.normal((qr, D), 1.0 / math.sqrt(D))
        q_norm = b.norm_w(qr)
        if csa and bias_feature:
            u = b.normal(qr, 1.0)
            wq_a[:, mf.BIAS_DIM] += 2.0 * u
            r_hat = q_norm * u / np.linalg.norm(q_norm * u)
        w.dense(f"{a}wq_a.weight", wq_a)
        b.f32(f"{a}q_norm.weight", q_norm)
        w.dense(f"{a}wq_b.weight", b.normal((H * hd, qr), 1.0 / math.sqrt(qr)))
        w.dense(f"{a}wkv.weight", b.normal((hd, D), 1.0 / math.sqrt(D)))
        b.f32(f"{a}kv_norm.weight", b.norm_w(hd))
        w.dense(f"{a}wo_a.weight", b.normal((og * olr, H * hd // og), 1.0 / math.sqrt(H * hd // og)))
        wo_b = b.normal((D, og * olr), 1.0 / math.sqrt(og * olr))
        if bias_feature:
            wo_b[mf.BIAS_DIM, :] = 0.0
        w.dense(f"{a}wo_b.weight", wo_b)
        b.f32(f"{a}attn_sink", b.normal(H, 1.0))

        if layer_type != SW:
            ratio = c["compress_rates"][layer_type]
            width = 2 * hd if csa else hd
            w.half(f"{a}compressor.wkv.weight", b.normal((width, D), 1.0 / math.sqrt(D)))
            w.half(f"{a}compressor.wgate.weight", b.normal((width, D), 1.0 / math.sqrt(D)))
            b.f32(f"{a}compressor.ape", b.normal((ratio, width), 0.5))
            b.f32(f"{a}compressor.norm.weight", b.norm_w(hd))
        if csa:
            ratio = c["compress_rates"][CSA]
            iwq_b = b.normal((ih * ihd, qr), 1.0 / math.sqrt(qr))
            iwkv = b.normal((2 * ihd, D), 1.0 / math.sqrt(D))
            if bias_feature:
                nope = ihd - rd
                v = np.abs(b.normal(nope, 1.0)) + 0.2
                v /= np.linalg.norm(v)
                for h in range(ih):
                    iwq_b[h * ihd : h * ihd + nope, :] += 1.5 * np.outer(v, r_hat)
                for half in (0, ihd):
                    iwkv[half : half + nope, mf.BIAS_DIM] += 10.0 * v
            w.dense(f"{a}indexer.wq_b.weight", iwq_b)
            w.half(f"{a}indexer.weights_proj.weight", b.normal((ih, D), 1.0 / math.sqrt(D)))
            w.half(f"{a}indexer.compressor.wkv.weight", iwkv)
            w.half(f"{a}indexer.compressor.wgate.weight", b.normal((2 * ihd, D), 1.0 / math.sqrt(D)))
            b.f32(f"{a}indexer.compressor.ape", b.normal((ratio, 2 * ihd), 0.5))
            b.f32(f"{a}indexer.compressor.norm.weight", b.norm_w(ihd))

        f = f"{p}ffn."
        w.half(f"{f}gate.weight", b.normal((E, D), 2.0 / math.sqrt(D)))
        if mlp_type == "hash_moe":
            b.i32(f"{f}gate.tid2eid", np.stack([b.rng.choice(E, size=k, replace=False) for _ in range(V)]))
        else:
            b.f32(f"{f}gate.bias", b.normal(E, 0.5))
        for e in range(E):
            w.expert(f"{f}experts.{e}.w1.weight", b.normal((inter, D), 0.5))
            w2 = b.normal((D, inter), 0.025)
            if bias_feature:
                w2[mf.BIAS_DIM, :] = 0.0
            w.expert(f"{f}experts.{e}.w2.weight", w2)
            w.expert(f"{f}experts.{e}.w3.weight", b.normal((inter, D), 0.5))
        w.dense(f"{f}shared_experts.w1.weight", b.normal((inter, D), 1.0 / math.sqrt(D)))
        w2 = b.normal((D, inter), 1.0 / math.sqrt(inter))
        if bias_feature:
            w2[mf.BIAS_DIM, :] = 0.0
        w.dense(f"{f}shared_experts.w2.weight", w2)
        w.dense(f"{f}shared_experts.w3.weight", b.normal((inter, D), 1.0 / math.sqrt(D)))
    return b


class IndexerTies:
    """Makes the reference's lightning-indexer top-k well defined, and measures how
    close each choice is to a tie that rounding could flip.

    torch.topk returns equal scores in no specified order, and on CPU that order
    depends on the number of entries: with few indexer heads many scores are exactly
    zero (every head's ReLU clipped), and transformers' logits at a position then change
    when tokens are appended after it (7.1 on `narrow-indexer`), so its prefill, decode
    and full forward disagree. The scorer's output feeds only the top-k, so replacing it
    by each entry's rank under (score descending, index ascending) - a stable sort,
    with -0.0 equal to +0.0 - selects exactly the entries of that rule, which is the one
    deepinfer implements; every other part of the reference is untouched.

    Exact ties are then harmless where the tied scores are exactly zero in any
    implementation; what must not occur is a choice decided by rounding: a boundary gap
    between two different scores below `MIN_INDEXER_GAP` (relative), or a pre-ReLU
    q.k so close to zero that its sign could flip.
    """

    def __init__(self, model):
        self.boundary_rel_gap = math.inf
        self.exact_ties = 0
        self.decisions = 0
        self.min_rel_qk = math.inf
        self.handles = []
        for mod in model.modules():
            if isinstance(mod, mdl.DeepseekV4Indexer):
                self.handles.append(mod.register_forward_pre_hook(self._pre))
                self.handles.append(mod.scorer.register_forward_hook(self._ranks))

    def _pre(self, mod, args):
        self.positions, self.indexer = args[2][0], mod

    @torch.no_grad()
    def _ranks(self, mod, inputs, scores):
        q, kv = inputs[0].float(), inputs[1].float()  # [B,S,H,D], [B,T,D]
        k, ratio = self.indexer.index_topk, self.indexer.compress_rate
        T = scores.shape[-1]
        if T > 0:
            dots = torch.matmul(q, kv.transpose(-1, -2).unsqueeze(1))  # [B,S,H,T]
            norms = q.norm(dim=-1, keepdim=True) * kv.norm(dim=-1)[:, None, None, :]
            for s in range(scores.shape[1]):
                visible = min(T, (int(self.positions[s]) + 1) // ratio)
                if visible == 0:
                    continue
                if visible <= k:
                    continue
                row = scores[0, s, :visible]
                top = row.sort(descending=True).values
                a, b = float(top[k - 1]), float(top[k])
                self.decisions += 1
                if a != b:
                    self.boundary_rel_gap = min(self.boundary_rel_gap, (a - b) / max(1.0, abs(a)))
                    continue
                # An exact tie at the boundary, decided by index: robust only if no tied
                # entry's score could leave the tie by a ReLU flipping under rounding.
                self.exact_ties += 1
                tied = (row == a).nonzero()[:, 0]
                rel = dots[0, s][:, tied].abs() / norms[0, s][:, tied].clamp_min(1e-30)
                self.min_rel_qk = min(self.min_rel_qk, float(rel.min()))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        ranks = torch.empty_like(order)
        ranks.scatter_(-1, order, torch.arange(T).expand_as(order).contiguous())
        return (T - ranks).to(scores.dtype)

    def detach(self):
        for h in self.handles:
            h.remove()


MIN_REL_QK = 1e-5  # |q_h . k| / (|q_h| |k|): below this, f32 rounding could flip a ReLU


def prefill_rows(S: int) -> list[int]:
    return sorted(set(range(0, S, PREFILL_STRIDE)) | set(range(max(0, S - PREFILL_TAIL), S)))


def run_entry(entry: dict, out: Path | None) -> tuple[dict, list[str]]:
    """Build, load, run and check one config; write its fixtures when `out` is given."""
    import tempfile

    c = full_config(entry)
    ckpt = build_checkpoint(entry, c)
    with tempfile.TemporaryDirectory() as tmp:
        where = out if out is not None else Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        with open(where / "config.json", "w") as fh:
            json.dump(c, fh, indent=1)
            fh.write("\n")
        save_file(ckpt.tensors, str(where / "model.safetensors"), metadata={"format": "pt"})
        model, info = DeepseekV4ForCausalLM.from_pretrained(
            where, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
    model.float().eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            raise SystemExit(f"{entry['name']}: load reported {key}: {info[key]}")
    assert model.config.qk_rope_head_dim == c["qk_rope_head_dim"], model.config.qk_rope_head_dim
    n_checked = mf.check_model_against(
        model, mf.expected_hf_state(ckpt.values, c["num_hidden_layers"], c["n_routed_experts"]), entry["name"]
    )

    ties = IndexerTies(model)  # before the monitor: the monitor then sees the ranks, not scores
    monitor = mf.Monitor().attach(model)
    prng = np.random.default_rng(entry["seed"] + 1)
    refs: dict[str, torch.Tensor] = {}
    checks = {"argmax_min_gap": math.inf, "decode_vs_full_max_abs_diff": 0.0, "prefill_cache_max_abs_diff": 0.0}
    V = c["vocab_size"]
    with torch.no_grad():
        for i, S in enumerate(entry["prompts"]):
            ids = torch.from_numpy(prng.integers(2, V, size=S).astype(np.int64))
            out_c = model(ids[None], use_cache=True)
            prefill = out_c.logits[0].float().clone()
            cache = out_c.past_key_values
            prefill_nc = model(ids[None], use_cache=False).logits[0]
            checks["prefill_cache_max_abs_diff"] = max(
                checks["prefill_cache_max_abs_diff"], float((prefill - prefill_nc).abs().max())
            )

            def pick(row):
                top = row.topk(2).values
                checks["argmax_min_gap"] = min(checks["argmax_min_gap"], float(top[0] - top[1]))
                return int(row.argmax())

            toks, dl = [], []
            nxt = pick(prefill[-1])
            for _ in range(N_DECODE):
                toks.append(nxt)
                step = model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1].clone()
                dl.append(step)
                nxt = pick(step) if len(toks) < N_DECODE else int(step.argmax())
            dl = torch.stack(dl)
            full = model(torch.cat([ids, torch.tensor(toks)])[None], use_cache=False).logits[0]
            checks["decode_vs_full_max_abs_diff"] = max(
                checks["decode_vs_full_max_abs_diff"],
                float((full[S:] - dl).abs().max()),
                float((full[:S] - prefill).abs().max()),
            )
            rows = prefill_rows(S)
            refs[f"p{i}.input_ids"] = ids
            refs[f"p{i}.prefill_rows"] = torch.tensor(rows, dtype=torch.int64)
            refs[f"p{i}.prefill_logits"] = prefill[rows].contiguous()
            refs[f"p{i}.decode_tokens"] = torch.tensor(toks, dtype=torch.int64)
            refs[f"p{i}.decode_logits"] = dl.contiguous()
    monitor.detach()
    ties.detach()
    # For the record: with torch's own tie order the reference is not causal where
    # scores tie (a position's logits move when tokens are appended after it).
    with torch.no_grad():
        ids, toks = refs["p0.input_ids"], refs["p0.decode_tokens"]
        alone = model(ids[None], use_cache=False).logits[0]
        extended = model(torch.cat([ids, toks])[None], use_cache=False).logits[0][: len(ids)]
        checks["torch_tie_order_prefix_logits_moved_by"] = float((alone - extended).abs().max())
    checks.update(
        router_min_gap=monitor.router_gap,
        indexer_boundary_min_rel_gap=ties.boundary_rel_gap,
        indexer_decisions_with_choice=ties.decisions,
        indexer_exact_ties_at_boundary=ties.exact_ties,
        indexer_min_rel_qk=ties.min_rel_qk,
        routed_expert_preacts_clamped=monitor.clamped,
        parameters_checked=n_checked,
    )
    problems = []
    if checks["router_min_gap"] < mf.MIN_ROUTER_GAP:
        problems.append(f"MoE top-k gap {checks['router_min_gap']:.2e}")
    # The indexer chooses only where more entries are visible than it keeps.
    topk_below = CSA in c["layer_types"] and any(
        (S + N_DECODE) // c["compress_rates"][CSA] > c["index_topk"] for S in entry["prompts"]
    )
    if topk_below and ties.decisions == 0:
        problems.append("the indexer never chooses")
    if ties.boundary_rel_gap < mf.MIN_INDEXER_GAP:
        problems.append(f"indexer top-k gap {ties.boundary_rel_gap:.2e}")
    if ties.min_rel_qk < MIN_REL_QK:
        problems.append(f"indexer q.k near zero ({ties.min_rel_qk:.2e})")
    if checks["argmax_min_gap"] < mf.MIN_ARGMAX_GAP:
        problems.append(f"greedy argmax gap {checks['argmax_min_gap']:.2e}")
    if checks["decode_vs_full_max_abs_diff"] > mf.DECODE_CONSISTENCY_TOL:
        problems.append("cached decode vs cache-less forward mismatch")
    if checks["prefill_cache_max_abs_diff"] > mf.PREFILL_CACHE_TOL:
        problems.append("prefill with cache vs without mismatch")

    if out is not None and not problems:
        save_file({k: v.contiguous() for k, v in refs.items()}, str(out / "reference.safetensors"),
                  metadata={"format": "pt"})
        meta = {
            "generator": "tools/oracle/make_sweep.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "entry": {k: v for k, v in entry.items() if k != "cfg"},
            "max_abs_logit": {k: float(v.abs().max()) for k, v in refs.items() if k.endswith("_logits")},
            "checks": checks,
            "tensor_formats": mf.summarize_formats(ckpt.formats),
        }
        with open(out / "reference.json", "w") as fh:
            json.dump(meta, fh, indent=1)
            fh.write("\n")
    return checks, problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", help="one config by name")
    ap.add_argument("--search", help="find a seed whose decision margins pass for this config")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # thread count changes float summation order
    if args.search:
        entry = next(e for e in SWEEP if e["name"] == args.search)
        for seed in range(entry["seed"], entry["seed"] + 200):
            torch.manual_seed(seed)
            checks, problems = run_entry(dict(entry, seed=seed), None)
            print(seed, problems or "ok", flush=True)
            if not problems:
                return
        raise SystemExit("no seed found")
    failed = []
    for entry in SWEEP:
        if args.only and entry["name"] != args.only:
            continue
        t0 = time.time()
        torch.manual_seed(entry["seed"])
        checks, problems = run_entry(entry, args.out / entry["name"])
        status = "ok" if not problems else "FAILED: " + ", ".join(problems)
        print(f"{entry['name']}: {status} ({time.time() - t0:.1f}s) {json.dumps(checks)}", flush=True)
        if problems:
            failed.append(entry["name"])
    if failed:
        raise SystemExit(f"degenerate configs {failed}: pick another seed with --search")


if __name__ == "__main__":
    main()
