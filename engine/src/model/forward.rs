//! The model-level forward pass over a batch of sequence chunks.
//!
//! Every linear layer runs once over the flat batch of all chunks' tokens;
//! attention and compressors run per sequence. Kernels are batch-invariant, so
//! a sequence's logits do not depend on what else is in the batch.

use deepinfer_kernels::ops::rms_norm;
use deepinfer_kernels::workers::on_workers;

use super::attention::{self, Segment};
use super::state::{LayerState, SequenceState};
use super::weights::{Block, Mtp};
use super::{hyper, moe, Model};
use crate::v41::EmbeddedSpan;

/// New tokens of one sequence, and its state (advanced in place).
pub struct Chunk<'a> {
    pub tokens: &'a [u32],
    pub state: &'a mut SequenceState,
    /// Replay: recompute the window KV of tokens whose compressed entries and
    /// compressor state the state already holds (a prefix-cache hit). The
    /// compressors are not fed; everything else runs as usual.
    pub replay: bool,
    /// The last `drafts` tokens are speculative: the state can take them back
    /// afterwards ([`SequenceState::reject_drafts`]) or keep them
    /// ([`SequenceState::accept_drafts`]). Fewer than the sliding window.
    pub drafts: usize,
}

impl<'a> Chunk<'a> {
    pub fn new(tokens: &'a [u32], state: &'a mut SequenceState) -> Self {
        Self { tokens, state, replay: false, drafts: 0 }
    }
}

/// Which positions of a chunk need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    Last,
    All,
    /// The last `n` rows of every chunk (a chunk's drafts and the token before them).
    Tail(usize),
}

impl LogitsWanted {
    /// The rows of a chunk of `len` tokens that get logits.
    pub fn rows(self, len: usize) -> std::ops::Range<usize> {
        match self {
            LogitsWanted::None => 0..0,
            LogitsWanted::Last => len.saturating_sub(1)..len,
            LogitsWanted::All => 0..len,
            LogitsWanted::Tail(n) => len.saturating_sub(n)..len,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ChunkOutput {
    /// `[rows, vocab]`: one row (`Last`), one per token (`All`) or none.
    pub logits: Vec<f32>,
    /// Final hc streams of every token, `[len, hc · D]` (input to MTP), if kept.
    pub streams: Vec<f32>,
}

/// A forward pass in progress (see `Model::begin_pass`).
pub struct Pass {
    tokens: Vec<u32>,
    segments: Vec<Segment>,
    streams: Vec<f32>,
    layer: usize,
    num_layers: usize,
    pending: Option<(Vec<hyper::Mix>, moe::Dispatch)>,
    /// The pass of a DeepSeek-V4.1 model (the fields above are then unused).
    v41: Option<crate::v41::forward::PassV41>,
}

impl Pass {
    /// The layer the next `attend` runs.
    pub fn layer(&self) -> usize {
        self.v41.as_ref().map_or(self.layer, |p| p.layer())
    }

    pub fn is_done(&self) -> bool {
        self.layer() == self.num_layers
    }
}

/// One MTP step for a sequence: for each position `t`, the main model's final
/// streams at `t` and the token at `t + 1`.
pub struct MtpChunk<'a> {
    pub streams: &'a [f32],
    pub next_tokens: &'a [u32],
    pub state: &'a mut SequenceState,
}

impl Model {
    /// Run the chunks through the model, advancing each state.
    pub fn forward(&self, chunks: &mut [Chunk], wanted: LogitsWanted, keep_streams: bool) -> Vec<ChunkOutput> {
        self.forward_spans(chunks, &[], wanted, keep_streams)
    }

    /// [`Model::forward`] with image spans: `spans[i]` replaces embeddings of
    /// chunk `i` (V4.1 on the CPU only; missing entries: none).
    pub fn forward_spans(
        &self,
        chunks: &mut [Chunk],
        spans: &[Vec<EmbeddedSpan>],
        wanted: LogitsWanted,
        keep_streams: bool,
    ) -> Vec<ChunkOutput> {
        if let Some(d) = &self.device {
            assert!(spans.iter().all(Vec::is_empty), "a device model takes no image spans");
            return d
                .forward(chunks, wanted, keep_streams)
                .unwrap_or_else(|e| panic!("a step on {}: {e}", d.gpu().name()));
        }
        on_workers(|| {
            let mut pass = self.begin_pass_spans(chunks, spans);
            while !pass.is_done() {
                let layer = pass.layer();
                let dispatch = self.attend(&mut pass, chunks).clone();
                let outputs = self.run_experts(layer, &dispatch);
                self.combine(&mut pass, &outputs);
            }
            self.finish_pass(pass, chunks, wanted, keep_streams)
        })
    }

    /// Every routed expert of `layer` for a dispatch, computed here.
    pub fn run_experts(&self, layer: usize, dispatch: &moe::Dispatch) -> moe::ExpertOutputs {
        on_workers(|| match &self.v41 {
            Some(m) => m.run_experts(layer, dispatch),
            None => moe::run_all_experts(&self.weights.blocks[layer].moe, &self.config, dispatch),
        })
    }

    /// Whether a dispatch carries each row's routing weight to the expert (V4.1
    /// applies it before the down projection); V4 weighs the outputs instead.
    pub fn experts_take_weights(&self) -> bool {
        self.v41.is_some()
    }

    /// Start a forward pass that the caller drives layer by layer: `attend`,
    /// run the routed experts wherever they live, `combine`; then `finish_pass`.
    pub fn begin_pass(&self, chunks: &[Chunk]) -> Pass {
        self.begin_pass_spans(chunks, &[])
    }

    /// [`Model::begin_pass`] with image spans per chunk (see [`Model::forward_spans`]).
    pub fn begin_pass_spans(&self, chunks: &[Chunk], spans: &[Vec<EmbeddedSpan>]) -> Pass {
        assert!(self.device.is_none(), "a device model runs whole passes (Model::forward), not layer by layer");
        if let Some(m) = &self.v41 {
            let inputs: Vec<crate::v41::ChunkInput> = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    assert!(!c.replay && !c.tokens.is_empty(), "V4.1 chunks are non-empty and never replayed");
                    crate::v41::ChunkInput {
                        tokens: c.tokens,
                        state: c.state.v41.as_ref().expect("a V4.1 model runs on V4.1 states"),
                        drafts: c.drafts,
                        spans: spans.get(i).map_or(&[], Vec::as_slice),
                    }
                })
                .collect();
            return Pass {
                tokens: Vec::new(),
                segments: Vec::new(),
                streams: Vec::new(),
                layer: 0,
                num_layers: m.config.n_layers,
                pending: None,
                v41: Some(m.begin(&inputs)),
            };
        }
        assert!(spans.iter().all(Vec::is_empty), "DeepSeek-V4 takes no image spans");
        let cfg = &self.config;
        let d = cfg.hidden_size;
        let hc = cfg.hc_mult;
        for c in chunks.iter() {
            assert!(c.drafts == 0 || (!c.replay && c.drafts < cfg.sliding_window), "drafts fit the window");
            assert!(!c.state.has_drafts(), "the previous drafts were accepted or rejected");
        }
        let segments = segments(chunks.iter().map(|c| (c.tokens.len(), c.state.position, c.replay, c.drafts)));
        let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().copied()).collect();
        let n = tokens.len();
        let mut streams = vec![0.0f32; n * hc * d];
        let mut row = vec![0.0f32; d];
        for (t, &tok) in tokens.iter().enumerate() {
            self.weights.embed.dequantize_row((tok as usize).min(cfg.vocab_size - 1), &mut row);
            for k in 0..hc {
                streams[(t * hc + k) * d..][..d].copy_from_slice(&row);
            }
        }
        Pass { tokens, segments, streams, layer: 0, num_layers: self.weights.blocks.len(), pending: None, v41: None }
    }

    /// Run the current layer's attention and routing; returns what the routed experts must compute.
    pub fn attend<'p>(&self, pass: &'p mut Pass, chunks: &mut [Chunk]) -> &'p moe::Dispatch {
        on_workers(|| {
            if let Some(m) = &self.v41 {
                let p = pass.v41.as_mut().expect("a V4.1 pass");
                let mut states: Vec<&mut crate::v41::V41State> =
                    chunks.iter_mut().map(|c| c.state.v41.as_mut().expect("V4.1 state")).collect();
                return m.attend(p, &mut states);
            }
            assert!(pass.pending.is_none() && !pass.is_done(), "attend once per layer");
            let l = pass.layer;
            let mut states: Vec<&mut LayerState> = chunks.iter_mut().map(|c| &mut c.state.layers[l]).collect();
            let staged = self.attend_and_route(
                &self.weights.blocks[l],
                &mut pass.streams,
                &pass.tokens,
                &pass.segments,
                &mut states,
            );
            &pass.pending.insert(staged).1
        })
    }

    /// Finish the current layer with the routed experts' outputs.
    pub fn combine(&self, pass: &mut Pass, outputs: &moe::ExpertOutputs) {
        on_workers(|| {
            if let (Some(m), Some(p)) = (&self.v41, pass.v41.as_mut()) {
                m.combine(p, outputs);
                return;
            }
            let (mixes, dispatch) = pass.pending.take().expect("attend before combine");
            self.finish_block(&self.weights.blocks[pass.layer], &mixes, &dispatch, outputs, &mut pass.streams);
            pass.layer += 1;
        })
    }

    /// Outputs `[rows, D]` of routed expert `expert` of layer `layer` for gathered input rows.
    pub fn expert_forward(&self, layer: usize, expert: usize, x_rows: &[f32]) -> Vec<f32> {
        on_workers(|| {
            assert!(self.v41.is_none(), "V4.1 experts take their rows' routing weights");
            moe::expert_forward(&self.weights.blocks[layer].moe, &self.config, expert, x_rows, moe::Threads::Pool)
        })
    }

    /// [`Model::expert_forward`] for models whose experts apply the routing weight.
    pub fn expert_forward_weighted(&self, layer: usize, expert: usize, x_rows: &[f32], weights: &[f32]) -> Vec<f32> {
        on_workers(|| match &self.v41 {
            Some(m) => m.expert_forward(layer, expert, x_rows, weights),
            None => self.expert_forward(layer, expert, x_rows),
        })
    }

    /// After the last layer: logits (and streams) per chunk; advances each state's position.
    pub fn finish_pass(
        &self,
        pass: Pass,
        chunks: &mut [Chunk],
        wanted: LogitsWanted,
        keep_streams: bool,
    ) -> Vec<ChunkOutput> {
        on_workers(|| {
            assert!(pass.is_done(), "every layer ran");
            let starts: Vec<usize> = chunks.iter().map(|c| c.state.position).collect();
            for c in chunks.iter_mut() {
                if c.drafts > 0 {
                    c.state.draft_from = Some(c.state.position + c.tokens.len() - c.drafts);
                }
                c.state.position += c.tokens.len();
            }
            if let (Some(m), Some(p)) = (&self.v41, pass.v41) {
                let mut states: Vec<&mut crate::v41::V41State> =
                    chunks.iter_mut().map(|c| c.state.v41.as_mut().expect("V4.1 state")).collect();
                let results = m.finish(p, &mut states, wanted);
                return results
                    .into_iter()
                    .zip(chunks.iter_mut().zip(starts))
                    .map(|(r, (c, start))| {
                        if m.config.dspark.is_some() {
                            let state = c.state.v41.as_mut().expect("V4.1 state");
                            m.dspark_follow(&r.main_hidden, start, c.tokens.len() - c.drafts, state);
                        }
                        ChunkOutput { logits: r.logits, streams: if keep_streams { r.main_hidden } else { Vec::new() } }
                    })
                    .collect();
            }
            let d = self.config.hidden_size;
            let hc = self.config.hc_mult;
            let streams = &pass.streams;
            pass.segments
                .iter()
                .map(|seg| {
                    let seg_streams = &streams[seg.start * hc * d..(seg.start + seg.len) * hc * d];
                    let rows = wanted.rows(seg.len);
                    let logits = self.logits(
                        &self.weights.hc_head,
                        &self.weights.norm,
                        &seg_streams[rows.start * hc * d..rows.end * hc * d],
                        rows.len(),
                    );
                    ChunkOutput { logits, streams: if keep_streams { seg_streams.to_vec() } else { Vec::new() } }
                })
                .collect()
        })
    }

    /// Run the first MTP block: returns, per chunk, logits `[len, vocab]` predicting the token at `t + 2`.
    pub fn mtp_forward(&self, chunks: &mut [MtpChunk]) -> Vec<Vec<f32>> {
        self.mtp_forward_rows(chunks, LogitsWanted::All).into_iter().map(|o| o.logits).collect()
    }

    /// [`Model::mtp_forward`] with the chosen logits rows and the block's output
    /// streams `[len, hc · D]` (a chain of drafts feeds them back as the next
    /// position's streams).
    pub fn mtp_forward_rows(&self, chunks: &mut [MtpChunk], wanted: LogitsWanted) -> Vec<ChunkOutput> {
        assert!(self.device.is_none(), "a device model runs no MTP drafts");
        on_workers(|| {
            let mtp: &Mtp = self.weights.mtp.first().expect("checkpoint has no MTP block");
            let cfg = &self.config;
            let d = cfg.hidden_size;
            let hc = cfg.hc_mult;
            let segments = segments(chunks.iter().map(|c| (c.next_tokens.len(), c.state.mtp_position, false, 0)));
            let tokens: Vec<u32> = chunks.iter().flat_map(|c| c.next_tokens.iter().copied()).collect();
            let n = tokens.len();

            // Fuse: e_proj(enorm(embed(next))) added to h_proj(hnorm(stream)) on every stream.
            let mut embedded = vec![0.0f32; n * d];
            for (t, &tok) in tokens.iter().enumerate() {
                let e = &mut embedded[t * d..(t + 1) * d];
                self.weights.embed.dequantize_row((tok as usize).min(cfg.vocab_size - 1), e);
                rms_norm(e, Some(&mtp.enorm), cfg.rms_norm_eps);
            }
            let mut e_out = vec![0.0f32; n * d];
            mtp.e_proj.forward(&embedded, n, &mut e_out);
            let mut prev: Vec<f32> = chunks.iter().flat_map(|c| c.streams.iter().copied()).collect();
            assert_eq!(prev.len(), n * hc * d, "MTP input streams");
            for r in prev.chunks_exact_mut(d) {
                rms_norm(r, Some(&mtp.hnorm), cfg.rms_norm_eps);
            }
            let mut streams = vec![0.0f32; n * hc * d];
            mtp.h_proj.forward(&prev, n * hc, &mut streams);
            for t in 0..n {
                for k in 0..hc {
                    let s = &mut streams[(t * hc + k) * d..][..d];
                    s.iter_mut().zip(&e_out[t * d..(t + 1) * d]).for_each(|(v, e)| *v += e);
                }
            }
            let mut states: Vec<&mut LayerState> = chunks.iter_mut().map(|c| &mut c.state.mtp[0]).collect();
            self.block_forward(&mtp.block, &mut streams, &tokens, &segments, &mut states);
            for c in chunks.iter_mut() {
                c.state.mtp_position += c.next_tokens.len();
            }
            segments
                .iter()
                .map(|seg| {
                    let seg_streams = &streams[seg.start * hc * d..(seg.start + seg.len) * hc * d];
                    let rows = wanted.rows(seg.len);
                    let logits = self.logits(
                        &mtp.hc_head,
                        &mtp.norm,
                        &seg_streams[rows.start * hc * d..rows.end * hc * d],
                        rows.len(),
                    );
                    ChunkOutput { logits, streams: seg_streams.to_vec() }
                })
                .collect()
        })
    }

    fn block_forward(
        &self,
        block: &Block,
        streams: &mut [f32],
        tokens: &[u32],
        segments: &[Segment],
        states: &mut [&mut LayerState],
    ) {
        let (mixes, dispatch) = self.attend_and_route(block, streams, tokens, segments, states);
        let outputs = moe::run_all_experts(&block.moe, &self.config, &dispatch);
        self.finish_block(block, &mixes, &dispatch, &outputs, streams);
    }

    /// First stage of a block: the attention sublayer with its mHC mixing, then
    /// the FFN's mHC collapse, norm and routing.
    fn attend_and_route(
        &self,
        block: &Block,
        streams: &mut [f32],
        tokens: &[u32],
        segments: &[Segment],
        states: &mut [&mut LayerState],
    ) -> (Vec<hyper::Mix>, moe::Dispatch) {
        let cfg = &self.config;
        let d = cfg.hidden_size;
        let n = tokens.len();
        let (mixes, mut x) = hyper::pre(&block.hc_attn, cfg, streams, n);
        super::rows::norm_rows(&mut x, d, Some(&block.attn_norm), cfg.rms_norm_eps);
        let rope = self.rope_for(block.attn.kind);
        let out = attention::forward(&block.attn, cfg, rope, &x, segments, states);
        hyper::post(&mixes, cfg, &out, streams);

        let (mixes, mut x) = hyper::pre(&block.hc_ffn, cfg, streams, n);
        super::rows::norm_rows(&mut x, d, Some(&block.ffn_norm), cfg.rms_norm_eps);
        let routes = moe::route(&block.moe, cfg, &x, tokens);
        (mixes, moe::Dispatch { hidden_size: d, x, routes })
    }

    /// Last stage of a block: combine the experts' outputs and mix them into the streams.
    fn finish_block(
        &self,
        block: &Block,
        mixes: &[hyper::Mix],
        dispatch: &moe::Dispatch,
        outputs: &moe::ExpertOutputs,
        streams: &mut [f32],
    ) {
        let out = moe::combine(&block.moe, &self.config, dispatch, outputs);
        hyper::post(mixes, &self.config, &out, streams);
    }

    fn logits(&self, head: &super::weights::HyperHead, norm: &[f32], streams: &[f32], rows: usize) -> Vec<f32> {
        if rows == 0 {
            return Vec::new();
        }
        let mut x = hyper::head(head, &self.config, streams, rows);
        for r in x.chunks_exact_mut(self.config.hidden_size) {
            rms_norm(r, Some(norm), self.config.rms_norm_eps);
        }
        let mut logits = vec![0.0f32; rows * self.config.vocab_size];
        self.weights.head.forward(&x, rows, &mut logits);
        logits
    }
}

fn segments(chunks: impl Iterator<Item = (usize, usize, bool, usize)>) -> Vec<Segment> {
    let mut start = 0;
    chunks
        .map(|(len, position, replay, drafts)| {
            let s = Segment { start, len, position, replay, drafts };
            start += len;
            s
        })
        .collect()
}
