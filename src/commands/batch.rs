//! `deepinfer generate --input requests.jsonl --output results.jsonl`:
//! offline batch generation through the continuous-batching engine.
//!
//! Each non-blank input line is one request:
//! `{"id": …, "prompt": "…"}` or `{"id": …, "messages": [{"role": "user", "content": "…"}]}`,
//! with optional `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
//! `logprobs` (alternatives per token, 0–20), `stop` (a string or a list)
//! and `ignore_eos`. Each gets one result line, in input order. A line that
//! cannot run gets an `error` in its result line; the others still run.
//! With `--devices N` the requests run on the in-process actor cluster and
//! the results are the same (`usage.cached_tokens` aside, which depends on
//! when each request reached its instance).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use deepinfer_actors::Update;
use deepinfer_engine::request::{FinishReason, Finished, Request, TokenOutput};
use deepinfer_engine::sampling::SamplingParams;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::backend::{Backend, ClusterBackend, EngineBackend};
use crate::cli::GenerateArgs;
use crate::generation::{
    encode_chat, encode_prompt, load_model_with, new_engine, start_cluster, ChatMessage, LoadedModel,
};
use deepinfer_engine::model::RoutedExperts;

/// Longest accepted input line, in bytes.
const MAX_LINE_BYTES: usize = 16 << 20;
/// Most requests in one input file.
const MAX_REQUESTS: usize = 1_000_000;
/// Most stop strings per request.
const MAX_STOP_STRINGS: usize = 16;

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// One input line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct InputLine {
    /// Echoed in the result line.
    id: Option<Value>,
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    logprobs: Option<usize>,
    stop: Option<Stop>,
    ignore_eos: Option<bool>,
}

/// A request ready for the engine.
struct Job {
    /// 1-based line number in the input file.
    line: usize,
    id: Option<Value>,
    request: Request,
    stops: Vec<String>,
    logprobs: bool,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Prompt tokens whose compressed state came from the prefix cache.
    cached_tokens: usize,
}

#[derive(Serialize)]
struct TokenLogprob {
    token: u32,
    logprob: f32,
    top: Vec<(u32, f32)>,
}

/// One output line.
#[derive(Serialize)]
struct ResultLine {
    line: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Value>,
    finish_reason: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<Vec<TokenLogprob>>,
}

impl ResultLine {
    fn error(line: usize, id: Option<Value>, error: String) -> Self {
        Self {
            line,
            id,
            finish_reason: "error",
            error: Some(error),
            text: None,
            token_ids: None,
            usage: None,
            logprobs: None,
        }
    }
}

/// Why a line cannot run.
struct LineError {
    line: usize,
    id: Option<Value>,
    message: String,
}

impl From<LineError> for ResultLine {
    fn from(e: LineError) -> Self {
        ResultLine::error(e.line, e.id, e.message)
    }
}

/// Totals of one batch run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BatchSummary {
    pub requests: usize,
    pub failed: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// Share of looked-up prompt tokens served by the prefix cache.
    pub prefix_hit_rate: f64,
    pub preemptions: u64,
    pub elapsed: Duration,
}

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let input = args.input.as_deref().context("--input is required in batch mode")?;
    let output = args.output.as_deref().context("--output is required with --input")?;
    crate::commands::generate::check_devices(args)?;
    let gpu = crate::generation::open_device(args.source.device)?;
    if gpu.is_some() && (args.devices > 1 || args.topology.is_some()) {
        anyhow::bail!(
            "--device {:?} runs one engine in this process: not with --devices or --topology",
            args.source.device
        );
    }
    let spec = crate::commands::generate::model_spec(args)?;
    // A client of a running cluster computes nothing: the shards hold the routed experts.
    let routed = if args.topology.is_some() { RoutedExperts::Elsewhere } else { RoutedExperts::Resident };
    let mut loaded = load_model_with(&spec, args.source.model_seed, args.source.tokenizer.as_deref(), routed)?;
    loaded.model = crate::generation::place_model(loaded.model, gpu.as_ref())?;
    let name = loaded.name.clone();
    let summary = run_batch(loaded, args, input, output, true)?;
    let secs = summary.elapsed.as_secs_f64().max(1e-9);
    eprintln!(
        "{}: {} requests ({} failed) in {:.2} s; prompt {} tokens, generated {} tokens: {:.1} generated tokens/s, \
         {:.1} tokens/s in all",
        name,
        summary.requests,
        summary.failed,
        secs,
        summary.prompt_tokens,
        summary.completion_tokens,
        summary.completion_tokens as f64 / secs,
        (summary.prompt_tokens + summary.completion_tokens) as f64 / secs,
    );
    eprintln!(
        "prefix cache ({}): {:.1}% hit rate, {} prompt tokens cached; {} preemptions; results in {}",
        args.engine.prefix_cache,
        100.0 * summary.prefix_hit_rate,
        summary.cached_tokens,
        summary.preemptions,
        output.display(),
    );
    Ok(())
}

/// Read the input file: one job or one error per non-blank line.
fn read_jobs(loaded: &LoadedModel, args: &GenerateArgs, input: &Path) -> anyhow::Result<Vec<Result<Job, LineError>>> {
    let file = File::open(input).with_context(|| format!("cannot open {}", input.display()))?;
    let mut jobs = Vec::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line_no = i + 1;
        let text = line.with_context(|| format!("{}: cannot read line {line_no}", input.display()))?;
        if text.trim().is_empty() {
            continue;
        }
        if jobs.len() == MAX_REQUESTS {
            anyhow::bail!("{}: more than {MAX_REQUESTS} requests; split the file", input.display());
        }
        jobs.push(parse_job(loaded, args, line_no, &text));
    }
    Ok(jobs)
}

fn parse_job(loaded: &LoadedModel, args: &GenerateArgs, line: usize, text: &str) -> Result<Job, LineError> {
    if text.len() > MAX_LINE_BYTES {
        return Err(LineError { line, id: None, message: format!("line is longer than {MAX_LINE_BYTES} bytes") });
    }
    let input: InputLine = serde_json::from_str(text).map_err(|e| LineError {
        line,
        id: None,
        message: format!("invalid request line: {e}"),
    })?;
    let id = input.id.clone();
    let fail = |message: String| LineError { line, id: id.clone(), message };
    let prompt = match (&input.prompt, &input.messages) {
        (Some(p), None) => encode_prompt(&loaded.tokenizer, &loaded.model, p),
        (None, Some(m)) => encode_chat(&loaded.tokenizer, &loaded.model, m),
        _ => return Err(fail("give exactly one of `prompt` and `messages`".into())),
    }
    .map_err(|e| fail(format!("{e:#}")))?;
    let stops = match input.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stops.len() > MAX_STOP_STRINGS || stops.iter().any(String::is_empty) {
        return Err(fail(format!("`stop` takes 1 to {MAX_STOP_STRINGS} non-empty strings")));
    }
    let params = SamplingParams {
        temperature: input.temperature.unwrap_or(args.temperature),
        top_p: input.top_p.unwrap_or(args.top_p),
        top_k: input.top_k.unwrap_or(args.top_k),
        seed: input.seed.unwrap_or_else(|| args.seed.wrapping_add(line as u64)),
        logprobs: input.logprobs.unwrap_or(0),
        ..SamplingParams::default()
    };
    let mut request = Request::new(prompt, input.max_tokens.unwrap_or(args.max_tokens)).with_params(params);
    request.ignore_eos = input.ignore_eos.unwrap_or(false);
    Ok(Job { line, id, request, stops, logprobs: input.logprobs.is_some() })
}

/// A request on the backend.
struct Live {
    slot: usize,
    job: Job,
    /// Tokens kept: none after a stop string.
    tokens: Vec<TokenOutput>,
    /// A stop string occurred; the request is being cancelled.
    stopped: bool,
}

/// Text of the generated tokens, cut before the first stop string if one occurs.
fn output_text(tokenizer: &Tokenizer, live: &Live) -> (String, bool) {
    let ids: Vec<u32> = live.tokens.iter().map(|t| t.token).collect();
    let text = tokenizer.decode(&ids, true).unwrap_or_default();
    match live.job.stops.iter().filter_map(|s| text.find(s.as_str())).min() {
        Some(cut) => (text[..cut].to_string(), true),
        None => (text, false),
    }
}

fn result_line(tokenizer: &Tokenizer, live: Live, finished: Finished) -> ResultLine {
    let (text, stopped) = output_text(tokenizer, &live);
    let reason = if stopped { FinishReason::Stop } else { finished.reason.clone() };
    let error = match &finished.reason {
        FinishReason::Error(e) => Some(e.clone()),
        _ => None,
    };
    let logprobs = live.job.logprobs.then(|| {
        live.tokens.iter().map(|t| TokenLogprob { token: t.token, logprob: t.logprob, top: t.top.clone() }).collect()
    });
    ResultLine {
        line: live.job.line,
        id: live.job.id,
        finish_reason: reason.as_str(),
        error,
        text: Some(text),
        token_ids: Some(live.tokens.iter().map(|t| t.token).collect()),
        usage: Some(Usage {
            prompt_tokens: finished.prompt_tokens,
            completion_tokens: finished.completion_tokens,
            cached_tokens: finished.cached_tokens,
        }),
        logprobs,
    }
}

/// Write results in input order as soon as they are contiguous.
fn write_ready(
    results: &mut [Option<ResultLine>],
    written: &mut usize,
    out: &mut impl Write,
    summary: &mut BatchSummary,
    bar: &ProgressBar,
) -> anyhow::Result<()> {
    while let Some(Some(r)) = results.get_mut(*written).map(Option::take) {
        if r.finish_reason == "error" {
            summary.failed += 1;
        }
        if let Some(u) = &r.usage {
            summary.prompt_tokens += u.prompt_tokens;
            summary.completion_tokens += u.completion_tokens;
            summary.cached_tokens += u.cached_tokens;
        }
        serde_json::to_writer(&mut *out, &r)?;
        out.write_all(b"\n")?;
        *written += 1;
        bar.inc(1);
    }
    Ok(())
}

fn progress_bar(progress: bool, total: usize) -> ProgressBar {
    let bar = if progress { ProgressBar::new(total as u64) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} requests, {msg} (eta {eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar
}

/// Run every request of `input` on the backend `args` names (the engine,
/// the in-process cluster of `--devices`, or the cluster of `--topology`;
/// the model moves into a cluster) and write `output`; `progress` shows a
/// bar on stderr.
pub fn run_batch(
    loaded: LoadedModel,
    args: &GenerateArgs,
    input: &Path,
    output: &Path,
    progress: bool,
) -> anyhow::Result<BatchSummary> {
    let config = args.engine.to_config()?;
    let jobs = read_jobs(&loaded, args, input)?;
    let LoadedModel { model, tokenizer, .. } = loaded;
    let mut backend: Box<dyn Backend + '_> = match (&args.topology, args.devices) {
        (Some(path), _) => {
            Box::new(ClusterBackend::new(crate::cluster::connect(path, args.certs.as_deref(), model)?, &config))
        }
        (None, 1) => Box::new(EngineBackend::new(new_engine(&model, config)?)),
        (None, n) => {
            let cluster = start_cluster(model, n, args.expert_parallel, config.clone())?;
            Box::new(ClusterBackend::new(cluster, &config))
        }
    };
    let summary = run_jobs(&mut *backend, &tokenizer, jobs, output, progress);
    backend.shutdown();
    summary
}

/// Run `jobs` on `backend`, writing each result line to `output` in input
/// order. Requests are kept as deep as the backend wants; a stop string
/// cancels its request, and tokens after it are not kept, so the results
/// do not depend on how many tokens an update carries.
fn run_jobs(
    backend: &mut dyn Backend,
    tokenizer: &Tokenizer,
    jobs: Vec<Result<Job, LineError>>,
    output: &Path,
    progress: bool,
) -> anyhow::Result<BatchSummary> {
    let file = File::create(output).with_context(|| format!("cannot create {}", output.display()))?;
    let mut out = BufWriter::new(file);
    let total = jobs.len();
    let bar = progress_bar(progress, total);
    let started = Instant::now();
    let mut summary = BatchSummary { requests: total, ..BatchSummary::default() };
    let mut results: Vec<Option<ResultLine>> = (0..total).map(|_| None).collect();
    let mut written = 0;
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut pending = jobs.into_iter().enumerate();
    let (mut generated, mut cached, mut prompts, mut preemptions) = (0usize, 0usize, 0usize, 0u64);
    loop {
        while backend.has_room() {
            let Some((slot, job)) = pending.next() else { break };
            match job {
                Err(e) => results[slot] = Some(e.into()),
                Ok(job) => {
                    let id = backend.submit(job.request.clone());
                    live.insert(id, Live { slot, job, tokens: Vec::new(), stopped: false });
                }
            }
        }
        let updates = backend.next_updates();
        let idle = updates.is_none();
        for update in updates.into_iter().flatten() {
            match update {
                Update::Tokens { id, tokens, .. } => {
                    let Some(l) = live.get_mut(&id) else { continue };
                    for t in tokens {
                        if l.stopped {
                            break;
                        }
                        generated += 1;
                        l.tokens.push(t);
                        if !l.job.stops.is_empty() && output_text(tokenizer, l).1 {
                            l.stopped = true;
                            backend.cancel(id);
                        }
                    }
                }
                Update::Finished { id, mut finished } => {
                    let Some(l) = live.remove(&id) else { continue };
                    finished.completion_tokens = l.tokens.len();
                    cached += finished.cached_tokens;
                    prompts += finished.prompt_tokens;
                    preemptions += u64::from(finished.preemptions);
                    let slot = l.slot;
                    results[slot] = Some(result_line(tokenizer, l, finished));
                }
                Update::Refused { id, reason } => {
                    let Some(l) = live.remove(&id) else { continue };
                    results[l.slot] = Some(ResultLine::error(l.job.line, l.job.id, reason));
                }
            }
        }
        write_ready(&mut results, &mut written, &mut out, &mut summary, &bar)?;
        let secs = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!("{generated} tokens, {:.0} tokens/s", generated as f64 / secs));
        if idle && pending.len() == 0 {
            break;
        }
    }
    anyhow::ensure!(written == total, "{} of {total} results were never produced", total - written);
    out.flush()?;
    bar.finish_and_clear();
    summary.elapsed = started.elapsed();
    // Without the backend's own count, the finished requests' records.
    let stats = backend.stats();
    summary.prefix_hit_rate =
        stats.prefix_hit_rate.unwrap_or(if prompts == 0 { 0.0 } else { cached as f64 / prompts as f64 });
    summary.preemptions = stats.preemptions.unwrap_or(preemptions);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    fn args(extra: &[&str]) -> GenerateArgs {
        let mut argv = vec!["deepinfer", "generate", "--input", "in", "--output", "out"];
        argv.extend_from_slice(extra);
        match Cli::parse_from(argv).command {
            Command::Generate(a) => a,
            other => panic!("parsed {other:?}"),
        }
    }

    fn temp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("deepinfer-batch-{}-{name}", std::process::id()))
    }

    /// Run `lines` on a fresh `builtin:tiny-v4` (the backend takes the model).
    fn run_lines(args: &GenerateArgs, name: &str, lines: &[String]) -> (BatchSummary, Vec<Value>, String) {
        let loaded = crate::generation::load_model("builtin:tiny-v4", 0, None).unwrap();
        let (input, output) = (temp(&format!("{name}.in.jsonl")), temp(&format!("{name}.out.jsonl")));
        std::fs::write(&input, lines.join("\n")).unwrap();
        let summary = run_batch(loaded, args, &input, &output, false).unwrap();
        let text = std::fs::read_to_string(&output).unwrap();
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&output);
        let rows = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        (summary, rows, text)
    }

    #[test]
    fn bad_lines_get_an_error_and_the_others_still_run() {
        let long: String = (0..3000).map(|i| format!("{i} ")).collect();
        let lines: Vec<String> = [
            r#"{"id": "a", "prompt": "Hello there", "max_tokens": 5}"#.to_string(),
            "not json".into(),
            String::new(),
            r#"{"id": 3, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 4, "temperature": 0.7, "seed": 3, "logprobs": 2}"#
                .replace('\n', " "),
            r#"{"prompt": "x", "messages": []}"#.into(),
            r#"{"prompt": "x", "colour": 1}"#.into(),
            r#"{"messages": [{"role": "robot", "content": "x"}, {"role": "user", "content": "y"}]}"#.into(),
            format!(r#"{{"id": "long", "prompt": "{long}"}}"#),
            r#"{"prompt": "fine", "max_tokens": 3, "top_p": 0}"#.into(),
            r#"{"prompt": "Hello there", "max_tokens": 5, "ignore_eos": true}"#.into(),
        ]
        .into();
        let args = args(&[]);
        let (summary, rows, text) = run_lines(&args, "bad", &lines);
        let line_numbers: Vec<u64> = rows.iter().map(|r| r["line"].as_u64().unwrap()).collect();
        assert_eq!(line_numbers, [1, 2, 4, 5, 6, 7, 8, 9, 10], "one result per non-blank line, in order");
        let errors: Vec<bool> = rows.iter().map(|r| r["finish_reason"] == "error").collect();
        assert_eq!(errors, [false, true, false, true, true, true, true, true, false]);
        assert_eq!((summary.requests, summary.failed), (9, 6));
        assert_eq!(rows[0]["id"], "a");
        assert!(rows[1]["error"].as_str().unwrap().starts_with("invalid request line"));
        assert_eq!(rows[3]["error"], "give exactly one of `prompt` and `messages`");
        assert!(rows[4]["error"].as_str().unwrap().contains("unknown field `colour`"));
        assert!(rows[5]["error"].as_str().unwrap().contains("unknown message role `robot`"));
        assert_eq!(rows[6]["id"], "long");
        assert!(rows[6]["error"].as_str().unwrap().contains("the model's context is 4096 tokens"));
        assert!(rows[7]["error"].as_str().unwrap().contains("top_p"));
        let chat = &rows[2];
        assert_eq!(chat["id"], 3);
        assert_eq!(chat["logprobs"].as_array().unwrap().len(), chat["token_ids"].as_array().unwrap().len());
        assert_eq!(chat["logprobs"][0]["top"].as_array().unwrap().len(), 2);
        assert!(rows[0].get("logprobs").is_none());
        assert_eq!(rows[8]["usage"]["completion_tokens"], 5);
        assert!(rows[8]["usage"]["cached_tokens"].as_u64().unwrap() == 0, "prompt shorter than a block");
        // Same file, same bytes.
        assert_eq!(run_lines(&args, "bad2", &lines).2, text);
    }

    #[test]
    fn stop_strings_cut_the_text_and_end_the_request() {
        let args = args(&[]);
        let free = vec![r#"{"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": true}"#.to_string()];
        let (_, rows, _) = run_lines(&args, "free", &free);
        let text = rows[0]["text"].as_str().unwrap().to_string();
        let stop: String = text.chars().skip(4).take(2).collect();
        assert_eq!(stop.chars().count(), 2, "enough text to pick a stop string from: {text:?}");
        let cut = &text[..text.find(&stop).unwrap()];
        let line =
            serde_json::json!({"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": true, "stop": [stop]});
        let (_, rows, _) = run_lines(&args, "stop", &[line.to_string()]);
        assert_eq!(rows[0]["text"], cut);
        assert_eq!(rows[0]["finish_reason"], "stop");
        assert!(rows[0]["token_ids"].as_array().unwrap().len() < 16);
    }

    #[test]
    fn the_engine_and_a_cluster_write_the_same_lines() {
        let engine = args(&["--max-batch-size", "2", "--max-batch-tokens", "16"]);
        let free = vec![r#"{"prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": true}"#.to_string()];
        let text = run_lines(&engine, "probe", &free).1[0]["text"].as_str().unwrap().to_string();
        let stop: String = text.chars().skip(5).take(2).collect();
        let long: String = (0..3000).map(|i| format!("{i} ")).collect();
        let lines: Vec<String> = [
            r#"{"id": "a", "prompt": "Hello there", "max_tokens": 9}"#.to_string(),
            serde_json::json!({"id": "stop", "prompt": "Once upon a time", "max_tokens": 16, "ignore_eos": true,
                "stop": [stop]})
            .to_string(),
            r#"{"prompt": "x", "max_tokens": 0}"#.into(),
            format!(r#"{{"id": "long", "prompt": "{long}"}}"#),
            r#"{"prompt": "Seeded", "max_tokens": 6, "temperature": 0.9, "logprobs": 2}"#.into(),
            "not json".into(),
            r#"{"prompt": "Tell me", "max_tokens": 12, "ignore_eos": true}"#.into(),
        ]
        .into();
        let (_, rows, one) = run_lines(&engine, "engine", &lines);
        let errors: Vec<bool> = rows.iter().map(|r| r["finish_reason"] == "error").collect();
        assert_eq!(errors, [false, false, true, true, false, true, false], "{one}");
        assert_eq!(rows[1]["finish_reason"], "stop");
        let cluster = args(&["--max-batch-size", "2", "--max-batch-tokens", "16", "--devices", "2"]);
        let (summary, _, two) = run_lines(&cluster, "cluster", &lines);
        assert_eq!(two, one);
        assert_eq!((summary.requests, summary.failed), (7, 3));
    }
}
