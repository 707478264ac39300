//! Memory-mapped safetensors checkpoints in DeepSeek's published tensor naming.
//!
//! Quantised weights stay in their stored bytes (borrowed from the mapping);
//! only their small scale grids are decoded at load time. Tensors stored under
//! transformers' spellings are found under their published names ([`naming`]).

mod naming;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use bytes::Bytes;
use deepinfer_kernels::dtype::{bf16_to_f32, ue8m0_to_f32};
use deepinfer_kernels::{Linear, WeightFormat};
pub use naming::published_name;
use safetensors::{Dtype, SafeTensors};

/// The index of a sharded checkpoint.
pub const SHARD_INDEX: &str = "model.safetensors.index.json";
/// Shard files an index may list; more is not a checkpoint we accept.
const SHARDS_MAX: usize = 100_000;

/// An error while reading a checkpoint; names the file and, where there is one, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{file}: {problem}")]
    File { file: String, problem: String },
    #[error("{file}: tensor `{tensor}`: {problem}")]
    Tensor { file: String, tensor: String, problem: String },
    #[error("{dir}: no tensor named `{tensor}` in any *.safetensors file")]
    MissingTensor { dir: String, tensor: String },
    #[error("{file}: tensor `{tensor}` is not part of this model{more}")]
    Unknown { file: String, tensor: String, more: String },
}

struct TensorEntry {
    shard: usize,
    /// The name in the file, for errors.
    stored: String,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    bytes: Bytes,
    /// The open file, for reads that copy a tensor out instead of borrowing the mapping.
    file: Option<File>,
}

/// All tensors of a checkpoint directory (one or more `*.safetensors` shards),
/// keyed by published name.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Published names the loader has asked for, so that leftovers can be reported.
    used: Mutex<BTreeSet<String>>,
    /// Tensors are read from the files into memory of their own instead of
    /// borrowing the mapping: what is dropped is then freed, and the pages of
    /// tensors never read never count against the process.
    owned_reads: bool,
}

/// A borrowed tensor: dtype, shape and raw little-endian bytes.
pub struct RawTensor<'a> {
    /// The name as stored in the file.
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: Bytes,
    file: &'a Path,
}

impl Checkpoint {
    /// Map the weight shards of `dir`: those `model.safetensors.index.json` lists, or
    /// else every `model*.safetensors` file (sorted by name).
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        Self::open_with(dir, false)
    }

    /// [`Checkpoint::open`] for loading parts on demand: each tensor asked for is
    /// read into memory of its own (only the headers are touched through the mapping).
    pub fn open_for_reads(dir: &Path) -> Result<Self, CheckpointError> {
        Self::open_with(dir, true)
    }

    fn open_with(dir: &Path, owned_reads: bool) -> Result<Self, CheckpointError> {
        let file_err = |problem: String| CheckpointError::File { file: dir.display().to_string(), problem };
        let index_path = dir.join(SHARD_INDEX);
        let (paths, weight_map) = if index_path.exists() {
            let (paths, map) = read_shard_index(&index_path)?;
            (paths.into_iter().map(|p| dir.join(p)).collect(), Some(map))
        } else {
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
            (paths, None)
        };
        if paths.is_empty() {
            return Err(file_err("no model*.safetensors files".into()));
        }
        let mut checkpoint = Self::empty(dir.to_path_buf());
        checkpoint.owned_reads = owned_reads;
        for path in paths {
            let err = |problem: String| CheckpointError::File { file: path.display().to_string(), problem };
            let file = File::open(&path).map_err(|e| err(format!("cannot open: {e}")))?;
            // SAFETY: the mapping is read-only; a checkpoint modified while mapped is outside what we support.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| err(format!("cannot map: {e}")))?;
            checkpoint.add_shard(path, Bytes::from_owner(map), Some(file))?;
        }
        if let Some(map) = weight_map {
            checkpoint.check_weight_map(&index_path, &map)?;
        }
        Ok(checkpoint)
    }

    /// A checkpoint held in memory (one serialised safetensors buffer); `label` names it in errors.
    pub fn from_bytes(label: &str, bytes: Bytes) -> Result<Self, CheckpointError> {
        let mut checkpoint = Self::empty(PathBuf::from(label));
        checkpoint.add_shard(PathBuf::from(label), bytes, None)?;
        Ok(checkpoint)
    }

    fn empty(dir: PathBuf) -> Self {
        Self {
            dir,
            shards: Vec::new(),
            tensors: BTreeMap::new(),
            used: Mutex::new(BTreeSet::new()),
            owned_reads: false,
        }
    }

    fn add_shard(&mut self, path: PathBuf, bytes: Bytes, file: Option<File>) -> Result<(), CheckpointError> {
        let err = |problem: String| CheckpointError::File { file: path.display().to_string(), problem };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&bytes).map_err(|e| err(format!("not a safetensors file: {e}")))?;
        let data_start = 8 + header_len;
        let index = self.shards.len();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let published = published_name(&name);
            let entry = TensorEntry {
                shard: index,
                stored: name.clone(),
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + start,
                end: data_start + end,
            };
            if let Some(previous) = self.tensors.insert(published.clone(), entry) {
                let first = &previous.stored;
                let problem = if *first == name {
                    format!("tensor `{name}` appears in more than one shard")
                } else {
                    format!("tensors `{first}` and `{name}` are both `{published}`")
                };
                return Err(err(problem));
            }
        }
        self.shards.push(Shard { path, bytes, file });
        Ok(())
    }

    /// Every tensor the index names is in the shard it names.
    fn check_weight_map(&self, index: &Path, map: &BTreeMap<String, String>) -> Result<(), CheckpointError> {
        let err = |problem: String| CheckpointError::File { file: index.display().to_string(), problem };
        for (stored, shard_file) in map {
            let Some(entry) = self.tensors.get(&published_name(stored)) else {
                return Err(err(format!("lists tensor `{stored}`, which is in none of its shards")));
            };
            let actual = &self.shards[entry.shard].path;
            if actual.file_name().and_then(|n| n.to_str()) != Some(shard_file.as_str()) {
                return Err(err(format!(
                    "places tensor `{stored}` in {shard_file}, but it is in {}",
                    actual.display()
                )));
            }
        }
        if let Some((name, entry)) = self.tensors.iter().find(|(_, e)| !map.contains_key(&e.stored)) {
            return Err(CheckpointError::Tensor {
                file: self.shards[entry.shard].path.display().to_string(),
                tensor: entry.stored.clone(),
                problem: format!("is missing from {} (published name `{name}`)", index.display()),
            });
        }
        Ok(())
    }

    /// Tensors nobody asked for, as an error naming the first; `ignore` exempts
    /// published names (parts the configuration leaves out).
    pub fn check_all_used(&self, ignore: impl Fn(&str) -> bool) -> Result<(), CheckpointError> {
        let used = self.used.lock().expect("checkpoint use set");
        let mut unused = self.tensors.iter().filter(|(name, _)| !used.contains(*name) && !ignore(name));
        let Some((_, first)) = unused.next() else {
            return Ok(());
        };
        let others = unused.count();
        Err(CheckpointError::Unknown {
            file: self.shards[first.shard].path.display().to_string(),
            tensor: first.stored.clone(),
            more: if others > 0 { format!(" (and {others} more)") } else { String::new() },
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensor of published name `name`, however the file spells it.
    pub fn get(&self, name: &str) -> Result<RawTensor<'_>, CheckpointError> {
        self.read(name, None)
    }

    /// Slab `index` along the first dimension of tensor `name`: its bytes
    /// only (`shape` stays the whole tensor's), read alone with owned reads.
    pub fn get_slab(&self, name: &str, index: usize) -> Result<RawTensor<'_>, CheckpointError> {
        self.read(name, Some(index))
    }

    fn read(&self, name: &str, slab: Option<usize>) -> Result<RawTensor<'_>, CheckpointError> {
        let e = self.tensors.get(name).ok_or_else(|| CheckpointError::MissingTensor {
            dir: self.dir.display().to_string(),
            tensor: name.into(),
        })?;
        self.used.lock().expect("checkpoint use set").insert(name.to_string());
        let shard = &self.shards[e.shard];
        let tensor_error = |problem: String| CheckpointError::Tensor {
            file: shard.path.display().to_string(),
            tensor: e.stored.clone(),
            problem,
        };
        let (start, end) = match slab {
            None => (e.start, e.end),
            Some(index) => {
                let slabs = e.shape.first().copied().unwrap_or(0);
                if index >= slabs {
                    return Err(tensor_error(format!("has no slab {index} (shape {:?})", e.shape)));
                }
                let size = (e.end - e.start) / slabs;
                (e.start + index * size, e.start + (index + 1) * size)
            }
        };
        let bytes = match &shard.file {
            Some(file) if self.owned_reads => read_range(file, start, end)
                .map_err(|err| tensor_error(format!("cannot read bytes {start}..{end}: {err}")))?,
            _ => shard.bytes.slice(start..end),
        };
        Ok(RawTensor { name: &e.stored, dtype: e.dtype, shape: &e.shape, bytes, file: &shard.path })
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
                WeightFormat::fp8(w.bytes.clone(), scales, block_rows, block_cols)
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

/// Bytes `start..end` of `file`, read into memory of their own.
fn read_range(file: &File, start: usize, end: usize) -> std::io::Result<Bytes> {
    let mut buffer = vec![0u8; end - start];
    #[cfg(unix)]
    std::os::unix::fs::FileExt::read_exact_at(file, &mut buffer, start as u64)?;
    #[cfg(not(unix))]
    {
        use std::io::{Read, Seek};
        let mut file = file;
        file.seek(std::io::SeekFrom::Start(start as u64))?;
        file.read_exact(&mut buffer)?;
    }
    Ok(Bytes::from(buffer))
}

/// The shard files of an index and its tensor → file map.
fn read_shard_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>), CheckpointError> {
    let err = |problem: String| CheckpointError::File { file: path.display().to_string(), problem };
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| err("missing key `weight_map` (an object of tensor name -> shard file)".into()))?;
    let mut weight_map = BTreeMap::new();
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| err(format!("key `weight_map.{tensor}`: expected a file name")))?;
        // Shards live beside the index; a path elsewhere is not part of this checkpoint.
        if file.contains('/') || file.contains('\\') || file == ".." || !file.ends_with(".safetensors") {
            return Err(err(format!(
                "key `weight_map.{tensor}`: `{file}` is not a .safetensors file beside the index"
            )));
        }
        files.insert(file.to_string());
        weight_map.insert(tensor.clone(), file.to_string());
    }
    if files.len() > SHARDS_MAX {
        return Err(err(format!("lists {} shard files, more than {SHARDS_MAX}", files.len())));
    }
    for file in &files {
        let shard = path.with_file_name(file);
        if !shard.is_file() {
            return Err(err(format!(
                "lists shard {file}, which is not in {}",
                path.parent().unwrap_or(path).display()
            )));
        }
    }
    Ok((files.into_iter().collect(), weight_map))
}

impl RawTensor<'_> {
    pub fn error(&self, problem: String) -> CheckpointError {
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
