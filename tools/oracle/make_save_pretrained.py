#!/usr/bin/env python3
"""A checkpoint as transformers writes it, and what transformers computes on it.

What a user holds after fine-tuning or merging with transformers 5.23.0: a
``DeepseekV4ForCausalLM`` saved by ``save_pretrained`` (``model.`` prefix,
``embed_tokens``, ``hc_head.hc_*``, ``attn.norm`` for the attention KV norm, sharded into
``model-0000N-of-0000M.safetensors`` with ``model.safetensors.index.json``, BF16, a
config announcing one MTP layer that the checkpoint does not carry). The same weights are
also written as a raw ``state_dict`` dump (transformers' module names, routed experts
fused into ``gate_up_proj`` / ``down_proj``) in ``state-dict/``.

The config is unlike the presets where the CSA indexer is concerned (4 heads, 2 indexer
heads of 16 dims, rope dim 8, top-8 of up to 75 entries). Weights are drawn from our own
seeded generator (transformers' 0.02-std init gives logits too flat for greedy decoding
to be well defined), set into the model, then saved by transformers itself.

Outputs, ``tests/fixtures/oracle/save-pretrained/``: the saved checkpoint and
``reference.safetensors`` with, per prompt i (10, 97 and 300 tokens): ``p{i}.input_ids``,
``p{i}.prefill_rows`` / ``p{i}.prefill_logits`` (a subset of positions),
``p{i}.decode_tokens`` / ``p{i}.decode_logits`` (16 greedy steps on the cache), computed
by ``from_pretrained`` of the saved directory in float32 with the indexer's ties broken
by index (see ``make_sweep.IndexerTies``).

Run: tools/oracle/.venv/bin/python tools/oracle/make_save_pretrained.py
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402
import make_sweep as ms  # noqa: E402

import transformers  # noqa: E402
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "fixtures" / "oracle" / "save-pretrained"
STATE_DICT_OUT = REPO / "tests" / "fixtures" / "oracle" / "state-dict"
SEED = 1205
# 1,432 indexer choices over three prompts: the preset's 1e-4 margin is too strict to find
# a seed; 1e-5 is still ten times the f32 error of deepinfer's intermediate values (~1e-6).
INDEXER_GAP_MIN = 1e-5
PROMPTS = (10, 97, 300)

CONFIG = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
    qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=32, index_n_heads=2, index_head_dim=16,
    index_topk=8, sliding_window=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
    layer_types=[ms.SW, ms.CSA, ms.HCA, ms.CSA], compress_rates={ms.CSA: 4, ms.HCA: 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], routed_scaling_factor=1.5,
    rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096,
)


def init_weights(model, rng: np.random.Generator):
    """Seeded values for every parameter and persistent buffer, by role."""
    c = model.config
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            shape = tuple(t.shape)
            leaf = name.rsplit(".", 1)[-1]
            if "inv_freq" in name:
                continue
            if leaf == "tid2eid":
                ids = np.stack([rng.choice(c.n_routed_experts, c.num_experts_per_tok, replace=False)
                                for _ in range(shape[0])])
                t.copy_(torch.from_numpy(ids))
                continue
            if name.endswith("norm.weight"):
                v = (1.0 + 0.1 * rng.standard_normal(shape)).clip(0.5, 1.5)
            elif leaf in ("base", "hc_base"):
                v = 0.5 * rng.standard_normal(shape)
            elif leaf in ("scale", "hc_scale"):
                v = rng.uniform(0.5, 1.5, shape)
            elif leaf in ("sinks",):
                v = rng.standard_normal(shape)
            elif leaf in ("position_bias", "e_score_correction_bias"):
                v = 0.5 * rng.standard_normal(shape)
            elif leaf == "gate_up_proj":
                v = 0.5 * rng.standard_normal(shape)
            elif leaf == "down_proj" and len(shape) == 3:
                v = 0.025 * rng.standard_normal(shape)
            elif name.endswith("embed_tokens.weight"):
                v = rng.standard_normal(shape)
            elif name == "lm_head.weight":
                v = 0.3 * rng.standard_normal(shape)
            elif name.endswith("mlp.gate.weight"):
                v = 2.0 / math.sqrt(shape[1]) * rng.standard_normal(shape)
            elif len(shape) == 2:
                v = rng.standard_normal(shape) / math.sqrt(shape[1])
            else:
                raise SystemExit(f"no initialiser for {name} {shape}")
            t.copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)).to(t.dtype))


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=SEED, help="only for searching a non-degenerate seed")
    seed = ap.parse_args().seed
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**CONFIG))
    init_weights(model, rng)
    model = model.to(torch.bfloat16)

    for d in (OUT, STATE_DICT_OUT):
        shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(OUT, max_shard_size="150KB")
    shards = sorted(p.name for p in OUT.glob("model-*.safetensors"))
    assert len(shards) > 1 and (OUT / "model.safetensors.index.json").exists(), shards
    # The raw state_dict: transformers' module names, fused experts.
    STATE_DICT_OUT.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(STATE_DICT_OUT / "model.safetensors"))
    shutil.copy(OUT / "config.json", STATE_DICT_OUT / "config.json")

    # The reference: the saved directory as a user loads it.
    ref_model, info = DeepseekV4ForCausalLM.from_pretrained(
        OUT, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if v and k != "missing_keys"}
    assert not bad and not info.get("missing_keys"), info
    ref_model.eval()
    ties = ms.IndexerTies(ref_model)
    monitor = mf.Monitor().attach(ref_model)
    prng = np.random.default_rng(seed + 1)
    refs, argmax_gap = {}, math.inf
    with torch.no_grad():
        for i, S in enumerate(PROMPTS):
            ids = torch.from_numpy(prng.integers(2, CONFIG["vocab_size"], size=S).astype(np.int64))
            out = ref_model(ids[None], use_cache=True)
            prefill, cache = out.logits[0].clone(), out.past_key_values
            toks, dl = [], []
            nxt = int(prefill[-1].argmax())
            for _ in range(ms.N_DECODE):
                toks.append(nxt)
                step = ref_model(torch.tensor([[nxt]]), past_key_values=cache, use_cache=True).logits[0, -1].clone()
                dl.append(step)
                top = step.topk(2).values
                argmax_gap = min(argmax_gap, float(top[0] - top[1]))
                nxt = int(step.argmax())
            # transformers' own greedy generation agrees with the loop above (it stops
            # at EOS, which the loop feeds on).
            gen = ref_model.generate(ids[None], max_new_tokens=ms.N_DECODE, do_sample=False)[0, S:].tolist()
            assert gen == toks[: len(gen)] and (len(gen) == len(toks) or gen[-1] == CONFIG.get("eos_token_id", 1)), (
                gen, toks)
            rows = ms.prefill_rows(S)
            refs[f"p{i}.input_ids"] = ids
            refs[f"p{i}.prefill_rows"] = torch.tensor(rows, dtype=torch.int64)
            refs[f"p{i}.prefill_logits"] = prefill[rows].contiguous()
            refs[f"p{i}.decode_tokens"] = torch.tensor(toks, dtype=torch.int64)
            refs[f"p{i}.decode_logits"] = torch.stack(dl).contiguous()
    monitor.detach()
    ties.detach()
    checks = {
        "argmax_min_gap": argmax_gap,
        "router_min_gap": monitor.router_gap,
        "indexer_boundary_min_rel_gap": ties.boundary_rel_gap,
        "indexer_decisions_with_choice": ties.decisions,
        "indexer_exact_ties_at_boundary": ties.exact_ties,
        "indexer_min_rel_qk": ties.min_rel_qk,
    }
    print(json.dumps(checks))
    if (argmax_gap < mf.MIN_ARGMAX_GAP or monitor.router_gap < mf.MIN_ROUTER_GAP
            or ties.boundary_rel_gap < INDEXER_GAP_MIN or ties.min_rel_qk < ms.MIN_REL_QK):
        raise SystemExit("degenerate random model: change SEED")
    save_file(refs, str(OUT / "reference.safetensors"), metadata={"format": "pt"})
    with open(OUT / "reference.json", "w") as fh:
        json.dump({"generator": "tools/oracle/make_save_pretrained.py", "transformers": transformers.__version__,
                   "torch": torch.__version__, "seed": seed, "prompts": list(PROMPTS), "shards": shards,
                   "checks": checks}, fh, indent=1)
        fh.write("\n")
    print(f"wrote {OUT} ({len(shards)} shards) and {STATE_DICT_OUT}")


if __name__ == "__main__":
    main()
