//! The ViT (`vision.py`): patch projection, pre-norm blocks of bidirectional
//! attention with 2D RoPE and SwiGLU, a final RMSNorm; then the aligner (a
//! zero-padded 3×3 unfold, two linears with an exact GELU between).
//!
//! Arithmetic is the defined arithmetic of the text model (see DESIGN.md):
//! bf16 activations, every linear a f64 dot product plus its bias in f64
//! rounded once (to f32, then bf16, as PyTorch converts f64 to bf16), norms as
//! `ops::rms_norm`, the RoPE table's `pow`, `cos` and `sin` in f64 rounded to
//! f32, the rotation in f32 element by element, attention (scores, softmax and
//! weighted sum) in f64 rounded once, SiLU and GELU in f64.

use rayon::prelude::*;

use deepinfer_kernels::act_quant::{dot_f64_rows, round_bf16};

use super::erf::gelu;
use super::VisionConfig;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::v41::ops;

/// `vision.py`'s `RMSNorm` takes its default ε.
const NORM_EPS: f32 = 1e-6;

/// A bf16 linear with an optional bias, weights as f32 values `[out, in]`.
pub struct BiasedLinear {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
    pub out: usize,
    pub inp: usize,
}

impl BiasedLinear {
    fn load(ck: &Checkpoint, prefix: &str, out: usize, inp: usize, bias: bool) -> Result<Self, CheckpointError> {
        let weight = ck.f32_tensor(&format!("{prefix}.weight"), &[out, inp])?;
        let bias = if bias { Some(ck.f32_tensor(&format!("{prefix}.bias"), &[out])?) } else { None };
        Ok(Self { weight, bias, out, inp })
    }

    /// `[n, out]` bf16 values of `x` `[n, in]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let n = x.len() / self.inp;
        let mut y = vec![0.0f32; n * self.out];
        let row = |(xt, yt): (&[f32], &mut [f32])| {
            let mut acc = vec![0.0f64; self.out];
            dot_f64_rows(xt, &self.weight, &mut acc);
            for (o, (a, v)) in yt.iter_mut().zip(acc.iter().enumerate()) {
                let b = self.bias.as_ref().map_or(0.0, |b| b[a] as f64);
                *o = round_bf16((v + b) as f32);
            }
        };
        if ops::worth_spreading(n * self.out * self.inp) {
            x.par_chunks(self.inp).zip(y.par_chunks_mut(self.out)).for_each(row);
        } else {
            x.chunks(self.inp).zip(y.chunks_mut(self.out)).for_each(row);
        }
        y
    }
}

pub struct VisionBlock {
    pub norm1: Vec<f32>,
    pub wqkv: BiasedLinear,
    pub wo: BiasedLinear,
    pub norm2: Vec<f32>,
    /// Gate and up projections stacked `[2 · inter, dim]`, no bias.
    pub w1: BiasedLinear,
    pub w2: BiasedLinear,
}

/// The tower, the aligner and the span's learned vectors, under the published names.
pub struct VisionWeights {
    pub patch_embed: BiasedLinear,
    pub blocks: Vec<VisionBlock>,
    pub norm: Vec<f32>,
    pub aligner_w1: BiasedLinear,
    pub aligner_w2: BiasedLinear,
    /// `[dim]` each, bf16 values.
    pub image_start: Vec<f32>,
    pub image_end: Vec<f32>,
    pub image_newline: Vec<f32>,
}

impl VisionWeights {
    pub fn load(ck: &Checkpoint, cfg: &VisionConfig, dim: usize) -> Result<Self, CheckpointError> {
        let vd = cfg.dim;
        let blocks = (0..cfg.n_layers)
            .map(|i| {
                let p = format!("vision.blocks.{i}");
                Ok(VisionBlock {
                    norm1: ck.f32_tensor(&format!("{p}.norm1.weight"), &[vd])?,
                    wqkv: BiasedLinear::load(ck, &format!("{p}.attn.wqkv"), 3 * vd, vd, true)?,
                    wo: BiasedLinear::load(ck, &format!("{p}.attn.wo"), vd, vd, true)?,
                    norm2: ck.f32_tensor(&format!("{p}.norm2.weight"), &[vd])?,
                    w1: BiasedLinear::load(ck, &format!("{p}.mlp.w1"), 2 * cfg.inter_dim, vd, false)?,
                    w2: BiasedLinear::load(ck, &format!("{p}.mlp.w2"), vd, cfg.inter_dim, false)?,
                })
            })
            .collect::<Result<Vec<_>, CheckpointError>>()?;
        let r2 = cfg.downsample_ratio * cfg.downsample_ratio;
        let bf16_vector = |name: &str| -> Result<Vec<f32>, CheckpointError> {
            Ok(ck.f32_tensor(name, &[dim])?.into_iter().map(round_bf16).collect())
        };
        Ok(Self {
            patch_embed: BiasedLinear::load(
                ck,
                "vision.patch_embed.proj",
                vd,
                3 * cfg.patch_size * cfg.patch_size,
                true,
            )?,
            blocks,
            norm: ck.f32_tensor("vision.norm.weight", &[vd])?,
            aligner_w1: BiasedLinear::load(ck, "aligner.w1", dim, vd * r2, true)?,
            aligner_w2: BiasedLinear::load(ck, "aligner.w2", dim, dim, true)?,
            image_start: bf16_vector("image_start")?,
            image_end: bf16_vector("image_end")?,
            image_newline: bf16_vector("image_newline")?,
        })
    }

    /// The tower's output `[n_h · n_w, vision_dim]` (bf16 values) for `patches` `[n_h · n_w, 3·p·p]`.
    pub fn tower(&self, cfg: &VisionConfig, patches: &[f32], n_h: usize, n_w: usize) -> Vec<f32> {
        let (vd, n) = (cfg.dim, n_h * n_w);
        assert_eq!(patches.len(), n * self.patch_embed.inp, "patches of the plan's grid");
        let (cos, sin) = rope_table(n_h, n_w, cfg.head_dim() / 2, cfg.rope_theta);
        let mut x = self.patch_embed.forward(patches);
        for b in &self.blocks {
            let h = normed(&x, &b.norm1, vd);
            let qkv = b.wqkv.forward(&h);
            let o = attention(cfg, &qkv, n, &cos, &sin);
            add_bf16(&mut x, &b.wo.forward(&o));
            let h = normed(&x, &b.norm2, vd);
            let gu = b.w1.forward(&h);
            let inter = b.w2.inp;
            let act: Vec<f32> = gu
                .chunks_exact(2 * inter)
                .flat_map(|row| {
                    let (g, u) = row.split_at(inter);
                    g.iter().zip(u).map(|(&g, &u)| round_bf16(round_bf16(ops::silu(g)) * u)).collect::<Vec<_>>()
                })
                .collect();
            add_bf16(&mut x, &b.w2.forward(&act));
        }
        normed(&x, &self.norm, vd)
    }

    /// The aligner rows `[⌈n_h/r⌉ · ⌈n_w/r⌉, dim]` of the tower's output.
    pub fn align(&self, cfg: &VisionConfig, features: &[f32], n_h: usize, n_w: usize) -> Vec<f32> {
        let (vd, r) = (cfg.dim, cfg.downsample_ratio);
        let (gh, gw) = (n_h.div_ceil(r), n_w.div_ceil(r));
        // F.unfold's feature order: channel, then the kernel's row, then its column
        let mut merged = vec![0.0f32; gh * gw * vd * r * r];
        for (cell, out) in merged.chunks_exact_mut(vd * r * r).enumerate() {
            let (bi, bj) = (cell / gw, cell % gw);
            for ki in 0..r {
                for kj in 0..r {
                    let (y, x) = (bi * r + ki, bj * r + kj);
                    if y < n_h && x < n_w {
                        for c in 0..vd {
                            out[c * r * r + ki * r + kj] = features[(y * n_w + x) * vd + c];
                        }
                    }
                }
            }
        }
        let mut y = self.aligner_w1.forward(&merged);
        y.iter_mut().for_each(|v| *v = round_bf16(gelu(*v as f64) as f32));
        self.aligner_w2.forward(&y)
    }
}

fn normed(x: &[f32], weight: &[f32], d: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    out.chunks_exact_mut(d).for_each(|row| ops::rms_norm(row, weight, NORM_EPS));
    out
}

/// `x + y` of bf16 tensors: added in f32, rounded to bf16.
fn add_bf16(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, &b)| *a = round_bf16(*a + b));
}

/// `get_vision_cos_sin`: per patch, `rope` angles — the first half its row
/// times each frequency, the second half its column.
fn rope_table(n_h: usize, n_w: usize, rope: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<f32> = (0..rope / 2)
        .map(|j| {
            let e = (2 * j) as f32 / rope as f32;
            1.0f32 / theta.powf(e as f64) as f32
        })
        .collect();
    let (mut cos, mut sin) = (Vec::with_capacity(n_h * n_w * rope), Vec::with_capacity(n_h * n_w * rope));
    for i in 0..n_h * n_w {
        for pos in [(i / n_w) as f32, (i % n_w) as f32] {
            for &f in &inv {
                let a = (pos * f) as f64;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
    }
    (cos, sin)
}

/// Rotate-half RoPE of one head's `[2 · rope]` values, in place (bf16 out).
fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = x.len() / 2;
    for j in 0..half {
        let (x1, x2) = (x[j], x[half + j]);
        let (a, b) = (x1 * cos[j], x2 * sin[j]);
        let (c, d) = (x2 * cos[j], x1 * sin[j]);
        x[j] = round_bf16(a - b);
        x[half + j] = round_bf16(c + d);
    }
}

/// Bidirectional attention of every head over all `n` patches: `[n, vision_dim]`.
fn attention(cfg: &VisionConfig, qkv: &[f32], n: usize, cos: &[f32], sin: &[f32]) -> Vec<f32> {
    let (vd, heads, hd) = (cfg.dim, cfg.n_heads, cfg.head_dim());
    let rope = hd / 2;
    let mut q = vec![0.0f32; n * vd];
    let mut k = vec![0.0f32; n * vd];
    let mut v = vec![0.0f32; n * vd];
    for t in 0..n {
        let row = &qkv[t * 3 * vd..(t + 1) * 3 * vd];
        q[t * vd..(t + 1) * vd].copy_from_slice(&row[..vd]);
        k[t * vd..(t + 1) * vd].copy_from_slice(&row[vd..2 * vd]);
        v[t * vd..(t + 1) * vd].copy_from_slice(&row[2 * vd..]);
        for h in 0..heads {
            let at = t * vd + h * hd;
            let (c, s) = (&cos[t * rope..(t + 1) * rope], &sin[t * rope..(t + 1) * rope]);
            rotate(&mut q[at..at + hd], c, s);
            rotate(&mut k[at..at + hd], c, s);
        }
    }
    let scale = (hd as f64).powf(-0.5);
    let mut out = vec![0.0f32; n * vd];
    let one = |(t, o): (usize, &mut [f32])| {
        let mut p = vec![0.0f64; n];
        for h in 0..heads {
            let qh = &q[t * vd + h * hd..t * vd + (h + 1) * hd];
            for (j, pj) in p.iter_mut().enumerate() {
                let kh = &k[j * vd + h * hd..j * vd + (h + 1) * hd];
                *pj = qh.iter().zip(kh).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale;
            }
            let max = p.iter().fold(f64::NEG_INFINITY, |m, &s| m.max(s));
            p.iter_mut().for_each(|s| *s = (*s - max).exp());
            let total: f64 = p.iter().sum();
            for c in 0..hd {
                let acc: f64 = p.iter().enumerate().map(|(j, &w)| w / total * v[j * vd + h * hd + c] as f64).sum();
                o[h * hd + c] = round_bf16(acc as f32);
            }
        }
    };
    if ops::worth_spreading(n * n * vd) {
        out.par_chunks_mut(vd).enumerate().for_each(one);
    } else {
        out.chunks_mut(vd).enumerate().for_each(one);
    }
    out
}
