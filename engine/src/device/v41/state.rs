//! One V4.1 sequence's state in a device's memory: per layer the window KV
//! of the last `window_size` positions, and per KV-source layer its
//! compressed entries, index keys and the open group's projections. The
//! Engram look-back (a few token ids) stays on the host. It converts to and
//! from the CPU's [`V41State`] exactly, which is how a prefix-cache block is
//! captured or restored and how a state moves between devices.

use deepinfer_cuda::{DeviceBuffer, DeviceError, Gpu};

use crate::v41::config::V41Config;
use crate::v41::state::{SourceState, V41State};

/// Rows a fresh entries or keys buffer has room for; it doubles when full.
const INITIAL_ROWS: usize = 64;

/// Rows of `width` values that grow at the end.
pub(crate) struct Rows {
    pub buf: DeviceBuffer<f32>,
    pub rows: usize,
    pub width: usize,
}

impl Rows {
    fn new(gpu: &Gpu, width: usize, values: &[f32]) -> Result<Self, DeviceError> {
        let rows = values.len() / width.max(1);
        let buf = gpu.zeros::<f32>(INITIAL_ROWS.max(rows.next_power_of_two()) * width.max(1))?;
        gpu.write(&buf, 0, values)?;
        Ok(Self { buf, rows, width })
    }

    /// Append `count` rows from `src` (packed from its start).
    pub fn append(&mut self, gpu: &Gpu, src: &DeviceBuffer<f32>, count: usize) -> Result<(), DeviceError> {
        let needed = (self.rows + count) * self.width;
        if needed > self.buf.len() {
            let grown = gpu.zeros::<f32>(needed.next_power_of_two().max(2 * self.buf.len()))?;
            gpu.copy(&self.buf, 0, &grown, 0, self.rows * self.width)?;
            self.buf = grown;
        }
        gpu.copy(src, 0, &self.buf, self.rows * self.width, count * self.width)?;
        self.rows += count;
        Ok(())
    }

    fn download(&self, gpu: &Gpu) -> Result<Vec<f32>, DeviceError> {
        gpu.download_range(&self.buf, 0, self.rows * self.width)
    }
}

/// A KV source's compressed state.
pub(crate) struct Source {
    pub entries: Rows,
    pub keys: Rows,
    /// `[ratio, head_dim]` each: the open group's f32 projections, `pending` rows of them.
    pub pending_kv: DeviceBuffer<f32>,
    pub pending_score: DeviceBuffer<f32>,
    pub pending: usize,
}

pub(crate) struct Layer {
    /// `[window_size, head_dim]`: the last positions' KV, oldest first, `window_rows` of them.
    pub window: DeviceBuffer<f32>,
    pub window_rows: usize,
    pub source: Option<Source>,
}

/// A V4.1 sequence on a device.
pub struct V41Sequence {
    pub(crate) layers: Vec<Layer>,
    /// Compressed ids of the last tokens (the Engram look-back), on the host.
    pub(crate) engram_history: Vec<u64>,
    /// The DSpark windows, kept as given (a device model drafts nothing, so it never feeds them).
    pub(crate) dspark_windows: Vec<Vec<f32>>,
}

impl V41Sequence {
    /// A device sequence holding exactly `state`.
    pub(crate) fn upload(gpu: &Gpu, cfg: &V41Config, state: &V41State) -> Result<Self, DeviceError> {
        assert!(state.draft_mark.is_none(), "no drafts pending on a state moved to a device");
        let (hd, ihd, win) = (cfg.head_dim, cfg.index_head_dim, cfg.window_size);
        let layers = (0..cfg.n_layers)
            .map(|l| {
                let w = &state.windows[l];
                assert!(w.len() <= win * hd && w.len().is_multiple_of(hd), "layer {l}: a window of {} values", w.len());
                let window = gpu.zeros::<f32>(win * hd)?;
                gpu.write(&window, 0, w)?;
                let source = match (&state.sources[l], cfg.layers[l].owns_compressor(l)) {
                    (Some(s), true) => {
                        let ratio = cfg.layers[l].ratio.max(1);
                        let pending = s.pending_kv.len() / hd;
                        assert!(pending < ratio, "layer {l}: {pending} pending rows for groups of {ratio}");
                        let pending_kv = gpu.zeros::<f32>(ratio * hd)?;
                        let pending_score = gpu.zeros::<f32>(ratio * hd)?;
                        gpu.write(&pending_kv, 0, &s.pending_kv)?;
                        gpu.write(&pending_score, 0, &s.pending_score)?;
                        Some(Source {
                            entries: Rows::new(gpu, hd, &s.entries)?,
                            keys: Rows::new(gpu, ihd, &s.keys)?,
                            pending_kv,
                            pending_score,
                            pending,
                        })
                    }
                    (None, false) => None,
                    _ => panic!("layer {l}: a KV source's state where the config has none, or the reverse"),
                };
                Ok(Layer { window, window_rows: w.len() / hd, source })
            })
            .collect::<Result<_, DeviceError>>()?;
        Ok(Self { layers, engram_history: state.engram_history.clone(), dspark_windows: state.dspark_windows.clone() })
    }

    /// The CPU form at `position`, value for value.
    pub(crate) fn download(&self, gpu: &Gpu, cfg: &V41Config, position: usize) -> Result<V41State, DeviceError> {
        let hd = cfg.head_dim;
        let mut windows = Vec::with_capacity(self.layers.len());
        let mut sources = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            windows.push(gpu.download_range(&l.window, 0, l.window_rows * hd)?);
            sources.push(match &l.source {
                Some(s) => Some(SourceState {
                    entries: s.entries.download(gpu)?,
                    keys: s.keys.download(gpu)?,
                    pending_kv: gpu.download_range(&s.pending_kv, 0, s.pending * hd)?,
                    pending_score: gpu.download_range(&s.pending_score, 0, s.pending * hd)?,
                }),
                None => None,
            });
        }
        Ok(V41State {
            position,
            windows,
            sources,
            engram_history: self.engram_history.clone(),
            dspark_windows: self.dspark_windows.clone(),
            draft_mark: None,
        })
    }

    /// Bytes of device memory the state's values occupy (what is held, not reserved).
    pub(crate) fn state_bytes(&self, cfg: &V41Config) -> usize {
        let hd = cfg.head_dim;
        4 * self
            .layers
            .iter()
            .map(|l| {
                l.window_rows * hd
                    + l.source.as_ref().map_or(0, |s| {
                        s.entries.rows * s.entries.width + s.keys.rows * s.keys.width + 2 * s.pending * hd
                    })
            })
            .sum::<usize>()
    }
}
