//! A real `deepinfer serve` process on a free port, stopped when dropped.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Served {
    child: Child,
    pub base: String,
    /// Everything the server wrote to stderr so far.
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Served {
    /// Start the built binary on `builtin:tiny-v4` with `extra` flags and wait
    /// until it listens.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with_env(extra, &[])
    }

    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_deepinfer"));
        cmd.args(Self::serve_args(extra));
        for (k, v) in env {
            cmd.env(k, v);
        }
        Self::start_command(cmd)
    }

    /// The arguments of `deepinfer serve` on a free port with `extra` flags.
    pub fn serve_args(extra: &[&str]) -> Vec<String> {
        let mut args: Vec<String> = ["serve", "--listen", "127.0.0.1:0"].iter().map(|s| s.to_string()).collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        if !extra.contains(&"--model") {
            args.extend(["--model".to_string(), "builtin:tiny-v4".to_string()]);
        }
        args
    }

    /// Start a prepared command that runs the server (through a shell, say).
    pub fn start_command(mut cmd: Command) -> Self {
        // No key from the environment running the tests, unless the caller set one.
        if !cmd.get_envs().any(|(k, _)| k == "DEEPINFER_API_KEY") {
            cmd.env_remove("DEEPINFER_API_KEY");
        }
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("the binary starts");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = log.clone();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line.clone());
                if let Some(addr) = line.split("on http://").nth(1) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr.trim().to_string());
                    }
                }
                // Keep reading so the server never blocks on a full pipe.
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                panic!("the server did not start; {:?}", child.wait());
            }
        };
        Self { child, base: format!("http://{addr}"), log }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The value of a metric line `name` (with labels, if given) in `/metrics`.
    pub async fn metric(&self, client: &reqwest::Client, name: &str) -> f64 {
        let text = client.get(self.url("/metrics")).send().await.unwrap().text().await.unwrap();
        metric_value(&text, name).unwrap_or(0.0)
    }

    /// Poll `/metrics` until `name` satisfies `ok`, or fail after `timeout`.
    pub async fn wait_metric(&self, client: &reqwest::Client, name: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let start = Instant::now();
        loop {
            let v = self.metric(client, name).await;
            if ok(v) {
                return v;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "{name} stayed at {v}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `python3` can import the SDKs; panics if they are required.
pub fn sdks_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import openai, anthropic, jsonschema"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        if std::env::var("DEEPINFER_REQUIRE_SDK").as_deref() == Ok("1") {
            panic!("DEEPINFER_REQUIRE_SDK=1 but python3 cannot import openai, anthropic and jsonschema");
        }
        eprintln!(
            "skipped: python3 cannot import openai, anthropic and jsonschema \
             (python3 -m pip install openai anthropic jsonschema)"
        );
    }
    ok
}
