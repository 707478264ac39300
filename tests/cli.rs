//! The program as a user runs it: real processes of the built binary.

use std::path::PathBuf;
use std::process::{Command, Output};

fn deepinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer")).args(args).output().expect("binary runs")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("deepinfer-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn builtin_model_generates_without_any_files() {
    let o = deepinfer(&[
        "generate",
        "--model",
        "builtin:tiny-v4",
        "--prompt",
        "Hello",
        "--max-tokens",
        "8",
        "--show-tokens",
    ]);
    let out = stdout(&o);
    assert!(out.contains("tokens: ["), "{out}");
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("generated 8 tokens") && stderr.contains("tokens/s"), "{stderr}");
}

#[test]
fn model_init_then_generate_is_reproducible() {
    let dir = temp_dir("init");
    let out =
        stdout(&deepinfer(&["model", "init", "--preset", "tiny-v4", "--seed", "3", "--out", dir.to_str().unwrap()]));
    assert!(out.contains("wrote tiny-v4"), "{out}");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(dir.join(file).exists(), "{file}");
    }
    let args = ["generate", "--model", dir.to_str().unwrap(), "--prompt", "The quick brown fox", "--max-tokens", "12"];
    let sampled = [&args[..], &["--temperature", "0.8", "--top-p", "0.9", "--seed", "5", "--show-tokens"]].concat();
    let first = stdout(&deepinfer(&sampled));
    assert_eq!(first, stdout(&deepinfer(&sampled)), "same seed, same tokens");
    let other_seed = [&args[..], &["--temperature", "0.8", "--top-p", "0.9", "--seed", "6", "--show-tokens"]].concat();
    assert_ne!(first, stdout(&deepinfer(&other_seed)), "another seed, other tokens");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_broken_checkpoint_is_reported_with_its_file() {
    let dir = temp_dir("broken");
    stdout(&deepinfer(&["model", "init", "--out", dir.to_str().unwrap()]));
    std::fs::write(dir.join("config.json"), r#"{"model_type": "deepseek_v4", "hidden_size": 64}"#).unwrap();
    let o = deepinfer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "x"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("config.json") && err.contains("missing key `num_hidden_layers`"), "{err}");

    stdout(&deepinfer(&["model", "init", "--out", dir.to_str().unwrap()]));
    std::fs::write(dir.join("model.safetensors"), b"not a checkpoint").unwrap();
    let o = deepinfer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "x"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("model.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn model_init_takes_the_real_tokenizer() {
    let real = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/assets/deepseek-v4/tokenizer.json");
    if !real.exists() {
        eprintln!("skipped: {} is not here", real.display());
        return;
    }
    let dir = temp_dir("real-tokenizer");
    stdout(&deepinfer(&["model", "init", "--out", dir.to_str().unwrap(), "--tokenizer", real.to_str().unwrap()]));
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains("\"vocab_size\": 129280"), "{config}");
    let out =
        stdout(&deepinfer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "你好", "--max-tokens", "4"]));
    assert!(!out.trim().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// DeepSeek-V4.1: the built-in preset and a `model init`'d directory give the
/// same tokens; with the real tokenizer the Engram vocabulary is derived from
/// it at load time (no map file, as in a published checkpoint).
#[test]
fn v41_builtin_and_initialised_directory_agree() {
    let dir = temp_dir("v41");
    let out = stdout(&deepinfer(&["model", "init", "--preset", "tiny-v41", "--out", dir.to_str().unwrap()]));
    assert!(out.contains("wrote tiny-v41"), "{out}");
    assert!(dir.join("engram_token_map.json").is_file());
    let run = |model: &str| {
        stdout(&deepinfer(&[
            "generate",
            "--model",
            model,
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            "12",
            "--show-tokens",
        ]))
    };
    assert_eq!(run("builtin:tiny-v41"), run(dir.to_str().unwrap()));
    let _ = std::fs::remove_dir_all(&dir);

    let real = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/assets/deepseek-v4/tokenizer.json");
    if !real.exists() {
        eprintln!("skipped the real tokenizer: {} is not here", real.display());
        return;
    }
    let dir = temp_dir("v41-real");
    stdout(&deepinfer(&[
        "model",
        "init",
        "--preset",
        "tiny-v41",
        "--out",
        dir.to_str().unwrap(),
        "--tokenizer",
        real.to_str().unwrap(),
    ]));
    assert!(!dir.join("engram_token_map.json").exists());
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains("\"engram_compressed_vocab_size\": 99092"), "{config}");
    let out =
        stdout(&deepinfer(&["generate", "--model", dir.to_str().unwrap(), "--prompt", "你好", "--max-tokens", "4"]));
    assert!(!out.trim().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--device cuda` on a machine without the CUDA driver: one line, a failing
/// exit, before any model loads. (On a GPU machine the driver is there and
/// the run is `tools/gpu/check.sh`'s to test.)
#[test]
fn device_cuda_without_a_driver_fails_at_once_with_one_line() {
    if deepinfer_cuda::Gpu::cuda(0).is_ok() {
        eprintln!("a CUDA device is present: the missing-driver message cannot be shown here");
        return;
    }
    let o = deepinfer(&["generate", "--model", "builtin:tiny-v4", "--device", "cuda", "--prompt", "Hello"]);
    assert!(!o.status.success(), "a run without a GPU must fail");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    assert!(lines[0].contains("--device cuda") && lines[0].contains("no CUDA driver"), "{stderr}");
    assert!(o.stdout.is_empty(), "nothing generated");
}

/// The emulated device prints the CPU's text and tokens (the engine's bits).
#[test]
fn device_emulated_generates_the_cpus_tokens() {
    let args = ["generate", "--model", "builtin:tiny-v4-trained", "--prompt", "fn main() {", "--max-tokens", "16"];
    let cpu = stdout(&deepinfer(&[&args[..], &["--show-tokens"]].concat()));
    let o = deepinfer(&[&args[..], &["--show-tokens", "--device", "emulated"]].concat());
    assert_eq!(stdout(&o), cpu);
    assert!(String::from_utf8_lossy(&o.stderr).contains("device: emulated device"));
}
