#!/usr/bin/env python3
"""Train a tiny DeepSeek-V4.1 (the ``tiny-v41`` preset's shape, BF16, with Engram and DSpark)
on Rust source code, so that DSpark speculative decoding has drafts worth accepting.

There is no transformers implementation of V4.1: the model is DeepSeek's own reference
(``inference/model.py`` with ``engram.py`` and ``kernel_cpu.py``, the package
``models.demos.deepseek_v3_d_p.reference.deepseek_v41`` under ``--reference``, as for
``tools/oracle/make_v41.py``), whose modules are reused for training:

1. **Config**: ``deepinfer model init --preset tiny-v41 --seed 1``'s ``config.json`` with
   ``dtype = "bf16"``, ``expert_dtype = null`` (no FP8/FP4 matrices, as make_v41's
   ``r1-first-bf16``) and ``engram_compressed_vocab_size`` = the size of the Engram compressed
   vocabulary of the real tokenizer (the built-in byte-level BPE, vocab 1024, bos 0 / eos 1),
   computed by the reference's ``engram.build_compressed_token_map``; the map is written as
   ``engram_token_map.json``. Weights: a fresh seeded init (``init_weights``), not the preset's.
2. **Trunk forward**: the reference's own ``Block``/``Engram``/``Compressor``/``Indexer``
   modules run as a start_pos-0 prefill of whole windows, in float32 with autograd. Patched
   for training only (never in the checks): ``act_quant``/``fp4_act_quant`` (in-place
   quantise-dequantise of window KV, compressed KV, indexer q/k) -> the same rounding as a
   straight-through estimator; ``sparse_attn`` -> the same sparse attention (gathered
   indices, attention sink), float32 and differentiable; the Engram table (FP8 in the
   checkpoint) -> an f32 master table quantised per 32 columns (E4M3, power-of-two scale)
   with a straight-through estimator; the indexers run without gradient (they only choose
   entries); top-k breaks ties toward the lower index (make_v41's rule). KV caches are
   reset to fresh tensors before every step.
3. **DSpark forward (training)**: for every anchor position p of a window at once, what
   ``forward_spec`` computes at decode step p: ``main_x = main_norm(main_proj(main_hidden[p]))``
   (main_hidden = the inputs of ``dspark_target_layer_ids`` after Engram, mean over the hc
   copies, concatenated), the block ``[tok[p+1], noise, noise]`` at positions p+1..p+3 going
   through the DSpark ``Block`` (hc mixes, MoE) whose attention sees the main KV of positions
   p-window+1..p plus the whole block (``DSparkAttention`` / ``get_dspark_topk_idxs``), then
   ``norm`` -> shared ``head`` + the Markov bias of the previous token, and the confidence
   head on ``[hc_pre output, Markov embedding]``.
4. **Objective**: next-token cross-entropy for the trunk; for DSpark slot j of anchor p
   (drafting position p+2+j) the cross-entropy against the trunk's own (detached) next-token
   distribution at position p+1+j (distillation: acceptance is agreement with the trunk's
   greedy choice), the Markov head fed the trunk's greedy tokens as the previous drafts
   (teacher forcing along the greedy path), and binary cross-entropy for the confidence
   head on "this slot's draft argmax equals the trunk's argmax". ``main_hidden`` is
   detached: the DSpark loss does not train the trunk. Routers' ``bias`` follows the
   auxiliary-loss-free balancing as in train_tiny_v4.py.
5. **Export**: a fresh reference model built exactly as make_v41 builds one (BF16 default
   dtype) gets the trained weights (BF16 matrices, fp32 hc/sink/router bias, Engram table
   E4M3 + E8M0 scales; the fp32-promoted bf16 tensors rounded to bf16) and is written with
   make_v41's ``checkpoint_tensors`` (its names are the ``state_dict``'s).
6. **check** (``--check``): the exported checkpoint, loaded into the reference with
   make_v41's deviations (stable top-k ties, own-group index keys, float64 arithmetic),
   greedy-decoded on a few prompts and compared token by token with
   ``deepinfer generate --show-tokens``; DSpark drafts of the reference along the greedy
   path (forward_spec after every decode step) give the reference's own acceptance; then
   ``deepinfer generate --speculative dspark`` statistics.

Run (see README.md):

    OMP_NUM_THREADS=1 nice -n 19 tools/oracle/.venv/bin/python tools/train/train_tiny_v41.py --reference /work/ref
    OMP_NUM_THREADS=1 nice -n 19 tools/oracle/.venv/bin/python tools/train/train_tiny_v41.py --reference /work/ref --check
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "oracle"))
sys.path.insert(0, str(REPO / "tools" / "train"))
import make_v41 as mv  # noqa: E402  (reference import, deviations, checkpoint writer)

SEED = 1234
INIT_SEED = 1
DEFAULT_OUT = REPO / "assets" / "tiny-v41-trained"
REPORT = Path(__file__).resolve().parent / "train_v41_report.json"

SEQ_LEN = 128
BATCH = 8
STEPS = 1700
LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP = 100
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)
DSPARK_WEIGHT = 1.0
CONF_WEIGHT = 0.1
BIAS_UPDATE = 1e-3
EVAL_EVERY = 200
EVAL_WINDOWS = 16
PY_MAX_SEQ_LEN = 1024  # buffer sizes of the Python model only (config.json keeps the preset's)

# ----------------------------------------------------------------------------------------------
# reference, config, tokenizer


class TokenizerForEngram:
    """What engram.build_compressed_token_map reads of a HF tokenizer, over a `tokenizers` one."""

    def __init__(self, tok):
        self.backend_tokenizer = tok
        self._n = tok.get_vocab_size(True)

    def __len__(self):
        return self._n


def model_args(v41, cfg: dict, max_batch: int, temperature: float = 0.0):
    names = {f.name for f in fields(v41.ModelArgs)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in names}
    kw.update(max_batch_size=max_batch, max_seq_len=PY_MAX_SEQ_LEN, temperature=temperature)
    return v41.ModelArgs(**kw)


def make_config(init_cfg: dict, token_map_size: int) -> dict:
    cfg = dict(init_cfg)
    cfg.update(dtype="bf16", expert_dtype=None, engram_compressed_vocab_size=token_map_size)
    return cfg


def build(v41, args, tok):
    v41.shared_attn.__init__()
    with v41.set_dtype(torch.bfloat16):
        model = v41.Transformer(args, TokenizerForEngram(tok))
    return model.eval()


# ----------------------------------------------------------------------------------------------
# training-time replacements (straight-through quantisation, differentiable sparse attention)

FP8_MAX, FP4_MAX = 448.0, 6.0


def _pow2_scale(amax, max_inv):
    x = (amax.float() * max_inv).contiguous()
    bits = x.view(torch.int32)
    e = (bits >> 23) & 0xFF
    man = bits & ((1 << 23) - 1)
    return (((e - 127 + (man != 0).to(torch.int32)) + 127) << 23).view(torch.float32)


def qd_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    xg = x.detach().float().unflatten(-1, (-1, block))
    s = _pow2_scale(xg.abs().amax(-1).clamp_min(1e-4), torch.tensor(1.0 / FP8_MAX)).unsqueeze(-1)
    q = (xg / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2)


def qd_fp4(x: torch.Tensor, block: int, scale_dtype) -> torch.Tensor:
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41 import kernel_cpu as kc

    xg = x.detach().float().unflatten(-1, (-1, block))
    amax = xg.abs().amax(-1)
    if scale_dtype == torch.float8_e4m3fn:
        s = (amax.clamp_min(6 * 2**-9) / FP4_MAX).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        s = _pow2_scale(amax.clamp_min(6 * 2**-126), torch.tensor(1.0 / FP4_MAX))
    v = (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    return (kc._e2m1_round(v) * s.unsqueeze(-1)).flatten(-2)


def ste_act_quant(x, block_size=128, scale_fmt=None, scale_dtype=torch.float32, inplace=False):
    assert inplace
    x.add_((qd_fp8(x, block_size) - x).detach())
    return x


def ste_fp4_act_quant(x, block_size=32, inplace=False, scale_dtype=torch.float8_e8m0fnu):
    assert inplace
    x.add_((qd_fp4(x, block_size, scale_dtype) - x).detach())
    return x


def ste(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return x + (q - x).detach()


def attend(q, keys, valid, sink, scale):
    """q [..., m, h, d], keys [..., n, d], valid [..., m or 1, n] -> [..., m, h, d]; sink per head."""
    s = torch.einsum("...mhd,...nd->...mhn", q, keys) * scale
    s = s.masked_fill(~valid.unsqueeze(-2), -torch.inf)
    sk = sink.view(*([1] * (s.dim() - 2)), -1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sk], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("...mhn,...nd->...mhd", p, keys)


def train_sparse_attn(q, kv, attn_sink, topk_idxs, softmax_scale):
    b = q.size(0)
    idx = topk_idxs.long()
    g = kv[torch.arange(b).view(b, 1, 1), idx.clamp_min(0)]  # [b, m, k, d]
    # each query row has its own keys: treat (b, m) as the batch, one query each
    o = attend(q.unsqueeze(2), g, (idx != -1).unsqueeze(2), attn_sink.float(), softmax_scale)
    return o.squeeze(2)


def train_engram_embed(self, indices):
    w = ste(self.weight, qd_fp8(self.weight, self.block_size))
    return F.embedding(indices, w)


def install_training_patches(v41):
    v41.act_quant = ste_act_quant
    v41.fp4_act_quant = ste_fp4_act_quant
    v41.sparse_attn = train_sparse_attn
    v41.ParallelEngramEmbedding.forward = train_engram_embed
    orig = v41.Indexer.forward

    def indexer_forward(self, *a):
        with torch.no_grad():
            return orig(self, *a)

    v41.Indexer.forward = indexer_forward
    torch.Tensor.topk = mv.stable_topk
    torch.topk = mv.stable_topk


# ----------------------------------------------------------------------------------------------
# init, training forward


@torch.no_grad()
def init_weights(v41, model, seed):
    gen = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    n_layers = len(model.layers)
    for name, p in model.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        owner = mods[owner_name]
        last = owner_name.rsplit(".", 1)[-1]
        if p.dtype == torch.float8_e8m0fnu:
            continue
        if isinstance(owner, v41.ParallelEngramEmbedding):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        elif isinstance(owner, v41.RMSNorm):
            p.fill_(1.0)
        elif leaf in ("q_weight", "k_weight"):
            p.fill_(1.0)
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02 * p.size(1) ** -0.5)
        elif leaf.startswith("hc_") and leaf.endswith("_scale"):
            p.fill_(1.0)
        elif leaf.startswith("hc_") and leaf.endswith("_base"):
            p.zero_()
        elif leaf in ("attn_sink", "bias"):
            p.zero_()
        elif isinstance(owner, v41.ParallelEmbedding):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif p.dim() >= 2:
            std = p.size(1) ** -0.5
            if last in ("wo_b", "w2"):
                std /= math.sqrt(2 * n_layers)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        else:
            p.zero_()


def reset_caches(model):
    for mod in model.modules():
        for n, b in list(mod._buffers.items()):
            if n in ("window_kv_cache", "compress_kv_cache", "k_cache", "kv_state", "score_state"):
                mod._buffers[n] = b.detach().clone()


def trunk_forward(v41, model, ids):
    """-> logits [B, T, V] (f32), main_hidden [B, T, n_targets*dim]."""
    reset_caches(model)
    with torch.inference_mode():
        hashes = model.engram_hash(ids, 0)
    hashes = hashes.clone()
    h = model.embed(ids)
    h = h.unsqueeze(2).repeat(1, 1, model.hc_mult, 1)
    pre_mix = v41.make_identity_pre_mix(h, model.hc_mult)
    mains = []
    for i, layer in enumerate(model.layers):
        if layer.engram is not None:
            h = layer.engram(h, hashes[:, :, layer.engram.layer_hash_index, :])
        if i in model.target_layer_ids:
            mains.append(h.mean(dim=2))
        h, pre_mix = layer(h, 0, pre_mix, None)
    h = layer.hc_pre(h, pre_mix)
    return model.head(model.norm(h), full_logits=True), torch.cat(mains, dim=-1)


def rope(x, fc, inverse=False):
    """x [..., rd] real, fc complex broadcastable to [..., rd/2] -> rotated copy."""
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    if inverse:
        fc = fc.conj()
    return torch.view_as_real(xc * fc).flatten(-2)


def with_rope(x, fc, rd, inverse=False):
    return torch.cat([x[..., :-rd], rope(x[..., -rd:], fc, inverse)], dim=-1)


def dspark_attention(attn, x, main_x):
    """x [B, P, k, D] (attn_norm'ed block inputs), main_x [B, T, D] -> [B, P, k, D]."""
    B, P, k, D = x.shape
    win, rd, H = attn.window_size, attn.rope_head_dim, attn.n_local_heads
    fc = attn.freqs_cis
    T = main_x.size(1)
    main_kv = attn.kv_norm(attn.wkv(main_x))
    main_kv = with_rope(main_kv, fc[:T].view(1, T, -1), rd)
    main_kv = ste(main_kv, qd_fp8(main_kv, 32))
    pos = torch.arange(P).unsqueeze(1) - torch.arange(win - 1, -1, -1)  # [P, win]
    wk = main_kv[:, pos.clamp_min(0)]  # [B, P, win, hd]
    qpos = torch.arange(P).unsqueeze(1) + 1 + torch.arange(k)  # [P, k]
    qfc = fc[qpos]  # [P, k, rd/2]
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(qr).unflatten(-1, (H, attn.head_dim))
    q = with_rope(q, qfc.unsqueeze(-2), rd)
    bkv = attn.kv_norm(attn.wkv(x))
    bkv = with_rope(bkv, qfc, rd)
    bkv = ste(bkv, qd_fp8(bkv, 32))
    keys = torch.cat([wk, bkv], dim=2)  # [B, P, win + k, hd]
    valid = torch.cat([pos >= 0, torch.ones(P, k, dtype=torch.bool)], dim=1)  # [P, win + k]
    o = attend(q, keys, valid.view(1, P, 1, -1), attn.attn_sink.float(), attn.softmax_scale)
    o = with_rope(o, qfc.unsqueeze(-2), rd, inverse=True)
    o = o.reshape(B, P, k, attn.n_local_groups, -1)
    wo_a = attn.wo_a.weight.view(attn.n_local_groups, attn.o_lora_rank, -1)
    o = torch.einsum("bpsgd,grd->bpsgr", o, wo_a)
    return attn.wo_b(o.flatten(-2))


def dspark_forward(model, ids, main_hidden, greedy):
    """Drafts for every anchor p = 0..T-2 -> logits [B, P, k, V], confidence [B, P, k]."""
    blk0, last = model.mtp[0], model.mtp[-1]
    B, T = ids.shape
    k, P = blk0.block_size, T - 1
    main_x = blk0.main_norm(blk0.main_proj(main_hidden))
    draft = torch.full((B, P, k), blk0.noise_token_id, dtype=torch.long)
    draft[:, :, 0] = ids[:, 1:]
    h = model.embed(draft).unsqueeze(3).repeat(1, 1, 1, model.hc_mult, 1)  # [B, P, k, hc, D]
    h = h.flatten(0, 1)
    pre_mix = torch.zeros(B * P, k, model.hc_mult)
    pre_mix[:, :, 0] = 1.0
    for layer in model.mtp:
        residual = h
        a_pre, a_post, a_comb = layer.hc_mixes(h, layer.hc_attn_fn, layer.hc_attn_scale, layer.hc_attn_base)
        x = layer.attn_norm(layer.hc_pre(h, pre_mix))
        x = dspark_attention(layer.attn, x.view(B, P, k, -1), main_x).flatten(0, 1)
        h = layer.hc_post(x, residual, a_post, a_comb)
        residual = h
        f_pre, f_post, f_comb = layer.hc_mixes(h, layer.hc_ffn_fn, layer.hc_ffn_scale, layer.hc_ffn_base)
        x = layer.ffn(layer.ffn_norm(layer.hc_pre(h, a_pre)), None)
        h = layer.hc_post(x, residual, f_post, f_comb)
        pre_mix = f_pre
    x = last.hc_pre(h, pre_mix)
    logits = last.head(last.norm(x), full_logits=True)  # [BP, k, V]
    # previous tokens: the anchor, then the trunk's greedy tokens along the block (teacher forcing)
    prev = torch.empty(B, P, k, dtype=torch.long)
    prev[:, :, 0] = ids[:, 1:]
    for j in range(1, k):
        g = greedy[:, j: j + P]  # greedy[q] = trunk argmax at q (a token for position q+1)
        pad = P - g.size(1)
        prev[:, :, j] = torch.cat([g, torch.zeros(B, pad, dtype=torch.long)], 1) if pad else g
    bias, memb = last.markov_head(prev.flatten(0, 1))
    logits = logits + bias
    conf = last.confidence_head(x, memb)
    return logits.view(B, P, k, -1), conf.view(B, P, k)


def losses(v41, model, ids, with_metrics=False):
    logits, main_hidden = trunk_forward(v41, model, ids)
    B, T, V = logits.shape
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    tl = logits.detach()
    greedy = tl.argmax(-1)
    dl, conf = dspark_forward(model, ids, main_hidden.detach(), greedy)
    P, k = dl.shape[1], dl.shape[2]
    # slot j of anchor p drafts position p+2+j; the trunk's prediction for it is at row p+1+j
    rows = torch.arange(P).unsqueeze(1) + 1 + torch.arange(k)  # [P, k]
    valid = rows <= T - 1
    rows = rows.clamp_max(T - 1)
    tgt = tl[:, rows]  # [B, P, k, V]
    tgt_g = greedy[:, rows]
    soft = torch.softmax(tgt, -1)
    ce = -(soft * torch.log_softmax(dl, -1)).sum(-1)  # [B, P, k]
    m = valid.unsqueeze(0).expand(B, -1, -1).float()
    dspark = (ce * m).sum() / m.sum()
    hit = (dl.detach().argmax(-1) == tgt_g).float()
    bce = F.binary_cross_entropy_with_logits(conf, hit, reduction="none")
    conf_loss = (bce * m).sum() / m.sum()
    out = dict(main=main, dspark=dspark, conf=conf_loss)
    if with_metrics:
        text = torch.zeros(B, P, k, dtype=torch.long)
        for j in range(k):
            sl = ids[:, 2 + j:]
            text[:, : sl.size(1), j] = sl
        text_valid = (torch.arange(P).unsqueeze(1) + 2 + torch.arange(k)) <= T - 1
        tm = text_valid.unsqueeze(0).expand(B, -1, -1)
        out.update(
            main_acc=float((greedy[:, :-1] == ids[:, 1:]).float().mean()),
            main_tokens=int(ids[:, 1:].numel()),
            slot_hit=[float((hit[..., j] * m[..., j]).sum() / m[..., j].sum()) for j in range(k)],
            slot_text_acc=[float(((dl.argmax(-1)[..., j] == text[..., j]) & tm[..., j]).sum() / tm[..., j].sum())
                           for j in range(k)],
            # acceptance length along a teacher-forced block: leading run of hits
            run=float((torch.cumprod(hit * m, dim=-1).sum(-1)).mean()),
            conf_auc_proxy=float(((torch.sigmoid(conf) > 0.5).float() == hit).float().mean()),
        )
    return out


class Balancer:
    def __init__(self, v41, model):
        self.gates = [m for m in model.modules() if isinstance(m, v41.Gate)]
        self.counts = {id(g): torch.zeros(g.weight.size(0)) for g in self.gates}
        self.enabled = False
        for g in self.gates:
            g.register_forward_hook(self._hook)

    def _hook(self, mod, inputs, out):
        if self.enabled:
            self.counts[id(mod)] += torch.bincount(out[1].reshape(-1), minlength=mod.weight.size(0)).float()

    @torch.no_grad()
    def update(self, rate):
        for g in self.gates:
            c = self.counts[id(g)]
            g.bias += rate * torch.sign(c.mean() - c)
            c.zero_()

    def max_bias(self):
        return [round(float(g.bias.abs().max()), 4) for g in self.gates]


def lr_at(step):
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


@torch.no_grad()
def evaluate(v41, model, data, batch=8):
    model.eval()
    tot = dict(main=0.0, dspark=0.0, conf=0.0, main_acc=0.0, run=0.0)
    slot_hit, slot_text = None, None
    n = 0
    for i in range(0, data.shape[0], batch):
        r = losses(v41, model, data[i: i + batch], with_metrics=True)
        w = data[i: i + batch].shape[0]
        for key in tot:
            tot[key] += float(r[key]) * w
        sh, st = np.array(r["slot_hit"]) * w, np.array(r["slot_text_acc"]) * w
        slot_hit = sh if slot_hit is None else slot_hit + sh
        slot_text = st if slot_text is None else slot_text + st
        n += w
    out = {k: v / n for k, v in tot.items()}
    out["dspark_slot_eq_trunk_greedy"] = (slot_hit / n).tolist()
    out["dspark_slot_eq_text"] = (slot_text / n).tolist()
    out["windows"] = n
    return out


# ----------------------------------------------------------------------------------------------
# export


def export(v41, train_model, args, tok, out_dir: Path, cfg: dict, init_dir: Path, token_map):
    """Weights of `train_model` into a fresh BF16 reference model, written as make_v41 writes one."""
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41 import kernel_cpu as kc

    model = build(v41, replace(args, max_batch_size=1), tok)
    src = dict(train_model.named_parameters())
    mods = dict(model.named_modules())
    promoted = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = mods[name.rpartition(".")[0]]
            if isinstance(owner, v41.ParallelEngramEmbedding):
                if name.endswith(".scale"):
                    continue
                w = src[name].detach().float()
                groups = w.unflatten(-1, (-1, owner.block_size))
                s = kc.fast_round_scale(groups.abs().amax(-1).clamp_min(1e-4), torch.tensor(1.0 / 448.0))
                q = (groups / s.unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
                p.copy_(q.flatten(-2))
                owner.scale.copy_(s.to(torch.float8_e8m0fnu))
                continue
            p.copy_(src[name].detach().to(p.dtype))
            if p.dtype == torch.float32 and isinstance(owner, (v41.Linear, v41.ParallelHead)):
                p.copy_(p.to(torch.bfloat16).float())
                promoted.append(name)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = mv.checkpoint_tensors(model, promoted)
    save_file(ckpt, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    mv.check_checkpoint_roundtrip(out_dir / "model.safetensors", model, promoted)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copy(init_dir / "tokenizer.json", out_dir / "tokenizer.json")
    (out_dir / "engram_token_map.json").write_text(
        json.dumps({"token_map": token_map, "compressed_vocab_size": len(set(token_map))}) + "\n")
    return model, promoted


def load_exported(v41, out_dir: Path, tok, max_batch=1):
    cfg = json.loads((out_dir / "config.json").read_text())
    args = model_args(v41, cfg, max_batch)
    model = build(v41, args, tok)
    sd = load_file(str(out_dir / "model.safetensors"))
    own = model.state_dict()
    with torch.no_grad():
        for name, t in own.items():
            if mv.ALIAS.fullmatch(name):
                continue
            if t.dtype == torch.float32 and t.dtype != sd[name].dtype:
                t.copy_(sd[name].float())
            else:
                assert t.dtype == sd[name].dtype, (name, t.dtype, sd[name].dtype)
                t.copy_(sd[name])
    return model, args


# ----------------------------------------------------------------------------------------------
# check mode: reference greedy + DSpark vs deepinfer


def ref_greedy(v41, model, args, prompt, n, with_dspark=True):
    """Greedy decode as make_v41.run (prefill, then one token a step), DSpark drafts after each step.
    Returns tokens and, per step, the drafted ids (block_size) made after that step."""
    toks, drafts = [], []
    with v41.set_dtype(torch.bfloat16):
        _, logits, main_hidden = model(torch.tensor([prompt]), 0)
        tok = logits[:, -1].argmax(-1) if logits.dim() == 3 else logits.argmax(-1)
        if with_dspark:
            assert model.forward_spec(tok, main_hidden, 0) is None
        S = len(prompt)
        for i in range(n):
            toks.append(int(tok))
            if i == n - 1:
                break
            _, logits, main_hidden = model(tok.view(1, 1), S + i)
            tok = logits.argmax(-1)
            if with_dspark:
                ids, _, conf = model.forward_spec(tok, main_hidden, S + i)
                drafts.append((ids[0, 1:].tolist(), conf[0].float().tolist()))
    return toks, drafts


def draft_acceptance(toks, drafts):
    """drafts[i] is made after toks[i+1] is known, drafting toks[i+2], toks[i+3], ...: the leading
    run of drafts equal to the greedy continuation."""
    acc, prop, per_slot, n = 0, 0, None, 0
    for i, (d, _) in enumerate(drafts):
        fut = toks[i + 2: i + 2 + len(d)]
        if len(fut) < len(d):
            break
        run = 0
        for a, b in zip(d, fut):
            if a != b:
                break
            run += 1
        hits = [int(a == b) for a, b in zip(d, fut)]
        per_slot = hits if per_slot is None else [x + y for x, y in zip(per_slot, hits)]
        acc += run
        prop += len(d)
        n += 1
    return dict(blocks=n, drafts=prop, accepted_leading=acc, mean_accepted_per_block=acc / max(n, 1),
                slot_hits=per_slot)


def deepinfer_tokens(exe, model_dir, prompt, n, extra=()):
    r = subprocess.run([str(exe), "generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", str(n),
                        "--show-tokens", *extra], capture_output=True, text=True, check=True)
    return r.stdout, r.stderr


CHECK_PROMPTS = ["impl<T> Iterator for", "/// Returns the number of", "fn main() {",
                 "pub struct Config {\n    pub name: String,"]


def check(v41, a, tok):
    mv.install_global_patches(v41)
    model, args = load_exported(v41, a.out, tok)
    mv.install_model_patches(v41, model, args)
    res = {"prompts": []}
    bos = 0
    for prompt in CHECK_PROMPTS:
        ids = [bos] + tok.encode(prompt, add_special_tokens=False).ids
        t0 = time.time()
        toks, drafts = ref_greedy(v41, model, args, ids, a.check_tokens)
        ref_s = time.time() - t0
        out, err = deepinfer_tokens(a.deepinfer, a.out, prompt, a.check_tokens)
        m = re.findall(r"\[([0-9, ]+)\]", out + err)
        di = [int(x) for x in m[-1].split(",")] if m else []
        agree = 0
        for x, y in zip(toks, di):
            if x != y:
                break
            agree += 1
        acc = draft_acceptance(toks, drafts)
        entry = dict(prompt=prompt, reference_tokens=toks, deepinfer_tokens=di, leading_agreement=agree,
                     compared=min(len(toks), len(di)), reference_text=tok.decode(toks),
                     reference_dspark=acc, reference_seconds=round(ref_s, 1))
        # deepinfer's own DSpark speculative decoding: statistics, and the same tokens as without drafts
        spec = {}
        for k in (1, 2, 3):
            flags = ["--speculative", "dspark", "--num-draft-tokens", str(k), "--draft-length", "fixed"]
            cmd = f"generate --model DIR --prompt {json.dumps(prompt)} --max-tokens {a.spec_tokens} " + " ".join(flags)
            o_spec, e_spec = deepinfer_tokens(a.deepinfer, a.out, prompt, a.spec_tokens, flags)
            o_plain, e_plain = deepinfer_tokens(a.deepinfer, a.out, prompt, a.spec_tokens)
            st = re.search(r"speculative dspark: (\d+) drafts verified, (\d+) accepted.*?([0-9.]+) tokens per verification",
                           o_spec + e_spec)
            same = re.findall(r"tokens: (\[[0-9, ]*\])", o_spec + e_spec) == re.findall(r"tokens: (\[[0-9, ]*\])",
                                                                                          o_plain + e_plain)
            spec[str(k)] = dict(command=cmd, drafts_verified=int(st.group(1)) if st else None,
                                accepted=int(st.group(2)) if st else None,
                                tokens_per_verification=float(st.group(3)) if st else None,
                                same_tokens_as_without_drafts=same,
                                line=st.group(0) if st else (o_spec + e_spec)[-300:])
        entry["deepinfer_dspark"] = spec
        print(json.dumps({k: entry[k] for k in ("prompt", "leading_agreement", "compared", "reference_dspark")}),
              flush=True)
        print(json.dumps({k: (v["drafts_verified"], v["accepted"], v["tokens_per_verification"],
                              v["same_tokens_as_without_drafts"]) for k, v in spec.items()}), flush=True)
        res["prompts"].append(entry)
    return res


# ----------------------------------------------------------------------------------------------


def main():
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reference", type=Path, required=True)
    ap.add_argument("--init", type=Path, default=Path(tempfile.gettempdir()) / "tiny-v41-init")
    ap.add_argument("--deepinfer", type=Path, default=REPO / "target" / "release" / "deepinfer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--report", type=Path, default=REPORT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--time-limit", type=float, default=0, help="stop training after this many seconds (0: none)")
    ap.add_argument("--check", action="store_true", help="only the checks of an exported checkpoint")
    ap.add_argument("--check-tokens", type=int, default=40)
    ap.add_argument("--spec-tokens", type=int, default=200)
    a = ap.parse_args()
    STEPS = a.steps
    t_start = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    v41, engram, _testing, rev = mv.load_reference(a.reference.resolve(), with_testing=False)
    if not (a.init / "config.json").exists():
        subprocess.run([str(a.deepinfer), "model", "init", "--preset", "tiny-v41", "--seed", str(INIT_SEED),
                        "--out", str(a.init)], check=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.init / "tokenizer.json"))
    if a.check:
        res = check(v41, a, tok)
        rep = json.loads(a.report.read_text()) if a.report.exists() else {}
        rep["check"] = res
        a.report.write_text(json.dumps(rep, indent=1) + "\n")
        return

    token_map, n_map = engram.build_compressed_token_map(TokenizerForEngram(tok))
    init_cfg = json.loads((a.init / "config.json").read_text())
    cfg = make_config(init_cfg, n_map)
    args = model_args(v41, cfg, BATCH)
    print(f"engram compressed vocab: {n_map}; reference revision {rev}", flush=True)

    install_training_patches(v41)
    model = build(v41, args, tok)
    model.float()
    init_weights(v41, model, INIT_SEED)
    model.train()

    import train_tiny_v4 as t4  # corpus: the same crates, files, windows

    t4.SEQ_LEN = SEQ_LEN
    t4_crate_dirs = t4.crate_dirs

    def crate_dirs(crates):
        """The crates in cargo's registry cache when all are there (no cargo run), else `cargo fetch`."""
        roots = sorted(Path.home().glob(".cargo/registry/src/*"))
        found = {}
        for n, v in crates:
            hits = [r / f"{n}-{v}" for r in roots if (r / f"{n}-{v}" / "Cargo.toml").is_file()]
            if hits:
                found[(n, v)] = hits[0]
        return found if len(found) == len(crates) else t4_crate_dirs(crates)

    t4.crate_dirs = crate_dirs  # the corpus sha256 check still applies
    train, held, order, eval_ids, corpus_info = t4.training_data(tok, cfg["bos_token_id"], cfg["eos_token_id"],
                                                                 SEED, STEPS, BATCH, EVAL_WINDOWS)

    params = [p for n, p in model.named_parameters() if p.requires_grad and not n.endswith(".scale")
              and ".gate.bias" not in n and ".indexer." not in n]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=1e-8)
    for n, p in model.named_parameters():
        if n.endswith(".scale") or ".gate.bias" in n or ".indexer." in n:
            p.requires_grad_(False)
    balancer = Balancer(v41, model)
    before = evaluate(v41, model, eval_ids)
    print(f"step 0: held-out {json.dumps(before)}", flush=True)
    log = []
    run = {}
    t_train = time.time()
    steps_done = 0
    for step in range(STEPS):
        model.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids = train[order[step]]
        balancer.enabled = True
        r = losses(v41, model, ids)
        balancer.enabled = False
        loss = r["main"] + DSPARK_WEIGHT * r["dspark"] + CONF_WEIGHT * r["conf"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
        opt.step()
        balancer.update(BIAS_UPDATE)
        for key in ("main", "dspark", "conf"):
            v = float(r[key].detach())
            if not math.isfinite(v):
                raise SystemExit(f"step {step}: {key} loss {v}")
            run[key] = v if key not in run else 0.98 * run[key] + 0.02 * v
        steps_done = step + 1
        el = time.time() - t_train
        if steps_done % 25 == 0:
            print(f"step {steps_done}/{STEPS} main {run['main']:.3f} dspark {run['dspark']:.3f} conf {run['conf']:.3f} "
                  f"|g| {gnorm:.2f} lr {lr_at(step):.2e} {el / steps_done:.2f}s/step", flush=True)
        stop = a.time_limit and el > a.time_limit
        if steps_done % EVAL_EVERY == 0 or steps_done == STEPS or stop:
            ev = evaluate(v41, model, eval_ids)
            log.append({"step": steps_done, "train_main": run["main"], "train_dspark": run["dspark"],
                        "train_conf": run["conf"], "heldout": ev, "seconds": round(time.time() - t_train, 1)})
            print(f"  eval: {json.dumps(ev)} bias {balancer.max_bias()}", flush=True)
        if stop:
            print(f"time limit: stopping after {steps_done} steps", flush=True)
            break
    train_seconds = time.time() - t_train

    export(v41, model, args, tok, a.out, cfg, a.init, token_map)
    # metrics of the exported weights (BF16-rounded) through the training forward
    exported, _ = load_exported(v41, a.out, tok, max_batch=BATCH)
    ev_model = build(v41, args, tok)
    ev_model.float()
    with torch.no_grad():
        sd = exported.state_dict()
        for name, p in ev_model.named_parameters():
            if name.endswith(".scale") and "engram" in name:
                continue
            if "engram.embed.weight" in name:
                owner_scale = sd[name[: -len("weight")] + "scale"].float()
                vals = sd[name].float().unflatten(-1, (-1, 32)) * owner_scale.unsqueeze(-1)
                p.copy_(vals.flatten(-2))
            else:
                p.copy_(sd[name].float())
    del exported
    final_held = evaluate(v41, ev_model, held[: min(held.shape[0], 128)])
    final_train = evaluate(v41, ev_model, train[torch.from_numpy(np.random.default_rng(SEED + 2)
                                                                 .permutation(train.shape[0])[:64])])
    import transformers

    report = {
        "generator": "tools/train/train_tiny_v41.py",
        "reference": f"{mv.PACKAGE} (DeepSeek-V4.1-Flash inference/model.py, revision {rev})",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "transformers_unused": transformers.__version__},
        "settings": {"seed": SEED, "init_seed": INIT_SEED, "seq_len": SEQ_LEN, "batch": BATCH, "steps_planned": STEPS,
                     "steps_done": steps_done, "lr": LR, "min_lr_frac": MIN_LR_FRAC, "warmup": WARMUP,
                     "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "grad_clip": GRAD_CLIP,
                     "dspark_weight": DSPARK_WEIGHT, "confidence_weight": CONF_WEIGHT, "bias_update": BIAS_UPDATE,
                     "time_limit_s": a.time_limit},
        "config": {k: cfg[k] for k in ("dim", "n_layers", "n_mtp_layers", "vocab_size", "dtype", "expert_dtype",
                                       "engram_layer_ids", "engram_compressed_vocab_size", "dspark_block_size",
                                       "dspark_target_layer_ids", "compress_ratios")},
        "parameters": sum(p.numel() for p in params),
        "corpus": {"train_crates": [f"{n} {v}" for n, v in t4.TRAIN_CRATES],
                   "heldout_crates": [f"{n} {v}" for n, v in t4.HELDOUT_CRATES], **corpus_info},
        "init_heldout_subset": before,
        "log": log,
        "train_seconds": round(train_seconds, 1),
        "final_heldout_first128_exported": final_held,
        "final_train_subset64_exported": final_train,
        "checkpoint_bytes": {p.name: p.stat().st_size for p in sorted(a.out.iterdir())},
        "total_seconds": round(time.time() - t_start, 1),
    }
    a.report.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("final_heldout_first128_exported", "final_train_subset64_exported",
                                                 "train_seconds", "total_seconds", "checkpoint_bytes")}, indent=1))


if __name__ == "__main__":
    main()
