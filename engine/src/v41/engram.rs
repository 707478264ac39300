//! Engram n-gram memory: the hash of the n-grams ending at each position
//! (over a tokenizer-derived compressed vocabulary), the lookup of FP8 table
//! rows in the memory-mapped checkpoint, and the gate that adds them into the
//! residual streams.

use deepinfer_kernels::act_quant::round_bf16;
use deepinfer_kernels::dtype::{fp8_e4m3_to_f32, ue8m0_to_f32};

use super::config::EngramConfig;
use super::numpy_rng::Pcg64;

/// The look-back entry of an image position: it contributes no token, and an
/// n-gram that reaches it takes the pad id there and at every older slot.
pub const DEAD: u64 = u64::MAX;

/// A look-back entry as the flat state forms carry it (−1 for [`DEAD`]).
pub fn entry_as_f32(id: u64) -> f32 {
    if id == DEAD {
        -1.0
    } else {
        id as f32
    }
}

/// The inverse of [`entry_as_f32`]: `None` unless an id below `limit` or −1.
pub fn entry_from_f32(v: f32, limit: f32) -> Option<u64> {
    if v == -1.0 {
        Some(DEAD)
    } else if v >= 0.0 && v < limit && v.fract() == 0.0 {
        Some(v as u64)
    } else {
        None
    }
}

/// Bucket layout and hash constants of every Engram layer.
#[derive(Clone, Debug, PartialEq)]
pub struct EngramHash {
    pub max_ngram_size: usize,
    pub n_heads: usize,
    /// `[layer][(ngram − 2) · heads + head]` prime bucket counts.
    pub primes: Vec<Vec<u64>>,
    /// `[layer][col]` first row of each bucket range.
    pub offsets: Vec<Vec<u64>>,
    /// `[layer][lookback]` odd multipliers.
    pub multipliers: Vec<Vec<u64>>,
    /// Compressed id of every token id.
    pub token_map: Vec<u32>,
    /// Compressed id of the pad token.
    pub pad: u64,
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u64;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

impl EngramHash {
    /// Primes drawn in order and never reused (so the bucket ranges are
    /// disjoint), multipliers from NumPy's generator seeded `10007 · layer`.
    pub fn new(cfg: &EngramConfig, token_map: Vec<u32>) -> Result<Self, String> {
        if let Some(&bad) = token_map.iter().find(|&&c| c as usize >= cfg.compressed_vocab_size) {
            return Err(format!(
                "Engram token map holds compressed id {bad}, not below engram_compressed_vocab_size {}",
                cfg.compressed_vocab_size
            ));
        }
        let distinct = {
            let mut ids = token_map.clone();
            ids.sort_unstable();
            ids.dedup();
            ids.len()
        };
        if distinct != cfg.compressed_vocab_size {
            return Err(format!(
                "Engram token map has {distinct} distinct compressed ids; the config says engram_compressed_vocab_size \
                 is {} (every hash multiplier derives from it, so the table would be read wrong)",
                cfg.compressed_vocab_size
            ));
        }
        let pad = *token_map
            .get(cfg.pad_id as usize)
            .ok_or_else(|| format!("engram_pad_id {} is outside the token map", cfg.pad_id))? as u64;
        let mut seen = std::collections::BTreeSet::new();
        let mut primes = Vec::new();
        for _ in &cfg.layer_ids {
            let mut layer = Vec::new();
            for _ in 0..cfg.max_ngram_size - 1 {
                let mut current = cfg.vocab_size as u64 - 1;
                for _ in 0..cfg.n_heads {
                    current += 1;
                    while !is_prime(current) || seen.contains(&current) {
                        current += 1;
                    }
                    seen.insert(current);
                    layer.push(current);
                }
            }
            primes.push(layer);
        }
        let offsets: Vec<Vec<u64>> = primes
            .iter()
            .map(|layer| {
                let mut acc = 0;
                layer
                    .iter()
                    .map(|&p| {
                        let o = acc;
                        acc += p;
                        o
                    })
                    .collect()
            })
            .collect();
        for (i, (layer_offsets, layer_primes)) in offsets.iter().zip(&primes).enumerate() {
            let rows = layer_offsets.last().unwrap() + layer_primes.last().unwrap();
            if rows > cfg.num_embeddings[i] as u64 {
                return Err(format!(
                    "Engram layer {} hashes into {rows} rows but engram_num_embeddings gives {}",
                    cfg.layer_ids[i], cfg.num_embeddings[i]
                ));
            }
        }
        let bound = ((i64::MAX as u64) / cfg.compressed_vocab_size as u64 / 2).max(1);
        let multipliers = cfg
            .layer_ids
            .iter()
            .map(|&layer| {
                let mut rng = Pcg64::from_seed(10007 * layer as u64);
                (0..cfg.max_ngram_size).map(|_| rng.integer_below(bound) * 2 + 1).collect()
            })
            .collect();
        Ok(Self {
            max_ngram_size: cfg.max_ngram_size,
            n_heads: cfg.n_heads,
            primes,
            offsets,
            multipliers,
            token_map,
            pad,
        })
    }

    /// Table rows of every Engram layer for the position whose compressed
    /// history (oldest first, current token last) is `history`: `[layers][cols]`.
    pub fn rows(&self, history: &[u64]) -> Vec<Vec<u64>> {
        let n = self.max_ngram_size;
        // Look-back tokens, current first; slots before the sequence start, at an
        // image position ([`DEAD`]) and older than one take the pad id.
        let mut blocked = false;
        let tokens: Vec<u64> = (0..n)
            .map(|shift| {
                let id = history.len().checked_sub(1 + shift).map(|i| history[i]);
                blocked |= id.is_none_or(|id| id == DEAD);
                if blocked {
                    self.pad
                } else {
                    id.unwrap()
                }
            })
            .collect();
        self.multipliers
            .iter()
            .enumerate()
            .map(|(l, mult)| {
                let mut rolling = tokens[0].wrapping_mul(mult[0]);
                let mut cols = Vec::with_capacity((n - 1) * self.n_heads);
                for i in 1..n {
                    rolling ^= tokens[i].wrapping_mul(mult[i]);
                    for h in 0..self.n_heads {
                        let c = (i - 1) * self.n_heads + h;
                        cols.push(rolling % self.primes[l][c] + self.offsets[l][c]);
                    }
                }
                cols
            })
            .collect()
    }

    pub fn compress(&self, token: u32) -> u64 {
        self.token_map.get(token as usize).copied().unwrap_or(self.pad as u32) as u64
    }
}

/// One Engram layer's FP8 table, read in place from the checkpoint.
pub struct EngramTable {
    pub rows: usize,
    pub dim: usize,
    pub values: bytes::Bytes,
    pub scales: bytes::Bytes,
}

impl EngramTable {
    /// Row `r` dequantised to bf16 values (one UE8M0 scale per 32).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows && out.len() == self.dim, "Engram row {r} of {}", self.rows);
        let v = &self.values[r * self.dim..(r + 1) * self.dim];
        let s = &self.scales[r * self.dim / 32..(r + 1) * self.dim / 32];
        for (c, o) in out.iter_mut().enumerate() {
            *o = round_bf16(fp8_e4m3_to_f32(v[c]) * ue8m0_to_f32(s[c / 32]));
        }
    }
}

/// The gate of one (token, stream): sigmoid of the signed square root of the
/// normalised stream·key product.
pub fn gate(stream: &[f32], key: &[f32], weight: &[f32], eps: f32) -> f32 {
    use super::ops::{mean_square, rsqrt, sigmoid, sum};
    let d = stream.len();
    let rstd = rsqrt(mean_square(stream) + eps) * rsqrt(mean_square(key) + eps);
    let dot = sum(stream.iter().zip(weight).zip(key).map(|((h, w), k)| h * w * k));
    let dot = dot * rstd * (d as f64).powf(-0.5) as f32;
    sigmoid(dot.abs().max(1e-6).sqrt().copysign(dot))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_position_ends_the_look_back() {
        let cfg = EngramConfig {
            layer_ids: vec![0, 3],
            num_embeddings: vec![10_000, 10_000],
            max_ngram_size: 4,
            vocab_size: 50,
            n_heads: 2,
            head_dim: 32,
            pad_id: 2,
            compressed_vocab_size: 20,
        };
        let hash = EngramHash::new(&cfg, (0..40).map(|t| t / 2).collect()).unwrap();
        // the n-grams reaching the image position pad it and every older slot
        assert_eq!(hash.rows(&[7, 9, DEAD, 4, 5]), hash.rows(&[4, 5]));
        assert_eq!(hash.rows(&[3, DEAD]), hash.rows(&[]));
        assert_ne!(hash.rows(&[7, 9, 3, 4, 5]), hash.rows(&[4, 5]));
        for id in [0, 17, DEAD] {
            assert_eq!(entry_from_f32(entry_as_f32(id), 20.0), Some(id));
        }
        assert_eq!(entry_from_f32(-2.0, 20.0), None);
        assert_eq!(entry_from_f32(20.0, 20.0), None);
    }
}
