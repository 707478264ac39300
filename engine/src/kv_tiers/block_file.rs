//! The disk tier's file format: one file per cached block, self-describing
//! and checked end to end, so that a file from another model, another
//! layout, a torn write or a flipped bit is recognised and never served.
//!
//! Layout (little-endian), version 1:
//!
//! | bytes | field |
//! |---|---|
//! | 8 | magic `DIKVBLK1` |
//! | 4 | format version |
//! | 4 | block tokens |
//! | 8 | model fingerprint ([`fingerprint`]) |
//! | 8 | block key, 8 parent key |
//! | 8 | TTL in ms, 8 time written in ms |
//! | 4 | token count, 4 length count, 8 value count |
//! | … | tokens (u32), lengths (u32), values (f32): [`BlockValues::to_parts`] |
//! | 8 | XXH64 of every byte before it |

use crate::block_values::BlockValues;
use crate::model::Model;
use crate::prefix_cache::{block_hash, xxh64};

pub const MAGIC: [u8; 8] = *b"DIKVBLK1";
/// Bumped whenever what a block stores, or how, changes.
pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 72;
const CHECKSUM_BYTES: usize = 8;
/// Largest block file read back (a bound against a corrupt length): 256
/// MiB, several times a DeepSeek-V3 block of 128 tokens with full MLA KV.
pub const MAX_FILE_BYTES: u64 = 1 << 28;

/// Identity of the KV a model computes: the format version, what the
/// caller knows of the weights (`weights_identity`: a preset's name, a
/// checkpoint's files), the full configuration and the block size. Blocks
/// are only ever served to a model with the same fingerprint.
pub fn fingerprint(model: &Model, weights_identity: &str, block_tokens: usize) -> u64 {
    let v41 = model.v41.as_ref().map(|m| format!("{:?}", m.config)).unwrap_or_default();
    let text = format!("{FORMAT_VERSION}|{weights_identity}|{:?}|{v41}|{block_tokens}", model.config);
    xxh64(text.as_bytes())
}

/// The fixed-size start of a block file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub fingerprint: u64,
    pub block_tokens: u32,
    pub key: u64,
    pub parent: u64,
    pub ttl_ms: u64,
    pub written_ms: u64,
    tokens: u32,
    lens: u32,
    values: u64,
}

impl Header {
    /// Bytes of the whole file this header describes.
    pub fn file_bytes(&self) -> u64 {
        // Saturating: a corrupt count must give a size that fails the checks, not wrap.
        let words = u64::from(self.tokens).saturating_add(u64::from(self.lens)).saturating_add(self.values);
        words.saturating_mul(4).saturating_add((HEADER_BYTES + CHECKSUM_BYTES) as u64)
    }
}

/// Why a block file is not served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FileFault {
    #[error("truncated: {have} bytes of {need}")]
    Truncated { have: u64, need: u64 },
    #[error("corrupt: {0}")]
    Corrupt(String),
    #[error("foreign: {0}")]
    Foreign(String),
}

/// A block read back from its file.
#[derive(Debug)]
pub struct DecodedBlock {
    pub header: Header,
    pub tokens: Vec<u32>,
    pub values: BlockValues,
}

/// The file of one block.
#[allow(clippy::too_many_arguments)]
pub fn encode(
    fingerprint: u64,
    block_tokens: usize,
    key: u64,
    parent: u64,
    tokens: &[u32],
    values: &BlockValues,
    ttl_ms: u64,
    written_ms: u64,
) -> Vec<u8> {
    let (lens, data) = values.to_parts();
    let mut out = Vec::with_capacity(HEADER_BYTES + 4 * (tokens.len() + lens.len() + data.len()) + CHECKSUM_BYTES);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(block_tokens as u32).to_le_bytes());
    for v in [fingerprint, key, parent, ttl_ms, written_ms] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    out.extend_from_slice(&(lens.len() as u32).to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    debug_assert_eq!(out.len(), HEADER_BYTES);
    tokens.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
    lens.iter().for_each(|l| out.extend_from_slice(&l.to_le_bytes()));
    data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
    let sum = xxh64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Read a file's header (its first [`HEADER_BYTES`]) and check that it
/// belongs to this model and block size. The rest is checked by [`decode`].
pub fn read_header(bytes: &[u8], fingerprint: u64, block_tokens: usize) -> Result<Header, FileFault> {
    if bytes.len() < HEADER_BYTES {
        return Err(FileFault::Truncated { have: bytes.len() as u64, need: HEADER_BYTES as u64 });
    }
    if bytes[..8] != MAGIC {
        return Err(FileFault::Foreign("not a block file (bad magic)".into()));
    }
    let version = u32_at(bytes, 8);
    if version != FORMAT_VERSION {
        return Err(FileFault::Foreign(format!("format version {version}, this build reads {FORMAT_VERSION}")));
    }
    let header = Header {
        block_tokens: u32_at(bytes, 12),
        fingerprint: u64_at(bytes, 16),
        key: u64_at(bytes, 24),
        parent: u64_at(bytes, 32),
        ttl_ms: u64_at(bytes, 40),
        written_ms: u64_at(bytes, 48),
        tokens: u32_at(bytes, 56),
        lens: u32_at(bytes, 60),
        values: u64_at(bytes, 64),
    };
    if header.fingerprint != fingerprint {
        return Err(FileFault::Foreign(format!(
            "model fingerprint {:016x}, not {fingerprint:016x}",
            header.fingerprint
        )));
    }
    if header.block_tokens as usize != block_tokens || header.tokens as usize != block_tokens {
        return Err(FileFault::Foreign(format!("blocks of {} tokens, not {block_tokens}", header.block_tokens)));
    }
    if header.file_bytes() > MAX_FILE_BYTES {
        return Err(FileFault::Corrupt(format!("declares {} bytes", header.file_bytes())));
    }
    Ok(header)
}

/// Check a whole file and rebuild its block: checksum, key against its
/// tokens, and values against the model's layers.
pub fn decode(model: &Model, bytes: &[u8], fingerprint: u64, block_tokens: usize) -> Result<DecodedBlock, FileFault> {
    let header = read_header(bytes, fingerprint, block_tokens)?;
    let need = header.file_bytes();
    if (bytes.len() as u64) < need {
        return Err(FileFault::Truncated { have: bytes.len() as u64, need });
    }
    if bytes.len() as u64 > need {
        return Err(FileFault::Corrupt(format!("{} bytes, {need} expected", bytes.len())));
    }
    let body = bytes.len() - CHECKSUM_BYTES;
    if xxh64(&bytes[..body]) != u64_at(bytes, body) {
        return Err(FileFault::Corrupt("checksum mismatch".into()));
    }
    let words = |at: usize, n: usize| (0..n).map(move |i| u32_at(bytes, at + 4 * i));
    let mut at = HEADER_BYTES;
    let tokens: Vec<u32> = words(at, header.tokens as usize).collect();
    at += 4 * tokens.len();
    let lens: Vec<u32> = words(at, header.lens as usize).collect();
    at += 4 * lens.len();
    let data: Vec<f32> = words(at, header.values as usize).map(f32::from_bits).collect();
    if block_hash(header.parent, &tokens) != header.key {
        return Err(FileFault::Corrupt("the key does not match the tokens".into()));
    }
    let values = BlockValues::from_parts(model, block_tokens, &lens, &data).map_err(FileFault::Corrupt)?;
    Ok(DecodedBlock { header, tokens, values })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::{build, Preset};

    /// A header that passes the magic, version, fingerprint and block-size
    /// checks, with these counts, and `extra` bytes after it.
    fn file(fp: u64, lens: u32, values: u64, extra: usize) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&64u32.to_le_bytes());
        for v in [fp, 1, 0, 1000, 0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&64u32.to_le_bytes());
        b.extend_from_slice(&lens.to_le_bytes());
        b.extend_from_slice(&values.to_le_bytes());
        b.resize(b.len() + extra, 0);
        b
    }

    #[test]
    fn absurd_counts_are_errors_not_panics() {
        let model = build(Preset::TinyV4, 1).unwrap();
        let fp = fingerprint(&model, "x", 64);
        for (lens, values) in [(u32::MAX, u64::MAX), (0, u64::MAX / 4 + 1), (u32::MAX, 0), (0, 1 << 40)] {
            let f = file(fp, lens, values, 4096);
            assert!(decode(&model, &f, fp, 64).is_err(), "{lens} {values}");
        }
        // Consistent counts but a checksum that does not match.
        let f = file(fp, 0, 0, 64 * 4 + 8);
        assert!(matches!(decode(&model, &f, fp, 64), Err(FileFault::Corrupt(_))));
        // Every prefix of a header is truncated, never a panic.
        let f = file(fp, 0, 0, 0);
        for n in 0..f.len() {
            assert!(matches!(read_header(&f[..n], fp, 64), Err(FileFault::Truncated { .. })), "{n}");
        }
    }
}
