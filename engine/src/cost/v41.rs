//! DeepSeek-V4.1-Flash's attention and Engram in the cost model, from its
//! published configuration: CSA2 (compressed KV and index keys held only by the
//! KV-source layers, shared by their group), the two-level indexer, FP8
//! window KV and FP4 compressed entries, and the Engram lookups.

/// The released V4.1-Flash attention and Engram layout.
#[derive(Clone, Debug, PartialEq)]
pub struct V41Attention {
    pub heads: usize,
    pub head_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub window: usize,
    /// Layers by kind: window only, ratio-2 pooled, ratio-1 (uncompressed shared KV).
    pub window_layers: usize,
    pub ratio2_layers: usize,
    pub ratio1_layers: usize,
    /// KV sources (own a compressor and the index keys) of each ratio.
    pub ratio2_sources: usize,
    pub ratio1_sources: usize,
    /// Index sources of each ratio; of the ratio-1 ones, `candidate_consumers`
    /// score only inside the candidate source's blocks.
    pub ratio2_index_sources: usize,
    pub ratio1_index_sources: usize,
    pub candidate_consumers: usize,
    pub candidate_entries: usize,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub hc: usize,
    pub engram_layers: usize,
    /// Table rows one position reads per Engram layer, and their width.
    pub engram_rows: usize,
    pub engram_dim: usize,
    /// Rows of each Engram table (not counted as parameters: memory, not compute).
    pub engram_table_rows: usize,
}

impl V41Attention {
    /// DeepSeek-V4.1-Flash (config revision dba1be0a).
    pub fn released() -> Self {
        Self {
            heads: 64,
            head_dim: 512,
            q_lora: 1280,
            o_groups: 8,
            o_lora: 1024,
            window: 128,
            window_layers: 2,
            ratio2_layers: 18,
            ratio1_layers: 20,
            ratio2_sources: 3,
            ratio1_sources: 1,
            ratio2_index_sources: 3,
            ratio1_index_sources: 5,
            candidate_consumers: 4,
            candidate_entries: 2048 * 8,
            index_heads: 32,
            index_dim: 128,
            index_topk: 512,
            hc: 4,
            engram_layers: 2,
            engram_rows: 3 * 8,
            engram_dim: 256,
            engram_table_rows: 384_011_425,
        }
    }

    pub fn layers(&self) -> usize {
        self.window_layers + self.ratio2_layers + self.ratio1_layers
    }

    /// Dense parameters of all layers' attention, compressors, indexers, mHC and Engram projections.
    pub fn params(&self, hidden: usize) -> f64 {
        let (h, hd, q_lora) = (hidden as f64, self.head_dim as f64, self.q_lora as f64);
        let qd = (self.heads * self.head_dim) as f64;
        let go = (self.o_groups * self.o_lora) as f64;
        let per_layer = q_lora * h + qd * q_lora + hd * h + go * (qd / self.o_groups as f64) + h * go;
        let mixes = 2.0 * ((2 + self.hc) * self.hc * self.hc) as f64 * h;
        let keys = self.index_dim as f64 * hd;
        let compressors =
            self.ratio2_sources as f64 * (2.0 * hd * h + keys) + self.ratio1_sources as f64 * (hd * h + keys);
        let indexers = (self.ratio2_index_sources + self.ratio1_index_sources) as f64
            * ((self.index_heads * self.index_dim) as f64 * q_lora + self.index_heads as f64 * h);
        let engram = self.engram_layers as f64
            * (h * (self.hc + 1) as f64 * (self.engram_rows * self.engram_dim) as f64 + 2.0 * (self.hc as f64) * h);
        (per_layer + mixes) * self.layers() as f64 + compressors + indexers + engram
    }

    /// Bytes of the Engram tables (FP8 rows with one scale per 32).
    pub fn engram_table_bytes(&self) -> f64 {
        (self.engram_layers * self.engram_table_rows) as f64 * (self.engram_dim + self.engram_dim / 32) as f64
    }

    /// Bytes of Engram rows one position reads.
    pub fn engram_read_bytes_per_token(&self) -> f64 {
        (self.engram_layers * self.engram_rows) as f64 * (self.engram_dim + self.engram_dim / 32) as f64
    }

    /// Attention FLOPs per new token with `visible` positions in view: the
    /// window, the chosen entries of every compressed layer, the indexer's scores.
    pub fn flops_per_token(&self, visible: f64) -> f64 {
        let per_key = (self.heads * self.head_dim) as f64 * 2.0 * 2.0;
        let win = visible.min(self.window as f64);
        let (entries2, entries1) = (visible / 2.0, visible);
        let chosen = |entries: f64| entries.min(self.index_topk as f64);
        let attend = self.layers() as f64 * win * per_key
            + self.ratio2_layers as f64 * chosen(entries2) * per_key
            + self.ratio1_layers as f64 * chosen(entries1) * per_key;
        let score = (self.index_heads * self.index_dim) as f64 * 2.0;
        let consumers = self.candidate_consumers as f64;
        let scoring = self.ratio2_index_sources as f64 * entries2 * score
            + (self.ratio1_index_sources as f64 - consumers) * entries1 * score
            + consumers * entries1.min(self.candidate_entries as f64) * score;
        attend + scoring
    }

    /// KV bytes of a sequence of `tokens` positions: held (`only_selected`
    /// false), or read in one step (window, the chosen entries of every
    /// compressed layer, the keys every index source scores).
    pub fn kv_bytes(&self, tokens: f64, only_selected: bool) -> f64 {
        let hd = self.head_dim as f64;
        let window_row = hd + hd / 32.0; // FP8 e4m3 with a scale per 32
        let entry = hd / 2.0 + hd / 16.0; // FP4 e2m1 with an e4m3 scale per 16
        let key = self.index_dim as f64 / 2.0 + self.index_dim as f64 / 32.0; // FP4 with a UE8M0 scale per 32
        let win = tokens.min(self.window as f64) * window_row * self.layers() as f64;
        let (entries2, entries1) = (tokens / 2.0, tokens);
        if !only_selected {
            let sources = self.ratio2_sources as f64 * entries2 * (entry + key)
                + self.ratio1_sources as f64 * entries1 * (entry + key);
            return win + sources;
        }
        let chosen = |entries: f64| entries.min(self.index_topk as f64);
        let values =
            self.ratio2_layers as f64 * chosen(entries2) * entry + self.ratio1_layers as f64 * chosen(entries1) * entry;
        let consumers = self.candidate_consumers as f64;
        let keys = self.ratio2_index_sources as f64 * entries2 * key
            + (self.ratio1_index_sources as f64 - consumers) * entries1 * key
            + consumers * entries1.min(self.candidate_entries as f64) * key;
        win + values + keys
    }
}
