//! `deepinfer model init`: write a random checkpoint of a built-in preset.

use anyhow::{bail, Context};
use deepinfer_engine::config::ModelConfig;
use deepinfer_engine::presets::{random_checkpoint, serialize, Preset};
use deepinfer_engine::presets_v41;
use deepinfer_engine::v41::{V41Config, ENGRAM_TOKEN_MAP};

use crate::cli::InitArgs;
use crate::tokenizer::{builtin_tokenizer_json, load_tokenizer};

pub fn run(args: &InitArgs) -> anyhow::Result<()> {
    let Some(preset) = Preset::from_name(&args.preset) else {
        let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
        bail!("unknown preset `{}` (known: {})", args.preset, names.join(", "));
    };
    let mut config_json = preset.config_json();
    for o in &args.overrides {
        let Some((key, value)) = o.split_once('=') else {
            bail!("--set {o}: expected KEY=JSON, as in n_routed_experts=64");
        };
        if config_json.get(key).is_none() {
            bail!("--set {o}: the preset's config.json has no key `{key}`");
        }
        let value: serde_json::Value =
            serde_json::from_str(value).with_context(|| format!("--set {o}: `{value}` is not a JSON value"))?;
        config_json[key] = value;
    }
    let tokenizer_json = match &args.tokenizer {
        None => builtin_tokenizer_json(),
        Some(path) => {
            // A larger tokenizer (the real DeepSeek-V4 one has 129,280 ids) widens the
            // embedding and the head; every other dimension stays the preset's.
            let size = load_tokenizer(path)?.get_vocab_size(true);
            if size > config_json["vocab_size"].as_u64().unwrap_or(0) as usize {
                config_json["vocab_size"] = size.into();
            }
            std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?
        }
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("{}: cannot create directory", args.out.display()))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = args.out.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("{}: cannot write", path.display()))
    };
    let tensors = if preset.is_v41() {
        // With a real tokenizer the Engram vocabulary is derived from it at load time,
        // as for a published checkpoint; the built-in one gets the preset's map file.
        match &args.tokenizer {
            Some(path) => {
                let (_, size) = crate::engram_vocab::token_map_of_file(path)?;
                config_json["engram_compressed_vocab_size"] = size.into();
            }
            None => {
                let map = presets_v41::token_map_json(config_json["vocab_size"].as_u64().unwrap_or(0) as usize);
                write(ENGRAM_TOKEN_MAP, serde_json::to_string(&map)?.as_bytes())?;
            }
        }
        let config = V41Config::from_json_str(&config_json.to_string(), preset.name())?;
        presets_v41::random_checkpoint(&config, args.seed)
    } else {
        let config = ModelConfig::from_json_str(&config_json.to_string(), preset.name())?;
        random_checkpoint(&config, args.seed)
    };
    let weights = serialize(&tensors);
    write("config.json", serde_json::to_string_pretty(&config_json)?.as_bytes())?;
    write("model.safetensors", &weights)?;
    write("tokenizer.json", tokenizer_json.as_bytes())?;
    println!(
        "wrote {} ({} tensors, {:.1} MiB) to {}",
        preset.name(),
        tensors.len(),
        weights.len() as f64 / (1 << 20) as f64,
        args.out.display()
    );
    Ok(())
}
