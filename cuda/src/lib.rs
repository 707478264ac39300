//! deepinfer's NVIDIA device.
//!
//! The kernels are `.cu` files in `cuda/kernels/`. They run in one of two
//! places behind one launch interface ([`Gpu`]):
//!
//! - a real GPU through cudarc, with libcuda loaded at run time (a machine
//!   without CUDA builds and runs everything else, and asking it for a GPU
//!   is one clear error); kernels come from NVRTC at first use (`nvrtc.rs`);
//! - the emulated device: the same sources compiled for the host by the C++
//!   compiler (`emu/`), device memory being host memory, so that `cargo
//!   test` runs every kernel and the executor above them without a GPU.
//!
//! `ops/` are the typed launches the model's forward pass calls.

mod device;
mod driver;
pub mod nvrtc;
pub mod ops;
pub mod pool;
mod table;

pub use device::{Arg, DeviceBuffer, DeviceError, DeviceValue, Gpu, GpuKind};
pub use table::{kernel, KernelInfo, ParamKind, KERNELS};

/// The source of one kernel file as NVRTC compiles it: each header of
/// `cuda/kernels/` it includes inlined (NVRTC is given no include path).
pub fn nvrtc_source(file: &str) -> Option<String> {
    let mut source = table::SOURCES.iter().find(|(stem, _)| *stem == file)?.1.to_string();
    for (name, text) in table::HEADERS {
        source = source.replace(&format!("#include \"{name}\""), text);
    }
    Some(source)
}

/// Every kernel file's stem.
pub fn kernel_files() -> impl Iterator<Item = &'static str> {
    table::SOURCES.iter().map(|(stem, _)| *stem)
}

/// The device tests run on: the emulated device, or what
/// `DEEPINFER_TEST_DEVICE` names: `cuda` (GPU 0: how `tools/gpu/check.sh`
/// runs the same test binaries on a real GPU) or `emulated-reversed` (each
/// block's threads in the opposite order, which exposes a missing barrier).
pub fn test_gpu() -> Gpu {
    match std::env::var("DEEPINFER_TEST_DEVICE").as_deref() {
        Ok("cuda") => Gpu::cuda(0).unwrap_or_else(|e| panic!("DEEPINFER_TEST_DEVICE=cuda: {e}")),
        Ok("emulated") | Err(_) => Gpu::emulated(),
        Ok("emulated-reversed") => Gpu::emulated_reversed(),
        Ok(other) => panic!("DEEPINFER_TEST_DEVICE={other}: expected cuda, emulated or emulated-reversed"),
    }
}
