//! The `[speculative]` table of a scenario: the draft method, how many
//! drafts, fixed or adaptive verification lengths, and the acceptance model
//! (see simulations/README.md for where the default numbers come from).

use deepinfer_actors::modelled::drafting::{AcceptanceModel, Drafting};
use deepinfer_engine::cost::draft::DraftHead;
use deepinfer_engine::cost::ModelKind;
use deepinfer_engine::speculative::policy::{DraftPolicy, MAX_DRAFT_TOKENS};
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};
use serde::Deserialize;
use toml::Spanned;

use crate::config_file::FileError;

/// DeepSeek-V3's MTP accepts the second token 85–90% of the time; the chain
/// reuses one module trained for one step ahead, so later drafts fare worse
/// (an assumption): 1.87 tokens per step with one draft, 2.94 with five.
pub const MTP_ACCEPTANCE: [f64; 5] = [0.87, 0.65, 0.55, 0.45, 0.35];
/// Acceptance lengths of 2.7–3.6 are reported with five DSpark drafts; these
/// give 3.23 (an assumption within that range).
pub const DSPARK_ACCEPTANCE: [f64; 5] = [0.85, 0.75, 0.65, 0.55, 0.45];
const DEFAULT_SPREAD: f64 = 0.5;
const DEFAULT_NOISE: f64 = 0.1;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSpec {
    /// `off`, `mtp` or `dspark`.
    pub method: Spanned<String>,
    /// Most drafts a request verifies per step (1 to 16).
    #[serde(default = "default_drafts")]
    pub num_draft_tokens: Spanned<usize>,
    /// `fixed` (always `num_draft_tokens`) or `adaptive` (the engine's policy).
    #[serde(default = "default_length")]
    pub draft_length: Spanned<String>,
    /// Probability that draft i is accepted given draft i − 1 was, per position.
    #[serde(default)]
    pub acceptance: Option<Spanned<Vec<f64>>>,
    /// Spread of each draft's own acceptance probability around its
    /// position's mean, in [0, 1).
    #[serde(default)]
    pub acceptance_spread: Option<Spanned<f64>>,
    /// Standard deviation of the draft head's estimate of that probability.
    #[serde(default)]
    pub confidence_noise: Option<Spanned<f64>>,
}

fn default_drafts() -> Spanned<usize> {
    Spanned::new(0..0, 5)
}

fn default_length() -> Spanned<String> {
    Spanned::new(0..0, "adaptive".into())
}

/// `method` with this module's defaults (five drafts, adaptive) on `model`,
/// or `None` for off; an error names a method the model has no head for.
pub fn default_drafting(model: ModelKind, method: DraftMethod) -> Result<Option<Drafting>, String> {
    if method == DraftMethod::Off {
        return Ok(None);
    }
    if !DraftHead::exists(model, method) {
        return Err(no_head(model, method));
    }
    let acceptance = if method == DraftMethod::Mtp { MTP_ACCEPTANCE } else { DSPARK_ACCEPTANCE };
    Ok(Some(Drafting {
        config: SpeculativeConfig { method, policy: DraftPolicy::Adaptive { max: acceptance.len() } },
        acceptance: AcceptanceModel {
            acceptance: acceptance.to_vec(),
            spread: DEFAULT_SPREAD,
            confidence_noise: DEFAULT_NOISE,
        },
    }))
}

fn no_head(model: ModelKind, method: DraftMethod) -> String {
    let hint = if model == ModelKind::V41Flash { "V4.1 drafts with dspark" } else { "dspark needs V4.1-Flash" };
    format!("{} has no {method} draft head ({hint})", model.cost().name)
}

impl SpeculativeSpec {
    /// The drafting this table asks for on `model` (`None`: off).
    pub fn drafting(
        &self,
        model: ModelKind,
        err: &dyn Fn(std::ops::Range<usize>, String) -> FileError,
    ) -> Result<Option<Drafting>, FileError> {
        let config = crate::config_file::speculative_config(&self.method, &self.num_draft_tokens, &self.draft_length)
            .map_err(|(span, why)| err(span, why))?;
        let method = config.method;
        if method == DraftMethod::Off {
            return Ok(None);
        }
        if !DraftHead::exists(model, method) {
            return Err(err(self.method.span(), no_head(model, method)));
        }
        let acceptance = match &self.acceptance {
            Some(a) => {
                let list = a.get_ref();
                if list.is_empty() || list.len() > MAX_DRAFT_TOKENS || !list.iter().all(|p| (0.0..=1.0).contains(p)) {
                    let why = format!("must list 1 to {MAX_DRAFT_TOKENS} probabilities in [0, 1]");
                    return Err(err(a.span(), why));
                }
                list.clone()
            }
            None if method == DraftMethod::Mtp => MTP_ACCEPTANCE.to_vec(),
            None => DSPARK_ACCEPTANCE.to_vec(),
        };
        let fraction = |v: &Option<Spanned<f64>>, default: f64, top: f64, what: &str| match v {
            None => Ok(default),
            Some(x) if (0.0..top).contains(x.get_ref()) => Ok(*x.get_ref()),
            Some(x) => Err(err(x.span(), format!("{what} must be in [0, {top})"))),
        };
        let spread = fraction(&self.acceptance_spread, DEFAULT_SPREAD, 1.0, "a spread")?;
        let confidence_noise = fraction(&self.confidence_noise, DEFAULT_NOISE, 1.0, "a standard deviation")?;
        Ok(Some(Drafting { config, acceptance: AcceptanceModel { acceptance, spread, confidence_noise } }))
    }
}
