//! The official `openai` and `anthropic` Python SDKs against a real
//! `deepinfer serve` (scripts in tests/sdk/). Without the packages the tests
//! are skipped with a notice, unless `DEEPINFER_REQUIRE_SDK=1` (CI) makes
//! that a failure.

mod serve_support;

use std::path::Path;
use std::process::Command;

use serve_support::{sdks_available, Served};

fn run_script(script: &str) {
    run_script_on(script, "tiny-v4");
}

/// `script` against `serve --model builtin:<preset>`.
fn run_script_on(script: &str, preset: &str) {
    run_script_with(script, preset, &[]);
}

/// `script` against `serve --model builtin:<preset>` with `extra` flags.
fn run_script_with(script: &str, preset: &str, extra: &[&str]) {
    if !sdks_available() {
        return;
    }
    let model = format!("builtin:{preset}");
    let mut args = vec!["--model", &model];
    args.extend_from_slice(extra);
    let server = Served::start(&args);
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/sdk").join(script);
    let out = Command::new("python3")
        .arg(&path)
        .env("DEEPINFER_BASE_URL", &server.base)
        .env("DEEPINFER_MODEL", preset)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
    eprint!("{stdout}");
}

#[test]
fn openai_sdk_chat_responses_tools_and_json_schema() {
    run_script("openai_sdk.py");
}

#[test]
fn request_fields_are_honoured_or_refused_through_the_sdks() {
    run_script("params_sdk.py");
}

#[test]
fn forced_tool_calls_parse_and_validate_through_the_sdks() {
    run_script("tools_sdk.py");
}

#[test]
fn vllm_fields_wide_json_schemas_attachments_and_forced_tool_inputs_through_the_sdks() {
    run_script("vllm_sdk.py");
}

#[test]
fn image_parts_through_the_sdks_get_a_clear_400() {
    run_script("images_sdk.py");
}

/// scikit-image's chelsea.png and coffee.png read by a model with a vision
/// tower: data URLs and URLs of a local HTTP server, each limit a 400.
#[test]
fn images_through_the_sdks_on_a_model_with_a_vision_tower() {
    run_script_with("vision_sdk.py", "tiny-v41-vision", &["--image-fetch", "--image-fetch-allow", "127.0.0.1/32"]);
}

#[test]
fn anthropic_sdk_messages() {
    run_script("anthropic_sdk.py");
}

/// DeepSeek-V4.1 behind the same API: the OpenAI and Anthropic SDK scripts unchanged.
#[test]
fn the_sdks_against_deepseek_v41() {
    run_script_on("openai_sdk.py", "tiny-v41");
    run_script_on("anthropic_sdk.py", "tiny-v41");
}
