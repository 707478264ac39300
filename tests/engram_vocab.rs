//! The Engram compressed vocabulary derived from the real DeepSeek tokenizer
//! (`../shared/assets/deepseek-v4/tokenizer.json`) against DeepSeek's reference
//! `engram.build_compressed_token_map` on the same file: the published
//! `engram_compressed_vocab_size` (99,092) and the whole map, by checksum.

use std::path::Path;

use deepinfer::engram_vocab::token_map_of_file;

/// FNV-1a over the map's ids as little-endian u32, as the reference's map hashed in Python.
fn fnv1a(map: &[u32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in map.iter().flat_map(|v| v.to_le_bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[test]
fn the_real_tokenizer_compresses_like_the_reference() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/assets/deepseek-v4/tokenizer.json");
    if !path.is_file() {
        eprintln!("skipped: {} is not here", path.display());
        return;
    }
    let (map, size) = token_map_of_file(&path).unwrap();
    assert_eq!(map.len(), 129_280);
    assert_eq!(size, 99_092, "DeepSeek-V4.1-Flash's engram_compressed_vocab_size");
    assert_eq!(&map[..12], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    assert_eq!(&map[128_000..128_006], &[97_812, 97_813, 97_814, 97_815, 97_816, 97_817]);
    assert_eq!(fnv1a(&map), 0x6b5c_fa68_a5f5_7ba6, "the reference's map, checksummed");
}
