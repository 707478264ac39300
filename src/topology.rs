//! Topology files (`cluster-configs/*.toml`): the nodes of a cluster, their
//! devices, the serving instances spread over them, the model and the API
//! address. Errors name the file, line and key.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;

use deepinfer_engine::speculative::SpeculativeConfig;
use serde::Deserialize;
use toml::Spanned;

use crate::config_file::{parse_toml, read_text, value_error, FileError};

/// Most devices one node may declare.
pub const MAX_DEVICES_PER_NODE: usize = 64;
/// Most nodes in one topology.
pub const MAX_NODES: usize = 1024;

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Cpu,
    Cuda,
    Ascend,
    Simulated,
}

pub use deepinfer_actors::cluster::disagg::InstanceKind;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub name: String,
    /// A Hugging Face model directory or `builtin:<preset>`.
    pub model: String,
    /// Where `deepinfer serve` listens (OpenAI/Anthropic API).
    pub api_listen: Spanned<String>,
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: Spanned<u64>,
    #[serde(default = "default_failure_timeout_ms")]
    pub failure_timeout_ms: Spanned<u64>,
    /// How long a node waits for a peer it has never heard from (one still
    /// starting, or dead when this node started) before declaring it down.
    #[serde(default = "default_startup_grace_ms")]
    pub startup_grace_ms: Spanned<u64>,
    /// Directory of the cluster CA and node certificates (relative to the file).
    #[serde(default)]
    pub certs_dir: Option<String>,
    /// Expert load balancing at run time; absent: the table changes only when devices are lost.
    #[serde(default)]
    pub eplb: Option<Eplb>,
    /// The prompt cache below each instance's KV pool; absent: the defaults (host memory, no disk).
    #[serde(default)]
    pub cache: Option<CacheTiers>,
    /// Speculative decoding on the decoding workers; absent: off.
    #[serde(default)]
    pub speculative: Option<Speculative>,
}

/// `[cluster.speculative]`: every worker drafts with the model's own draft
/// head and verifies the drafts with the next step (the same tokens as
/// without drafts).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Speculative {
    /// `mtp` (DeepSeek-V4's MTP block), `dspark` (DeepSeek-V4.1's DSpark layers) or `off`.
    pub method: Spanned<String>,
    /// Most drafts a request verifies per step (1 to 16).
    #[serde(default = "default_num_draft_tokens")]
    pub num_draft_tokens: Spanned<usize>,
    /// `adaptive` (as many as pay for themselves at the worker's batch) or `fixed`.
    #[serde(default = "default_draft_length")]
    pub draft_length: Spanned<String>,
}

fn default_num_draft_tokens() -> Spanned<usize> {
    Spanned::new(0..0, 3)
}

fn default_draft_length() -> Spanned<String> {
    Spanned::new(0..0, "adaptive".into())
}

impl Speculative {
    /// The engine's configuration, or what is wrong with which field.
    pub fn config(&self) -> Result<SpeculativeConfig, (std::ops::Range<usize>, String)> {
        crate::config_file::speculative_config(&self.method, &self.num_draft_tokens, &self.draft_length)
    }
}

/// `[cluster.cache]`: each node's host-memory and disk tiers of the prompt cache.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CacheTiers {
    /// Host memory per node for blocks a KV pool evicts, in MiB (0: none).
    #[serde(default = "default_host_mib")]
    pub host_mib: Spanned<u64>,
    /// Directory of the disk tier (relative to the file); absent: no disk tier.
    #[serde(default)]
    pub disk_dir: Option<Spanned<String>>,
    /// Most GiB of block files each node keeps there.
    #[serde(default = "default_disk_gib")]
    pub disk_gib: Spanned<u64>,
    /// `disk_dir` is one mount every node shares (3FS, NFS, Lustre); otherwise
    /// each node keeps its own directory under it.
    #[serde(default)]
    pub disk_shared: bool,
    /// Persist long prompts every this many blocks, besides each prompt's and output's end.
    #[serde(default = "default_persist_interval")]
    pub persist_interval_blocks: Spanned<u64>,
}

/// The most host memory a node's cache tier may be given (1 TiB), in MiB.
pub const MAX_HOST_CACHE_MIB: u64 = 1 << 20;

impl Default for CacheTiers {
    fn default() -> Self {
        Self {
            host_mib: default_host_mib(),
            disk_dir: None,
            disk_gib: default_disk_gib(),
            disk_shared: false,
            persist_interval_blocks: default_persist_interval(),
        }
    }
}

fn default_host_mib() -> Spanned<u64> {
    Spanned::new(0..0, 2048)
}

fn default_disk_gib() -> Spanned<u64> {
    Spanned::new(0..0, 64)
}

fn default_persist_interval() -> Spanned<u64> {
    Spanned::new(0..0, 16)
}

/// `[cluster.eplb]`: every instance re-places its experts from the loads it measures.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Eplb {
    /// Steps of an instance between placements.
    pub every_steps: Spanned<u64>,
    /// Weight of the newest step in the moving average of loads (0 < decay ≤ 1).
    #[serde(default = "default_eplb_decay")]
    pub decay: Spanned<f64>,
    /// Expert copies beyond one per expert, spread over the instance's devices.
    #[serde(default)]
    pub redundant_experts: u32,
    /// Least drop of the heaviest device's load, as a multiple of the mean
    /// device's, worth moving weights for.
    #[serde(default = "default_eplb_min_gain")]
    pub min_gain: Spanned<f64>,
}

fn default_eplb_decay() -> Spanned<f64> {
    Spanned::new(0..0, 0.2)
}

fn default_eplb_min_gain() -> Spanned<f64> {
    Spanned::new(0..0, 0.05)
}

fn default_heartbeat_ms() -> Spanned<u64> {
    Spanned::new(0..0, 200)
}

fn default_startup_grace_ms() -> Spanned<u64> {
    Spanned::new(0..0, 60_000)
}

fn default_failure_timeout_ms() -> Spanned<u64> {
    Spanned::new(0..0, 1000)
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Node {
    pub name: Spanned<String>,
    /// `host:port` of the node's QUIC endpoint.
    pub address: Spanned<String>,
    pub devices: Spanned<usize>,
    pub backend: Backend,
    /// Hardware kind (`cpu`, `H800`, `H100`, `H200`, `B200`, `GB200`, `Ascend950`).
    #[serde(default = "default_hardware")]
    pub hardware: Spanned<String>,
}

fn default_hardware() -> Spanned<String> {
    Spanned::new(0..0, "cpu".into())
}

/// What an `[[instance]]` is: a serving instance (`prefill`, `decode`,
/// `both`), or an image encoder (`encoder`: V4.1's vision tower for the
/// prefill instances, on nodes of its own).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum InstanceRole {
    Both,
    Prefill,
    Decode,
    Encoder,
}

impl InstanceRole {
    /// The serving kind; `None` for an encoder.
    pub fn kind(self) -> Option<InstanceKind> {
        match self {
            InstanceRole::Both => Some(InstanceKind::Both),
            InstanceRole::Prefill => Some(InstanceKind::Prefill),
            InstanceRole::Decode => Some(InstanceKind::Decode),
            InstanceRole::Encoder => None,
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Instance {
    pub name: Spanned<String>,
    pub role: InstanceRole,
    /// Nodes whose devices this instance uses, all of them.
    pub nodes: Vec<Spanned<String>>,
    /// Attention data-parallel degree (default: every device).
    #[serde(default)]
    pub attention_dp: Option<Spanned<usize>>,
    /// Devices sharing the routed experts (default: every device).
    #[serde(default)]
    pub expert_parallel: Option<Spanned<usize>>,
    #[serde(default)]
    pub redundant_experts: usize,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    pub cluster: Cluster,
    #[serde(rename = "node")]
    pub nodes: Vec<Node>,
    #[serde(rename = "instance")]
    pub instances: Vec<Instance>,
}

impl Topology {
    pub fn from_file(path: &Path) -> Result<Self, FileError> {
        let (file, text) = read_text(path)?;
        Self::parse(&file, &text)
    }

    /// Parse and check a topology; `file` names it in errors.
    pub fn parse(file: &str, text: &str) -> Result<Self, FileError> {
        let t: Topology = parse_toml(file, text)?;
        let err = |span: std::ops::Range<usize>, message: String| value_error(file, text, span, message);

        parse_addr(&t.cluster.api_listen).map_err(|m| err(t.cluster.api_listen.span(), m))?;
        if *t.cluster.heartbeat_ms.get_ref() == 0 {
            return Err(err(t.cluster.heartbeat_ms.span(), "must be at least 1".into()));
        }
        if t.cluster.startup_grace_ms.get_ref() < t.cluster.failure_timeout_ms.get_ref() {
            return Err(err(
                t.cluster.startup_grace_ms.span(),
                format!("must be at least failure_timeout_ms ({})", t.cluster.failure_timeout_ms.get_ref()),
            ));
        }
        if t.cluster.failure_timeout_ms.get_ref() <= t.cluster.heartbeat_ms.get_ref() {
            return Err(err(
                t.cluster.failure_timeout_ms.span(),
                format!("must exceed heartbeat_ms ({})", t.cluster.heartbeat_ms.get_ref()),
            ));
        }
        if let Some(e) = &t.cluster.eplb {
            if *e.every_steps.get_ref() == 0 {
                return Err(err(e.every_steps.span(), "must be at least 1".into()));
            }
            let decay = *e.decay.get_ref();
            if !(decay > 0.0 && decay <= 1.0) {
                return Err(err(e.decay.span(), format!("must be in (0, 1], not {decay}")));
            }
            let gain = *e.min_gain.get_ref();
            if !(0.0..=1.0).contains(&gain) {
                return Err(err(e.min_gain.span(), format!("must be in [0, 1], not {gain}")));
            }
        }
        if let Some(spec) = &t.cluster.speculative {
            spec.config().map_err(|(span, m)| err(span, m))?;
        }
        if let Some(c) = &t.cluster.cache {
            if *c.host_mib.get_ref() > MAX_HOST_CACHE_MIB {
                return Err(err(c.host_mib.span(), format!("must be at most {MAX_HOST_CACHE_MIB} (1 TiB)")));
            }
            if *c.disk_gib.get_ref() == 0 {
                return Err(err(c.disk_gib.span(), "must be at least 1".into()));
            }
            if c.disk_dir.as_ref().is_some_and(|d| d.get_ref().trim().is_empty()) {
                return Err(err(c.disk_dir.as_ref().expect("checked").span(), "must name a directory".into()));
            }
            if *c.persist_interval_blocks.get_ref() > 1 << 20 {
                return Err(err(
                    c.persist_interval_blocks.span(),
                    "must be at most 1048576 (0: prompt ends only)".into(),
                ));
            }
        }
        if t.nodes.is_empty() || t.nodes.len() > MAX_NODES {
            return Err(err(0..0, format!("a topology needs 1 to {MAX_NODES} [[node]] tables")));
        }
        let mut names = BTreeSet::new();
        let mut addresses = BTreeSet::new();
        for node in &t.nodes {
            if !names.insert(node.name.get_ref().clone()) {
                return Err(err(node.name.span(), format!("node `{}` is declared twice", node.name.get_ref())));
            }
            let addr = parse_addr(&node.address).map_err(|m| err(node.address.span(), m))?;
            if !addresses.insert(addr) {
                return Err(err(node.address.span(), format!("address {addr} is used by another node")));
            }
            let devices = *node.devices.get_ref();
            if devices == 0 || devices > MAX_DEVICES_PER_NODE {
                return Err(err(node.devices.span(), format!("must be 1 to {MAX_DEVICES_PER_NODE}")));
            }
            let hw = node.hardware.get_ref();
            if hw != "cpu" && deepinfer_engine::cost::HardwareKind::from_name(hw).is_none() {
                return Err(err(
                    node.hardware.span(),
                    format!("unknown hardware `{hw}` (cpu, H800, H100, H200, B200, GB200, Ascend950)"),
                ));
            }
        }
        if t.instances.is_empty() {
            return Err(err(0..0, "a topology needs at least one [[instance]] table".into()));
        }
        let mut instance_names = BTreeSet::new();
        let mut used = BTreeSet::new();
        for inst in &t.instances {
            if !instance_names.insert(inst.name.get_ref().clone()) {
                return Err(err(inst.name.span(), format!("instance `{}` is declared twice", inst.name.get_ref())));
            }
            if inst.nodes.is_empty() {
                return Err(err(inst.name.span(), "an instance needs at least one node".into()));
            }
            let mut devices = 0;
            for n in &inst.nodes {
                let Some(node) = t.nodes.iter().find(|x| x.name.get_ref() == n.get_ref()) else {
                    return Err(err(n.span(), format!("unknown node `{}`", n.get_ref())));
                };
                if !used.insert(n.get_ref().clone()) {
                    return Err(err(n.span(), format!("node `{}` already serves another instance", n.get_ref())));
                }
                devices += node.devices.get_ref();
            }
            if inst.role == InstanceRole::Encoder {
                // An encoder runs the vision tower alone: no experts, no attention ranks.
                for (value, what) in [(&inst.attention_dp, "attention_dp"), (&inst.expert_parallel, "expert_parallel")]
                {
                    if let Some(v) = value {
                        return Err(err(v.span(), format!("an encoder instance takes no `{what}`")));
                    }
                }
                if inst.redundant_experts > 0 {
                    return Err(err(inst.name.span(), "an encoder instance takes no `redundant_experts`".into()));
                }
                continue;
            }
            for (value, what) in [(&inst.attention_dp, "attention_dp"), (&inst.expert_parallel, "expert_parallel")] {
                if let Some(v) = value {
                    let n = *v.get_ref();
                    if n == 0 || n > devices || !devices.is_multiple_of(n) {
                        return Err(err(v.span(), format!("{what} {n} must divide the instance's {devices} devices")));
                    }
                }
            }
        }
        if let Some(first) = t.instances.iter().find(|i| i.role == InstanceRole::Encoder) {
            if t.instances.iter().all(|i| i.role == InstanceRole::Encoder) {
                return Err(err(
                    first.name.span(),
                    "encoders need a serving instance (prefill, decode or both)".into(),
                ));
            }
        }
        Ok(t)
    }

    /// The node called `name`.
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name.get_ref() == name)
    }

    pub fn total_devices(&self) -> usize {
        self.nodes.iter().map(|n| *n.devices.get_ref()).sum()
    }
}

fn parse_addr(value: &Spanned<String>) -> Result<SocketAddr, String> {
    value
        .get_ref()
        .parse()
        .map_err(|_| format!("`{}` is not a host:port address (e.g. 127.0.0.1:7100)", value.get_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use deepinfer_engine::speculative::policy::DraftPolicy;
    use deepinfer_engine::speculative::DraftMethod;

    const GOOD: &str = r#"
[cluster]
name = "two"
model = "builtin:tiny-v4"
api_listen = "127.0.0.1:8000"

[[node]]
name = "a"
address = "127.0.0.1:7100"
devices = 2
backend = "cpu"

[[node]]
name = "b"
address = "127.0.0.1:7101"
devices = 2
backend = "cpu"

[[instance]]
name = "main"
role = "both"
nodes = ["a", "b"]
expert_parallel = 4
"#;

    #[test]
    fn a_good_topology_parses() {
        let t = Topology::parse("t.toml", GOOD).unwrap();
        assert_eq!(t.total_devices(), 4);
        assert_eq!(*t.cluster.failure_timeout_ms.get_ref(), 1000);
        assert_eq!(t.instances[0].role, InstanceRole::Both);
    }

    #[test]
    fn an_unknown_key_is_named_with_its_line() {
        let text = GOOD.replace(
            "devices = 2\nbackend = \"cpu\"\n\n[[instance]]",
            "devices = 2\nbackend = \"cpu\"\ngpus = 3\n\n[[instance]]",
        );
        let e = Topology::parse("t.toml", &text).unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (18, Some("node.gpus")), "{e}");
        assert!(e.to_string().starts_with("t.toml:18:1: key `node.gpus`: unknown field `gpus`"), "{e}");
    }

    #[test]
    fn a_wrong_type_is_named_with_its_line() {
        let text = GOOD.replacen("devices = 2", "devices = \"two\"", 1);
        let e = Topology::parse("t.toml", &text).unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (10, Some("node.devices")), "{e}");
        assert!(e.message.contains("invalid type"), "{e}");
    }

    #[test]
    fn a_missing_node_is_named_with_its_line() {
        let text = GOOD.replace("nodes = [\"a\", \"b\"]", "nodes = [\"a\", \"c\"]");
        let e = Topology::parse("t.toml", &text).unwrap_err();
        assert_eq!((e.line, e.key.as_deref()), (22, Some("instance.nodes")), "{e}");
        assert!(e.message.contains("unknown node `c`"), "{e}");
    }

    #[test]
    fn a_missing_key_is_named() {
        let text = GOOD.replace("model = \"builtin:tiny-v4\"\n", "");
        let e = Topology::parse("t.toml", &text).unwrap_err();
        assert_eq!(e.key.as_deref(), Some("cluster.model"), "{e}");
    }

    #[test]
    fn values_that_do_not_fit_are_refused() {
        for (from, to, needle) in [
            ("expert_parallel = 4", "expert_parallel = 3", "must divide"),
            ("address = \"127.0.0.1:7101\"", "address = \"127.0.0.1:7100\"", "used by another node"),
            ("api_listen = \"127.0.0.1:8000\"", "api_listen = \"localhost\"", "not a host:port"),
            ("backend = \"cpu\"", "backend = \"tpu\"", "unknown variant"),
        ] {
            let e = Topology::parse("t.toml", &GOOD.replacen(from, to, 1)).unwrap_err();
            assert!(e.to_string().contains(needle), "{from}: {e}");
        }
    }

    #[test]
    fn the_cache_table_is_read_and_its_bad_values_are_named_with_their_line() {
        let cache = "api_listen = \"127.0.0.1:8000\"\n\n[cluster.cache]\nhost_mib = 512\ndisk_dir = \"kv\"\n";
        let text = GOOD.replace("api_listen = \"127.0.0.1:8000\"\n", cache);
        let t = Topology::parse("t.toml", &text).unwrap();
        let c = t.cluster.cache.expect("read");
        assert_eq!(
            (*c.host_mib.get_ref(), c.disk_dir.map(|d| d.into_inner()), c.disk_shared),
            (512, Some("kv".into()), false)
        );
        assert_each_edit_refused(
            &text,
            &[
                ("host_mib = 512", "host_mib = 2000000", 8, "at most 1048576"),
                ("disk_dir = \"kv\"", "disk_dir = \" \"", 9, "must name a directory"),
                ("disk_dir = \"kv\"", "disk_gib = 0", 9, "at least 1"),
                ("host_mib = 512", "host_gib = 1", 8, "unknown field `host_gib`"),
            ],
        );
    }

    /// Each `(from, to, line, needle)`: `text` with `from` replaced by `to` is
    /// refused at `line` with a message containing `needle`.
    fn assert_each_edit_refused(text: &str, edits: &[(&str, &str, usize, &str)]) {
        for &(from, to, line, needle) in edits {
            let e = Topology::parse("t.toml", &text.replacen(from, to, 1)).unwrap_err();
            assert_eq!(e.line, line, "{to}: {e}");
            assert!(e.to_string().contains(needle), "{to}: {e}");
        }
    }

    #[test]
    fn the_speculative_table_is_read_and_its_bad_values_are_named_with_their_line() {
        let spec = "api_listen = \"127.0.0.1:8000\"\n\n[cluster.speculative]\nmethod = \"mtp\"\nnum_draft_tokens = 4\n";
        let text = GOOD.replace("api_listen = \"127.0.0.1:8000\"\n", spec);
        let t = Topology::parse("t.toml", &text).unwrap();
        let config = t.cluster.speculative.expect("read").config().unwrap();
        assert_eq!(config, SpeculativeConfig { method: DraftMethod::Mtp, policy: DraftPolicy::Adaptive { max: 4 } });
        assert_each_edit_refused(
            &text,
            &[
                ("method = \"mtp\"", "method = \"eagle\"", 8, "unknown speculative method"),
                ("num_draft_tokens = 4", "num_draft_tokens = 17", 9, "must be 1 to 16"),
                ("num_draft_tokens = 4", "draft_length = \"long\"", 9, "(fixed, adaptive)"),
                ("num_draft_tokens = 4", "drafts = 2", 9, "unknown field `drafts`"),
            ],
        );
    }
}
