//! Times the manifest directory source: how long a directory of Services and their
//! EndpointSlices, written as multi-document YAML files, takes to be read (start to the last
//! `Synced`), and how long a one-Service edit of one file takes to be reported (write to
//! `Upsert`). Prints the figures; asserts nothing about them.
//!
//! ```text
//! cargo run --release -p kp-source --example manifest_load -- \
//!     [--services 10000] [--per 10] [--files 100] [--changes 40] [--runs 3]
//! ```
//!
//! `--files` spreads the Services over that many files (each Service followed by its
//! EndpointSlice); `--files 1` writes one file. The objects look like what a user writes or
//! `kubectl get -o yaml` prints (the objects of kp-bench's cluster): labels, a selector, ready
//! conditions and node names; 10k Services with 10 endpoints each are about 13 MB.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::track::{Kind, Object, SourceEvent};
use kp_metrics::Metrics;
use tokio::sync::mpsc;

struct Args {
    services: usize,
    per: usize,
    files: usize,
    changes: usize,
    runs: usize,
}

fn args() -> Args {
    let mut a = Args {
        services: 10_000,
        per: 10,
        files: 100,
        changes: 40,
        runs: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value: usize = it
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{flag} needs a number"));
        match flag.as_str() {
            "--services" => a.services = value,
            "--per" => a.per = value,
            "--files" => a.files = value.max(1),
            "--changes" => a.changes = value,
            "--runs" => a.runs = value.max(1),
            _ => panic!("unknown flag {flag}"),
        }
    }
    a
}

/// Service `i` (with its first port `port`) and its EndpointSlice, as YAML documents.
fn pair(out: &mut String, i: usize, per: usize, port: u32) {
    let name = format!("svc-{i:05}");
    let (a, b) = ((i >> 8) & 0xff, i & 0xff);
    let _ = write!(
        out,
        "---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  namespace: bench
  labels:
    app: {name}
spec:
  type: ClusterIP
  selector:
    app: {name}
  clusterIP: 10.96.{a}.{b}
  clusterIPs: [10.96.{a}.{b}]
  ports:
  - name: http
    port: {port}
    protocol: TCP
    targetPort: 8080
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-abcde
  namespace: bench
  labels:
    kubernetes.io/service-name: {name}
addressType: IPv4
ports:
- name: http
  port: 8080
  protocol: TCP
endpoints:
"
    );
    for j in 0..per {
        let _ = write!(
            out,
            "- addresses: [10.{c}.{d}.{e}]
  conditions: {{ready: true}}
  nodeName: node-{node}
",
            c = 100 + (i >> 12),
            d = (i >> 4) & 0xff,
            e = ((i & 0xf) << 4) | (j & 0xf),
            node = (i + j) % 50,
        );
    }
}

/// The text of file `f`: Services `f, f + files, f + 2 files, ...`; Service `edited` has port
/// `port`, the others 80.
fn file_text(a: &Args, f: usize, edited: Option<(usize, u32)>) -> String {
    let mut out = String::new();
    for i in (f..a.services).step_by(a.files) {
        let port = match edited {
            Some((e, p)) if e == i => p,
            _ => 80,
        };
        pair(&mut out, i, a.per, port);
    }
    out
}

fn file_name(f: usize) -> String {
    format!("services-{f:03}.yaml")
}

fn write_atomic(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    fs::write(&tmp, text).expect("write");
    fs::rename(&tmp, dir.join(name)).expect("rename");
}

fn peak_rss_mib() -> f64 {
    let status = fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

async fn run(a: &Args, run_no: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut bytes = 0;
    for f in 0..a.files {
        let text = file_text(a, f, None);
        bytes += text.len();
        fs::write(dir.path().join(file_name(f)), text).expect("write");
    }
    let (tx, mut rx) = mpsc::channel(4096);
    let metrics = Arc::new(Metrics::new());
    let start = Instant::now();
    let source = tokio::spawn(kp_source::run_manifests(
        dir.path().to_path_buf(),
        tx,
        metrics,
    ));
    let (mut upserts, mut synced) = (0, 0);
    while synced < 3 {
        match rx.recv().await.expect("source stopped") {
            SourceEvent::Upsert(_) => upserts += 1,
            SourceEvent::Synced(_) => synced += 1,
            SourceEvent::Delete(..) => {}
        }
    }
    let load = start.elapsed();
    assert_eq!(upserts, 2 * a.services, "every object reported once");
    println!(
        "run {run_no}: {} Services x {} endpoints in {} files, {:.1} MB of YAML: \
         live after {:.0} ms (peak RSS so far {:.0} MiB)",
        a.services,
        a.per,
        a.files,
        bytes as f64 / 1e6,
        ms(load),
        peak_rss_mib()
    );

    let mut latencies = Vec::with_capacity(a.changes);
    for c in 0..a.changes {
        let i = (c * 7919) % a.services;
        let port = 1000 + c as u32;
        let f = i % a.files;
        let text = file_text(a, f, Some((i, port)));
        let t = Instant::now();
        write_atomic(dir.path(), &file_name(f), &text);
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), rx.recv())
                .await
                .expect("no change within 30 s")
                .expect("source stopped");
            if let SourceEvent::Upsert(Object::Service(svc)) = &ev {
                let got = svc
                    .spec
                    .as_ref()
                    .and_then(|s| s.ports.as_ref())
                    .map(|p| p[0].port);
                if got == Some(port as i32) {
                    break;
                }
            }
            if let SourceEvent::Synced(k) = ev {
                assert!(matches!(k, Kind::Service), "unexpected Synced");
            }
        }
        latencies.push(t.elapsed());
        // Put it back, outside the timing.
        write_atomic(dir.path(), &file_name(f), &file_text(a, f, None));
        loop {
            let ev = rx.recv().await.expect("source stopped");
            if let SourceEvent::Upsert(Object::Service(svc)) = &ev {
                if svc.metadata.name.as_deref() == Some(&*format!("svc-{i:05}")) {
                    break;
                }
            }
        }
    }
    latencies.sort();
    if !latencies.is_empty() {
        println!(
            "run {run_no}: one-Service edit of a {:.0} KB file, {} changes: p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms",
            bytes as f64 / a.files as f64 / 1e3,
            latencies.len(),
            ms(percentile(&latencies, 0.5)),
            ms(percentile(&latencies, 0.9)),
            ms(*latencies.last().expect("not empty")),
        );
    }
    drop(rx);
    let _ = source.await;
}

#[tokio::main]
async fn main() {
    let a = args();
    for r in 1..=a.runs {
        run(&a, r).await;
    }
}
