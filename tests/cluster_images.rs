//! Images on a cluster of real processes with an image encoder instance of
//! its own: node0 serves (`role = "both"`), node1 encodes (`role =
//! "encoder"`), talking QUIC with mutual TLS. A client of the running
//! cluster gets the single-process engine's tokens for requests with two
//! images; the same images sent again are answered from the encoder's cache,
//! which `deepinfer status` and the front end's `/metrics` show; the front
//! end answers OpenAI image parts as one process does; with the
//! encoder's process killed while requests with images are in flight, every
//! request still finishes with the engine's tokens (node0 encodes them).

mod cluster_support;
mod serve_support;

use deepinfer_engine::presets_v41::synthetic_image;
use std::net::UdpSocket;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster_support::{run_plain, s, Proc, BIN, FAILURE_TIMEOUT_MS};
use deepinfer::cluster::{connect_client, ClusterPlan};
use deepinfer_engine::engine::{Engine, EngineConfig};
use deepinfer_engine::images::{PromptBuilder, RequestImage};
use deepinfer_engine::model::Model;
use deepinfer_engine::presets::{build, Preset};
use deepinfer_engine::request::Request;
use serve_support::Served;

/// Two nodes on free ports serving `tiny-v41-vision`: node0 the serving
/// instance, node1 the encoder; and their certificates.
struct Site {
    dir: PathBuf,
    topology: PathBuf,
}

impl Site {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("deepinfer-quic-{}-images", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sockets: Vec<UdpSocket> = (0..2).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
        let ports: Vec<u16> = sockets.iter().map(|s| s.local_addr().unwrap().port()).collect();
        drop(sockets);
        let mut text = format!(
            "[cluster]\nname = \"images\"\nmodel = \"builtin:tiny-v41-vision\"\napi_listen = \"127.0.0.1:0\"\n\
             heartbeat_ms = 100\nfailure_timeout_ms = {FAILURE_TIMEOUT_MS}\ncerts_dir = \"certs\"\n"
        );
        for (i, port) in ports.iter().enumerate() {
            text += &format!(
                "\n[[node]]\nname = \"node{i}\"\naddress = \"127.0.0.1:{port}\"\ndevices = 1\nbackend = \"cpu\"\n"
            );
        }
        text += "\n[[instance]]\nname = \"main\"\nrole = \"both\"\nnodes = [\"node0\"]\n";
        text += "\n[[instance]]\nname = \"vision\"\nrole = \"encoder\"\nnodes = [\"node1\"]\n";
        let topology = dir.join("cluster.toml");
        std::fs::write(&topology, text).unwrap();
        let o = run_plain(&["cluster", "init-certs", "--topology", s(&topology), "--out", s(&dir.join("certs"))]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        Self { dir, topology }
    }
}

impl Drop for Site {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A greedy request with two images (`salt` changes both) between text.
fn request(model: &Model, salt: usize) -> Request {
    let cfg = model.image_model().unwrap().config.vision.clone().unwrap();
    let text = |n: u32, k: u32| (0..n).map(|i| 5 + (i * 131 + k * 17) % 400).collect::<Vec<u32>>();
    let mut b = PromptBuilder::new(&cfg);
    b.text(&text(10, 1)).image(&synthetic_image(200, 120, salt), 200, 120).unwrap();
    b.text(&text(7, 2)).image(&synthetic_image(90, 160, salt + 1), 90, 160).unwrap().text(&text(12, 3));
    let (prompt, images): (Vec<u32>, Vec<RequestImage>) = b.finish();
    let mut r = Request::with_images(prompt, images, 6);
    r.ignore_eos = true;
    r
}

/// Each request alone through one engine: its tokens.
fn engine_tokens(model: &Model, requests: &[Request]) -> Vec<Vec<u32>> {
    let mut engine = Engine::new(model, EngineConfig::default()).unwrap();
    requests
        .iter()
        .map(|r| {
            let id = engine.add_request(r.clone()).unwrap();
            engine.run_to_completion().remove(&id).unwrap().token_ids()
        })
        .collect()
}

/// A labelled series' value in a Prometheus text page (`name{encoder="0"} v`).
fn series(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find_map(|l| l.rsplit(' ').next().and_then(|v| v.parse().ok()))
}

#[test]
fn an_encoder_process_serves_images_caches_repeats_and_its_loss_costs_no_request() {
    let site = Site::new();
    // The nodes log their actors' events: the retry after the kill shows in node0's.
    std::env::set_var("DEEPINFER_EVENTS", "1");
    let mut nodes: Vec<Proc> = (0..2).map(|i| spawn_node_of(&site, i)).collect();
    for n in &nodes {
        n.wait_for("cluster ready", Duration::from_secs(120));
    }
    let model = build(Preset::TinyV41Vision, 0).unwrap();
    let first = [request(&model, 0), request(&model, 0)];
    let later: Vec<Request> = (1..5).map(|k| request(&model, 10 * k)).collect();
    let want_first = engine_tokens(&model, &first);
    let want_later = engine_tokens(&model, &later);
    assert_ne!(want_first[0], want_later[0], "the images matter");

    let plan = ClusterPlan::load(&site.topology).unwrap();
    let (rt, mut cluster) = connect_client(&plan, None, Arc::new(build(Preset::TinyV41Vision, 0).unwrap())).unwrap();
    // One after the other: the second's images come from the encoder's cache.
    for (i, r) in first.iter().enumerate() {
        let got = rt.block_on(cluster.generate(std::slice::from_ref(r))).remove(0);
        let got = got.unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(got.tokens, want_first[i], "request {i}: the engine's tokens");
    }

    // `status` shows the encoder's work and its cache hits.
    let o = run_plain(&["status", "--topology", s(&site.topology), "--wait-ms", "3000"]);
    let status = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{status}");
    assert!(status.contains("encoder0: images encoded 2, cache hits 2"), "{status}");

    // The front end's `/metrics` shows them too (it asks the encoders' nodes about once a second).
    let mut front = Command::new(BIN);
    front.args(["serve", "--topology", s(&site.topology), "--listen", "127.0.0.1:0"]);
    let front = Served::start_command(front);
    let started = Instant::now();
    let page = loop {
        let page = rt.block_on(async { reqwest::get(front.url("/metrics")).await.unwrap().text().await.unwrap() });
        if series(&page, "deepinfer_encoder_cache_hits_total").is_some() || started.elapsed() > Duration::from_secs(30)
        {
            break page;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(series(&page, "deepinfer_encoder_cache_hits_total"), Some(2.0), "{page}");
    assert_eq!(series(&page, "deepinfer_images_encoded_total"), Some(2.0), "{page}");
    assert!(
        series(&page, "deepinfer_encoder_queue_images").is_some()
            && series(&page, "deepinfer_encoder_seconds").is_some()
    );

    // Through the API: OpenAI image parts (data URLs of scikit-image's
    // chelsea and coffee) give the cluster's front end the answer one process gives.
    let one = Served::start(&["--model", "builtin:tiny-v41-vision"]);
    let body = chat_with_images(&["chelsea.png", "coffee.png"]);
    let (got, want) = rt.block_on(async { (post_chat(&front, &body).await, post_chat(&one, &body).await) });
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"], "the front end answers as one process");
    assert_eq!(got["usage"]["prompt_tokens"], want["usage"]["prompt_tokens"], "image spans counted alike");

    // The encoder's process killed with requests with images on their way:
    // node0 encodes them once membership says node1 is down.
    let killed = Instant::now();
    nodes[1].child.kill().unwrap();
    let got = rt.block_on(cluster.generate(&later));
    for (i, (g, w)) in got.iter().zip(&want_later).enumerate() {
        let g = g.as_ref().unwrap_or_else(|e| panic!("request {i} after the kill: {e}"));
        assert_eq!(&g.tokens, w, "request {i} after the kill: the engine's tokens");
    }
    assert!(killed.elapsed() < Duration::from_secs(60), "a retry, not a request timeout: {:?}", killed.elapsed());
    let log = nodes[0].text();
    assert!(log.contains("node node1 down"), "{log}");
    let lost = log.lines().filter(|l| l.contains("lost request") && l.contains("encoder0")).count();
    let here = log.lines().filter(|l| l.contains("images are encoded here")).count();
    assert!(
        lost >= 1 && lost == here,
        "images sent to the dead encoder are encoded on node0: {lost} lost, {here} here"
    );
    rt.block_on(cluster.shutdown());
    drop(nodes.remove(1));
    drop(nodes.remove(0).child.stdin.take());
}

/// A seeded chat request: text, the fixture images as data URLs, text.
fn chat_with_images(names: &[&str]) -> serde_json::Value {
    use base64::Engine as _;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/images");
    let mut parts = vec![serde_json::json!({"type": "text", "text": "Compare these pictures."})];
    for name in names {
        let data = base64::engine::general_purpose::STANDARD.encode(std::fs::read(dir.join(name)).unwrap());
        parts.push(
            serde_json::json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{data}")}}),
        );
    }
    parts.push(serde_json::json!({"type": "text", "text": "Which one is warmer?"}));
    serde_json::json!({
        "model": "tiny-v41-vision",
        "max_tokens": 12,
        "seed": 7,
        "messages": [{"role": "user", "content": parts}],
    })
}

async fn post_chat(s: &Served, body: &serde_json::Value) -> serde_json::Value {
    let r = reqwest::Client::new().post(s.url("/v1/chat/completions")).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status, 200, "{v}");
    v
}

fn spawn_node_of(site: &Site, i: usize) -> Proc {
    Proc::spawn(&["node", "--topology", s(&site.topology), "--node", &format!("node{i}"), "--exit-with-stdin"], false)
}
