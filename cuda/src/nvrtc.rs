//! Kernels compiled by NVRTC (loaded at run time, like libcuda): to a cubin
//! for one architecture (which runs the real assembler, `ptxas`) or to PTX,
//! with `ptxas`'s per-kernel report parsed into registers, spills and shared
//! memory.

use std::ffi::CString;

use cudarc::nvrtc::{result, sys};

use crate::device::DeviceError;

/// What NVRTC is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// Machine code for one GPU, e.g. `sm_90a` (Hopper) or `sm_100a` (Blackwell).
    Cubin(&'a str),
    /// PTX for a virtual architecture, e.g. `compute_90`, which the driver compiles at load.
    Ptx(&'a str),
}

/// One compiled kernel file.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub image: Vec<u8>,
    pub log: String,
}

/// What `ptxas` reported for one kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KernelReport {
    pub name: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub stack_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
}

/// Whether libnvrtc can be loaded on this machine.
pub fn available() -> bool {
    // SAFETY: only probes for the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32), DeviceError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
    Ok((major, minor))
}

/// The options every kernel is compiled with. `--fmad=false`: a multiply and
/// an add stay two roundings unless the source fuses them (`__fmaf_rn`), as
/// on the CPU, whose kernels define the bits.
fn options(target: Target) -> Vec<String> {
    let arch = match target {
        Target::Cubin(a) | Target::Ptx(a) => a,
    };
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--ptxas-options=-v".into(),
        "--ptxas-options=--warn-on-spills".into(),
    ]
}

/// Compile kernel file `file` (a stem of `cuda/kernels/`) for `target`.
pub fn compile(file: &str, target: Target) -> Result<Compiled, DeviceError> {
    if !available() {
        return Err(DeviceError::Compile("libnvrtc is not on this machine (LD_LIBRARY_PATH)".into()));
    }
    let source = crate::nvrtc_source(file).ok_or_else(|| DeviceError::Compile(format!("no kernel file {file}")))?;
    let src = CString::new(source).map_err(|_| DeviceError::Compile(format!("{file}.cu holds a NUL byte")))?;
    let name = CString::new(format!("{file}.cu")).expect("a file name without NUL");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
    // SAFETY: `prog` is live until destroyed at the end of this block.
    unsafe {
        let compiled = result::compile_program(prog, &options(target));
        let log = result::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_default();
        let image = match (compiled, target) {
            (Err(e), _) => {
                let _ = result::destroy_program(prog);
                return Err(DeviceError::Compile(format!("{file}.cu for {target:?}: {e:?}\n{log}")));
            }
            (Ok(()), Target::Ptx(_)) => {
                let ptx = result::get_ptx(prog).map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
                let mut bytes: Vec<u8> = ptx.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                bytes.push(0);
                bytes
            }
            (Ok(()), Target::Cubin(_)) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
                let mut bytes = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, bytes.as_mut_ptr() as *mut _)
                    .result()
                    .map_err(|e| DeviceError::Compile(format!("{e:?}")))?;
                bytes
            }
        };
        let _ = result::destroy_program(prog);
        Ok(Compiled { image, log })
    }
}

/// The per-kernel lines of a `ptxas -v` log.
pub fn parse_report(log: &str) -> Vec<KernelReport> {
    let mut reports: Vec<KernelReport> = Vec::new();
    for line in log.lines() {
        let line = line.trim();
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            reports.push(KernelReport { name, ..Default::default() });
            continue;
        }
        let Some(current) = reports.last_mut() else { continue };
        let number_before = |text: &str, unit: &str| -> Option<u32> {
            let at = text.find(unit)?;
            text[..at].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
        };
        if line.contains("Used") && line.contains("registers") {
            current.registers = number_before(line, " registers").unwrap_or(0);
            current.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
        }
        if line.contains("stack frame") {
            current.stack_bytes = number_before(line, " bytes stack frame").unwrap_or(0);
            current.spill_stores = number_before(line, " bytes spill stores").unwrap_or(0);
            current.spill_loads = number_before(line, " bytes spill loads").unwrap_or(0);
        }
    }
    reports
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ptxas_log_parses_into_kernels() {
        let log = "ptxas info    : 0 bytes gmem\n\
            ptxas info    : Compiling entry function 'rms_norm_rows' for 'sm_90a'\n\
            ptxas info    : Function properties for rms_norm_rows\n\
            \x20   8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
            ptxas info    : Used 30 registers, used 1 barriers, 64 bytes smem, 380 bytes cmem[0]\n\
            ptxas info    : Compiling entry function 'b' for 'sm_90a'\n\
            ptxas info    : Used 8 registers, 368 bytes cmem[0]\n";
        let r = parse_report(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            KernelReport {
                name: "rms_norm_rows".into(),
                registers: 30,
                shared_bytes: 64,
                stack_bytes: 8,
                spill_stores: 4,
                spill_loads: 12
            }
        );
        assert_eq!((r[1].registers, r[1].shared_bytes, r[1].spill_stores), (8, 0, 0));
    }
}
