//! The tensor spellings a DeepSeek-V4 checkpoint comes in, mapped onto DeepSeek's
//! published names (`embed.weight`, `layers.N.attn.wq_a.weight`, …), which the loader
//! asks for.
//!
//! Three spellings meet a user: DeepSeek's published checkpoints; what transformers'
//! `save_pretrained` writes (a `model.` prefix, `embed_tokens`, `hc_head.hc_*`, and
//! `attn.norm` for the attention KV norm, the rest reverse-mapped to published names);
//! and transformers' own module names (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj`,
//! …), which a raw `state_dict` dump carries.

/// Module-path rewrites inside a block (`layers.N.` or `mtp.K.`), from transformers'
/// spelling to the published one. Longer, more specific prefixes come first.
const BLOCK_REWRITES: &[(&str, &str)] = &[
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"),
    // save_pretrained's reverse mapping spells the attention KV norm `attn.norm`.
    ("attn.norm.", "attn.kv_norm."),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.fn", "hc_attn_fn"),
    ("attn_hc.base", "hc_attn_base"),
    ("attn_hc.scale", "hc_attn_scale"),
    ("ffn_hc.fn", "hc_ffn_fn"),
    ("ffn_hc.base", "hc_ffn_base"),
    ("ffn_hc.scale", "hc_ffn_scale"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.", "ffn.gate."),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.experts.", "ffn.experts."),
];

/// Rewrites outside the blocks (after the `model.` prefix is gone).
const TOP_REWRITES: &[(&str, &str)] = &[
    ("embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("hc_head.hc_fn", "hc_head_fn"),
    ("hc_head.hc_base", "hc_head_base"),
    ("hc_head.hc_scale", "hc_head_scale"),
];

/// The published name of a stored tensor name (itself when it is already published).
pub fn published_name(stored: &str) -> String {
    let name = stored.strip_prefix("model.").unwrap_or(stored);
    // `layers.N.` / `mtp.K.` then the rest of the path.
    let (block, rest) = match split_block(name) {
        Some((block, rest)) => (block, rest),
        None => ("", name),
    };
    let rewrites = if block.is_empty() { TOP_REWRITES } else { BLOCK_REWRITES };
    for (from, to) in rewrites {
        if let Some(tail) = rest.strip_prefix(from) {
            return format!("{block}{to}{tail}");
        }
    }
    // The MTP block's own head is spelled like the model's.
    if !block.is_empty() {
        for (from, to) in TOP_REWRITES.iter().filter(|(from, _)| from.starts_with("hc_head.")) {
            if let Some(tail) = rest.strip_prefix(from) {
                return format!("{block}{to}{tail}");
            }
        }
    }
    format!("{block}{rest}")
}

/// Splits `layers.12.attn.wq_a.weight` into `("layers.12.", "attn.wq_a.weight")`.
fn split_block(name: &str) -> Option<(&str, &str)> {
    for head in ["layers.", "mtp."] {
        if let Some(after) = name.strip_prefix(head) {
            let digits = after.bytes().take_while(u8::is_ascii_digit).count();
            if digits > 0 && after.as_bytes().get(digits) == Some(&b'.') {
                let cut = head.len() + digits + 1;
                return Some((&name[..cut], &name[cut..]));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::published_name;

    #[test]
    fn published_names_are_unchanged() {
        for name in [
            "embed.weight",
            "head.weight",
            "hc_head_fn",
            "layers.3.attn.kv_norm.weight",
            "layers.3.attn.compressor.norm.weight",
            "layers.3.attn.indexer.compressor.norm.weight",
            "layers.0.ffn.experts.7.w1.scale",
            "mtp.0.hc_head_base",
            "mtp.0.e_proj.weight",
        ] {
            assert_eq!(published_name(name), name);
        }
    }

    #[test]
    fn save_pretrained_spelling_maps_to_published() {
        let cases = [
            ("model.embed_tokens.weight", "embed.weight"),
            ("model.norm.weight", "norm.weight"),
            ("model.hc_head.hc_fn", "hc_head_fn"),
            ("model.hc_head.hc_scale", "hc_head_scale"),
            ("model.layers.1.attn.norm.weight", "layers.1.attn.kv_norm.weight"),
            ("model.layers.1.attn.compressor.norm.weight", "layers.1.attn.compressor.norm.weight"),
            ("model.layers.10.hc_attn_fn", "layers.10.hc_attn_fn"),
            ("model.layers.2.ffn.experts.gate_up_proj", "layers.2.ffn.experts.gate_up_proj"),
        ];
        for (stored, published) in cases {
            assert_eq!(published_name(stored), published, "{stored}");
        }
    }

    #[test]
    fn transformers_module_names_map_to_published() {
        let cases = [
            ("model.layers.4.self_attn.q_a_proj.weight", "layers.4.attn.wq_a.weight"),
            ("model.layers.4.self_attn.q_a_proj.weight_scale_inv", "layers.4.attn.wq_a.weight_scale_inv"),
            ("model.layers.4.self_attn.sinks", "layers.4.attn.attn_sink"),
            (
                "model.layers.4.self_attn.compressor.indexer.scorer.weights_proj.weight",
                "layers.4.attn.indexer.weights_proj.weight",
            ),
            ("model.layers.4.self_attn.compressor.position_bias", "layers.4.attn.compressor.ape"),
            ("model.layers.4.attn_hc.base", "layers.4.hc_attn_base"),
            ("model.layers.4.mlp.gate.e_score_correction_bias", "layers.4.ffn.gate.bias"),
            ("model.layers.4.mlp.shared_experts.up_proj.weight", "layers.4.ffn.shared_experts.w3.weight"),
            ("model.layers.4.mlp.experts.down_proj", "layers.4.ffn.experts.down_proj"),
            ("lm_head.weight", "head.weight"),
        ];
        for (stored, published) in cases {
            assert_eq!(published_name(stored), published, "{stored}");
        }
    }
}
