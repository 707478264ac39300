//! Draft tokens ride at the end of a chunk; rejecting them leaves the state
//! bit-identical to one that never saw them, and accepting them equals having
//! fed them as real tokens. Checked on every layer kind of both models, with
//! draft runs that cross compressor windows and push rows out of the windows.

use deepinfer_engine::model::{Chunk, LogitsWanted, Model};
use deepinfer_engine::presets::{build, Preset};

fn tokens(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 2 + (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 97) >> 7) % 1000).collect()
}

fn models() -> Vec<(&'static str, Model)> {
    vec![
        ("tiny-v4", build(Preset::TinyV4, 7).expect("tiny-v4 builds")),
        ("tiny-v41", build(Preset::TinyV41, 3).expect("tiny-v41 builds")),
    ]
}

fn feed(m: &Model, state: &mut deepinfer_engine::model::SequenceState, tokens: &[u32], drafts: usize) -> Vec<f32> {
    let mut chunk = Chunk::new(tokens, state);
    chunk.drafts = drafts;
    m.forward(&mut [chunk], LogitsWanted::All, false).remove(0).logits
}

#[test]
fn rejected_drafts_leave_no_trace_and_accepted_ones_equal_real_tokens() {
    for (name, m) in models() {
        // Prompt lengths put the drafts across CSA/HCA and ratio-1/2 group
        // boundaries, and past the sliding window of every layer.
        for (prompt_len, real, drafts) in [(130, 1, 5), (131, 3, 4), (200, 1, 1), (257, 2, 6), (64, 1, 3)] {
            let all = tokens(prompt_len + real + drafts + 8, prompt_len as u32);
            let prompt = &all[..prompt_len];
            let mut base = m.new_state();
            feed(&m, &mut base, prompt, 0);

            // Never drafted: the real tokens alone.
            let mut plain = base.clone();
            let plain_logits = feed(&m, &mut plain, &all[prompt_len..prompt_len + real], 0);

            // Drafted, then rejected.
            let mut drafted = base.clone();
            let chunk = &all[prompt_len..prompt_len + real + drafts];
            let logits = feed(&m, &mut drafted, chunk, drafts);
            assert!(drafted.has_drafts());
            let vocab = m.config.vocab_size;
            assert_eq!(logits[..real * vocab], plain_logits[..], "{name} {prompt_len}: real rows unchanged by drafts");
            let mut rejected = drafted.clone();
            rejected.reject_drafts(&m.config);
            assert_eq!(rejected, plain, "{name} {prompt_len}+{real}+{drafts}: rejection restores the state");

            // Accepted: equal to feeding the drafts as real tokens.
            let mut accepted = drafted;
            accepted.accept_drafts();
            let mut real_all = base.clone();
            let real_logits = feed(&m, &mut real_all, chunk, 0);
            assert_eq!(logits, real_logits, "{name} {prompt_len}: draft rows equal real rows");
            assert_eq!(accepted, real_all, "{name} {prompt_len}+{real}+{drafts}: acceptance keeps them");

            // And decoding goes on identically from the rejected state.
            let next = &all[prompt_len + real..prompt_len + real + 8];
            assert_eq!(feed(&m, &mut rejected, next, 0), feed(&m, &mut plain, next, 0), "{name}: decoding after");
        }
    }
}
