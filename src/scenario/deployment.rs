//! The deployment keys of a scenario that say how the model is served rather
//! than what runs it: the formats of the weights and the KV cache
//! (`[experts] precision`, `[engine] attention_precision`, `[engine]
//! kv_dtype`), the scale-up domain apart from the node (`[scenario]
//! scale_up_domain`), and each instance's own batch limits and weight
//! offload (`[[instance]] batch_per_device`, `batch_tokens_per_device`,
//! `offload_gib`).

use std::ops::Range;

use deepinfer_actors::modelled::deployment::InstanceLimits;
use deepinfer_engine::cost::{HardwareKind, KvFormat, ModelKind, Precision, WeightFormat};
use toml::Spanned;

use crate::config_file::FileError;

const GIB: f64 = (1u64 << 30) as f64;

type Err<'a> = &'a dyn Fn(Range<usize>, String) -> FileError;

/// A weight format by name.
fn weight_format(v: &Spanned<String>, err: Err) -> Result<WeightFormat, FileError> {
    WeightFormat::from_name(v.get_ref())
        .ok_or_else(|| err(v.span(), format!("unknown `{}` (bf16, fp8, mxfp4, nvfp4)", v.get_ref())))
}

/// The formats a scenario serves `model` in; a KV format the model's
/// attention has no layout for is refused.
pub fn precision(
    model: ModelKind,
    experts: Option<&Spanned<String>>,
    attention: Option<&Spanned<String>>,
    kv: Option<&Spanned<String>>,
    err: Err,
) -> Result<Precision, FileError> {
    let kv_format = match kv {
        None => None,
        Some(v) => Some(match v.get_ref().to_ascii_lowercase().as_str() {
            "bf16" => KvFormat::Bf16,
            "fp8" => KvFormat::Fp8,
            "fp4" => KvFormat::V41Mixed,
            other => return Err(err(v.span(), format!("unknown `{other}` (bf16, fp8, fp4)"))),
        }),
    };
    let p = Precision {
        experts: experts.map(|v| weight_format(v, err)).transpose()?,
        dense: attention.map(|v| weight_format(v, err)).transpose()?,
        kv: kv_format,
    };
    if let (Err(why), Some(v)) = (model.cost().with_precision(p), kv) {
        return Err(err(v.span(), why));
    }
    Ok(p)
}

/// The scale-up domain: given, a multiple of the node; by default the
/// hardware's own (NVL72: 72) rounded down to whole nodes, at least one node.
pub fn scale_up_domain(
    given: Option<&Spanned<u32>>,
    hardware: HardwareKind,
    per_node: u32,
    err: Err,
) -> Result<u32, FileError> {
    match given {
        Some(d) => {
            let v = *d.get_ref();
            if v == 0 || !v.is_multiple_of(per_node) || v > crate::scenario::MAX_DEVICES {
                return Err(err(
                    d.span(),
                    format!(
                        "must be a positive multiple of devices_per_node ({per_node}), at most {}",
                        crate::scenario::MAX_DEVICES
                    ),
                ));
            }
            Ok(v)
        }
        None => Ok((hardware.spec().scale_up_domain as u32 / per_node).max(1) * per_node),
    }
}

/// One `[[instance]]` table's own limits.
pub fn instance_limits(
    batch: Option<&Spanned<usize>>,
    batch_tokens: Option<&Spanned<usize>>,
    offload_gib: Option<&Spanned<f64>>,
    err: Err,
) -> Result<InstanceLimits, FileError> {
    let in_range = |v: Option<&Spanned<usize>>, most: usize| -> Result<Option<usize>, FileError> {
        match v {
            Some(b) if !(1..=most).contains(b.get_ref()) => Err(err(b.span(), format!("must be 1 to {most}"))),
            other => Ok(other.map(|b| *b.get_ref())),
        }
    };
    let offload_bytes = match offload_gib {
        None => 0.0,
        Some(g) if g.get_ref().is_finite() && *g.get_ref() >= 0.0 => *g.get_ref() * GIB,
        Some(g) => return Err(err(g.span(), "must be 0 or more GiB".into())),
    };
    Ok(InstanceLimits {
        batch_per_device: in_range(batch, 4096)?,
        batch_tokens_per_device: in_range(batch_tokens, 65536)?,
        offload_bytes,
    })
}
