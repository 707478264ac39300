//! Tidy checks: invariants of the source tree written as absences, so that
//! `cargo test` fails the day one stops holding.

use std::path::{Path, PathBuf};

/// Longest a source file may grow without saying at its top why.
const LONG_FILE_LINES: usize = 600;
/// What a long file writes in its first lines to say why it is long.
const LONG_FILE_MARK: &str = "tidy: long file";

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file below `dir` (relative to the workspace), sorted.
fn sources(dir: &str) -> Vec<(String, String)> {
    files(dir, &["rs"])
}

/// Every file below `dir` (relative to the workspace) whose extension is one
/// of `exts`, sorted, as (path, text).
fn files(dir: &str, exts: &[&str]) -> Vec<(String, String)> {
    fn walk(dir: &Path, exts: &[&str], out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                walk(&p, exts, out);
            } else if p.extension().is_some_and(|x| exts.iter().any(|e| x == *e)) {
                out.push(p);
            }
        }
    }
    let root = workspace();
    let mut files = Vec::new();
    walk(&root.join(dir), exts, &mut files);
    files.sort();
    assert!(!files.is_empty(), "no {exts:?} files under {dir}");
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p.strip_prefix(&root).expect("below the workspace").display().to_string(), text)
        })
        .collect()
}

/// The device kernels' sources: what NVRTC and the emulated device compile.
fn kernel_sources() -> Vec<(String, String)> {
    files("cuda/kernels", &["cu", "cuh"])
}

/// Lines of code (comments dropped) that contain one of `words`, as `file:line: text`.
fn uses(files: &[(String, String)], words: &[&str]) -> Vec<String> {
    let mut found = Vec::new();
    for (path, text) in files {
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if words.iter().any(|w| code.contains(w)) {
                found.push(format!("{path}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    found
}

#[test]
fn protocol_machines_touch_no_runtime_clock_or_socket() {
    let words = ["ractor", "tokio", "Instant", "SystemTime", ".clock", ".transport", "send_message", "spawn", "async"];
    let found = uses(&sources("actors/src/proto"), &words);
    assert!(found.is_empty(), "I/O inside a protocol machine (it belongs in actors/src/actor):\n{}", found.join("\n"));
}

#[test]
fn only_the_wire_schema_derives_rkyv() {
    let files: Vec<_> = sources("actors/src")
        .into_iter()
        .chain(sources("src"))
        .filter(|(p, _)| !p.starts_with("actors/src/wire/") && p != "src/tidy.rs")
        .collect();
    let found = uses(&files, &["rkyv::", "Archive", "use rkyv"]);
    assert!(found.is_empty(), "rkyv outside actors/src/wire/:\n{}", found.join("\n"));
}

#[test]
fn lower_layers_of_the_actors_name_no_higher_one() {
    // wire ← proto ← actor; the wire schema is the bottom of every layer.
    // (`cluster/topology.rs` names nothing else of the crate.)
    let layers = [
        ("actors/src/wire", &["crate::actor", "crate::proto", "crate::cluster", "crate::net", "crate::modelled"][..]),
        ("actors/src/proto", &["crate::actor", "crate::net::quic", "crate::net::tls"][..]),
        // The cost model and modelled devices see the topology, never the actors or their context.
        ("actors/src/modelled", &["crate::actor", "crate::proto", "crate::cluster::ctx", "crate::net"][..]),
    ];
    for (dir, higher) in layers {
        let found = uses(&sources(dir), higher);
        assert!(found.is_empty(), "{dir} reaches up a layer:\n{}", found.join("\n"));
    }
}

#[test]
fn actors_share_mutable_state_only_through_the_durable_table() {
    // Machines, shells and the cluster learn everything else from frames;
    // counters go through `sim::events`, locks of the runtime stay in `net/` and `sim/`.
    let files: Vec<_> = ["actors/src/proto", "actors/src/actor", "actors/src/cluster"]
        .into_iter()
        .flat_map(sources)
        .filter(|(p, _)| p != "actors/src/cluster/durable.rs")
        .collect();
    let words = ["RwLock", "Mutex", "AtomicU64", "AtomicU32", "AtomicUsize", "AtomicBool", "RefCell", "static mut"];
    let found = uses(&files, &words);
    assert!(found.is_empty(), "shared mutable state outside cluster/durable.rs:\n{}", found.join("\n"));
}

#[test]
fn the_engine_and_kernels_are_synchronous_and_read_no_clock() {
    let files: Vec<_> = sources("engine/src").into_iter().chain(sources("kernels/src")).collect();
    let words = ["tokio", "async", "futures", "ractor", "Instant", "SystemTime", "std::thread::sleep"];
    let found = uses(&files, &words);
    assert!(found.is_empty(), "the engine is sans-IO (time is handed in):\n{}", found.join("\n"));
}

#[test]
fn decisions_never_iterate_a_hash_map() {
    // Lookups only: the prefix cache's two indexes and a step's answers by
    // sequence are never iterated.
    let allowed = ["engine/src/prefix_cache.rs", "actors/src/proto/scheduler/by_seq.rs"];
    let files: Vec<_> = ["engine/src", "actors/src", "kernels/src"]
        .into_iter()
        .flat_map(sources)
        .filter(|(p, _)| !allowed.contains(&p.as_str()))
        .collect();
    let found = uses(&files, &["HashMap", "HashSet"]);
    assert!(found.is_empty(), "use a BTreeMap (iteration order decides):\n{}", found.join("\n"));
}

#[test]
fn long_files_say_why() {
    let files: Vec<_> = ["src", "engine/src", "actors/src", "kernels/src", "tests", "engine/tests", "actors/tests"]
        .into_iter()
        .flat_map(sources)
        // The device crate: its Rust, kernels and emulator.
        .chain(files("cuda", &["rs", "cu", "cuh", "cpp", "h"]))
        .collect();
    let long: Vec<String> = files
        .iter()
        .filter(|(_, text)| text.lines().count() > LONG_FILE_LINES)
        .filter(|(_, text)| !text.lines().take(10).any(|l| l.contains(LONG_FILE_MARK)))
        .map(|(p, text)| format!("{p}: {} lines", text.lines().count()))
        .collect();
    assert!(
        long.is_empty(),
        "over {LONG_FILE_LINES} lines without `{LONG_FILE_MARK}: <why>` in the first ten lines (or split it):\n{}",
        long.join("\n")
    );
}

#[test]
fn kernels_use_no_atomics() {
    // A reduction's order is fixed by the kernel (the CPU's order), never by
    // which thread arrives first: an atomic add makes the bits a race.
    let found = uses(&kernel_sources(), &["atomic"]);
    assert!(found.is_empty(), "an atomic in a kernel (reduce in a fixed order instead):\n{}", found.join("\n"));
}

#[test]
fn kernels_hold_no_inline_ptx() {
    // The kernels are portable C++: the emulated device compiles them for the
    // host, and another device (Ascend) will run the same definitions.
    let found = uses(&kernel_sources(), &["asm(", "asm (", "asm volatile", "__asm"]);
    assert!(found.is_empty(), "inline PTX in a kernel (cuda_emu.h cannot run it):\n{}", found.join("\n"));
}

#[test]
fn kernels_include_only_their_own_headers() {
    // No CUDA toolkit header: the emulated device and NVRTC need nothing
    // installed. NVRTC gets no include path: a kernel file includes only
    // headers of cuda/kernels/ by their quoted name, which `nvrtc_source`
    // inlines.
    let own: Vec<String> = std::fs::read_dir(workspace().join("cuda/kernels"))
        .expect("cuda/kernels")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|name| name.ends_with(".cuh"))
        .map(|name| format!("\"{name}\""))
        .collect();
    let mut found = Vec::new();
    for (path, text) in kernel_sources() {
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("").trim();
            let directive = code.strip_prefix('#').map(str::trim_start);
            let included = directive.and_then(|d| d.strip_prefix("include")).map(str::trim);
            if included.is_some_and(|file| !own.iter().any(|o| o == file)) {
                found.push(format!("{path}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(found.is_empty(), "a kernel includes a header not of cuda/kernels/:\n{}", found.join("\n"));
}
