//! Speculative decoding. A decoding request's draft head proposes the next
//! few tokens (DeepSeek-V4's MTP block run as a chain, or DeepSeek-V4.1's
//! DSpark layers, which draft a whole block at once with a confidence per
//! position); the next step feeds them after the request's real tokens and
//! the target verifies every one of them in that single forward pass.
//!
//! Verification is *coupled*: a draft for position `t` is chosen with the
//! request's own rule for `t` (greedy, or the sampler's draw with the
//! request's uniform for `t` over the draft's distribution), and the target
//! accepts it exactly when its own choice at `t` is the same token. The
//! output is therefore always the target's own choice: greedy and sampled
//! requests produce exactly the tokens of decoding without drafts, whatever
//! their batch, their draft lengths or anyone else's (so batch invariance
//! survives), and the output distribution is the target's. `rejection`
//! holds the classic rejection-sampling verifier and its statistical checks.
//!
//! Rejected drafts leave nothing behind: the forward pass keeps what they
//! overwrote (`SequenceState::reject_drafts`), the accepted ones are fed
//! again with the next step's chunk, and the prefix cache never sees a
//! block a draft touched (`Scheduler` stops drafts short of block ends).

mod drafter;
pub mod policy;
pub mod rejection;

use std::fmt;
use std::str::FromStr;

pub use drafter::{count_output_token, draft_next, Chooser, DraftInput};
use policy::{DraftPolicy, MAX_DRAFT_TOKENS};

/// Which draft head proposes tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftMethod {
    #[default]
    Off,
    /// DeepSeek-V4's multi-token-prediction block, run autoregressively.
    Mtp,
    /// DeepSeek-V4.1's DSpark draft layers.
    Dspark,
}

impl FromStr for DraftMethod {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(Self::Off),
            "mtp" => Ok(Self::Mtp),
            "dspark" => Ok(Self::Dspark),
            other => Err(format!("unknown speculative method {other:?}: expected off, mtp or dspark")),
        }
    }
}

impl fmt::Display for DraftMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::Mtp => "mtp",
            Self::Dspark => "dspark",
        })
    }
}

/// Speculative decoding of one instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: DraftMethod,
    /// How many drafts each request verifies per step.
    pub policy: DraftPolicy,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self { method: DraftMethod::Off, policy: DraftPolicy::Off }
    }
}

impl SpeculativeConfig {
    /// Most drafts a request may verify in one step (0: no drafting).
    pub fn max_drafts(&self) -> usize {
        if self.method == DraftMethod::Off {
            return 0;
        }
        match self.policy {
            DraftPolicy::Off => 0,
            DraftPolicy::Fixed(k) | DraftPolicy::Adaptive { max: k } => k.min(MAX_DRAFT_TOKENS),
        }
    }

    /// Whether `model` has the draft head this configuration asks for.
    pub fn check(&self, model: &crate::model::Model) -> Result<(), String> {
        match self.method {
            DraftMethod::Off => Ok(()),
            _ if model.is_on_device() => Err(format!(
                "speculative method {:?} does not run on a device yet; drafts run on the CPU engine",
                self.method
            )
            .to_lowercase()),
            DraftMethod::Mtp if model.is_v41() => {
                Err("speculative method mtp needs a DeepSeek-V4 model with an MTP block; V4.1 drafts with dspark"
                    .into())
            }
            DraftMethod::Mtp if !model.has_mtp() => {
                Err("speculative method mtp: the checkpoint has no MTP block".into())
            }
            DraftMethod::Dspark if model.v41.as_ref().is_none_or(|m| m.config.dspark.is_none()) => {
                Err("speculative method dspark needs a DeepSeek-V4.1 model with DSpark layers".into())
            }
            _ => Ok(()),
        }
    }
}

/// Drafts proposed for a request's next step.
#[derive(Clone, Debug, PartialEq)]
pub struct Proposal {
    /// Position of the first draft: the request's length when proposed.
    pub at: usize,
    pub tokens: Vec<u32>,
    /// Estimated probability that the target accepts each draft, given the
    /// ones before it were accepted (DSpark's confidence head; for MTP the
    /// draft's own probability under the MTP head).
    pub acceptance: Vec<f64>,
}

/// Counters of speculative decoding.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpeculativeStats {
    /// Drafts proposed.
    pub proposed: u64,
    /// Drafts fed to the target for verification.
    pub verified: u64,
    /// Verified drafts the target accepted.
    pub accepted: u64,
    /// Verification runs whose every draft was accepted.
    pub all_accepted: u64,
    /// Verification runs (request-steps with at least one draft).
    pub verifications: u64,
    /// Tokens those runs produced (accepted drafts plus the target's own token).
    pub verification_tokens: u64,
}

impl SpeculativeStats {
    /// Mean tokens a verification run produced (DeepSeek's "acceptance length").
    pub fn acceptance_length(&self) -> f64 {
        if self.verifications == 0 {
            return 0.0;
        }
        self.verification_tokens as f64 / self.verifications as f64
    }

    /// Share of verified drafts the target rejected ("wasted verification").
    pub fn rejected_share(&self) -> f64 {
        if self.verified == 0 {
            return 0.0;
        }
        (self.verified - self.accepted) as f64 / self.verified as f64
    }
}
