//! The Engram compressed vocabulary of a tokenizer: DeepSeek-V4.1 hashes
//! n-grams over ids where tokens that normalise alike ("The", " the",
//! "THE") share one id. The rule is the reference's: decode each token,
//! normalise (NFKC, NFD, strip accents, lowercase, collapse whitespace, strip,
//! a token that is one space stays a space), and number the distinct keys in
//! token order; a token that decodes to a partial UTF-8 sequence is keyed by
//! its raw form.

use anyhow::Context;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{Lowercase, Sequence, Strip, StripAccents, NFD, NFKC};
use tokenizers::{NormalizedString, Normalizer, NormalizerWrapper, Tokenizer};

/// Private-use character that keeps a token of exactly one space from stripping to nothing.
const SENTINEL: &str = "\u{e000}";

fn normalizer() -> anyhow::Result<Sequence> {
    let replace = |pattern: tokenizers::normalizers::replace::ReplacePattern, with: &str| {
        Replace::new(pattern, with).map(NormalizerWrapper::from).map_err(|e| anyhow::anyhow!("{e}"))
    };
    use tokenizers::normalizers::replace::ReplacePattern;
    Ok(Sequence::new(vec![
        NFKC.into(),
        NFD.into(),
        StripAccents.into(),
        Lowercase.into(),
        replace(ReplacePattern::Regex(r"[ \t\r\n]+".into()), " ")?,
        replace(ReplacePattern::Regex(r"^ $".into()), SENTINEL)?,
        Strip::new(true, true).into(),
        replace(ReplacePattern::String(SENTINEL.into()), " ")?,
    ]))
}

/// The compressed id of every token id of `tokenizer`, and how many there are.
pub fn compressed_token_map(tokenizer: &Tokenizer) -> anyhow::Result<(Vec<u32>, usize)> {
    let norm = normalizer()?;
    let size = tokenizer.get_vocab_size(true);
    let mut keys: std::collections::BTreeMap<String, u32> = std::collections::BTreeMap::new();
    let mut map = Vec::with_capacity(size);
    for id in 0..size as u32 {
        let text = tokenizer.decode(&[id], false).map_err(|e| anyhow::anyhow!("decoding token {id}: {e}"))?;
        let key = if text.contains('\u{fffd}') {
            tokenizer.id_to_token(id).unwrap_or_default()
        } else {
            let mut n = NormalizedString::from(text.as_str());
            norm.normalize(&mut n).map_err(|e| anyhow::anyhow!("normalising token {id}: {e}"))?;
            if n.get().is_empty() {
                text
            } else {
                n.get().to_string()
            }
        };
        let next = keys.len() as u32;
        map.push(*keys.entry(key).or_insert(next));
    }
    Ok((map, keys.len()))
}

/// [`compressed_token_map`] of a `tokenizer.json`.
pub fn token_map_of_file(path: &std::path::Path) -> anyhow::Result<(Vec<u32>, usize)> {
    let tokenizer = Tokenizer::from_file(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    compressed_token_map(&tokenizer).with_context(|| format!("{}: Engram compressed vocabulary", path.display()))
}
