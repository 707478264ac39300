#!/usr/bin/env python3
"""Train the tiny DeepSeek-V4 preset (``tiny-v4``, with its MTP block) on Rust source code.

The result, ``assets/tiny-v4-trained/``, is a small model whose next-token head and
multi-token-prediction (MTP) head both predict something, so that speculative
decoding with MTP drafts can be exercised and measured on a model whose drafts are
actually accepted (random weights never agree with themselves).

Pipeline (deterministic: fixed seed, fixed corpus, fixed data order, one thread):

1. **Starting point.** ``deepinfer model init --preset tiny-v4 --seed 1`` (run by this
   script unless ``--init`` points at its output): ``config.json``, ``model.safetensors``
   (FP8/FP4/BF16/F32 under DeepSeek's published tensor names) and ``tokenizer.json``
   (the built-in byte-level BPE, vocabulary 1024, bos 0 / eos 1).
2. **Model.** transformers' ``DeepseekV4ForCausalLM`` built from that config (the same
   implementation ``tools/oracle`` checks deepinfer against), loaded with the init
   weights decoded exactly (``tools/oracle/make_fixtures.py``'s FP8/FP4 decoders and
   name mapping; compared bit for bit with transformers' own dequantising loader). The
   MTP block is composed exactly as ``make_fixtures.mtp_reference`` composes it: a
   1-layer ``DeepseekV4ForCausalLM`` (sliding window, non-hash MoE) holding
   ``mtp.0.*``, whose decoder layer gets
   ``x_t[j] = e_proj(enorm(embed(tok[t+1]))) + h_proj(hnorm(H_t[j]))`` (H_t = hc streams
   after the last main layer), then ``mtp.0.hc_head_*`` -> ``mtp.0.norm`` -> the shared
   ``head``. The lightning indexer's top-k breaks ties as deepinfer does
   (``indexer_tie_rule``), in training and in every check.
3. **Corpus.** The ``.rs`` files of a fixed list of crates (exact versions, fetched with
   ``cargo fetch`` and located with ``cargo metadata``), concatenated in a fixed order;
   one crate is held out for evaluation. Each file is encoded, followed by eos; the
   stream is cut into windows of ``SEQ_LEN - 1`` tokens, each preceded by bos (deepinfer
   prompts are ``bos + text``).
4. **Training.** float32, AdamW, warmup + cosine decay, gradient clipping; loss =
   next-token cross-entropy + ``MTP_WEIGHT`` x MTP cross-entropy (row t predicts token
   t+2), as in DeepSeek-V3. The non-hash routers' ``e_score_correction_bias`` follows
   DeepSeek's auxiliary-loss-free balancing (bias += ``BIAS_UPDATE`` x sign(mean load -
   load) after each step). Hash routing (``tid2eid``) stays the init table; the
   lightning indexers only choose entries (top-k), so their weights get no gradient and
   keep their init values.
5. **Export.** Every matrix in BF16, norms / hc / sinks / ape / router bias in F32,
   ``tid2eid`` in I32, under exactly the published names ``model init`` writes (incl.
   ``mtp.0.*``); ``config.json`` = the init config without ``quantization_config``;
   ``tokenizer.json`` copied.
6. **Checks and metrics** on the exported files, reloaded with transformers'
   ``from_pretrained``: the logits equal those of the trained weights rounded to BF16;
   train / held-out loss (main and MTP); MTP top-1 accuracy against the text and
   against the main model's own greedy prediction one step later; and the MTP draft
   acceptance of greedy generation (draft == the main model's next greedy token) on
   held-out prompts. Printed, and saved as ``train_report.json`` next to this script.

Run (25 to 40 minutes on one core, depending on what else runs; see README.md):

    OMP_NUM_THREADS=1 nice -n 19 /work/venv-train/bin/python tools/train/train_tiny_v4.py
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "oracle"))
import make_fixtures as mf  # noqa: E402  (FP8/FP4 decoders, published <-> transformers names)

import transformers  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl  # noqa: E402

# ----------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------

SEED = 1234
INIT_SEED = 1  # `deepinfer model init --preset tiny-v4 --seed 1`
DEFAULT_OUT = REPO / "assets" / "tiny-v4-trained"
REPORT = Path(__file__).resolve().parent / "train_report.json"

# Training crates (all MIT OR Apache-2.0), in this order; .rs files sorted by path.
TRAIN_CRATES = [
    ("serde", "1.0.229"),
    ("serde_json", "1.0.154"),
    ("itertools", "0.14.0"),
    ("rayon", "1.12.0"),
    ("rayon-core", "1.13.0"),
    ("regex", "1.13.2"),
    ("smallvec", "1.16.6"),
    ("log", "0.4.35"),
    ("once_cell", "1.21.4"),
    ("thiserror", "2.0.21"),
]
HELDOUT_CRATES = [("anyhow", "1.0.105")]  # MIT OR Apache-2.0
# sha256 of the corpus text (train files, then held-out files, each "// path\n" + text):
# guards against a different corpus slipping in.
CORPUS_SHA256 = "fc53f2f3b32bee9c314402c71745c6dd71e3d0f77517461dc19723031620d052"

SEQ_LEN = 128
BATCH = 8
STEPS = 2100
LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP = 100
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
BETAS = (0.9, 0.95)
MTP_WEIGHT = 0.3
BIAS_UPDATE = 1e-3
EVAL_EVERY = 300
EVAL_WINDOWS = 32  # held-out windows for the progress line
N_GEN_PROMPTS = 8  # greedy generations for the acceptance estimate
GEN_PROMPT_LEN = 48
GEN_TOKENS = 64

# ----------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------


def crate_dirs(crates: list[tuple[str, str]]) -> dict[tuple[str, str], Path]:
    """Source directories of exact crate versions, fetched by cargo into its registry cache."""
    with tempfile.TemporaryDirectory() as tmp:
        deps = "\n".join(f'{n.replace("-", "_")}_{v.replace(".", "_")} = {{ package = "{n}", version = "={v}", '
                         f"default-features = false }}" for n, v in crates)
        (Path(tmp) / "Cargo.toml").write_text(
            f'[package]\nname = "corpus"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\n{deps}\n'
        )
        (Path(tmp) / "src").mkdir()
        (Path(tmp) / "src" / "lib.rs").write_text("")
        env = dict(os.environ, CARGO_TARGET_DIR=str(Path(tmp) / "target"))
        subprocess.run(["cargo", "fetch", "--quiet"], cwd=tmp, env=env, check=True)
        meta = json.loads(
            subprocess.run(["cargo", "metadata", "--format-version", "1", "--offline"], cwd=tmp, env=env,
                           check=True, capture_output=True, text=True).stdout
        )
    found = {}
    for pkg in meta["packages"]:
        key = (pkg["name"], pkg["version"])
        if key in crates:
            found[key] = Path(pkg["manifest_path"]).parent
    missing = [c for c in crates if c not in found]
    if missing:
        raise SystemExit(f"cargo did not provide {missing}")
    return found


def training_data(tok, bos: int, eos: int, seed: int, steps: int, batch: int, eval_windows: int):
    """The corpus as windows, the window order of every step (a fixed permutation per
    epoch, from `seed`) and `eval_windows` held-out windows for the progress line.

    Returns (train windows, held-out windows, order [steps x batch], eval windows, corpus facts)."""
    train_docs, held_docs, corpus_info = read_corpus()
    train, n_train_tok = windows(tok, train_docs, bos, eos)
    held, n_held_tok = windows(tok, held_docs, bos, eos)
    corpus_info.update(train_tokens=n_train_tok, heldout_tokens=n_held_tok, train_windows=train.shape[0],
                       heldout_windows=held.shape[0])
    print(f"corpus: {json.dumps(corpus_info)}", flush=True)
    rng = np.random.default_rng(seed)
    order = []
    while len(order) < steps * batch:
        order.extend(rng.permutation(train.shape[0]).tolist())
    order = torch.tensor(order[: steps * batch]).view(steps, batch)
    eval_ids = held[torch.from_numpy(np.random.default_rng(seed + 1).permutation(held.shape[0])[:eval_windows])]
    return train, held, order, eval_ids, corpus_info


def read_corpus() -> tuple[list[tuple[str, str]], list[tuple[str, str]], dict]:
    dirs = crate_dirs(TRAIN_CRATES + HELDOUT_CRATES)
    h = hashlib.sha256()

    def files(crates):
        out = []
        for key in crates:
            root = dirs[key]
            for p in sorted(root.rglob("*.rs"), key=lambda p: p.relative_to(root).as_posix()):
                rel = f"{key[0]}-{key[1]}/{p.relative_to(root).as_posix()}"
                text = p.read_text(encoding="utf-8")
                h.update(f"// {rel}\n".encode())
                h.update(text.encode())
                out.append((rel, text))
        return out

    train, held = files(TRAIN_CRATES), files(HELDOUT_CRATES)
    digest = h.hexdigest()
    if CORPUS_SHA256 is not None and digest != CORPUS_SHA256:
        raise SystemExit(f"corpus sha256 {digest} != expected {CORPUS_SHA256}")
    info = {
        "train_files": len(train),
        "train_bytes": sum(len(t.encode()) for _, t in train),
        "heldout_files": len(held),
        "heldout_bytes": sum(len(t.encode()) for _, t in held),
        "sha256": digest,
    }
    return train, held, info


def windows(tokenizer, docs, bos: int, eos: int) -> torch.Tensor:
    """[N, SEQ_LEN] int64: bos + SEQ_LEN-1 tokens of the stream (each file's tokens, then eos)."""
    stream = []
    for _, text in docs:
        stream.extend(tokenizer.encode(text, add_special_tokens=False).ids)
        stream.append(eos)
    body = SEQ_LEN - 1
    n = len(stream) // body
    arr = np.asarray(stream[: n * body], dtype=np.int64).reshape(n, body)
    return torch.from_numpy(np.concatenate([np.full((n, 1), bos, dtype=np.int64), arr], axis=1)), len(stream)


# ----------------------------------------------------------------------------
# Checkpoint <-> transformers
# ----------------------------------------------------------------------------

_LEAF_INV = {v: k for k, v in mf._LEAF.items()}
_TOP_INV = {v: k for k, v in mf._TOP.items()}
MTP_OWN = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight")


def decode_checkpoint(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Published name -> exact f32 (or i32) values; published name -> stored dtype."""
    raw = load_file(str(path))
    values, dtypes = {}, {}
    for name, t in raw.items():
        if name.endswith(".scale"):
            continue
        scale = raw.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is not None and t.dtype == torch.float8_e4m3fn:
            values[name], dtypes[name] = mf.dequant_fp8(t, scale, (128, 128)), "FP8"
        elif scale is not None and t.dtype == torch.int8:
            values[name], dtypes[name] = mf.dequant_fp4(t, scale), "FP4"
        elif t.dtype == torch.bfloat16:
            values[name], dtypes[name] = mf.decode_bf16(t), "BF16"
        elif t.dtype == torch.float32:
            values[name], dtypes[name] = t.numpy().copy(), "F32"
        elif t.dtype == torch.int32:
            values[name], dtypes[name] = t.numpy().copy(), "I32"
        else:
            raise SystemExit(f"{name}: unexpected {t.dtype}")
    return values, dtypes


def mtp_config(cfg: dict) -> dict:
    c = copy.deepcopy(cfg)
    c.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"], num_nextn_predict_layers=0)
    return c


def hf_config(cfg: dict) -> DeepseekV4Config:
    # deep copy: DeepseekV4Config writes into the nested rope_scaling dict it is given
    c = copy.deepcopy({k: v for k, v in cfg.items() if k != "quantization_config"})
    conf = DeepseekV4Config(**c)
    conf._attn_implementation = "eager"
    conf._experts_implementation = "eager"
    return conf


def mtp_published_values(values: dict) -> dict:
    """The MTP block's values under the names a 1-layer model's loader expects (as make_fixtures)."""
    vals = {}
    for name, v in values.items():
        if name.startswith("mtp.0."):
            sub = name[len("mtp.0."):]
            if sub.startswith(("norm.", "hc_head_")):
                vals[sub] = v
            elif sub not in MTP_OWN:
                vals["mtp.0." + sub] = v
    vals["embed.weight"] = values["embed.weight"]
    vals["head.weight"] = values["head.weight"]
    return vals


def to_state(expected: dict) -> dict:
    out = {}
    for k, v in expected.items():
        t = torch.from_numpy(np.ascontiguousarray(v).copy())
        out[k] = t.long() if v.dtype == np.int32 else t
    return out


class Mtp(torch.nn.Module):
    """The MTP block, composed from transformers' modules exactly as make_fixtures.mtp_reference."""

    def __init__(self, cfg: dict):
        super().__init__()
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.block = DeepseekV4ForCausalLM(hf_config(mtp_config(cfg)))  # its embed / lm_head are unused
        self.enorm, self.hnorm = mdl.DeepseekV4RMSNorm(D, eps), mdl.DeepseekV4RMSNorm(D, eps)
        self.e_proj = torch.nn.Linear(D, D, bias=False)
        self.h_proj = torch.nn.Linear(D, D, bias=False)
        self._x = None
        self.block.model.layers[0].register_forward_pre_hook(self._substitute, with_kwargs=True)

    def _substitute(self, mod, args, kwargs):
        return (self._x,) + tuple(args[1:]), kwargs

    def forward(self, embed_next: torch.Tensor, last_hc: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        """embed_next [B, T, D] = embed(tok[t+1]); last_hc [B, T, hc, D] = H_t -> logits [B, T, V]."""
        x = self.e_proj(self.enorm(embed_next))[:, :, None, :] + self.h_proj(self.hnorm(last_hc))
        self._x = x.contiguous()
        dummy = torch.zeros_like(embed_next)
        hidden = self.block.model(inputs_embeds=dummy, use_cache=False).last_hidden_state
        self._x = None
        return head(hidden)

    def trainable(self):
        skip = {id(self.block.model.embed_tokens.weight), id(self.block.lm_head.weight)}
        return [p for p in self.parameters() if id(p) not in skip]


def _rank_scores(mod, inputs, scores):
    T = scores.shape[-1]
    if T == 0:
        return scores
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(T).expand_as(order).contiguous())
    return (T - ranks).to(scores.dtype)


def indexer_tie_rule(model):
    """Make the lightning indexer's top-k well defined: higher score first, equal scores
    to the older entry (deepinfer's rule; tools/oracle/make_sweep.py ``IndexerTies``).

    With 2 indexer heads many scores are exactly 0 (both ReLUs clip) and ``torch.topk``
    orders ties arbitrarily (by the number of entries), which makes transformers' output
    at a position depend on what follows it. The scorer's output only feeds the top-k, so
    replacing it by each entry's rank under that rule selects exactly the rule's entries."""
    for mod in model.modules():
        if isinstance(mod, mdl.DeepseekV4IndexerScorer):
            mod.register_forward_hook(_rank_scores)
    return model


def build_models(cfg: dict, values: dict) -> tuple[DeepseekV4ForCausalLM, Mtp]:
    L, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float()
    model.load_state_dict(to_state(mf.expected_hf_state(values, L, E)), strict=True)
    indexer_tie_rule(model)
    mtp = Mtp(cfg).float()
    mtp.block.load_state_dict(
        to_state(mf.expected_hf_state(mtp_published_values(values), 1, E, layer_prefix="mtp.0.")), strict=True
    )
    for name in MTP_OWN:
        getattr(mtp, name.split(".")[0]).weight.data = torch.from_numpy(values["mtp.0." + name].copy())
    return model, mtp


def export_values(model: DeepseekV4ForCausalLM, mtp: Mtp, cfg: dict) -> dict[str, torch.Tensor]:
    """Published name -> f32 / i64 tensor of the current weights."""
    out = {}
    E = cfg["n_routed_experts"]
    inter = cfg["moe_intermediate_size"]

    def layer(sd: dict, i: int, prefix: str):
        for src, dst in _LEAF_INV.items():
            k = f"model.layers.{i}.{src}"
            if k in sd:
                out[prefix + dst] = sd[k]
        gu, down = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"], sd[f"model.layers.{i}.mlp.experts.down_proj"]
        for e in range(E):
            out[f"{prefix}ffn.experts.{e}.w1.weight"] = gu[e, :inter]
            out[f"{prefix}ffn.experts.{e}.w3.weight"] = gu[e, inter:]
            out[f"{prefix}ffn.experts.{e}.w2.weight"] = down[e]

    sd = {k: v.detach() for k, v in model.state_dict().items()}
    for src, dst in _TOP_INV.items():
        out[dst] = sd[src]
    for i in range(cfg["num_hidden_layers"]):
        layer(sd, i, f"layers.{i}.")
    msd = {k: v.detach() for k, v in mtp.block.state_dict().items()}
    layer(msd, 0, "mtp.0.")
    out["mtp.0.norm.weight"] = msd["model.norm.weight"]
    out["mtp.0.hc_head_fn"] = msd["model.hc_head.hc_fn"]
    out["mtp.0.hc_head_base"] = msd["model.hc_head.hc_base"]
    out["mtp.0.hc_head_scale"] = msd["model.hc_head.hc_scale"]
    for name in MTP_OWN:
        out["mtp.0." + name] = getattr(mtp, name.split(".")[0]).weight.detach()
    return out


def write_checkpoint(out_dir: Path, init_dir: Path, cfg: dict, weights: dict, init_dtypes: dict):
    if set(weights) != set(init_dtypes):
        raise SystemExit(f"exported names differ from init: {sorted(set(weights) ^ set(init_dtypes))}")
    tensors = {}
    for name, t in weights.items():
        kind = init_dtypes[name]
        if kind == "I32":
            tensors[name] = t.to(torch.int32).contiguous()
        elif kind == "F32":
            tensors[name] = t.float().contiguous()
        else:  # FP8 / FP4 / BF16 matrices -> BF16
            tensors[name] = t.to(torch.bfloat16).contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    c = copy.deepcopy({k: v for k, v in cfg.items() if k != "quantization_config"})
    c["torch_dtype"] = "bfloat16"
    with open(out_dir / "config.json", "w") as fh:
        json.dump(c, fh, indent=2)
        fh.write("\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)
    shutil.copyfile(init_dir / "tokenizer.json", out_dir / "tokenizer.json")


def load_exported(out_dir: Path, cfg: dict) -> tuple[DeepseekV4ForCausalLM, Mtp]:
    """Reload the exported checkpoint with transformers' own loader (main) and the oracle's MTP composition."""
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        bad = [k for k in info.get(key, []) if not str(k).startswith("mtp.")]
        if bad:
            raise SystemExit(f"reload reported {key}: {bad}")
    indexer_tie_rule(model.float().eval())
    values, _ = decode_checkpoint(out_dir / "model.safetensors")
    ref = mf.expected_hf_state(values, cfg["num_hidden_layers"], cfg["n_routed_experts"])
    mf.check_model_against(model, ref, "exported")
    # MTP block through from_pretrained, mtp.0.* renamed to layers.0.* (make_fixtures.mtp_reference)
    raw = load_file(str(out_dir / "model.safetensors"))
    tensors = {}
    for name, t in raw.items():
        if name.startswith("mtp.0."):
            sub = name[len("mtp.0."):]
            if sub in MTP_OWN:
                continue
            tensors[sub if sub.startswith(("norm.", "hc_head_")) else "layers.0." + sub] = t
    tensors["embed.weight"], tensors["head.weight"] = raw["embed.weight"], raw["head.weight"]
    mtp = Mtp(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        c = mtp_config(json.loads((out_dir / "config.json").read_text()))
        (Path(tmp) / "config.json").write_text(json.dumps(c))
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        block, info = DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            output_loading_info=True,
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")}
    if bad:
        raise SystemExit(f"MTP block reload not clean: {bad}")
    mtp.block.load_state_dict(block.float().state_dict(), strict=True)
    for name in MTP_OWN:
        getattr(mtp, name.split(".")[0]).weight.data = torch.from_numpy(values["mtp.0." + name].copy())
    mtp.eval()
    return model, mtp


# ----------------------------------------------------------------------------
# Forward, losses, metrics
# ----------------------------------------------------------------------------


class LastHc:
    """Captures the hc streams after the main model's last decoder layer (before hc_head)."""

    def __init__(self, model):
        self.h = None
        model.model.layers[-1].register_forward_hook(lambda m, a, o: setattr(self, "h", o))


def forward_both(model, mtp, hc: LastHc, ids: torch.Tensor):
    """-> main logits [B, S, V], MTP logits [B, S-1, V] (row t predicts ids[t+2])."""
    logits = model(ids, use_cache=False).logits
    last = hc.h
    hc.h = None
    emb_next = model.model.embed_tokens(ids[:, 1:])
    mtp_logits = mtp(emb_next, last[:, :-1], model.lm_head)
    return logits, mtp_logits


def losses(logits, mtp_logits, ids):
    V = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    m = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), ids[:, 2:].reshape(-1))
    return main, m


@torch.no_grad()
def evaluate(model, mtp, hc, data: torch.Tensor, batch: int = 16) -> dict:
    model.eval(), mtp.eval()
    tot = {"main_nll": 0.0, "mtp_nll": 0.0, "main_acc": 0, "mtp_acc": 0, "mtp_eq_main_next": 0,
           "mtp_acc_when_main_right": 0, "main_right": 0}
    n = 0
    for i in range(0, data.shape[0], batch):
        ids = data[i: i + batch]
        logits, mtp_logits = forward_both(model, mtp, hc, ids)
        V = logits.shape[-1]
        tgt1, tgt2 = ids[:, 1:], ids[:, 2:]
        tot["main_nll"] += float(F.cross_entropy(logits[:, :-1].reshape(-1, V), tgt1.reshape(-1), reduction="sum"))
        tot["mtp_nll"] += float(F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), tgt2.reshape(-1), reduction="sum"))
        pm = logits.argmax(-1)  # pm[t] = main's guess for ids[t+1]
        pd = mtp_logits.argmax(-1)[:, :-1]  # pd[t] = MTP's guess for ids[t+2], t = 0..S-3
        tot["main_acc"] += int((pm[:, :-1] == tgt1).sum())
        tot["mtp_acc"] += int((pd == tgt2).sum())
        tot["mtp_eq_main_next"] += int((pd == pm[:, 1:-1]).sum())
        right = pm[:, :-2] == tgt1[:, :-1]  # main predicted ids[t+1] (the token MTP is fed) correctly
        tot["main_right"] += int(right.sum())
        tot["mtp_acc_when_main_right"] += int(((pd == pm[:, 1:-1]) & right).sum())
        n += tgt2.numel()
    n1 = n + data.shape[0]  # main has one more target per window
    return {
        "main_loss": tot["main_nll"] / n1,
        "mtp_loss": tot["mtp_nll"] / n,
        "main_top1": tot["main_acc"] / n1,
        "mtp_top1_vs_text": tot["mtp_acc"] / n,
        "mtp_top1_vs_main_next_greedy": tot["mtp_eq_main_next"] / n,
        "mtp_top1_vs_main_next_greedy_when_main_right": tot["mtp_acc_when_main_right"] / max(1, tot["main_right"]),
        "tokens": n1,
    }


@torch.no_grad()
def greedy_acceptance(model, mtp, hc, prompts: list[torch.Tensor], n_new: int) -> dict:
    """Greedy generation (cache-less forwards); at every step, does MTP's draft for the token
    after next equal the main model's greedy choice there? (the acceptance of a 1-token draft)."""
    model.eval(), mtp.eval()
    accepted = total = 0
    per_prompt = []
    for p in prompts:
        seq = p.clone()
        for _ in range(n_new + 1):
            logits = model(seq[None], use_cache=False).logits[0, -1]
            hc.h = None
            seq = torch.cat([seq, logits.argmax().view(1)])
        # one forward over the whole sequence: H_t for every t; drafts for positions >= len(p)
        logits = model(seq[None], use_cache=False).logits[0]
        last = hc.h
        hc.h = None
        greedy_consistent = bool((logits[len(p) - 1: -1].argmax(-1) == seq[len(p):]).all())
        emb_next = model.model.embed_tokens(seq[None, 1:])
        drafts = mtp(emb_next, last[:, :-1], model.lm_head)[0].argmax(-1)  # drafts[t] guesses seq[t+2]
        # draft made right after token t+1 = seq[len(p)-1+k] was generated
        t = torch.arange(len(p) - 2, len(seq) - 2)
        ok = drafts[t] == seq[t + 2]
        accepted += int(ok.sum())
        total += len(t)
        per_prompt.append({"accepted": int(ok.sum()), "drafts": len(t), "greedy_consistent": greedy_consistent})
    return {"greedy_draft_acceptance": accepted / total, "drafts": total, "per_prompt": per_prompt}


# ----------------------------------------------------------------------------
# Router balancing (DeepSeek's auxiliary-loss-free bias update)
# ----------------------------------------------------------------------------


class Balancer:
    def __init__(self, modules):
        self.routers = [m for mod in modules for m in mod.modules() if isinstance(m, mdl.DeepseekV4TopKRouter)]
        self.counts = {id(r): torch.zeros(r.num_experts) for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._hook)
        self.enabled = False

    def _hook(self, mod, inputs, out):
        if self.enabled:
            idx = out[2].reshape(-1)
            self.counts[id(mod)] += torch.bincount(idx, minlength=mod.num_experts).float()

    @torch.no_grad()
    def update(self, rate: float):
        for r in self.routers:
            c = self.counts[id(r)]
            r.e_score_correction_bias += rate * torch.sign(c.mean() - c)
            c.zero_()

    def imbalance(self) -> list[float]:
        return [round(float(r.e_score_correction_bias.abs().max()), 4) for r in self.routers]


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------


def lr_at(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    p = (step - WARMUP) / max(1, STEPS - WARMUP)
    return LR * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * p)))


def main():
    global STEPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--init", type=Path, default=Path(tempfile.gettempdir()) / "tiny-v4-init",
                    help="output of `deepinfer model init --preset tiny-v4 --seed 1` (made if missing)")
    ap.add_argument("--deepinfer", type=Path, default=REPO / "target" / "release" / "deepinfer")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=STEPS, help="only for quick trials")
    ap.add_argument("--report", type=Path, default=REPORT)
    args = ap.parse_args()
    STEPS = args.steps
    t_start = time.time()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    if not (args.init / "model.safetensors").exists():
        subprocess.run([str(args.deepinfer), "model", "init", "--preset", "tiny-v4", "--seed", str(INIT_SEED),
                        "--out", str(args.init)], check=True)
    cfg = json.loads((args.init / "config.json").read_text())
    values, init_dtypes = decode_checkpoint(args.init / "model.safetensors")

    # the decoded init weights == transformers' own dequantising load of the init checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        c = dict(cfg)
        c["quantization_config"] = dict(cfg["quantization_config"], expert_dtype="fp4", dequantize=True)
        (Path(tmp) / "config.json").write_text(json.dumps(c))
        os.symlink(args.init / "model.safetensors", Path(tmp) / "model.safetensors")
        ref = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                    experts_implementation="eager").float()
    n_checked = mf.check_model_against(ref, mf.expected_hf_state(values, cfg["num_hidden_layers"],
                                                                cfg["n_routed_experts"]), "init")
    del ref
    print(f"init: {n_checked} tensors equal transformers' dequantising load", flush=True)

    model, mtp = build_models(cfg, values)
    hc = LastHc(model)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.init / "tokenizer.json"))
    bos, eos = cfg["bos_token_id"], cfg["eos_token_id"]
    train, held, order, eval_ids, corpus_info = training_data(tok, bos, eos, SEED, STEPS, BATCH, EVAL_WINDOWS)

    params = [p for p in model.parameters()] + mtp.trainable()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=1e-8)
    balancer = Balancer([model, mtp])
    before = evaluate(model, mtp, hc, eval_ids)
    print(f"step 0: held-out main {before['main_loss']:.3f} mtp {before['mtp_loss']:.3f}", flush=True)

    log = []
    run_main = run_mtp = None
    t_train = time.time()
    for step in range(STEPS):
        model.train(), mtp.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids = train[order[step]]
        balancer.enabled = True
        logits, mtp_logits = forward_both(model, mtp, hc, ids)
        balancer.enabled = False
        l_main, l_mtp = losses(logits, mtp_logits, ids)
        loss = l_main + MTP_WEIGHT * l_mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
        opt.step()
        balancer.update(BIAS_UPDATE)
        lm, lt = l_main.item(), l_mtp.item()
        run_main = lm if run_main is None else 0.98 * run_main + 0.02 * lm
        run_mtp = lt if run_mtp is None else 0.98 * run_mtp + 0.02 * lt
        if not math.isfinite(lm + lt):
            raise SystemExit(f"step {step}: loss {lm} + {lt}")
        if (step + 1) % 50 == 0:
            el = time.time() - t_train
            print(f"step {step + 1}/{STEPS} train main {run_main:.3f} mtp {run_mtp:.3f} |g| {gnorm:.2f} "
                  f"lr {lr_at(step):.2e} {el / (step + 1):.2f}s/step", flush=True)
        if (step + 1) % EVAL_EVERY == 0 or step + 1 == STEPS:
            ev = evaluate(model, mtp, hc, eval_ids)
            log.append({"step": step + 1, "train_main": run_main, "train_mtp": run_mtp,
                        "heldout_main": ev["main_loss"], "heldout_mtp": ev["mtp_loss"],
                        "seconds": round(time.time() - t_train, 1)})
            print(f"  eval: held-out main {ev['main_loss']:.3f} mtp {ev['mtp_loss']:.3f} "
                  f"mtp==main-next {ev['mtp_top1_vs_main_next_greedy']:.3f} bias {balancer.imbalance()}", flush=True)
    train_seconds = time.time() - t_train

    # ---- export, reload, check ----
    weights = export_values(model, mtp, cfg)
    write_checkpoint(args.out, args.init, cfg, weights, init_dtypes)
    model_r, mtp_r = load_exported(args.out, cfg)
    hc_r = LastHc(model_r)
    # The reloaded model must equal the trained one with its weights replaced by what the
    # file holds (BF16-rounded matrices), written back through the export mapping: this
    # checks the published names (and transformers' loading of them) end to end.
    f32_subset = log[-1]
    exported = load_file(str(args.out / "model.safetensors"))
    views = export_values(model, mtp, cfg)  # views of the live parameters / buffers
    with torch.no_grad():
        for name, t in exported.items():
            views[name].copy_(t.to(views[name].dtype))
    probe = held[:4]
    with torch.no_grad():
        lg_a, mlg_a = forward_both(model.eval(), mtp.eval(), hc, probe)
        lg_b, mlg_b = forward_both(model_r, mtp_r, hc_r, probe)
    reload_diff = max(float((lg_a - lg_b).abs().max()), float((mlg_a - mlg_b).abs().max()))
    print(f"reloaded checkpoint vs trained weights rounded to BF16: max |d logit| {reload_diff:.2e}", flush=True)
    if reload_diff > 1e-4:
        raise SystemExit("exported checkpoint does not reproduce the trained model")

    heldout = evaluate(model_r, mtp_r, hc_r, held)
    train_eval = evaluate(model_r, mtp_r, hc_r, train[torch.from_numpy(np.random.default_rng(SEED + 2)
                                                                         .permutation(train.shape[0])[:256])])
    gen_rng = np.random.default_rng(SEED + 3)
    prompts = []
    for w in gen_rng.permutation(held.shape[0])[:N_GEN_PROMPTS]:
        prompts.append(held[int(w), :GEN_PROMPT_LEN])
    acc = greedy_acceptance(model_r, mtp_r, hc_r, prompts, GEN_TOKENS)
    report = {
        "generator": "tools/train/train_tiny_v4.py",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__},
        "settings": {"seed": SEED, "init_seed": INIT_SEED, "seq_len": SEQ_LEN, "batch": BATCH, "steps": STEPS,
                     "lr": LR, "min_lr_frac": MIN_LR_FRAC, "warmup": WARMUP, "weight_decay": WEIGHT_DECAY,
                     "betas": list(BETAS), "grad_clip": GRAD_CLIP, "mtp_weight": MTP_WEIGHT,
                     "bias_update": BIAS_UPDATE},
        "corpus": {"train_crates": [f"{n} {v}" for n, v in TRAIN_CRATES],
                   "heldout_crates": [f"{n} {v}" for n, v in HELDOUT_CRATES], **corpus_info},
        "init_heldout_subset": before,
        "log": log,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "reload_max_abs_logit_diff": reload_diff,
        "heldout_subset_f32_weights": {k: f32_subset[k] for k in ("heldout_main", "heldout_mtp")},
        "heldout_subset_exported": {k: v for k, v in evaluate(model_r, mtp_r, hc_r, eval_ids).items()
                                    if k in ("main_loss", "mtp_loss")},
        "final_train_subset": train_eval,
        "final_heldout": heldout,
        "greedy_acceptance": acc,
        "checkpoint_bytes": {p.name: p.stat().st_size for p in sorted(args.out.iterdir())},
    }
    args.report.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("final_train_subset", "final_heldout", "greedy_acceptance",
                                                 "train_seconds", "total_seconds", "checkpoint_bytes")}, indent=1))


if __name__ == "__main__":
    main()
