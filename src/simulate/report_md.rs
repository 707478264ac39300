//! The Markdown form of a simulation's report (`report.md`).

use super::report::Report;

impl Report {
    pub fn to_markdown(&self) -> String {
        let r = &self.requests;
        let mut md = format!(
            "# Simulation: {}\n\n{} × {} running {}, {} nodes ({} prefill + {} decode devices), seed {}, {:.0} s of arrivals ({:.0} s simulated).\n\n",
            self.scenario,
            self.devices,
            self.hardware,
            self.model,
            self.nodes,
            self.prefill_devices,
            self.decode_devices,
            self.seed,
            self.duration_s,
            self.simulated_s
        );
        md += "| metric | value |\n|---|---|\n";
        let mut row = |k: &str, v: String| md += &format!("| {k} | {v} |\n");
        row(
            "requests",
            format!(
                "{} submitted, {} completed, {} failed, {} refused, {} unfinished, **{} lost**",
                r.submitted, r.completed, r.failed, r.refused, r.unfinished, r.lost
            ),
        );
        let per_node = self.devices_per_node;
        row(
            "input tok/s (cache hits included)",
            format!(
                "{:.0} total, {:.0} per prefill GPU (of the {} that prefill), {:.0} per prefill node ({per_node} GPUs)",
                self.input_tok_s,
                self.input_tok_s_per_prefill_gpu,
                self.prefill_devices,
                self.input_tok_s_per_prefill_node
            ),
        );
        row("output tok/s", self.output_row());
        row(
            "TTFT ms p50 / p90 / p99",
            format!("{:.0} / {:.0} / {:.0}", self.ttft_ms.p50, self.ttft_ms.p90, self.ttft_ms.p99),
        );
        row(
            "TPOT ms p50 / p90 / p99",
            format!("{:.1} / {:.1} / {:.1}", self.tpot_ms.p50, self.tpot_ms.p90, self.tpot_ms.p99),
        );
        row(
            "goodput (TTFT ≤ SLO and TPOT ≤ SLO)",
            format!(
                "{:.2} req/s, {:.1}% of completed, {:.1}% of all judged, unfinished ones included (SLO {:.0} ms / {:.0} ms)",
                self.goodput_req_s,
                self.slo_attainment * 100.0,
                self.slo_attainment_judged * 100.0,
                self.slo_ttft_ms,
                self.slo_tpot_ms
            ),
        );
        row("prefix hit rate", format!("{:.1}%", self.prefix_hit_rate * 100.0));
        row(
            "steps / actor restarts / sequences rebuilt / prefill→decode handovers",
            format!("{} / {} / {} / {}", self.steps, self.actor_restarts, self.sequences_rebuilt, self.handovers),
        );
        if let Some(x) = &self.speculative {
            let probs: Vec<String> = x.acceptance.iter().map(|p| format!("{p}")).collect();
            row(
                "speculative decoding",
                format!(
                    "{}, {}, up to {} drafts; acceptance [{}], spread {}, head noise {}",
                    x.method,
                    x.draft_length,
                    x.num_draft_tokens,
                    probs.join(", "),
                    x.acceptance_spread,
                    x.confidence_noise
                ),
            );
            row(
                "acceptance length",
                format!(
                    "{:.2} tokens per verification (the model's means give {:.2} for the lengths verified)",
                    x.acceptance_length, x.acceptance_length_model
                ),
            );
            row(
                "wasted verification",
                format!("{:.1}% of {} verified drafts rejected", x.wasted_verification * 100.0, x.verified_drafts),
            );
            row(
                "drafts per step",
                format!(
                    "{:.2} verified per decoding request-step ({:.2} per verification), {:.2} tokens per step",
                    x.drafts_per_step, x.drafts_per_verification, x.tokens_per_step
                ),
            );
        }
        md += "\n| instance | role | devices | KV budget GiB | KV use max | KV use mean | expert load max/mean |\n|---|---|---|---|---|---|---|\n";
        for (i, x) in self.instances.iter().enumerate() {
            md += &format!(
                "| {i} | {} | {} | {:.0} | {:.1}% | {:.1}% | {:.2} |\n",
                x.role,
                x.devices,
                x.kv_budget_gib,
                x.kv_use_max * 100.0,
                x.kv_use_mean * 100.0,
                x.expert_imbalance
            );
        }
        md += &self.expert_balance.as_ref().map(|b| b.to_markdown()).unwrap_or_default();
        md += &self.handoffs.to_markdown();
        if let Some(c) = &self.cache {
            md += &c.to_markdown();
        }
        if let Some(e) = &self.encoders {
            md += &e.to_markdown();
        }
        if !self.faults.is_empty() {
            md += "\n| t (s) | fault |\n|---|---|\n";
            for (t, what) in &self.faults {
                md += &format!("| {t:.1} | {what} |\n");
            }
        }
        if !r.first_errors.is_empty() {
            md += "\nFirst errors:\n\n";
            for e in &r.first_errors {
                md += &format!("- {e}\n");
            }
        }
        md += "\nPlots: `throughput.svg` (faults marked), `latency_cdf.svg`, `tpot_cdf.svg`, `expert_load.svg`";
        md += if self.cache.is_some() { ", `cache_tiers.svg`.\n" } else { ".\n" };
        md
    }

    /// The output row: what each figure divides by, and no per-decode
    /// figure when no decode step ran (every output token was a first token).
    fn output_row(&self) -> String {
        if self.decode_tokens == 0 {
            return format!(
                "{:.0} total, first tokens only: no decode step ran (every request asked for 1 output token), \
                 so nothing is given per decode GPU",
                self.output_tok_s
            );
        }
        format!(
            "{:.0} total, {:.0} per decode GPU (of the {} that decode), {:.0} per decode node ({} GPUs)",
            self.output_tok_s,
            self.output_tok_s_per_decode_gpu,
            self.decode_devices,
            self.output_tok_s_per_decode_node,
            self.devices_per_node
        )
    }
}
