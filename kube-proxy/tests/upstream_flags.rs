//! Every flag of upstream kube-proxy (v1.28 to current releases, the hidden deprecated ones,
//! and the removed ones DaemonSets and guides still pass) is accepted by the binary, so a
//! DaemonSet written for upstream does not crash-loop on an unknown argument.
//!
//! Each run uses `--write-config-to`, which loads the whole configuration and exits before
//! anything touches the kernel or an API server.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Upstream v1.28.7's flags, as its `--help` lists them, each with a valid value (`None`: a
/// bare boolean). `--config`, `--write-config-to`, `--help` and `--version` are run
/// separately below.
const V1_28: &[(&str, Option<&str>)] = &[
    ("--bind-address", Some("0.0.0.0")),
    ("--bind-address-hard-fail", None),
    ("--boot-id-file", Some("/proc/sys/kernel/random/boot_id")),
    ("--cleanup", Some("false")),
    ("--cluster-cidr", Some("10.244.0.0/16")),
    ("--config-sync-period", Some("15m0s")),
    ("--conntrack-max-per-core", Some("32768")),
    ("--conntrack-min", Some("131072")),
    ("--conntrack-tcp-timeout-close-wait", Some("30m")),
    ("--conntrack-tcp-timeout-established", Some("2h")),
    ("--detect-local-mode", Some("ClusterCIDR")),
    ("--feature-gates", Some("AllAlpha=false,AllBeta=false")),
    ("--healthz-bind-address", Some("0.0.0.0:10256")),
    ("--hostname-override", Some("node-a")),
    ("--iptables-localhost-nodeports", Some("false")),
    ("--iptables-masquerade-bit", Some("14")),
    ("--iptables-min-sync-period", Some("1s")),
    ("--iptables-sync-period", Some("30s")),
    ("--ipvs-exclude-cidrs", Some("10.0.0.0/8,fd00::/8")),
    ("--ipvs-min-sync-period", Some("1s")),
    ("--ipvs-scheduler", Some("rr")),
    ("--ipvs-strict-arp", None),
    ("--ipvs-sync-period", Some("30s")),
    ("--ipvs-tcp-timeout", Some("900s")),
    ("--ipvs-tcpfin-timeout", Some("120s")),
    ("--ipvs-udp-timeout", Some("300s")),
    ("--kube-api-burst", Some("40")),
    (
        "--kube-api-content-type",
        Some("application/vnd.kubernetes.protobuf"),
    ),
    ("--kube-api-qps", Some("20")),
    ("--kubeconfig", Some("/var/lib/kube-proxy/kubeconfig.conf")),
    ("--log-flush-frequency", Some("5s")),
    ("--log-json-info-buffer-size", Some("0")),
    ("--log-json-split-stream", Some("false")),
    ("--logging-format", Some("json")),
    (
        "--machine-id-file",
        Some("/etc/machine-id,/var/lib/dbus/machine-id"),
    ),
    ("--masquerade-all", Some("false")),
    ("--master", Some("https://127.0.0.1:6443")),
    ("--metrics-bind-address", Some("127.0.0.1:10249")),
    ("--nodeport-addresses", Some("10.0.0.0/8,192.168.0.0/16")),
    ("--oom-score-adj", Some("-999")),
    ("--pod-bridge-interface", Some("cni0")),
    ("--pod-interface-name-prefix", Some("veth")),
    ("--profiling", Some("false")),
    ("--proxy-mode", Some("iptables")),
    ("--proxy-port-range", Some("30000-30100")),
    ("--show-hidden-metrics-for-version", Some("1.27")),
    ("--v", Some("2")),
    ("--vmodule", Some("proxier*=4,server=2")),
];

/// Flags upstream added after v1.28.
const AFTER_1_28: &[(&str, Option<&str>)] = &[
    ("--init-only", Some("false")),
    ("--conntrack-tcp-be-liberal", None),
    ("--conntrack-udp-timeout", Some("30s")),
    ("--conntrack-udp-timeout-stream", Some("2m0s")),
    ("--log-text-info-buffer-size", Some("64Ki")),
    ("--log-text-split-stream", Some("false")),
];

/// Hidden, deprecated or removed flags that DaemonSets and guides still pass; each must warn
/// with its own name and the word "deprecated".
const DEPRECATED: &[(&str, Option<&str>)] = &[
    ("--healthz-port", Some("10256")),
    ("--metrics-port", Some("10249")),
    ("--cleanup-iptables", Some("false")),
    ("--cleanup-ipvs", Some("true")),
    ("--add-dir-header", None),
    ("--alsologtostderr", None),
    ("--log-backtrace-at", Some(":0")),
    ("--log-dir", Some("/var/log")),
    ("--log-file", Some("/var/log/kube-proxy.log")),
    ("--log-file-max-size", Some("1800")),
    ("--logtostderr", Some("true")),
    ("--one-output", None),
    ("--skip-headers", None),
    ("--skip-log-headers", Some("true")),
    ("--stderrthreshold", Some("2")),
    ("--resource-container", Some("")),
    (
        "--azure-container-registry-config",
        Some("/etc/kubernetes/azure.json"),
    ),
    ("--conntrack-max", Some("0")),
];

/// A kubeadm-like configuration for `--config`.
const CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
clusterCIDR: 10.244.0.0/16
mode: \"\"
";

/// A scratch directory of this test process, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("kp-upstream-flags-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn arg((flag, value): &(&str, Option<&str>)) -> String {
    match value {
        Some(v) => format!("{flag}={v}"),
        None => (*flag).to_owned(),
    }
}

/// Runs the binary with `args` and `--write-config-to=OUT`; returns the exit code, stderr and
/// the written configuration (empty if none was written).
fn load(args: &[String], out: &Path) -> (i32, String, String) {
    let _ = std::fs::remove_file(out);
    let run = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .args(args)
        .arg(format!("--write-config-to={}", out.display()))
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let written = std::fs::read_to_string(out).unwrap_or_default();
    (
        run.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&run.stderr).into_owned(),
        written,
    )
}

fn every_flag() -> impl Iterator<Item = &'static (&'static str, Option<&'static str>)> {
    V1_28.iter().chain(AFTER_1_28).chain(DEPRECATED)
}

#[test]
fn every_upstream_flag_alone_loads_the_configuration() {
    let scratch = Scratch::new("alone");
    let out = scratch.path("effective.yaml");
    for flag in every_flag() {
        let (code, stderr, written) = load(&[arg(flag)], &out);
        assert_eq!(code, 0, "{}: exit {code}\n{stderr}", arg(flag));
        assert!(
            written.contains("kind: KubeProxyConfiguration"),
            "{}: no configuration written\n{stderr}",
            arg(flag)
        );
    }
}

#[test]
fn every_upstream_flag_at_once_with_a_config_file_loads_and_applies() {
    let scratch = Scratch::new("all");
    let config = scratch.path("config.conf");
    std::fs::write(&config, CONFIG).unwrap();
    let mut args: Vec<String> = every_flag().map(arg).collect();
    args.push(format!("--config={}", config.display()));
    let (code, stderr, written) = load(&args, &scratch.path("effective.yaml"));
    assert_eq!(code, 0, "{stderr}");

    // The flags that have a place in the configuration land there.
    for expected in [
        "tcpEstablishedTimeout: 2h0m0s",
        "tcpCloseWaitTimeout: 30m0s",
        "tcpBeLiberal: true",
        "udpTimeout: 30s",
        "udpStreamTimeout: 2m0s",
        "qps: 20",
        "burst: 40",
        "format: json",
        "bindAddressHardFail: true",
        "tcpTimeout: 15m0s",
        "tcpFinTimeout: 2m0s",
        "udpTimeout: 5m0s",
        "- 10.0.0.0/8",
        "- fd00::/8",
        "hostnameOverride: node-a",
        "verbosity: 2",
        "filePattern: proxier*",
        "infoBufferSize: 64Ki",
    ] {
        assert!(
            written.contains(expected),
            "{expected:?} missing from\n{written}"
        );
    }
    // --logging-format=json applies to the binary's own log lines.
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("\"warn\"")).collect();
    assert!(!warnings.is_empty(), "{stderr}");
    for line in stderr.lines() {
        assert!(
            line.starts_with("{\"ts\":") && line.ends_with('}'),
            "not a JSON log line: {line}"
        );
    }
}

#[test]
fn deprecated_flags_warn_by_name() {
    let scratch = Scratch::new("deprecated");
    let out = scratch.path("effective.yaml");
    for flag in DEPRECATED {
        let (code, stderr, _) = load(&[arg(flag)], &out);
        assert_eq!(code, 0, "{}: {stderr}", arg(flag));
        let warned = stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains(flag.0) && l.contains("deprecated"));
        assert!(warned, "{}: no deprecation warning in\n{stderr}", arg(flag));
    }
    // A current flag does not warn about deprecation.
    let (_, stderr, _) = load(&["--conntrack-min=131072".to_owned()], &out);
    assert!(
        !stderr
            .lines()
            .any(|l| l.contains("WARN") && l.contains("deprecated")),
        "{stderr}"
    );
}

#[test]
fn klog_underscore_spellings_are_the_same_flags() {
    let scratch = Scratch::new("underscore");
    let out = scratch.path("effective.yaml");
    for spelling in [
        "--log_dir=/var/log",
        "--log_file=/var/log/kube-proxy.log",
        "--skip_headers",
        "--add_dir_header=true",
        "--log_file_max_size=10",
    ] {
        let (code, stderr, _) = load(&[spelling.to_owned()], &out);
        assert_eq!(code, 0, "{spelling}: {stderr}");
        let dashed = spelling.split('=').next().unwrap().replace('_', "-");
        assert!(stderr.contains(&dashed), "{spelling}: {stderr}");
    }
    // Values keep their underscores.
    let (code, _, written) = load(&["--hostname_override=node_a".to_owned()], &out);
    assert_eq!(code, 0);
    assert!(written.contains("hostnameOverride: node_a"), "{written}");
}

#[test]
fn healthz_and_metrics_port_zero_disable_the_servers() {
    let scratch = Scratch::new("ports");
    let out = scratch.path("effective.yaml");
    let (code, stderr, written) = load(
        &["--healthz-port=0".to_owned(), "--metrics-port=0".to_owned()],
        &out,
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(written.contains("healthzBindAddress: \"\""), "{written}");
    assert!(written.contains("metricsBindAddress: \"\""), "{written}");
    let (_, _, written) = load(&["--healthz-port=12345".to_owned()], &out);
    assert!(
        written.contains("healthzBindAddress: 0.0.0.0:10256"),
        "{written}"
    );
}

#[test]
fn help_lists_the_flags_accepted_without_effect_and_version_exits_zero() {
    let help = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    let list = text
        .split("Accepted without effect (for drop-in compatibility)")
        .nth(1)
        .unwrap_or_else(|| panic!("no list of flags without effect in\n{text}"));
    for flag in [
        "--kube-api-qps",
        "--kube-api-burst",
        "--kube-api-content-type",
        "--profiling",
        "--vmodule",
        "--log-flush-frequency",
        "--log-dir",
        "--alsologtostderr",
        "--healthz-port",
        "--metrics-port",
    ] {
        assert!(list.contains(flag), "{flag} not listed in\n{list}");
    }
    for (flag, _) in V1_28.iter().chain(AFTER_1_28) {
        assert!(text.contains(flag), "{flag} not in --help");
    }
    // Upstream's `--version[=true|raw]` prints the version and exits 0; `=false` does not.
    for spelling in ["--version", "--version=true", "--version=raw"] {
        let version = Command::new(env!("CARGO_BIN_EXE_kube-proxy"))
            .arg(spelling)
            .output()
            .unwrap();
        assert!(version.status.success(), "{spelling}");
        let out = String::from_utf8_lossy(&version.stdout);
        assert!(
            out.starts_with(&format!("kube-proxy {}", env!("CARGO_PKG_VERSION"))),
            "{spelling}: {out}"
        );
    }
    let scratch = Scratch::new("version");
    let (code, stderr, written) = load(&["--version=false".to_owned()], &scratch.path("c.yaml"));
    assert_eq!(code, 0, "{stderr}");
    assert!(written.contains("kind: KubeProxyConfiguration"));
}

/// `--init-only` applies the privileged settings (here the conntrack timeouts, which are per
/// network namespace) and exits instead of running the proxy. Runs in a namespace of its own,
/// so the machine's sysctls are not touched.
#[test]
#[ignore = "needs root"]
fn init_only_sets_the_conntrack_sysctls_and_exits() {
    if !kp_test::netns::require_root() {
        return;
    }
    let ns = kp_test::netns::Netns::new("init-only").unwrap();
    // Make sure the conntrack sysctls exist in the namespace.
    let _ = std::process::Command::new("modprobe")
        .arg("nf_conntrack")
        .status();
    let dir = "/proc/sys/net/netfilter";
    let read = |name: &str| {
        ns.run(&["cat", &format!("{dir}/{name}")])
            .unwrap()
            .trim()
            .to_owned()
    };
    ns.sysctl("net.netfilter.nf_conntrack_tcp_timeout_close_wait", "60")
        .unwrap();
    ns.sysctl("net.netfilter.nf_conntrack_udp_timeout", "30")
        .unwrap();
    let root_close_wait =
        std::fs::read_to_string(format!("{dir}/nf_conntrack_tcp_timeout_close_wait")).unwrap();

    let mut child = ns
        .spawn(&[
            env!("CARGO_BIN_EXE_kube-proxy"),
            "--init-only",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-close-wait=2h",
            "--conntrack-tcp-timeout-established=3h",
            "--conntrack-udp-timeout=45s",
            "--master=https://127.0.0.1:1",
        ])
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "--init-only did not exit:\n{}",
            child.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status}\n{}", child.log());
    assert_eq!(read("nf_conntrack_tcp_timeout_close_wait"), "7200");
    assert_eq!(read("nf_conntrack_tcp_timeout_established"), "10800");
    assert_eq!(read("nf_conntrack_udp_timeout"), "45");
    assert_eq!(
        std::fs::read_to_string(format!("{dir}/nf_conntrack_tcp_timeout_close_wait")).unwrap(),
        root_close_wait,
        "the machine's own sysctl changed"
    );
}
