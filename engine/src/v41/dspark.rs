//! DSpark draft layers: from the target's mean streams at its target layers,
//! a block of `dspark_block_size` positions (the real next token, then noise
//! tokens) runs through window-only blocks that see the target's own window
//! KV; the Markov head conditions each draft on the one before it and the
//! confidence head predicts, per position, whether the target will accept it.

use deepinfer_kernels::act_quant::{fp8_round_trip, plain_linear, quantized_linear};

use super::ffn;
use super::ops;
use super::state::V41State;
use super::weights::{Block, DsparkLayer};
use super::ModelV41;

/// What one DSpark call proposes after position `p`.
#[derive(Clone, Debug, PartialEq)]
pub struct Drafts {
    /// Draft tokens for positions `p + 2 ..= p + 1 + block` (greedy under the Markov bias).
    pub tokens: Vec<u32>,
    /// `[block, vocab]` draft logits with the Markov bias added.
    pub logits: Vec<f32>,
    /// `[block]` acceptance logits of the confidence head.
    pub confidence: Vec<f32>,
}

impl ModelV41 {
    /// Feed the target's main hidden rows `[n, targets · dim]` of positions
    /// `start..start + n` into every draft layer's window.
    pub fn dspark_observe(&self, main_hidden: &[f32], start: usize, state: &mut V41State) {
        self.dspark_observe_windows(main_hidden, start, &mut state.dspark_windows);
    }

    /// [`ModelV41::dspark_observe`] into a copy of the windows.
    pub fn dspark_observe_windows(&self, main_hidden: &[f32], start: usize, windows: &mut [Vec<f32>]) {
        let cfg = &self.config;
        let d = cfg.dim;
        let (proj, norm) = self.weights.dspark[0].main.as_ref().expect("first DSpark layer has main_proj");
        let n = main_hidden.len() / proj.cols;
        let mut main_x = quantized_linear(proj, main_hidden, n);
        main_x.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, norm, cfg.norm_eps));
        let (hd, rd, win) = (cfg.head_dim, cfg.rope_head_dim, cfg.window_size);
        for (k, layer) in self.weights.dspark.iter().enumerate() {
            let mut kv = quantized_linear(&layer.block.attn.wkv, &main_x, n);
            for (t, row) in kv.chunks_exact_mut(hd).enumerate() {
                ops::rms_norm(row, &layer.block.attn.kv_norm, cfg.norm_eps);
                self.rope_main.apply(&mut row[hd - rd..], start + t, false);
                fp8_round_trip(row);
            }
            let w = &mut windows[k];
            w.extend_from_slice(&kv);
            let keep = w.len().min(win * hd);
            w.drain(..w.len() - keep);
        }
    }

    /// Keep the DSpark windows in step with the sequence after a chunk from
    /// `start` whose first `real` rows are real tokens and the rest drafts:
    /// the windows before the drafts are marked so that rejecting the drafts
    /// restores them. Only the last window's worth of rows can matter.
    pub fn dspark_follow(&self, main_hidden: &[f32], start: usize, real: usize, state: &mut V41State) {
        let width = main_hidden.len() / (state.position - start).max(1);
        let n = main_hidden.len() / width.max(1);
        assert!(real <= n, "real rows of the chunk");
        let win = self.config.window_size;
        let observe = |state: &mut V41State, from: usize, to: usize| {
            let from = from.max(to.saturating_sub(win));
            if from < to {
                self.dspark_observe(&main_hidden[from * width..to * width], start + from, state);
            }
        };
        observe(state, 0, real);
        if real < n {
            let mark = state.draft_mark.get_or_insert_with(Default::default);
            mark.dspark_windows = Some(state.dspark_windows.clone());
            observe(state, real, n);
        }
    }

    /// Draft the block after position `p`: `next_token` is the target's token at
    /// `p + 1`, `main_hidden` its main hidden row at `p` (already observed).
    pub fn dspark_propose(&self, next_token: u32, p: usize, state: &V41State) -> Drafts {
        self.dspark_propose_with(next_token, p, &state.dspark_windows, &mut |_, row| ops::argmax(row))
    }

    /// [`ModelV41::dspark_propose`] from given windows, with the draft at each
    /// block position `i` chosen by `choose(i, logits)` (which may mask the
    /// row); the Markov head conditions the next draft on that choice.
    pub fn dspark_propose_with(
        &self,
        next_token: u32,
        p: usize,
        windows: &[Vec<f32>],
        choose: &mut dyn FnMut(usize, &mut [f32]) -> u32,
    ) -> Drafts {
        let cfg = &self.config;
        let ds = cfg.dspark.as_ref().expect("model has DSpark layers");
        let (d, hc, block) = (cfg.dim, cfg.hc_mult, ds.block_size);
        let mut row = vec![0.0f32; d];
        let mut streams = vec![0.0f32; block * hc * d];
        for i in 0..block {
            let tok = if i == 0 { next_token } else { ds.noise_token_id };
            self.weights.embed.dequantize_row((tok as usize).min(cfg.vocab_size - 1), &mut row);
            for k in 0..hc {
                streams[(i * hc + k) * d..(i * hc + k + 1) * d].copy_from_slice(&row);
            }
        }
        let mut pre: Vec<Vec<f32>> = (0..block).map(|_| ops::one_hot(hc)).collect();
        for (k, layer) in self.weights.dspark.iter().enumerate() {
            pre = self.draft_block(layer, &windows[k], &mut streams, &pre, p);
        }
        let last = self.weights.dspark.last().expect("DSpark layers");
        let heads = last.heads.as_ref().expect("last DSpark layer has the heads");
        let mut x = vec![0.0f32; block * d];
        for i in 0..block {
            ops::hc_pre(&streams[i * hc * d..(i + 1) * hc * d], &pre[i], &mut x[i * d..(i + 1) * d]);
        }
        let mut normed = x.clone();
        normed.chunks_exact_mut(d).for_each(|r| ops::rms_norm(r, &heads.norm, cfg.norm_eps));
        let v = cfg.vocab_size;
        let mut logits = vec![0.0f32; block * v];
        plain_linear(&self.weights.head, &normed, block, &mut logits);
        let rank = ds.markov_rank;
        let mut tokens = Vec::with_capacity(block);
        let mut confidence = Vec::with_capacity(block);
        let mut previous = next_token;
        let mut bias = vec![0.0f32; v];
        for i in 0..block {
            let embed = &heads.markov_embed[(previous as usize).min(v - 1) * rank..][..rank];
            plain_linear(&heads.markov_head, embed, 1, &mut bias);
            let row = &mut logits[i * v..(i + 1) * v];
            row.iter_mut().zip(&bias).for_each(|(l, b)| *l += b);
            previous = choose(i, row);
            tokens.push(previous);
            let input: Vec<f32> = x[i * d..(i + 1) * d].iter().chain(embed).copied().collect();
            let mut c = [0.0f32];
            plain_linear(&heads.confidence, &input, 1, &mut c);
            confidence.push(c[0]);
        }
        Drafts { tokens, logits, confidence }
    }

    /// One draft block over the block's positions `p + 1 ..`; returns its FFN `pre`.
    fn draft_block(
        &self,
        layer: &DsparkLayer,
        window: &[f32],
        streams: &mut [f32],
        pre: &[Vec<f32>],
        p: usize,
    ) -> Vec<Vec<f32>> {
        let block = &layer.block;
        let (mixes, x) = self.mixed_attention(block, streams, pre, |x| self.draft_attention(block, window, x, p));
        let y = ffn::forward(&self.config, &block.moe, &x, pre.len());
        self.mix_ffn_output(streams, &y, mixes)
    }

    /// Every block position attends to the target's window (ring slots in slot
    /// order, as the reference lists them) and to all block positions.
    fn draft_attention(&self, block: &Block, window: &[f32], x: &[f32], p: usize) -> Vec<f32> {
        let cfg = &self.config;
        let attn = &block.attn;
        let (hd, rd, heads, win) = (cfg.head_dim, cfg.rope_head_dim, cfg.n_heads, cfg.window_size);
        let n = x.len() / cfg.dim;
        let mut qr = quantized_linear(&attn.wq_a, x, n);
        qr.chunks_exact_mut(cfg.q_lora_rank).for_each(|r| ops::rms_norm(r, &attn.q_norm, cfg.norm_eps));
        let mut q = quantized_linear(&attn.wq_b, &qr, n);
        for (t, row) in q.chunks_exact_mut(heads * hd).enumerate() {
            for head in row.chunks_exact_mut(hd) {
                self.rope_main.apply(&mut head[hd - rd..], p + 1 + t, false);
            }
        }
        let mut kv = quantized_linear(&attn.wkv, x, n);
        for (t, row) in kv.chunks_exact_mut(hd).enumerate() {
            ops::rms_norm(row, &attn.kv_norm, cfg.norm_eps);
            self.rope_main.apply(&mut row[hd - rd..], p + 1 + t, false);
            fp8_round_trip(row);
        }
        let held = window.len() / hd;
        let first = p + 1 - held;
        let mut slots: Vec<Option<&[f32]>> = vec![None; win.min(p + 1)];
        for i in 0..held {
            slots[(first + i) % win] = Some(&window[i * hd..(i + 1) * hd]);
        }
        let mut keys = slots;
        keys.extend(kv.chunks_exact(hd).map(Some));
        let scale = (hd as f64).powf(-0.5) as f32;
        let mut out = vec![0.0f32; n * heads * hd];
        for t in 0..n {
            let o = &mut out[t * heads * hd..(t + 1) * heads * hd];
            ops::sparse_attention(&q[t * heads * hd..(t + 1) * heads * hd], &keys, &attn.sink, scale, o);
            for head in o.chunks_exact_mut(hd) {
                self.rope_main.apply(&mut head[hd - rd..], p + 1 + t, true);
            }
        }
        super::attention::output_projection(cfg, attn, &out, n)
    }
}
