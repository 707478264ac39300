#!/usr/bin/env python3
"""Oracle fixtures for DeepSeek-V4.1-Flash's image input, computed by DeepSeek's own reference (MIT).

The reference is the package ``make_v41.py`` imports (``inference/model.py``, ``engram.py``,
``kernel_cpu.py``, ``testing.py``) plus the real ``inference/vision.py`` and
``inference/image_processor.py`` of the HF repository ``deepseek-ai/DeepSeek-V4.1-Flash``
(revision dba1be0a40aa45a94ad051997016db3960a90277, vendored byte-identical in tenstorrent/tt-metal
under ``models/demos/deepseek_v3_d_p/reference/deepseek_v41/``), imported from ``--reference``
and never copied here. The text model runs under make_v41.py's three imposed deviations (tie
order, fresh index keys, defined arithmetic); the vision tower adds four spellings to the defined
arithmetic (``Tensor.cos``, ``Tensor.sin`` for its 2D RoPE table, ``F.gelu`` for the aligner,
``F.scaled_dot_product_attention``: scores, softmax and the weighted sum in float64, rounded once
to the tensor's dtype). Everything else is the reference's own code.

It writes ``<out>/vision-tiny/`` (``--out`` defaults to make_v41.py's fixtures directory):

* ``config.json``, ``model.safetensors``, ``engram_token_map.json``: a tiny V4.1 with a vision
  tower (``VISION`` below), every ``ModelArgs`` field under its own name, the published
  ``vision_*`` keys included; tensors under the reference's module names (``vision.*``,
  ``aligner.*``, ``image_start``/``image_end``/``image_newline``, ``layers.N.ffn.gate.bias_vl``),
  in the model's dtypes (vision linears BF16, their norms F32, ``bias_vl`` F32).
* ``vision.safetensors`` (not ``reference.safetensors``, so the text oracle skips this directory):
  per image ``i`` (two synthetic images, ``synthetic_image`` below; PNG-encoded and read back by
  ``image_processor.load_image``): ``image{i}_padded`` u8 [H, W, 3] (the ``ImageOps.pad`` result),
  ``image{i}_patches`` bf16 [n_vit_h·n_vit_w, 3, p, p] (``load_image``'s output),
  ``image{i}_tower`` bf16 [n_vit_h·n_vit_w, vision_dim] (``model.vision``), ``image{i}_aligner``
  bf16 [n_llm_h·n_llm_w, dim] (``model.aligner``; equal to ``model.encode_image``); ``prompt`` i64 [S]
  and ``token_types`` i64 [S] (TEXT −1, IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3);
  ``prefill_logits`` f32 [S, V] (one start_pos-0 prefill with both images, every position);
  ``decode_tokens`` i64 [N], ``decode_logits`` f32 [N, V] (greedy, as make_v41.py).
* ``vision.json``: versions, the image plans (``plan_image_grid``) of ``PLAN_SIZES`` under the
  published vision arguments and under the tiny config's, the two images' geometry, the greedy
  margins, and how far the logits move when the image routing bias or the Engram rule is switched
  off in the reference (so a test that ignores either must fail).

Run: ``tools/oracle/.venv/bin/python tools/oracle/make_v41_vision.py --reference DIR`` where DIR
holds the ``models/`` package with the real vision.py and image_processor.py (make_v41.py's note
about stubs applies to the text fixtures only).
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_v41 as base  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

NAME = "vision-tiny"
SEED = 3
N_DECODE = 16
TEXT_BEFORE, TEXT_BETWEEN, TEXT_AFTER = 5, 2, 20

# text model: one layer of each V4.1 attention kind, Engram with a 3-token look-back, no DSpark
ARGS = dict(
    dim=64, moe_inter_dim=32, n_layers=4, n_mtp_layers=0, n_heads=2, head_dim=32, rope_head_dim=16,
    q_lora_rank=32, o_groups=1, o_lora_rank=32, window_size=8,
    compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
    index_n_heads=2, index_head_dim=32, index_topk=6,
    candidate_source_layer=2, candidate_topk_blocks=3, candidate_block_size=4,
    n_routed_experts=8, n_activated_experts=2, route_scale=1.5, swiglu_limit=10.0,
    original_seq_len=32, rope_factor=4, hc_mult=2, vocab_size=256,
    engram_layer_ids=(0, 2), engram_max_ngram_size=4, engram_n_heads=1, engram_head_dim=32,
    engram_vocab_size=60,
    dspark_block_size=0, dspark_target_layer_ids=(),
)
# the vision tower: the published layout at small widths (head 16: 4 row and 4 column frequencies)
VISION = dict(
    vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=48, vision_patch_size=14,
    vision_rope_theta=10000.0, vision_downsample_ratio=3, vision_max_n_token=16, vision_min_pixels=56 * 56,
    vision_max_wh_ratio=None, image_token_id=250,
)
# (width, height) of the two images: one shrunk to the token limit (antialiased downscale), one
# scaled up to the minimum pixel count (upscale, odd pad)
IMAGES = [(300, 200), (30, 45)]
PLAN_SIZES = [
    (1, 1), (13, 17), (30, 45), (300, 200), (544, 544), (640, 480), (800, 1200), (333, 777), (1920, 1080),
    (2048, 2048), (4032, 3024), (100, 5000), (5000, 100), (12000, 30), (30, 12000), (3000, 7), (7, 3000),
    (1000, 10), (10, 1000), (545, 543),
]


def synthetic_image(w: int, h: int, salt: int) -> np.ndarray:
    """u8 [h, w, 3]: integer arithmetic only, so any implementation can rebuild it."""
    y, x, c = np.meshgrid(np.arange(h), np.arange(w), np.arange(3), indexing="ij")
    v = x * (37 + salt) + y * 91 + c * 53 + ((x * y) % 29) * 7 + ((x // 5 + y // 3) % 2) * 100
    return (v % 256).astype(np.uint8)


def install_vision_arithmetic():
    """Defined arithmetic for the spellings only the vision tower calls (see the docstring)."""
    import torch.nn.functional as F

    orig = dict(cos=torch.Tensor.cos, sin=torch.Tensor.sin, gelu=F.gelu, sdpa=F.scaled_dot_product_attention)

    def on(*ts):
        return base.Patches.defined_arithmetic and all(t.is_floating_point() for t in ts)

    def unary(name):
        def f(x, *a, **k):
            if not on(x):
                return orig[name](x, *a, **k)
            return orig[name](x.double(), *a, **k).to(x.dtype)
        return f

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not on(q, k, v):
            return orig["sdpa"](q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        assert attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa
        s = scale if scale is not None else q.size(-1) ** -0.5
        scores = torch.matmul(q.double(), k.double().transpose(-2, -1)) * s
        p = torch.softmax(scores, dim=-1)
        return torch.matmul(p, v.double()).to(q.dtype)

    torch.Tensor.cos = unary("cos")
    torch.Tensor.sin = unary("sin")
    F.gelu = unary("gelu")
    F.scaled_dot_product_attention = sdpa


def published_vision_args(v41):
    """ModelArgs' vision defaults, which are the published config.json's values."""
    a = v41.ModelArgs()
    return {f.name: getattr(a, f.name) for f in fields(a) if f.name.startswith("vision_")}


def plan_row(ip, args, w, h):
    n_llm_h, n_llm_w, best_h, best_w = ip.plan_image_grid(w, h, args)
    return dict(width=w, height=h, n_llm_h=n_llm_h, n_llm_w=n_llm_w, best_height=best_h, best_width=best_w,
                tokens=ip.num_image_tokens(n_llm_h, n_llm_w))


def load(ip, args, pixels: np.ndarray):
    """image_processor.load_image on a PNG of `pixels`, and the padded u8 image it normalised."""
    from PIL import Image, ImageOps

    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    patches, n_vit_h, n_vit_w, n_llm_h, n_llm_w = ip.load_image({"data": buf.getvalue()}, args)
    n_llm_h2, n_llm_w2, best_h, best_w = ip.plan_image_grid(pixels.shape[1], pixels.shape[0], args)
    assert (n_llm_h, n_llm_w) == (n_llm_h2, n_llm_w2)
    padded = np.asarray(ImageOps.pad(Image.fromarray(pixels, "RGB"), (best_w, best_h), color=(127, 127, 127)))
    x = torch.from_numpy(padded.astype(np.float32)).permute(2, 0, 1) / 255
    p = args.vision_patch_size
    again = ((x - 0.5) / 0.5).to(torch.bfloat16).reshape(3, n_vit_h, p, n_vit_w, p).permute(1, 3, 0, 2, 4)
    assert torch.equal(again.reshape(patches.shape), patches), "padded image does not reproduce load_image"
    return patches, padded, n_vit_h, n_vit_w, n_llm_h, n_llm_w


def run(v41, model, tokens, types, images, n_steps, forced=None):
    S = len(tokens)
    out = dict(decode_tokens=[], decode_logits=[])
    with v41.set_dtype(torch.bfloat16):
        base.Patches.full_logits = True
        try:
            _, logits, _ = model(torch.tensor([tokens]), 0, images=[images], token_types=torch.tensor([types]))
        finally:
            base.Patches.full_logits = False
        out["prefill_logits"] = logits[0].float().clone()
        tok = logits[:, -1].argmax(-1)
        if forced is not None:
            tok = torch.tensor([forced[0]])
        for i in range(n_steps):
            out["decode_tokens"].append(int(tok))
            _, logits, _ = model(tok.view(1, 1), S + i)
            out["decode_logits"].append(logits[0].float().clone())
            tok = logits.argmax(-1)
            if forced is not None and i + 1 < len(forced):
                tok = torch.tensor([forced[i + 1]])
    out["decode_logits"] = torch.stack(out["decode_logits"])
    return out


def compare(a, b) -> dict:
    return dict(prefill_logits=base.max_diff(a["prefill_logits"], b["prefill_logits"]),
                decode_logits=base.max_diff(a["decode_logits"], b["decode_logits"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--reference", type=Path, required=True, help="directory holding the reference package")
    ap.add_argument("--out", type=Path, default=base.DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    v41, engram, testing, rev = base.load_reference(a.reference.resolve())
    import importlib

    ip = importlib.import_module(f"{base.PACKAGE}.image_processor")
    vision = importlib.import_module(f"{base.PACKAGE}.vision")
    assert v41.ViT is vision.ViT, "the reference's vision.py is a stub; pass the real one"
    base.install_global_patches(v41)
    install_vision_arithmetic()

    entry = dict(name=NAME, seed=a.seed, prompt_len=80, args=dict(ARGS, **VISION))
    args = base.make_args(testing, entry)
    assert args.vision_enabled
    base.layer_roles(args)
    model, promoted = base.build_model(v41, testing, args, entry["seed"])
    base.install_model_patches(v41, model, args)

    # (a) plans
    published = published_vision_args(v41)
    pub_ns = type("Args", (), published)
    plans = dict(published=[plan_row(ip, pub_ns, w, h) for w, h in PLAN_SIZES],
                 tiny=[plan_row(ip, args, w, h) for w, h in PLAN_SIZES])

    # (b), (c) images
    ref, geometry, spans = {}, [], []
    for i, (w, h) in enumerate(IMAGES):
        pixels = synthetic_image(w, h, i)
        patches, padded, n_vit_h, n_vit_w, n_llm_h, n_llm_w = load(ip, args, pixels)
        with v41.set_dtype(torch.bfloat16), torch.inference_mode():
            tower = model.vision(patches, n_vit_h, n_vit_w)
            aligned = model.aligner(tower, n_vit_h, n_vit_w)
            assert torch.equal(aligned, model.encode_image(patches, n_vit_h, n_vit_w))
        ref[f"image{i}_padded"] = torch.from_numpy(padded.copy())
        ref[f"image{i}_patches"] = patches.contiguous()
        ref[f"image{i}_tower"] = tower.contiguous()
        ref[f"image{i}_aligner"] = aligned.contiguous()
        geometry.append(dict(width=w, height=h, salt=i, n_vit_h=n_vit_h, n_vit_w=n_vit_w, n_llm_h=n_llm_h,
                             n_llm_w=n_llm_w, padded_height=padded.shape[0], padded_width=padded.shape[1]))
        spans.append((patches, n_vit_h, n_vit_w, ip.image_token_types(n_llm_h, n_llm_w)))
        print(f"image {i}: {w}x{h} -> {padded.shape[1]}x{padded.shape[0]} px, {n_vit_h}x{n_vit_w} patches, "
              f"{n_llm_h}x{n_llm_w} tokens")

    # (d) a prompt with two images and text after them
    rng = np.random.default_rng(2_000_003 + a.seed)
    text = lambda n: [int(t) for t in rng.integers(0, args.image_token_id, size=n)]  # noqa: E731
    tokens, types, images = text(TEXT_BEFORE), [ip.TEXT] * TEXT_BEFORE, []
    for k, (patches, n_vit_h, n_vit_w, span_types) in enumerate(spans):
        images.append(ip.ImageInput(len(tokens), patches, n_vit_h, n_vit_w, span_types))
        tokens += [args.image_token_id] * span_types.numel()
        types += span_types.tolist()
        n = TEXT_BETWEEN if k + 1 < len(spans) else TEXT_AFTER
        tokens += text(n)
        types += [ip.TEXT] * n
    assert len(tokens) <= entry["prompt_len"]
    res = run(v41, model, tokens, types, images, N_DECODE)
    margins = base.greedy_margins(res)
    print(f"seed {a.seed}: S={len(tokens)} greedy margin {margins['min_gap']:.4g} ({margins['relative']:.2e})")
    if margins["relative"] < base.MARGIN_REL:
        raise SystemExit(f"greedy margin {margins['relative']:.2e} < {base.MARGIN_REL}; try another --seed")
    again = run(v41, model, tokens, types, images, 2)
    assert torch.equal(again["prefill_logits"], res["prefill_logits"]), "the patched reference is not deterministic"

    # the two image rules, switched off in the reference, teacher-forced on the fixture's tokens
    effects = {}
    gates = [layer.ffn.gate for layer in model.layers]
    saved = [g.bias_vl for g in gates]
    for g in gates:
        g.bias_vl = None
    try:
        effects["without_bias_vl"] = compare(res, run(v41, model, tokens, types, images, N_DECODE,
                                                      forced=res["decode_tokens"]))
    finally:
        for g, b in zip(gates, saved):
            g.bias_vl = b
    hash_forward = model.engram_hash.forward
    model.engram_hash.forward = lambda ids, pos, mask=None: hash_forward(ids, pos, None)
    engram_forwards = [(layer.engram, layer.engram.forward) for layer in model.layers if layer.engram is not None]
    for e, f in engram_forwards:
        e.forward = lambda x, hashes, mask=None, _f=f: _f(x, hashes, None)
    try:
        effects["without_engram_rule"] = compare(res, run(v41, model, tokens, types, images, N_DECODE,
                                                          forced=res["decode_tokens"]))
    finally:
        model.engram_hash.forward = hash_forward
        for e, f in engram_forwards:
            e.forward = f
    print(f"effects: {effects}")

    ref.update(prompt=torch.tensor(tokens, dtype=torch.int64), token_types=torch.tensor(types, dtype=torch.int64),
               prefill_logits=res["prefill_logits"].contiguous(),
               decode_tokens=torch.tensor(res["decode_tokens"], dtype=torch.int64),
               decode_logits=res["decode_logits"].contiguous())

    d = a.out / NAME
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "deepseek_v41"}
    for f in fields(args):
        v = getattr(args, f.name)
        cfg[f.name] = list(v) if isinstance(v, tuple) else v
    (d / "config.json").write_text(base.dumps(cfg) + "\n")
    ckpt = base.checkpoint_tensors(model, promoted)
    save_file(ckpt, str(d / "model.safetensors"), metadata={"format": "pt"})
    base.check_checkpoint_roundtrip(d / "model.safetensors", model, promoted)
    token_map, n = engram.build_compressed_token_map(testing.StubTokenizer(args.vocab_size))
    assert token_map == model.engram_hash.token_map.tolist()
    (d / "engram_token_map.json").write_text(json.dumps({"token_map": token_map, "compressed_vocab_size": n}) + "\n")
    save_file(ref, str(d / "vision.safetensors"), metadata={"format": "pt"})
    back = load_file(str(d / "vision.safetensors"))
    assert all(torch.equal(back[k], v) for k, v in ref.items())
    meta = {
        "generator": "tools/oracle/make_v41_vision.py",
        "reference": f"{base.PACKAGE} (DeepSeek-V4.1-Flash inference/model.py, vision.py, image_processor.py, "
                     f"revision {rev})",
        "versions": {"torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
                     "pillow": __import__("PIL").__version__},
        "seed": a.seed,
        "published_vision_args": published,
        "plans": plans,
        "images": geometry,
        "synthetic_image": "v = x*(37+salt) + y*91 + c*53 + ((x*y) % 29)*7 + ((x//5 + y//3) % 2)*100, mod 256",
        "prompt": {"text_before": TEXT_BEFORE, "text_between": TEXT_BETWEEN, "text_after": TEXT_AFTER,
                   "length": len(tokens)},
        "n_decode": N_DECODE,
        "greedy_argmax_margin": dict(margins, threshold_relative=base.MARGIN_REL),
        "rules_switched_off_in_reference": effects,
        "defined_arithmetic_added": ["Tensor.cos", "Tensor.sin", "F.gelu", "F.scaled_dot_product_attention"],
        "max_abs_logit": float(res["prefill_logits"].abs().max()),
    }
    meta["files_bytes"] = {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.name != "vision.json"}
    (d / "vision.json").write_text(base.dumps(meta) + "\n")
    total = sum(p.stat().st_size for p in d.iterdir())
    print(f"wrote {d} ({total} bytes) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
