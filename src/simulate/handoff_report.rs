//! What the prefill → decode handoffs did: how many states moved, how many
//! requests were placed elsewhere and recomputed instead (by why), how many
//! transfers were sent again, the largest backlog a prefill instance held
//! and how long a prefilled request waited to be adopted.

use deepinfer_actors::sim::events::MetricsSnapshot;
use serde::Serialize;

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HandoffReport {
    /// States sent to a decode instance.
    pub handovers: u64,
    /// Requests a prefill instance placed on a decode instance to be
    /// recomputed there, by why: no state to send, its handoff table full,
    /// not adopted after every transfer attempt.
    pub reroutes_no_state: u64,
    pub reroutes_backlog: u64,
    pub reroutes_unadopted: u64,
    /// Transfers sent again after their acknowledgement deadline.
    pub transfers_resent: u64,
    /// Transferred states a decode instance did not accept and recomputed.
    pub recomputes: u64,
    /// Requests any scheduler started again from their tokens (reroutes
    /// included).
    pub requests_restarted: u64,
    /// Most handoffs one prefill instance held at once, sent or queued.
    pub pending_peak: u64,
    /// Prefill finish to adoption (as the prefill instance hears it), ms.
    pub adoption_wait_ms_p50: f64,
    pub adoption_wait_ms_p99: f64,
}

impl HandoffReport {
    pub fn new(m: &MetricsSnapshot) -> Self {
        let (p50, p99, _) = m.handoff_wait_us;
        Self {
            handovers: m.handovers,
            reroutes_no_state: m.reroutes_no_state,
            reroutes_backlog: m.reroutes_backlog,
            reroutes_unadopted: m.reroutes_unadopted,
            transfers_resent: m.transfers_resent,
            recomputes: m.handoff_recomputes,
            requests_restarted: m.requests_restarted,
            pending_peak: m.handoffs_pending_peak,
            adoption_wait_ms_p50: p50 as f64 / 1e3,
            adoption_wait_ms_p99: p99 as f64 / 1e3,
        }
    }

    pub fn reroutes(&self) -> u64 {
        self.reroutes_no_state + self.reroutes_backlog + self.reroutes_unadopted
    }

    /// The Markdown table of the handoffs; empty when no request was handed off or rerouted.
    pub fn to_markdown(&self) -> String {
        if self.handovers == 0 && self.reroutes() == 0 {
            return String::new();
        }
        let rows = [
            ("states handed to decode", self.handovers.to_string()),
            (
                "rerouted for recompute (no state / backlog full / not adopted)",
                format!(
                    "{} ({} / {} / {})",
                    self.reroutes(),
                    self.reroutes_no_state,
                    self.reroutes_backlog,
                    self.reroutes_unadopted
                ),
            ),
            ("states recomputed by decode (did not check out)", self.recomputes.to_string()),
            (
                "transfers resent / requests restarted",
                format!("{} / {}", self.transfers_resent, self.requests_restarted),
            ),
            ("handoff backlog peak (one prefill instance)", self.pending_peak.to_string()),
            (
                "prefill finish → adoption ms p50 / p99",
                format!("{:.1} / {:.1}", self.adoption_wait_ms_p50, self.adoption_wait_ms_p99),
            ),
        ];
        let mut md = String::from("\n| handoffs | value |\n|---|---|\n");
        for (what, value) in rows {
            md += &format!("| {what} | {value} |\n");
        }
        md
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_every_counter() {
        let m = MetricsSnapshot {
            handovers: 900,
            reroutes_no_state: 1,
            reroutes_backlog: 20,
            reroutes_unadopted: 300,
            transfers_resent: 4000,
            handoff_recomputes: 5,
            requests_restarted: 326,
            handoffs_pending_peak: 1024,
            handoff_wait_us: (2_500, 3_100_000, 900),
            ..Default::default()
        };
        let r = HandoffReport::new(&m);
        assert_eq!(r.reroutes(), 321);
        let md = r.to_markdown();
        for needle in ["| 900 |", "321 (1 / 20 / 300)", "| 5 |", "4000 / 326", "| 1024 |", "2.5 / 3100.0"] {
            assert!(md.contains(needle), "{needle} missing from\n{md}");
        }
        let json = serde_json::to_value(&r).expect("serialises");
        assert_eq!(json["reroutes_unadopted"], 300);
        assert_eq!(json["recomputes"], 5);
        assert_eq!(json["pending_peak"], 1024);
        assert_eq!(HandoffReport::default().to_markdown(), "");
    }
}
