//! simulations/README.md's "Scenario keys" table against the parser: every
//! key the parser takes has a row, and every default given as a value is
//! the one the parser uses when the key is left out.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use deepinfer::scenario::Scenario;

const README: &str = "simulations/README.md";
const SECTION: &str = "## Scenario keys";
/// A key no table has, to read serde's list of the ones it has.
const UNKNOWN: &str = "zz_not_a_key";
/// The table whose lengths keys the README lists for every lengths table.
const LENGTHS_ROWS: &str = "traffic.input";

fn readme() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(README);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One row of the table: the key's default cell and the README line it is on.
struct Row {
    default: String,
    line: usize,
}

/// `key → row` of the "Scenario keys" table.
fn rows(text: &str) -> BTreeMap<String, Row> {
    let start = text.lines().position(|l| l.trim() == SECTION).unwrap_or_else(|| panic!("{README}: no `{SECTION}`"));
    let mut rows = BTreeMap::new();
    for (i, line) in text.lines().enumerate().skip(start + 1) {
        if line.starts_with("## ") {
            break;
        }
        let Some(inner) = line.trim().strip_prefix('|').and_then(|l| l.strip_suffix('|')) else { continue };
        let cells: Vec<String> = inner.replace("\\|", "¦").split('|').map(|c| c.trim().to_string()).collect();
        let Some(key) = cells[0].strip_prefix('`').and_then(|k| k.strip_suffix('`')) else { continue };
        assert_eq!(cells.len(), 4, "{README}:{}: a row is | key | default | unit | meaning |", i + 1);
        let old = rows.insert(key.to_string(), Row { default: cells[1].clone(), line: i + 1 });
        assert!(old.is_none(), "{README}:{}: `{key}` listed twice", i + 1);
    }
    assert!(rows.len() > 20, "{README}: the `{SECTION}` table has {} rows", rows.len());
    rows
}

/// The scenario every check starts from: its tables' lines by table header.
fn base() -> Vec<(&'static str, Vec<String>)> {
    let lines = |l: &[&str]| l.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        ("[scenario]", lines(&["name = \"keys\"", "duration_s = 12", "hardware = \"H200\"", "model = \"V4-Flash\""])),
        ("[[instance]]", lines(&["role = \"both\"", "devices = 8"])),
        (
            "[traffic]",
            lines(&[
                "kind = \"poisson\"",
                "rate_per_s = 1",
                "input = { dist = \"fixed\", value = 64 }",
                "output = { dist = \"fixed\", value = 8 }",
            ]),
        ),
    ]
}

/// What the table of `key` needs besides it, so that the key counts:
/// its required keys, or the traffic or fault kind the key is for.
fn context(key: &str) -> (String, Vec<String>) {
    let (table, name) = key.split_once('.').expect("a dotted key");
    let header = if table == "instance" || table == "fault" { format!("[[{table}]]") } else { format!("[{table}]") };
    let lines: &[&str] = match (table, name) {
        ("speculative", _) => &["method = \"mtp\""],
        ("experts", "zipf_s") => &["popularity = \"zipf\""],
        ("fault", "latency_us" | "gb_per_s") => &["kind = \"slow_link\"", "nodes = [0]"],
        ("fault", _) => &["kind = \"straggler\"", "device = 0"],
        ("traffic", "burst_factor" | "on_s" | "off_s") => &["kind = \"bursty\""],
        ("traffic", "time_scale" | "repeat") => &["kind = \"mooncake\"", "trace = \"trace.jsonl\""],
        ("traffic", "system_prompts" | "resumed_fraction") => &[
            "kind = \"sessions\"",
            "turns = { dist = \"fixed\", value = 3 }",
            "think_s = { dist = \"fixed\", value = 10 }",
        ],
        _ => &[],
    };
    (header, lines.iter().map(|s| s.to_string()).collect())
}

/// The base scenario with `lines` in table `header` (their keys replacing the base's).
fn document(header: &str, lines: &[String]) -> String {
    let mut tables = base();
    let name = |l: &str| l.split('=').next().unwrap_or("").trim().to_string();
    match tables.iter_mut().find(|(h, _)| *h == header) {
        Some((_, body)) => {
            body.retain(|b| !lines.iter().any(|l| name(l) == name(b)));
            body.extend(lines.iter().cloned());
        }
        None => tables.push((leak(header), lines.to_vec())),
    }
    tables.iter().map(|(h, body)| format!("{h}\n{}\n", body.join("\n"))).collect::<Vec<_>>().join("\n")
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_string().into_boxed_str())
}

fn parse(text: &str) -> Result<Scenario, String> {
    Scenario::parse("keys.toml", text, Path::new(".")).map_err(|e| e.to_string())
}

/// The backticked names after "expected" in serde's message (`expected one
/// of `a`, `b``, or `expected `a``); empty if the message lists none.
fn expected(message: &str) -> Vec<String> {
    let Some((_, list)) = message.split_once("expected") else { return Vec::new() };
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// The keys the parser takes in the table `[header]` (or `[[header]]`), as `table.key`.
fn table_keys(table: &str) -> Vec<String> {
    let try_header = |header: String| {
        let text = format!("{header}\n{UNKNOWN} = 1\n");
        parse(&text).expect_err("an unknown key is refused")
    };
    let mut e = try_header(format!("[{table}]"));
    if !e.contains("unknown field") {
        e = try_header(format!("[[{table}]]"));
    }
    let keys = expected(&e);
    assert!(e.contains(&format!("unknown field `{UNKNOWN}`")) && !keys.is_empty(), "[{table}]: {e}");
    keys.into_iter().map(|k| format!("{table}.{k}")).collect()
}

/// For a lengths key (an internally tagged table): its tag and every variant's keys.
fn lengths_keys(key: &str) -> Option<Vec<String>> {
    let (_, name) = key.split_once('.')?;
    let with = |value: &str| {
        let (header, mut lines) = context(key);
        lines.push(format!("{name} = {value}"));
        parse(&document(&header, &lines)).err().unwrap_or_default()
    };
    let e = with(&format!("{{ {UNKNOWN} = 1 }}"));
    let tag = e.split("missing field `").nth(1)?.split('`').next()?.to_string();
    let variants = expected(&with(&format!("{{ {tag} = \"{UNKNOWN}\" }}")));
    assert!(!variants.is_empty(), "{key}: no variants of `{tag}`");
    let mut keys = vec![tag.clone()];
    for v in variants {
        for k in expected(&with(&format!("{{ {tag} = \"{v}\", {UNKNOWN} = 1 }}"))) {
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
    }
    Some(keys)
}

/// Every key the parser takes, in the README's spelling.
fn parser_keys() -> Vec<String> {
    let e = parse(&format!("[{UNKNOWN}]\nx = 1\n")).expect_err("an unknown table is refused");
    let tables = expected(&e);
    assert!(tables.contains(&"scenario".to_string()), "top level: {e}");
    let mut keys = Vec::new();
    for table in tables {
        for key in table_keys(&table) {
            if let Some(sub) = lengths_keys(&key) {
                if key == LENGTHS_ROWS {
                    keys.extend(sub.iter().map(|s| format!("{key}.{s}")));
                }
            }
            keys.push(key);
        }
    }
    keys
}

#[test]
fn every_key_the_parser_takes_is_in_the_readme_table() {
    let text = readme();
    let rows = rows(&text);
    let keys = parser_keys();
    assert!(keys.contains(&format!("{LENGTHS_ROWS}.dist")), "lengths keys not found: {keys:?}");
    let missing: Vec<String> = keys
        .iter()
        .filter(|k| !rows.contains_key(*k))
        .map(|k| format!("`{k}` (add a row | `{k}` | default | unit | meaning | to `{SECTION}` in {README})"))
        .collect();
    assert!(missing.is_empty(), "keys the scenario parser takes but {README} does not list:\n{}", missing.join("\n"));
    let unknown: Vec<String> =
        rows.iter().filter(|(k, _)| !keys.contains(k)).map(|(k, r)| format!("{README}:{}: `{k}`", r.line)).collect();
    assert!(unknown.is_empty(), "rows for keys the parser refuses:\n{}", unknown.join("\n"));
}

#[test]
fn each_default_in_the_readme_is_what_leaving_the_key_out_gives() {
    let text = readme();
    let rows = rows(&text);
    // A default in backticks is a value, or another key (then that key's default).
    let literal = |default: &str| default.strip_prefix('`').and_then(|d| d.strip_suffix('`')).map(str::to_string);
    let value_of = |default: &str| {
        let mut value = literal(default)?;
        while let Some(other) = rows.get(&value) {
            value = literal(&other.default)?;
        }
        Some(value)
    };
    let mut checked = 0;
    for (key, row) in &rows {
        // `required` and defaults in words are not values.
        let Some(value) = value_of(&row.default) else { continue };
        let (header, lines) = context(key);
        let without = parse(&document(&header, &lines))
            .unwrap_or_else(|e| panic!("{README}:{}: `{key}`: the scenario without it: {e}", row.line));
        let name = key.split_once('.').map_or(key.as_str(), |(_, n)| n);
        let mut set = lines.clone();
        set.push(format!("{name} = {value}"));
        let with = parse(&document(&header, &set))
            .unwrap_or_else(|e| panic!("{README}:{}: `{key} = {value}` is refused: {e}", row.line));
        assert!(
            with == without,
            "{README}:{}: `{key}` = {value} is not its default: the scenario differs from one without it",
            row.line
        );
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} defaults checked");
}

#[test]
fn a_wrong_default_is_caught() {
    // The check above can fail: a default the parser does not use differs.
    let (header, lines) = context("engine.batch_per_device");
    let without = parse(&document(&header, &lines)).unwrap();
    let with = parse(&document(&header, &["batch_per_device = 64".to_string()])).unwrap();
    assert!(with != without);
}
