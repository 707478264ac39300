//! Request arrivals for simulation: replay of Mooncake-format traces and
//! seeded synthetic traffic (Poisson or bursty, with length distributions and
//! shared prefixes). Pure functions of their input and seed.

use serde::Deserialize;

use crate::sampling::uniform;

/// Tokens per `hash_ids` block in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Most arrivals one trace or generator may produce.
pub const MAX_ARRIVALS: usize = 10_000_000;

/// One request arriving.
#[derive(Clone, Debug, PartialEq)]
pub struct Arrival {
    pub at_us: u64,
    pub input_tokens: usize,
    pub output_tokens: usize,
    /// Content ids of the prompt's 512-token blocks: equal prefixes of ids are
    /// equal prompt prefixes (they drive prefix-cache hits).
    pub prefix_blocks: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("{file}:{line}: {problem}")]
    Line { file: String, line: usize, problem: String },
    #[error("{file}: more than {MAX_ARRIVALS} requests")]
    TooLong { file: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: usize,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Parse a Mooncake trace (one JSON object per line: `timestamp` in ms,
/// `input_length`, `output_length`, `hash_ids`), stretching time by
/// `time_scale` (2.0 = half the rate). Blank lines are skipped.
pub fn parse_mooncake(text: &str, file: &str, time_scale: f64) -> Result<Vec<Arrival>, TraceError> {
    let err = |line: usize, problem: String| TraceError::Line { file: file.into(), line, problem };
    if !(time_scale.is_finite() && time_scale > 0.0) {
        return Err(err(0, format!("time scale {time_scale} must be positive")));
    }
    let mut out = Vec::new();
    let mut last = 0.0f64;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if out.len() == MAX_ARRIVALS {
            return Err(TraceError::TooLong { file: file.into() });
        }
        let rec: MooncakeLine = serde_json::from_str(raw).map_err(|e| err(line, e.to_string()))?;
        if !(rec.timestamp.is_finite() && rec.timestamp >= 0.0) {
            return Err(err(line, format!("field `timestamp`: {} is not a time in ms", rec.timestamp)));
        }
        if rec.timestamp < last {
            return Err(err(line, format!("field `timestamp`: {} goes back in time (after {last})", rec.timestamp)));
        }
        last = rec.timestamp;
        if rec.input_length == 0 {
            return Err(err(line, "field `input_length`: must be at least 1".into()));
        }
        let blocks = rec.input_length.div_ceil(MOONCAKE_BLOCK_TOKENS);
        if rec.hash_ids.len() > blocks {
            return Err(err(
                line,
                format!(
                    "field `hash_ids`: {} blocks for {} tokens (at most {blocks})",
                    rec.hash_ids.len(),
                    rec.input_length
                ),
            ));
        }
        out.push(Arrival {
            at_us: (rec.timestamp * 1000.0 * time_scale).round() as u64,
            input_tokens: rec.input_length,
            output_tokens: rec.output_length.max(1),
            prefix_blocks: rec.hash_ids,
        });
    }
    Ok(out)
}

/// A length distribution, always clamped to `[min, max]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Lengths {
    Fixed(usize),
    Uniform {
        min: usize,
        max: usize,
    },
    /// Log-normal with this median and log-space sigma.
    LogNormal {
        median: f64,
        sigma: f64,
        min: usize,
        max: usize,
    },
}

impl Lengths {
    /// A length from two uniforms in `[0, 1)`.
    pub fn draw(&self, u1: f64, u2: f64) -> usize {
        match *self {
            Lengths::Fixed(n) => n.max(1),
            Lengths::Uniform { min, max } => min + ((max.saturating_sub(min) + 1) as f64 * u1) as usize,
            Lengths::LogNormal { median, sigma, min, max } => {
                let normal = (-2.0 * (1.0 - u1).ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                ((median * (sigma * normal).exp()).round() as usize).clamp(min.max(1), max.max(1))
            }
        }
    }
}

/// When requests arrive.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pattern {
    Poisson {
        rate_per_s: f64,
    },
    /// On/off: `rate_per_s × burst_factor` for `on_s`, then `rate_per_s / burst_factor` for `off_s`.
    Bursty {
        rate_per_s: f64,
        burst_factor: f64,
        on_s: f64,
        off_s: f64,
    },
}

/// Seeded synthetic traffic.
#[derive(Clone, Debug, PartialEq)]
pub struct Synthetic {
    pub pattern: Pattern,
    pub input: Lengths,
    pub output: Lengths,
    /// A prompt prefix of this many tokens shared by `shared_fraction` of requests
    /// (e.g. a system prompt), in `MOONCAKE_BLOCK_TOKENS` blocks.
    pub shared_prefix_tokens: usize,
    pub shared_fraction: f64,
    pub duration_s: f64,
    pub seed: u64,
}

impl Synthetic {
    /// All arrivals within `duration_s`.
    pub fn arrivals(&self) -> Vec<Arrival> {
        let mut draw_index = 0u64;
        let mut next_u = || {
            draw_index += 1;
            uniform(self.seed, draw_index)
        };
        let shared_blocks = self.shared_prefix_tokens / MOONCAKE_BLOCK_TOKENS;
        // Ids of unique blocks start above the shared ones.
        let mut next_block = shared_blocks as u64;
        let mut out = Vec::new();
        let mut t = 0.0f64;
        let end = self.duration_s.max(0.0);
        while out.len() < MAX_ARRIVALS {
            let rate = match self.pattern {
                Pattern::Poisson { rate_per_s } => rate_per_s,
                Pattern::Bursty { rate_per_s, burst_factor, on_s, off_s } => {
                    let phase = t % (on_s + off_s).max(1e-9);
                    if phase < on_s {
                        rate_per_s * burst_factor
                    } else {
                        rate_per_s / burst_factor.max(1e-9)
                    }
                }
            };
            if rate.is_nan() || rate <= 0.0 {
                break;
            }
            t += -(1.0 - next_u()).ln() / rate;
            if t >= end {
                break;
            }
            let input = self.input.draw(next_u(), next_u());
            let output = self.output.draw(next_u(), next_u());
            let shares = shared_blocks > 0 && next_u() < self.shared_fraction;
            let blocks = input.div_ceil(MOONCAKE_BLOCK_TOKENS);
            let mut prefix_blocks = Vec::with_capacity(blocks);
            for b in 0..blocks {
                if shares && b < shared_blocks && (b + 1) * MOONCAKE_BLOCK_TOKENS <= input {
                    prefix_blocks.push(b as u64);
                } else {
                    prefix_blocks.push(next_block);
                    next_block += 1;
                }
            }
            out.push(Arrival { at_us: (t * 1e6) as u64, input_tokens: input, output_tokens: output, prefix_blocks });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mooncake_lines_parse_and_scale() {
        let text = "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 6, \"hash_ids\": [0, 1]}\n\n\
                    {\"timestamp\": 27.5, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [0]}\n";
        let a = parse_mooncake(text, "t.jsonl", 2.0).unwrap();
        assert_eq!(a.len(), 2);
        assert_eq!((a[1].at_us, a[1].output_tokens, a[1].prefix_blocks.clone()), (55_000, 1, vec![0]));
    }

    #[test]
    fn bad_trace_lines_name_the_line_and_field() {
        let cases = [
            ("{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1}\n{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1}", 2, "timestamp"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1}", 1, "input_length"),
            ("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1, 2]}", 1, "hash_ids"),
            ("{\"timestamp\": 0, \"input_length\": 10, \"output_len\": 1}", 1, "output_len"),
            ("not json", 1, "expected"),
        ];
        for (text, line, needle) in cases {
            let e = parse_mooncake(text, "t.jsonl", 1.0).unwrap_err().to_string();
            assert!(e.starts_with(&format!("t.jsonl:{line}:")) && e.contains(needle), "{e}");
        }
    }

    #[test]
    fn the_shared_trace_parses() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces/mooncake-synthetic.jsonl");
        let Ok(text) = std::fs::read_to_string(&path) else {
            eprintln!("skipped: {} is not here", path.display());
            return;
        };
        let a = parse_mooncake(&text, "mooncake-synthetic.jsonl", 1.0).unwrap();
        assert_eq!(a.len(), 3993);
        assert!(a.windows(2).all(|w| w[0].at_us <= w[1].at_us));
    }

    fn synthetic(seed: u64, pattern: Pattern) -> Synthetic {
        Synthetic {
            pattern,
            input: Lengths::LogNormal { median: 2048.0, sigma: 0.8, min: 16, max: 32768 },
            output: Lengths::Uniform { min: 16, max: 512 },
            shared_prefix_tokens: 4096,
            shared_fraction: 0.5,
            duration_s: 100.0,
            seed,
        }
    }

    #[test]
    fn synthetic_traffic_is_seeded_and_has_the_asked_rate() {
        let s = synthetic(7, Pattern::Poisson { rate_per_s: 20.0 });
        let a = s.arrivals();
        assert_eq!(a, s.arrivals());
        assert_ne!(a, synthetic(8, Pattern::Poisson { rate_per_s: 20.0 }).arrivals());
        assert!((1800..2200).contains(&a.len()), "{}", a.len());
        let sharing =
            a.iter().filter(|r| r.input_tokens >= 4096 && r.prefix_blocks[..8] == [0, 1, 2, 3, 4, 5, 6, 7]).count();
        let long = a.iter().filter(|r| r.input_tokens >= 4096).count();
        assert!((sharing as f64 / long as f64 - 0.5).abs() < 0.1, "{sharing} of {long}");
        assert!(a.iter().all(|r| (16..=32768).contains(&r.input_tokens) && (16..=512).contains(&r.output_tokens)));
    }

    #[test]
    fn bursts_concentrate_arrivals() {
        let s = synthetic(3, Pattern::Bursty { rate_per_s: 10.0, burst_factor: 4.0, on_s: 5.0, off_s: 5.0 });
        let a = s.arrivals();
        let in_burst = a.iter().filter(|r| (r.at_us / 1_000_000) % 10 < 5).count();
        assert!(in_burst as f64 > 0.85 * a.len() as f64, "{in_burst} of {}", a.len());
    }
}
