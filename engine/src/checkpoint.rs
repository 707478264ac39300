//! Memory-mapped safetensors checkpoints in DeepSeek's published tensor naming.
//!
//! Quantised weights stay in their stored bytes (borrowed from the mapping);
//! only their small scale grids are decoded at load time.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use deepinfer_kernels::dtype::{bf16_to_f32, ue8m0_to_f32};
use deepinfer_kernels::{Linear, WeightFormat};
use safetensors::{Dtype, SafeTensors};

/// An error while reading a checkpoint; names the file and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{file}: {problem}")]
    File { file: String, problem: String },
    #[error("{file}: tensor `{tensor}`: {problem}")]
    Tensor { file: String, tensor: String, problem: String },
    #[error("{dir}: no tensor named `{tensor}` in any *.safetensors file")]
    MissingTensor { dir: String, tensor: String },
}

struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    bytes: Bytes,
}

/// All tensors of a checkpoint directory (one or more `*.safetensors` shards).
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
}

/// A borrowed tensor: dtype, shape and raw little-endian bytes.
pub struct RawTensor<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: Bytes,
    file: &'a Path,
}

impl Checkpoint {
    /// Map every `*.safetensors` file in `dir` (sorted by name).
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let file_err = |problem: String| CheckpointError::File { file: dir.display().to_string(), problem };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| file_err(format!("cannot list directory: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            // Weight shards are `model.safetensors` or `model-0000N-of-0000M.safetensors`;
            // other safetensors files in the directory are not weights.
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    && p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("model"))
            })
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(file_err("no model*.safetensors files".into()));
        }
        let mut checkpoint = Self { dir: dir.to_path_buf(), shards: Vec::new(), tensors: BTreeMap::new() };
        for path in paths {
            let err = |problem: String| CheckpointError::File { file: path.display().to_string(), problem };
            let file = File::open(&path).map_err(|e| err(format!("cannot open: {e}")))?;
            // SAFETY: the mapping is read-only; a checkpoint modified while mapped is outside what we support.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| err(format!("cannot map: {e}")))?;
            checkpoint.add_shard(path, Bytes::from_owner(map))?;
        }
        Ok(checkpoint)
    }

    /// A checkpoint held in memory (one serialised safetensors buffer); `label` names it in errors.
    pub fn from_bytes(label: &str, bytes: Bytes) -> Result<Self, CheckpointError> {
        let mut checkpoint = Self { dir: PathBuf::from(label), shards: Vec::new(), tensors: BTreeMap::new() };
        checkpoint.add_shard(PathBuf::from(label), bytes)?;
        Ok(checkpoint)
    }

    fn add_shard(&mut self, path: PathBuf, bytes: Bytes) -> Result<(), CheckpointError> {
        let err = |problem: String| CheckpointError::File { file: path.display().to_string(), problem };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&bytes).map_err(|e| err(format!("not a safetensors file: {e}")))?;
        let data_start = 8 + header_len;
        let index = self.shards.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let entry = TensorEntry {
                shard: index,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + start,
                end: data_start + end,
            };
            if self.tensors.insert(name.clone(), entry).is_some() {
                return Err(err(format!("tensor `{name}` appears in more than one shard")));
            }
        }
        self.shards.push(Shard { path, bytes });
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Result<RawTensor<'_>, CheckpointError> {
        let (key, e) = self.tensors.get_key_value(name).ok_or_else(|| CheckpointError::MissingTensor {
            dir: self.dir.display().to_string(),
            tensor: name.into(),
        })?;
        let shard = &self.shards[e.shard];
        Ok(RawTensor {
            name: key,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: shard.bytes.slice(e.start..e.end),
            file: &shard.path,
        })
    }

    /// A float tensor of exactly `shape`, decoded to f32 (F32, BF16, F16 accepted).
    pub fn f32_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let t = self.get(name)?;
        t.expect_shape(shape)?;
        t.to_f32()
    }

    /// An integer tensor of exactly `shape` (I32, I64, U8, I8 accepted).
    pub fn int_tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<i64>, CheckpointError> {
        let t = self.get(name)?;
        t.expect_shape(shape)?;
        let b = &t.bytes;
        Ok(match t.dtype {
            Dtype::I64 => b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect(),
            Dtype::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as i64).collect(),
            Dtype::U8 => b.iter().map(|&v| v as i64).collect(),
            Dtype::I8 => b.iter().map(|&v| v as i8 as i64).collect(),
            other => return Err(t.error(format!("expected an integer dtype, found {other:?}"))),
        })
    }

    /// The linear layer `<prefix>.weight` of `rows × cols` (out × in), with its
    /// `<prefix>.scale` (or `.weight_scale_inv`) when quantised.
    pub fn linear(
        &self,
        prefix: &str,
        rows: usize,
        cols: usize,
        fp8_block: (usize, usize),
    ) -> Result<Linear, CheckpointError> {
        let name = format!("{prefix}.weight");
        let w = self.get(&name)?;
        let format = match w.dtype {
            Dtype::F32 | Dtype::F16 => {
                w.expect_shape(&[rows, cols])?;
                WeightFormat::F32(w.to_f32()?)
            }
            Dtype::BF16 => {
                w.expect_shape(&[rows, cols])?;
                WeightFormat::Bf16(w.bytes.clone())
            }
            Dtype::F8_E4M3 => {
                w.expect_shape(&[rows, cols])?;
                let (block_rows, block_cols) = fp8_block;
                let grid = [rows.div_ceil(block_rows), cols.div_ceil(block_cols)];
                let scales = self.scales(prefix, &grid)?;
                WeightFormat::Fp8 { data: w.bytes.clone(), scales, block_rows, block_cols }
            }
            Dtype::I8 | Dtype::U8 | Dtype::F4 => {
                // FP4 e2m1, two per byte along the input dimension.
                let packed_cols = if w.dtype == Dtype::F4 { cols } else { cols / 2 };
                w.expect_shape(&[rows, packed_cols])?;
                let scale = self.scale_tensor(prefix)?;
                let blocks = match scale.shape {
                    [r, b] if *r == rows && *b > 0 && cols.is_multiple_of(*b) => *b,
                    other => {
                        return Err(scale.error(format!(
                        "FP4 scale shape {other:?} does not fit weight of {rows}x{cols} (expected [{rows}, cols/32])"
                    )))
                    }
                };
                let scales = self.scales(prefix, &[rows, blocks])?;
                WeightFormat::Fp4 { data: w.bytes.clone(), scales, block_cols: cols / blocks }
            }
            other => return Err(w.error(format!("unsupported weight dtype {other:?}"))),
        };
        Ok(Linear { rows, cols, format })
    }

    fn scale_tensor(&self, prefix: &str) -> Result<RawTensor<'_>, CheckpointError> {
        let primary = format!("{prefix}.scale");
        if self.contains(&primary) {
            return self.get(&primary);
        }
        let alternative = format!("{prefix}.weight_scale_inv");
        if self.contains(&alternative) {
            return self.get(&alternative);
        }
        self.get(&primary)
    }

    fn scales(&self, prefix: &str, grid: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let s = self.scale_tensor(prefix)?;
        s.expect_shape(grid)?;
        match s.dtype {
            Dtype::F8_E8M0 | Dtype::U8 => Ok(s.bytes.iter().map(|&b| ue8m0_to_f32(b)).collect()),
            _ => s.to_f32(),
        }
    }
}

impl RawTensor<'_> {
    fn error(&self, problem: String) -> CheckpointError {
        CheckpointError::Tensor { file: self.file.display().to_string(), tensor: self.name.into(), problem }
    }

    pub fn expect_shape(&self, shape: &[usize]) -> Result<(), CheckpointError> {
        if self.shape != shape {
            return Err(self.error(format!("has shape {:?}, expected {shape:?}", self.shape)));
        }
        Ok(())
    }

    pub fn to_f32(&self) -> Result<Vec<f32>, CheckpointError> {
        let b = &self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect(),
            Dtype::BF16 => b.chunks_exact(2).map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect(),
            Dtype::F16 => {
                b.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
            }
            other => return Err(self.error(format!("expected a float dtype, found {other:?}"))),
        })
    }
}
