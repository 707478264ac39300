//! The `[cache]` table of a scenario: the prompt cache's tiers below the
//! device pool (host memory and local disk per node, a shared store for the
//! whole cluster), their bandwidths, the blocks' TTL, and optionally a
//! smaller device KV budget (see simulations/README.md).

use deepinfer_actors::modelled::tiers::TierSpec;
use serde::Deserialize;
use toml::Spanned;

use crate::config_file::FileError;

const GIB: f64 = (1u64 << 30) as f64;
const GB: f64 = 1e9;
/// Longest TTL a scenario may ask for: 30 days.
pub const MAX_TTL_S: f64 = 30.0 * 86_400.0;

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CacheSpec {
    /// Seconds a block stays servable after it was computed or last hit (default 72 h).
    #[serde(default)]
    pub ttl_s: Option<Spanned<f64>>,
    /// KV bytes per device, GiB, instead of what HBM leaves after the weights.
    #[serde(default)]
    pub device_kv_gib: Option<Spanned<f64>>,
    /// Host memory for KV blocks per node, GiB (0: no host tier).
    #[serde(default)]
    pub host_gib: Option<Spanned<f64>>,
    /// Host↔device bandwidth per node, GB/s.
    #[serde(default)]
    pub host_gb_per_s: Option<Spanned<f64>>,
    /// Local disk per node, GiB (0: none).
    #[serde(default)]
    pub disk_gib: Option<Spanned<f64>>,
    #[serde(default)]
    pub disk_read_gb_per_s: Option<Spanned<f64>>,
    #[serde(default)]
    pub disk_write_gb_per_s: Option<Spanned<f64>>,
    /// A store every node sees (3FS-like), GiB for the whole cluster (0: none).
    #[serde(default)]
    pub shared_gib: Option<Spanned<f64>>,
    /// Its aggregate bandwidths, GB/s.
    #[serde(default)]
    pub shared_read_gb_per_s: Option<Spanned<f64>>,
    #[serde(default)]
    pub shared_write_gb_per_s: Option<Spanned<f64>>,
}

/// The checked `[cache]` table.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheConfig {
    pub tiers: TierSpec,
    /// KV bytes per device, when smaller than HBM allows.
    pub device_kv_bytes: Option<f64>,
}

impl CacheConfig {
    /// Every capacity (device KV included) times `factor`.
    pub fn scaled(&self, factor: f64) -> Self {
        let mut c = self.clone();
        c.tiers.host_bytes *= factor;
        c.tiers.disk_bytes *= factor;
        c.tiers.shared_bytes *= factor;
        c.device_kv_bytes = c.device_kv_bytes.map(|b| b * factor);
        c
    }
}

impl CacheSpec {
    pub fn config(
        &self,
        block_tokens: usize,
        err: &dyn Fn(std::ops::Range<usize>, String) -> FileError,
    ) -> Result<CacheConfig, FileError> {
        let d = TierSpec::default();
        let size = |v: &Option<Spanned<f64>>, default: f64| match v {
            None => Ok(default),
            Some(x) if x.get_ref().is_finite() && *x.get_ref() >= 0.0 => Ok(*x.get_ref() * GIB),
            Some(x) => Err(err(x.span(), "must be a size in GiB, 0 or more".into())),
        };
        let speed = |v: &Option<Spanned<f64>>, default: f64| match v {
            None => Ok(default),
            Some(x) if x.get_ref().is_finite() && *x.get_ref() > 0.0 => Ok(*x.get_ref() * GB),
            Some(x) => Err(err(x.span(), "must be a positive bandwidth in GB/s".into())),
        };
        let ttl_ms = match &self.ttl_s {
            None => d.ttl_ms,
            Some(t) if t.get_ref().is_finite() && *t.get_ref() > 0.0 && *t.get_ref() <= MAX_TTL_S => {
                (*t.get_ref() * 1000.0).round().max(1.0) as u64
            }
            Some(t) => return Err(err(t.span(), format!("must be in (0, {MAX_TTL_S}] seconds"))),
        };
        let device_kv_bytes = match &self.device_kv_gib {
            None => None,
            Some(x) if x.get_ref().is_finite() && *x.get_ref() > 0.0 => Some(*x.get_ref() * GIB),
            Some(x) => return Err(err(x.span(), "must be a positive size in GiB".into())),
        };
        let tiers = TierSpec {
            block_tokens,
            ttl_ms,
            host_bytes: size(&self.host_gib, 0.0)?,
            host_bytes_per_s: speed(&self.host_gb_per_s, d.host_bytes_per_s)?,
            disk_bytes: size(&self.disk_gib, 0.0)?,
            disk_read_bytes_per_s: speed(&self.disk_read_gb_per_s, d.disk_read_bytes_per_s)?,
            disk_write_bytes_per_s: speed(&self.disk_write_gb_per_s, d.disk_write_bytes_per_s)?,
            shared_bytes: size(&self.shared_gib, 0.0)?,
            shared_read_bytes_per_s: speed(&self.shared_read_gb_per_s, d.shared_read_bytes_per_s)?,
            shared_write_bytes_per_s: speed(&self.shared_write_gb_per_s, d.shared_write_bytes_per_s)?,
        };
        Ok(CacheConfig { tiers, device_kv_bytes })
    }
}
