//! The container image (the repository's `Dockerfile`), built by `scripts/image.sh` around the
//! binary cargo built for this test run, on a base image made from Debian's packages (no
//! registry is needed). The image's binary must report this crate's version, serve the flow
//! lab's Services from inside a container joined to the lab's node namespace, and remove its
//! rules with `--cleanup`, using only the tools the image itself holds.
//!
//! Containers are run with `runc` and explicit, modest rlimits: on hosts with hybrid cgroups
//! (v1 controllers beside a v2 hierarchy) crun refuses to start containers, and where root lacks
//! CAP_SYS_RESOURCE podman's default rlimits (raised to the maximum) cannot be applied. Every
//! container joins a namespace this test created (`--network ns:`) or has no network at all,
//! so podman sets up no network of its own on the machine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kp_test::echo::{tally, Proto, Request};
use kp_test::lab::Lab;

mod common;
use common::{eventually, http_get, temp_dir, write_atomically, HEALTHZ, PROGRAMMED};

/// `podman` with the options every container of this test needs (see the module's comment).
fn podman_run() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(["--runtime", "runc", "run", "--rm"]);
    cmd.args([
        "--ulimit",
        "nofile=8192:8192",
        "--ulimit",
        "nproc=8192:8192",
    ]);
    cmd
}

fn podman(args: &[&str]) -> Output {
    Command::new("podman")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run podman")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The image built for this test; removed (with its layers of our binary) on drop. The base
/// image and the cached apt layer stay in podman's storage for the next run.
struct Image(String);

impl Image {
    fn build() -> Image {
        let tag = format!("localhost/kube-proxy-rs:smoke-{}", std::process::id());
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/image.sh");
        let start = Instant::now();
        let out = Command::new("bash")
            .arg(&script)
            .args(["--binary", env!("CARGO_BIN_EXE_kube-proxy"), "--tag", &tag])
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/image.sh");
        // From here on, whatever was tagged is removed again.
        let image = Image(tag);
        assert!(
            out.status.success(),
            "scripts/image.sh failed ({}); its progress and errors are above",
            out.status
        );
        assert_eq!(
            text(&out.stdout).trim(),
            image.0,
            "the script names its image"
        );
        eprintln!(
            "image_smoke: built {} in {:.1} s",
            image.0,
            start.elapsed().as_secs_f64()
        );
        image
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let out = podman(&["rmi", "--force", &self.0]);
        if !out.status.success() && !text(&out.stderr).contains("image not known") {
            eprintln!("image_smoke: podman rmi {}: {}", self.0, text(&out.stderr));
        }
    }
}

/// A container running in the background under a unique name, its output in a log file;
/// removed (`podman rm --force`) and reaped on drop, also while the test panics.
struct Container {
    name: String,
    client: Child,
    log: PathBuf,
}

impl Container {
    fn start(mut cmd: Command, name: String) -> Container {
        let log = std::env::temp_dir().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).expect("container log");
        let client = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("start podman run");
        Container { name, client, log }
    }

    fn log(&self) -> String {
        std::fs::read(&self.log)
            .map(|b| text(&b))
            .unwrap_or_default()
    }

    /// Waits for `needle` in the log; fails at once if the container exits first.
    fn wait_for_log(&mut self, needle: &str, timeout: Duration) {
        let start = Instant::now();
        while !self.log().contains(needle) {
            if let Some(status) = self.client.try_wait().unwrap() {
                panic!("the container exited ({status}) before `{needle}`");
            }
            assert!(
                start.elapsed() < timeout,
                "no `{needle}` from the container after {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `podman stop`: SIGTERM to the proxy, a kill after `grace`. Returns podman run's status.
    fn stop(&mut self, grace: Duration) -> std::process::ExitStatus {
        let secs = grace.as_secs().to_string();
        let out = podman(&["stop", "--time", &secs, &self.name]);
        assert!(out.status.success(), "podman stop: {}", text(&out.stderr));
        self.client.wait().unwrap()
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = podman(&["rm", "--force", "--time", "0", &self.name]);
        let _ = self.client.kill();
        let _ = self.client.wait();
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            eprintln!(
                "image_smoke: log of container {} (last 40 lines):\n{}",
                self.name,
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        let _ = std::fs::remove_file(&self.log);
    }
}

/// Who answered `tries` connections from pod 4 to the web Service (10.96.0.10:80), counted;
/// failures count under their outcome.
fn web_answers(lab: &Lab, tries: usize) -> BTreeMap<String, usize> {
    let web = "10.96.0.10".parse().unwrap();
    tally(&lab.send(lab.pod(4), &Request::new(Proto::Tcp, web, 80).count(tries)))
}

#[test]
#[ignore = "needs root"]
fn the_image_runs_its_binary_serves_the_lab_and_cleans_up() {
    if !kp_test::netns::require_root() {
        return;
    }
    let image = Image::build();

    // The binary, and every tool the modes run, are in the image.
    let out = podman_run()
        .args(["--network", "none", &image.0, "--version"])
        .output()
        .unwrap();
    assert!(out.status.success(), "--version: {}", text(&out.stderr));
    assert_eq!(
        text(&out.stdout).trim(),
        format!("kube-proxy {}", env!("CARGO_PKG_VERSION"))
    );
    let tools = "nft ip ipset conntrack iptables-nft-restore iptables-nft-save \
                 ip6tables-nft-restore iptables-legacy-restore iptables-legacy-save \
                 ip6tables-legacy-restore";
    let out = podman_run()
        .args(["--network", "none", "--entrypoint", "/bin/sh", &image.0])
        .args([
            "-c",
            &format!("for t in {tools}; do command -v $t || echo missing $t; done"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success() && !text(&out.stdout).contains("missing"),
        "tools in the image:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // The flow lab, with the image's binary in a container in the node namespace, reading the
    // fixture from a manifest directory mounted at the same path.
    let lab = kp_test::flows::lab().expect("lab");
    let _echo = kp_test::flows::serve_fixture_pods(&lab).expect("echo servers");
    let dir = temp_dir("image");
    write_atomically(&dir.0.join("cluster.json"), &kp_flows::manifest_list());
    let netns = format!("ns:/run/netns/{}", lab.node().name());
    let mount = format!("{0}:{0}:ro", dir.0.display());
    let manifests = dir.0.to_str().unwrap();
    let name = format!("kp-smoke-{}", std::process::id());
    let mut cmd = podman_run();
    cmd.args(["--name", &name, "--network", &netns, "--privileged"]);
    cmd.args(["--volume", &mount, &image.0]);
    cmd.args([
        "--proxy-mode=nftables",
        "--hostname-override",
        kp_flows::NODE,
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/48",
        "--nodeport-addresses=primary",
        "--healthz-bind-address=127.0.0.1:10256",
        "--metrics-bind-address=127.0.0.1:10249",
        "--iptables-min-sync-period=100ms",
        "--iptables-sync-period=1s",
        "-v=2",
        "--manifests",
        manifests,
    ]);
    let mut proxy = Container::start(cmd, name);
    proxy.wait_for_log(PROGRAMMED, Duration::from_secs(60));

    let health = http_get(lab.node(), HEALTHZ);
    assert!(health.contains("\"healthy\":true"), "{health}");
    // The ClusterIP answers from a pod, spread over all three endpoints (60 tries: the chance
    // that a random choice misses one is 3 * (2/3)^60, about 1e-10).
    let answers = web_answers(&lab, 60);
    assert_eq!(
        answers.keys().collect::<Vec<_>>(),
        ["pod-1", "pod-2", "pod-3"],
        "answers to 60 connections to the web ClusterIP: {answers:?}"
    );
    // And so does the rest of the flow table.
    let failures = kp_test::flows::check_all(&lab);
    assert!(
        failures.is_empty(),
        "{} rows failed:\n{}",
        failures.len(),
        failures.join("\n")
    );

    // Stopped, the proxy leaves its rules in place (as upstream does).
    let status = proxy.stop(Duration::from_secs(10));
    assert!(status.success(), "podman run after podman stop: {status}");
    eventually(
        "the web Service to still answer",
        Duration::from_secs(3),
        || web_answers(&lab, 6).keys().all(|k| k.starts_with("pod-")),
    );

    // `--cleanup` from the image removes them, and iptables chains of both backends written
    // here by hand, and nothing of anyone else's.
    let node = lab.node();
    node.run(&["nft", "add", "table", "inet", "someone-else"])
        .unwrap();
    for iptables in ["iptables-nft", "iptables-legacy"] {
        node.run(&[iptables, "-t", "nat", "-N", "KUBE-SERVICES"])
            .unwrap();
        node.run(&[iptables, "-t", "nat", "-A", "OUTPUT", "-j", "KUBE-SERVICES"])
            .unwrap();
    }
    let before = node.run(&["nft", "list", "tables"]).unwrap();
    assert!(before.contains("kube-proxy"), "{before}");
    let out = podman_run()
        .args(["--network", &netns, "--privileged", &image.0, "--cleanup"])
        .output()
        .unwrap();
    let log = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "--cleanup ({}):\n{log}", out.status);
    let tables = node.run(&["nft", "list", "tables"]).unwrap();
    assert!(!tables.contains("kube-proxy"), "{tables}\n{log}");
    assert!(tables.contains("someone-else"), "{tables}\n{log}");
    for save in ["iptables-nft-save", "iptables-legacy-save"] {
        let rules = node.run(&[save, "-t", "nat"]).unwrap();
        assert!(!rules.contains("KUBE-"), "{save}:\n{rules}\n{log}");
    }
    let web = "10.96.0.10".parse().unwrap();
    let req = Request::new(Proto::Tcp, web, 80)
        .count(2)
        .timeout(Duration::from_millis(500));
    let answers = tally(&lab.send(lab.pod(4), &req));
    assert!(
        !answers.keys().any(|k| k.starts_with("pod-")),
        "the ClusterIP still answers after --cleanup: {answers:?}"
    );
}
