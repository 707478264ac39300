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
        vec![("b200-128.toml".to_string(), 128), ("local-1.toml".to_string(), 1), ("local-4.toml".to_string(), 4)]
    );
}
