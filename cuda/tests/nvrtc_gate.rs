//! The compile gate: every kernel file through NVRTC to Hopper and Blackwell
//! cubins (the real assembler) and to PTX, failing on an error, a register
//! spill or static shared memory above the limit; prints each kernel's
//! registers, shared memory and stack frame (a local array, not a spill, is
//! allowed a frame).
//!
//! Needs libnvrtc (the `nvidia-cuda-nvrtc` wheel, on `LD_LIBRARY_PATH`):
//! without it the test says so and passes, unless `DEEPINFER_REQUIRE_NVRTC=1`
//! (which `.ci/run` sets).

use deepinfer_cuda::nvrtc::{self, parse_report, Target};

/// Static shared memory a kernel may take without opting in (48 KiB).
const SHARED_LIMIT: u32 = 48 * 1024;

#[test]
fn every_kernel_compiles_for_hopper_and_blackwell_without_spills() {
    if !nvrtc::available() {
        assert!(
            std::env::var("DEEPINFER_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "DEEPINFER_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded (LD_LIBRARY_PATH)"
        );
        eprintln!("NVRTC compile gate skipped: libnvrtc is not on this machine");
        return;
    }
    let (major, minor) = nvrtc::version().unwrap();
    println!("NVRTC {major}.{minor}");
    let mut failures = Vec::new();
    let mut table = vec![
        format!("| kernel | file | arch | registers | shared bytes | stack bytes |"),
        "|---|---|---|---:|---:|---:|".into(),
    ];
    let files: Vec<&str> = deepinfer_cuda::kernel_files().collect();
    for file in &files {
        for arch in ["sm_90a", "sm_100a"] {
            match nvrtc::compile(file, Target::Cubin(arch)) {
                Err(e) => failures.push(format!("{file}.cu for {arch}: {e}")),
                Ok(compiled) => {
                    let reports = parse_report(&compiled.log);
                    let kernels: Vec<_> = deepinfer_cuda::KERNELS.iter().filter(|k| k.file == *file).collect();
                    for k in &kernels {
                        let Some(r) = reports.iter().find(|r| r.name == k.name) else {
                            failures.push(format!("{file}.cu for {arch}: no ptxas report for {}", k.name));
                            continue;
                        };
                        if r.spill_stores > 0 || r.spill_loads > 0 {
                            failures.push(format!(
                                "{} on {arch}: {} bytes spilled",
                                k.name,
                                r.spill_stores + r.spill_loads
                            ));
                        }
                        if r.shared_bytes > SHARED_LIMIT {
                            failures.push(format!(
                                "{} on {arch}: {} bytes of static shared memory",
                                k.name, r.shared_bytes
                            ));
                        }
                        table.push(format!(
                            "| `{}` | {file}.cu | {arch} | {} | {} | {} |",
                            k.name, r.registers, r.shared_bytes, r.stack_bytes
                        ));
                    }
                    assert!(!compiled.image.is_empty());
                }
            }
        }
        // PTX for the driver to compile at load: a 13.0 NVRTC's PTX loads on a 13.0 driver.
        if let Err(e) = nvrtc::compile(file, Target::Ptx("compute_90")) {
            failures.push(format!("{file}.cu to PTX: {e}"));
        }
    }
    println!("{}", table.join("\n"));
    assert!(failures.is_empty(), "compile gate:\n{}", failures.join("\n"));
}
