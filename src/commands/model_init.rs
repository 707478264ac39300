//! `deepinfer model init`: write a random checkpoint of a built-in preset.

use anyhow::{bail, Context};
use deepinfer_engine::presets::{random_checkpoint, serialize, Preset};

use crate::cli::InitArgs;
use crate::tokenizer::{builtin_tokenizer_json, load_tokenizer};

pub fn run(args: &InitArgs) -> anyhow::Result<()> {
    let Some(preset) = Preset::from_name(&args.preset) else {
        let names: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
        bail!("unknown preset `{}` (known: {})", args.preset, names.join(", "));
    };
    let config = preset.config();
    let tokenizer_json = match &args.tokenizer {
        None => builtin_tokenizer_json(),
        Some(path) => {
            let tokenizer = load_tokenizer(path)?;
            let size = tokenizer.get_vocab_size(true);
            if size > config.vocab_size {
                bail!(
                    "{}: tokenizer has {size} tokens but preset {} has a vocabulary of {}",
                    path.display(),
                    preset.name(),
                    config.vocab_size
                );
            }
            std::fs::read_to_string(path).with_context(|| format!("{}: cannot read", path.display()))?
        }
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("{}: cannot create directory", args.out.display()))?;
    let write = |name: &str, bytes: &[u8]| {
        let path = args.out.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("{}: cannot write", path.display()))
    };
    let tensors = random_checkpoint(&config, args.seed);
    let weights = serialize(&tensors);
    write("config.json", serde_json::to_string_pretty(&preset.config_json())?.as_bytes())?;
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
