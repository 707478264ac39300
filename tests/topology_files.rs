//! Every shipped topology file parses and passes its checks.

use std::path::PathBuf;

use deepinfer::topology::Topology;

#[test]
fn shipped_topologies_are_valid() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let t = Topology::from_file(&path).unwrap_or_else(|e| panic!("{e}"));
            seen.push((path.file_name().unwrap().to_string_lossy().to_string(), t.total_devices()));
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        vec![
            ("b200-128.toml".to_string(), 128),
            ("local-1.toml".to_string(), 1),
            ("local-4-ep4.toml".to_string(), 4),
            ("local-4.toml".to_string(), 4),
            ("local-encoder.toml".to_string(), 2)
        ]
    );
}

/// An encoder instance takes a node of its own after the serving ones: the
/// serving devices are node0's, the encoder runs on node1.
#[test]
fn an_encoder_instance_runs_on_its_own_node() {
    use deepinfer::cluster::ClusterPlan;

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs");
    let plan = ClusterPlan::load(&dir.join("local-encoder.toml")).unwrap();
    assert_eq!((plan.instances, plan.devices(), plan.encoder_nodes.clone()), (1, 1, vec![1]));
    let topo = plan.base_config().topology();
    assert_eq!((topo.serving_nodes(), topo.nodes()), (1, 2));
    let text = std::fs::read_to_string(dir.join("local-encoder.toml")).unwrap();
    let at = |needle: &str| text[..text.find(needle).unwrap()].matches('\n').count() + 1;
    for (edit, want, line) in [
        (
            ("nodes = [\"node1\"]", "nodes = [\"node1\"]\nexpert_parallel = 1"),
            "an encoder instance takes no `expert_parallel`",
            at("nodes = [\"node1\"]") + 1,
        ),
        (("role = \"both\"", "role = \"encoder\""), "encoders need a serving instance", at("name = \"main\"")),
    ] {
        let bad = text.replace(edit.0, edit.1);
        let e = Topology::parse("local-encoder.toml", &bad).map(|_| ()).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains(&format!("local-encoder.toml:{line}:")), "{e}");
    }
    // Serving instances first: an encoder before one is refused, naming the serving one.
    let swapped = text
        .replace(
            "name = \"main\"\nrole = \"both\"\nnodes = [\"node0\"]",
            "name = \"main\"\nrole = \"encoder\"\nnodes = [\"node0\"]",
        )
        .replace("name = \"vision\"\nrole = \"encoder\"", "name = \"vision\"\nrole = \"both\"");
    let path = std::env::temp_dir().join(format!("deepinfer-encoder-first-{}.toml", std::process::id()));
    std::fs::write(&path, swapped).unwrap();
    let e = ClusterPlan::load(&path).map(|_| ()).unwrap_err();
    let _ = std::fs::remove_file(&path);
    assert!(format!("{e:#}").contains("serving instances come before the encoder instances"), "{e:#}");
}

/// The shipped four-node layout serves on with any one node gone: two
/// instances over disjoint nodes, their schedulers on node0 and node2. The
/// single-instance files say in their header that losing their scheduler's
/// node stops them.
#[test]
fn local_four_has_no_single_point_of_failure() {
    use deepinfer::cluster::ClusterPlan;

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs");
    let plan = ClusterPlan::load(&dir.join("local-4.toml")).unwrap();
    let topo = plan.base_config().topology();
    assert_eq!(topo.instances, 2);
    let homes: Vec<u32> = (0..topo.instances).map(|i| topo.home_node(i)).collect();
    assert_eq!(homes, [0, 2], "schedulers on node0 and node2");
    for node in 0..topo.nodes() {
        let untouched = (0..topo.instances).filter(|&i| topo.devices_of(i).all(|d| topo.node_of_device(d) != node));
        assert_eq!(untouched.count(), 1, "node{node} gone, one instance still has all its devices");
    }
    for file in ["local-1.toml", "local-4-ep4.toml"] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let header: String = text.lines().take_while(|l| l.starts_with('#')).collect::<Vec<_>>().join(" ");
        assert!(header.contains("scheduler") && header.contains("until"), "{file}: {header}");
    }
}

/// `serve --topology` takes the model and API address from a one-device
/// topology, and names what is missing to front a larger one's cluster.
#[test]
fn serve_takes_a_one_device_topology() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};

    let dir = std::env::temp_dir().join(format!("deepinfer-topology-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let local1 =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs/local-1.toml"))
            .unwrap()
            .replace("127.0.0.1:8000", "127.0.0.1:0");
    let file = dir.join("one.toml");
    std::fs::write(&file, local1).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["serve", "--topology", file.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("server prints its address").unwrap();
        if let Some(at) = line.find("http://") {
            break line[at + 7..].trim().to_string();
        }
    };
    let mut stream = std::net::TcpStream::connect(&addr).unwrap();
    stream.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");

    // Its `[cluster.speculative]` table is the engine's: DSpark on a V4 model is refused at start.
    let drafting = std::fs::read_to_string(&file)
        .unwrap()
        .replace("\n[[node]]", "\n[cluster.speculative]\nmethod = \"dspark\"\n\n[[node]]");
    let with_drafts = dir.join("one-drafting.toml");
    std::fs::write(&with_drafts, drafting).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["serve", "--topology", with_drafts.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("dspark"), "{err}");

    // A larger topology is served as a front end of its running cluster,
    // which needs the cluster's certificates: their absence is named.
    let four = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs/local-4.toml");
    let certs = dir.join("no-certs");
    let out = Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(["serve", "--topology", four.to_str().unwrap(), "--certs", certs.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no-certs/ca.pem"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `launch`, `node` and `status` refuse a broken topology before touching
/// the network, naming the file, line and key.
#[test]
fn cluster_commands_name_the_file_line_and_key_of_a_bad_topology() {
    use std::process::Command;

    let local4 =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cluster-configs/local-4.toml"))
            .unwrap();
    let dir = std::env::temp_dir().join(format!("deepinfer-bad-topology-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let line_of = |text: &str, needle: &str| text.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let node1 = "name = \"node1\"\naddress = \"127.0.0.1:7101\"\ndevices = 1\n";
    let cases = [
        (
            "unknown-key",
            local4.replacen("devices = 1\n", "devices = 1\ngpus = 2\n", 1),
            "gpus = 2",
            "node.gpus",
            "unknown field",
        ),
        (
            "wrong-type",
            local4.replacen("heartbeat_ms = 100", "heartbeat_ms = \"fast\"", 1),
            "heartbeat_ms",
            "cluster.heartbeat_ms",
            "invalid type",
        ),
        (
            "missing-node",
            local4.replace("\"node2\", \"node3\"]", "\"node2\", \"node9\"]"),
            "\"node9\"",
            "instance.nodes",
            "unknown node `node9`",
        ),
        // Parses, but cannot be launched: nodes of different sizes.
        (
            "uneven",
            local4
                .replacen(node1, "name = \"node1\"\naddress = \"127.0.0.1:7101\"\ndevices = 2\n", 1)
                .replace("attention_dp = 2\nexpert_parallel = 2\n", ""),
            "devices = 2",
            "node.devices",
            "same number of devices",
        ),
    ];
    for (name, text, needle, key, message) in cases {
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, &text).unwrap();
        let line = line_of(&text, needle);
        let f = file.to_str().unwrap();
        for args in
            [vec!["launch", f], vec!["node", "--topology", f, "--node", "node0"], vec!["status", "--topology", f]]
        {
            let out = Command::new(env!("CARGO_BIN_EXE_deepinfer")).args(&args).output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{name} {args:?}");
            assert!(err.contains(&format!("{f}:{line}:")), "{name} {args:?}: want line {line}: {err}");
            assert!(err.contains(&format!("key `{key}`")) && err.contains(message), "{name} {args:?}: {err}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
