//! `deepinfer generate --devices N --expert-parallel E` runs the in-process
//! actor cluster; the real binary's output bytes equal the single-device run,
//! for one prompt and for a batch file.

use std::path::PathBuf;
use std::process::{Command, Output};

fn deepinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_deepinfer")).args(args).output().expect("binary runs")
}

fn stdout(o: &Output) -> Vec<u8> {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    o.stdout.clone()
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("deepinfer-cluster-cli-{}-{name}", std::process::id()))
}

/// Device layouts compared with one device: full expert parallelism, 4 × 2
/// (each expert on two devices), and 2 devices with the default degree.
const LAYOUTS: [&[&str]; 3] =
    [&["--devices", "8", "--expert-parallel", "8"], &["--devices", "4", "--expert-parallel", "2"], &["--devices", "2"]];

#[test]
fn one_prompt_on_eight_devices_prints_the_same_bytes_as_one() {
    for sampling in [&[][..], &["--temperature", "0.8", "--top-p", "0.9", "--top-k", "40", "--seed", "11"][..]] {
        let base =
            [&["generate", "--prompt", "The quick brown fox", "--max-tokens", "24", "--show-tokens"][..], sampling]
                .concat();
        let one = stdout(&deepinfer(&[&base[..], &["--devices", "1"]].concat()));
        assert!(String::from_utf8_lossy(&one).contains("tokens: ["));
        for layout in LAYOUTS {
            let o = deepinfer(&[&base[..], layout].concat());
            assert_eq!(stdout(&o), one, "{layout:?} {sampling:?}");
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(err.contains(&format!("on {} devices", layout[1])), "{err}");
        }
    }
}

/// The workers of an in-process cluster draft with the trained model's MTP
/// block: the bytes are those of one device without drafts; with a fixed
/// length they verify and accept exactly the drafts one device does, and
/// with adaptive lengths (against the step time measured at start) drafts
/// are accepted too.
#[test]
fn drafting_devices_print_the_same_bytes_as_one_without_drafts() {
    let base = ["generate", "--model", "builtin:tiny-v4-trained", "--prompt", "impl<T> Iterator for"];
    let base = [&base[..], &["--max-tokens", "48", "--show-tokens"]].concat();
    let one = stdout(&deepinfer(&[&base[..], &["--speculative", "off"]].concat()));
    let drafts_line = |o: &Output| {
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        err.lines()
            .find(|l| l.starts_with("speculative mtp: "))
            .unwrap_or_else(|| panic!("no drafts: {err}"))
            .to_string()
    };
    let fixed = ["--speculative", "mtp", "--draft-length", "fixed", "--num-draft-tokens", "2"];
    let single = deepinfer(&[&base[..], &fixed].concat());
    assert_eq!(stdout(&single), one);
    let cluster = deepinfer(&[&base[..], &fixed, &["--devices", "4", "--expert-parallel", "2"]].concat());
    assert_eq!(stdout(&cluster), one, "fixed");
    assert_eq!(drafts_line(&cluster), drafts_line(&single), "the drafts of one device");
    let adaptive = ["--speculative", "mtp", "--draft-length", "adaptive", "--devices", "4"];
    let o = deepinfer(&[&base[..], &adaptive].concat());
    assert_eq!(stdout(&o), one, "adaptive");
    let line = drafts_line(&o);
    let accepted: u64 = line.split(" accepted").next().and_then(|t| t.rsplit(' ').next()?.parse().ok()).unwrap();
    assert!(accepted > 0, "{line}");
}

#[test]
fn a_batch_on_eight_devices_writes_the_same_bytes_as_one() {
    // A free run to find a stop string that really occurs.
    let probe =
        String::from_utf8(stdout(&deepinfer(&["generate", "--prompt", "Once upon a time", "--max-tokens", "16"])))
            .unwrap();
    let stop: String = probe.trim_end_matches('\n').chars().skip(5).take(2).collect();
    let lines = [
        r#"{"id": "a", "prompt": "Hello there", "max_tokens": 9}"#.to_string(),
        r#"{"id": 2, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 7, "temperature": 0.7, "seed": 3, "logprobs": 2}"#.into(),
        "not json".into(),
        serde_json::json!({"id": "stop", "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": true, "stop": [stop]})
            .to_string(),
        r#"{"prompt": "fine", "max_tokens": 5, "top_p": 0}"#.into(),
        r#"{"prompt": "A longer prompt that is cut into several prefill chunks by the token budget", "max_tokens": 12, "top_k": 5, "temperature": 1.2}"#.into(),
        r#"{"prompt": "x", "max_tokens": 0}"#.into(),
        r#"{"prompt": "Tell me", "max_tokens": 20, "ignore_eos": true, "logprobs": 3}"#.into(),
        r#"{"prompt": "Seeded", "max_tokens": 6, "temperature": 0.9}"#.into(),
    ];
    let input = temp("in.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let run = |layout: &[&str]| {
        let output = temp(&format!("out{}.jsonl", layout.join("")));
        let args = [
            &["generate", "--input", input.to_str().unwrap(), "--output", output.to_str().unwrap()][..],
            &["--max-batch-size", "3", "--max-batch-tokens", "16", "--seed", "5"],
            layout,
        ]
        .concat();
        stdout(&deepinfer(&args));
        let bytes = std::fs::read(&output).unwrap();
        let _ = std::fs::remove_file(&output);
        bytes
    };
    let one = run(&["--devices", "1"]);
    let text = String::from_utf8(one.clone()).unwrap();
    assert_eq!(text.lines().count(), lines.len());
    assert!(text.contains(r#""finish_reason":"stop""#) && text.contains(r#""finish_reason":"error""#), "{text}");
    for layout in LAYOUTS {
        assert_eq!(String::from_utf8(run(layout)).unwrap(), text, "{layout:?}");
    }
    let _ = std::fs::remove_file(&input);
}

#[test]
fn impossible_layouts_are_refused_with_a_reason() {
    let o = deepinfer(&["generate", "--prompt", "x", "--devices", "6", "--expert-parallel", "4"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("expert parallel degree 4") && err.contains("6 devices"), "{err}");
    let o = deepinfer(&["generate", "--prompt", "x", "--expert-parallel", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("--expert-parallel 2 needs --devices"), "{err}");
}
