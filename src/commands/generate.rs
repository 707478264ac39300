//! `deepinfer generate`: one prompt, printed as it is generated; with
//! `--devices N` on the in-process actor cluster, with the same output.

use std::io::Write;
use std::time::Instant;

use deepinfer_engine::engine::EngineConfig;
use deepinfer_engine::prefix_cache::PrefixMode;
use deepinfer_engine::sampling::SamplingParams;

use crate::backend::{Backend, ClusterBackend, EngineBackend};
use crate::cli::GenerateArgs;
use crate::generation::{encode_prompt, generate, load_model_with, single_engine, start_cluster, LoadedModel};
use deepinfer_engine::model::RoutedExperts;

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    check_devices(args)?;
    let gpu = crate::generation::open_device(args.source.device)?;
    if gpu.is_some() && (args.devices > 1 || args.topology.is_some()) {
        anyhow::bail!(
            "--device {:?} runs one engine in this process: not with --devices or --topology",
            args.source.device
        );
    }
    let speculative = args.engine.speculative()?;
    if speculative.max_drafts() > 0 && args.topology.is_some() {
        anyhow::bail!(
            "--speculative with --topology: a running cluster drafts as its topology's [cluster.speculative] says"
        );
    }
    // A client of a running cluster computes nothing: the shards hold the routed experts.
    let routed = if args.topology.is_some() { RoutedExperts::Elsewhere } else { RoutedExperts::Resident };
    let mut loaded =
        load_model_with(&model_spec(args)?, args.source.model_seed, args.source.tokenizer.as_deref(), routed)?;
    loaded.model = crate::generation::place_model(loaded.model, gpu.as_ref())?;
    let text = args.prompt.as_deref().unwrap_or_default();
    let prompt = encode_prompt(&loaded.tokenizer, &loaded.model, text)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let LoadedModel { name, model, tokenizer } = loaded;
    let one_request = EngineConfig { max_batch_size: 1, prefix_mode: PrefixMode::Off, ..EngineConfig::default() };
    let drafting = EngineConfig { speculative, ..one_request.clone() };
    let mut backend: Box<dyn Backend + '_> = match (&args.topology, args.devices) {
        (Some(path), _) => {
            Box::new(ClusterBackend::new(crate::cluster::connect(path, args.certs.as_deref(), model)?, &one_request))
        }
        (None, 1) => Box::new(EngineBackend::new(single_engine(&model, speculative)?)),
        (None, n) => {
            let cluster = start_cluster(model, n, args.expert_parallel, drafting.clone())?;
            Box::new(ClusterBackend::new(cluster, &drafting))
        }
    };
    let started = Instant::now();
    let mut first_token_at = None;
    let mut stdout = std::io::stdout().lock();
    let mut text_so_far = String::new();
    let mut ids = Vec::new();
    let on_token = |token| {
        first_token_at.get_or_insert_with(Instant::now);
        ids.push(token);
        // Print the new suffix of the decoded text, so multi-byte characters appear whole.
        if let Ok(text) = tokenizer.decode(&ids, true) {
            if text.len() > text_so_far.len() && text.starts_with(&text_so_far) {
                let _ = write!(stdout, "{}", &text[text_so_far.len()..]);
                let _ = stdout.flush();
                text_so_far = text;
            }
        }
    };
    let completion = generate(&mut *backend, &prompt, &params, args.max_tokens, on_token);
    let spec = backend.stats().speculative;
    backend.shutdown();
    let completion = completion?;
    let total = started.elapsed().as_secs_f64();
    writeln!(stdout)?;
    if args.show_tokens {
        writeln!(stdout, "tokens: {:?}", completion.tokens)?;
    }
    let ttft = first_token_at.map_or(total, |t| (t - started).as_secs_f64());
    let decode_tokens = completion.tokens.len().saturating_sub(1);
    let decode_secs = total - ttft;
    let reason = completion.finish.as_str();
    eprintln!(
        "{name}{}: prompt {} tokens, generated {} tokens ({reason}); prefill {:.1} ms ({:.0} tokens/s), decode {:.1} tokens/s",
        match (&args.topology, args.devices) {
            (Some(t), _) => format!(" on the cluster of {}", t.display()),
            (None, 1) => String::new(),
            (None, n) => format!(" on {n} devices"),
        },
        completion.prompt_tokens.len(),
        completion.tokens.len(),
        ttft * 1e3,
        completion.prompt_tokens.len() as f64 / ttft.max(1e-9),
        if decode_tokens > 0 { decode_tokens as f64 / decode_secs.max(1e-9) } else { 0.0 },
    );
    if let Some(s) = spec.filter(|s| s.proposed > 0) {
        eprintln!(
            "speculative {}: {} drafts verified, {} accepted ({:.0}% rejected), {:.2} tokens per verification",
            args.engine.speculative,
            s.verified,
            s.accepted,
            100.0 * s.rejected_share(),
            s.acceptance_length(),
        );
    }
    Ok(())
}

/// The model to load: the topology's with `--topology`, else `--model`.
pub fn model_spec(args: &GenerateArgs) -> anyhow::Result<String> {
    Ok(match &args.topology {
        // Relative to the topology file, as the nodes read it.
        Some(path) => crate::cluster::ClusterPlan::load(path)?.model_spec(),
        None => args.source.model.clone(),
    })
}

/// `--expert-parallel` only means something with several devices.
pub fn check_devices(args: &GenerateArgs) -> anyhow::Result<()> {
    if args.devices == 1 && args.expert_parallel.is_some_and(|e| e != 1) {
        anyhow::bail!("--expert-parallel {} needs --devices of at least that many", args.expert_parallel.unwrap_or(1));
    }
    Ok(())
}
