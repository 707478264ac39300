//! The client's side of what routers send: acknowledgements, a restarted
//! router (everything is submitted again), and outputs taken in order (a
//! gap asked for again, stale ones dropped), each request's last one
//! turned into its `Finished` update.

use super::*;

fn finish_reason(k: FinishKind) -> FinishReason {
    match k {
        FinishKind::Stop => FinishReason::Stop,
        FinishKind::Length => FinishReason::Length,
        FinishKind::Cancelled => FinishReason::Cancelled,
        FinishKind::Error(e) => FinishReason::Error(e),
    }
}

/// Why `spec` cannot travel in one frame (its images' values ride in the
/// request's archive), or `None`: refused at once rather than lost on the way.
pub(super) fn oversized(spec: &RequestSpec) -> Option<String> {
    use crate::limits::{FRAME_HEADER_BYTES_MAX, MAX_FRAME_BYTES};
    use crate::wire::ImageData;
    let values: usize = spec
        .images
        .iter()
        .map(|i| match &i.content {
            ImageData::Patches(v) | ImageData::Rows(v) => v.len(),
        })
        .sum();
    let bytes = (values + spec.prompt.len()).saturating_mul(4);
    let most = (MAX_FRAME_BYTES - FRAME_HEADER_BYTES_MAX) as usize;
    (bytes > most).then(|| {
        format!(
            "the request's {} images take {bytes} bytes, more than the {most} a request may carry",
            spec.images.len()
        )
    })
}

impl Cluster {
    /// Ask the agents of `nodes` for their status; the reports land in
    /// [`Self::statuses`] as they arrive (while updates are awaited, or at
    /// [`Self::poll_news`]).
    pub fn ask_status(&self, nodes: &[u32]) {
        for &n in nodes {
            let msg = Message::Control(crate::wire::Control::StatusQuery { nonce: u64::from(self.addr.index) });
            self.ctx.send(self.addr, Addr::agent(n), msg, &[]);
        }
    }

    /// The last status report of each node asked.
    pub fn statuses(&self) -> &BTreeMap<u32, crate::wire::NodeStatus> {
        &self.statuses
    }

    /// The node each image encoder runs on.
    pub fn encoder_nodes(&self) -> &[u32] {
        &self.ctx.encoders
    }

    pub(super) fn on_message(&mut self, from: crate::wire::Addr, msg: Message, body: Vec<f32>) {
        if let (Role::Agent, Message::Control(crate::wire::Control::StatusReport { status, .. })) = (from.role, &msg) {
            if status.node == from.index {
                self.statuses.insert(from.index, (**status).clone());
            }
            return;
        }
        if from.role != Role::Router {
            return;
        }
        let now = self.ctx.clock.now();
        let timeout = self.ctx.timeouts.request;
        match msg {
            Message::Ack { ids } => {
                for id in ids {
                    if let Some(o) = self.outstanding.get_mut(&id) {
                        o.attempts = 0;
                        self.set_deadline(id, now + timeout);
                    }
                }
            }
            Message::Heartbeat(h) if h.restarted && from == Addr::router(self.router) => {
                // A new router knows nothing: tell it everything again.
                self.resubmit_all();
            }
            Message::Outputs(out) => {
                let vocab = self.ctx.config.vocab_size;
                let Some(items) = out.with_logits(&body, vocab) else {
                    bump(&self.ctx.metrics.frames_rejected);
                    return;
                };
                for (item, logits) in items {
                    let id = item.id;
                    let Some(o) = self.outstanding.get(&id) else { continue };
                    let fits = fit(o.tokens.len(), item.from as usize, item.tokens.len());
                    if !matches!(fits, Fit::Stale) {
                        self.set_deadline(id, now + timeout);
                    }
                    let o = self.outstanding.get_mut(&id).expect("present");
                    let skip = match fits {
                        Fit::Gap => {
                            bump(&self.ctx.metrics.submits_resent);
                            let o = &self.outstanding[&id];
                            self.send_submit(o);
                            continue;
                        }
                        Fit::Stale => continue,
                        Fit::New { skip } => skip,
                    };
                    o.attempts = 0;
                    let tokens: Vec<TokenOutput> = item.tokens[skip..]
                        .iter()
                        .enumerate()
                        .map(|(j, t)| TokenOutput {
                            token: t.token,
                            logprob: t.logprob,
                            top: t.top.iter().map(|x| (x.token, x.logprob)).collect(),
                            logits: item.logits.then(|| logits[(skip + j) * vocab..(skip + j + 1) * vocab].to_vec()),
                        })
                        .collect();
                    o.tokens.extend(tokens.iter().map(|t| t.token));
                    if !tokens.is_empty() && !o.cancelled {
                        let cached_tokens = item.cached as usize;
                        self.ready.push_back(Update::Tokens { id, tokens, cached_tokens });
                    }
                    match item.end {
                        None => {}
                        Some(OutputEnd::Refused(reason)) => {
                            self.forget(id);
                            self.ready.push_back(Update::Refused { id, reason });
                        }
                        Some(OutputEnd::Finished(f)) => {
                            let o = self.forget(id).expect("present");
                            let finished = Finished {
                                reason: finish_reason(f.reason),
                                prompt_tokens: f.prompt_tokens as usize,
                                completion_tokens: o.tokens.len(),
                                cached_tokens: f.cached_tokens as usize,
                                cached_tokens_by_tier: [
                                    f.cached_tokens.saturating_sub(f.cached_host_tokens + f.cached_disk_tokens)
                                        as usize,
                                    f.cached_host_tokens as usize,
                                    f.cached_disk_tokens as usize,
                                ],
                                preemptions: f.preemptions,
                            };
                            self.ready.push_back(Update::Finished { id, finished });
                        }
                    }
                }
            }
            _ => {}
        }
    }
}
