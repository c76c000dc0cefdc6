//! Tests of flag parsing, the config file, merging, validation and Go durations.
//!
//! No test touches the environment: the config file is handed in through `load_with`.
//! Addresses come from the documentation ranges (192.0.2.0/24, 198.51.100.0/24, 2001:db8::/32).

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use super::*;

const FULL: &str = include_str!("fixtures/full.yaml");
const KUBEADM: &str = include_str!("fixtures/kubeadm.yaml");
const CONFIG_PATH: &str = "/etc/kube-proxy/config.yaml";

/// Loads with only flags; reading any file fails the test.
fn flags_only(args: &[&str]) -> Result<Loaded, ConfigError> {
    load_with(
        std::iter::once("kube-proxy").chain(args.iter().copied()),
        |path| panic!("no file should be read, but {} was", path.display()),
    )
}

/// Loads `yaml` as the `--config` file, then `args`.
fn with_file(yaml: &str, args: &[&str]) -> Result<Loaded, ConfigError> {
    load_with(
        ["kube-proxy", "--config", CONFIG_PATH]
            .into_iter()
            .chain(args.iter().copied()),
        |path| {
            assert_eq!(path, Path::new(CONFIG_PATH));
            Ok(yaml.to_owned())
        },
    )
}

/// A minimal file with `body` appended.
fn file(body: &str) -> String {
    format!("apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n{body}")
}

/// The field paths of an `Invalid` error; panics on any other outcome.
fn invalid_fields(result: Result<Loaded, ConfigError>) -> Vec<String> {
    match result {
        Err(ConfigError::Invalid(errors)) => errors.into_iter().map(|e| e.field).collect(),
        Err(other) => panic!("expected a validation error, got {other}"),
        Ok(loaded) => panic!("expected a validation error, got {:?}", loaded.config),
    }
}

fn is_cli_error(result: &Result<Loaded, ConfigError>) -> bool {
    matches!(result, Err(ConfigError::Cli(_)))
}

fn addr(s: &str) -> Option<SocketAddr> {
    Some(s.parse().unwrap())
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

#[test]
fn defaults_match_upstream() {
    let loaded = flags_only(&[]).unwrap();
    let c = &loaded.config;
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.healthz_bind_address, addr("0.0.0.0:10256"));
    assert_eq!(c.metrics_bind_address, addr("127.0.0.1:10249"));
    assert_eq!(c.bind_address, "0.0.0.0".parse::<IpAddr>().unwrap());
    assert_eq!(c.masquerade_bit, 14);
    assert!(!c.masquerade_all);
    assert_eq!(c.sync_period, Duration::from_secs(30));
    assert_eq!(c.min_sync_period, Duration::from_secs(1));
    assert_eq!(c.config_sync_period, Duration::from_secs(15 * 60));
    assert_eq!(c.detect_local_mode, LocalMode::ClusterCIDR);
    assert!(c.cluster_cidrs.is_empty());
    assert!(c.node_port_addresses.is_empty());
    // Off unless enabled (CVE-2020-8558); upstream defaults to on.
    assert!(!c.localhost_nodeports);
    assert_eq!(c.oom_score_adj, -999);
    assert_eq!(c.udp_idle_timeout, Duration::from_millis(250));
    assert_eq!(c.port_range, None);
    assert_eq!(c.ipvs.scheduler, "rr");
    assert_eq!(
        c.conntrack,
        Conntrack {
            max_per_core: 32768,
            min: 131072,
            tcp_established_timeout: Some(Duration::from_secs(24 * 3600)),
            tcp_close_wait_timeout: Some(Duration::from_secs(3600)),
            tcp_be_liberal: false,
            udp_timeout: None,
            udp_stream_timeout: None,
        }
    );
    assert_eq!(c.hostname, None);
    assert_eq!(c.kubeconfig, None);
    assert_eq!(c.verbosity, 0);
    assert!(!c.cleanup);

    let e = &loaded.effective;
    assert_eq!(e.api_version, API_VERSION);
    assert_eq!(e.kind, KIND);
    assert_eq!(e.mode, "iptables");
    assert_eq!(e.detect_local_mode, "ClusterCIDR");
    assert_eq!(e.config_sync_period.to_string(), "15m0s");
    assert_eq!(e.iptables.sync_period.to_string(), "30s");
    assert_eq!(e.nftables.masquerade_bit, Some(14));
    assert_eq!(e.client_connection.qps, 5.0);
    assert_eq!(e.client_connection.burst, 10);
    // Only settings that do nothing produce warnings, and the defaults set none of them,
    // except the upstream notice that ClusterCIDR mode without a CIDR detects nothing.
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
}

#[test]
fn empty_mode_means_iptables() {
    let loaded = with_file(&file("mode: \"\"\n"), &[]).unwrap();
    assert_eq!(loaded.config.mode, ProxyMode::Iptables);
    assert_eq!(loaded.effective.mode, "iptables");
    assert_eq!(
        flags_only(&["--proxy-mode="]).unwrap().config.mode,
        ProxyMode::Iptables
    );
}

#[test]
fn every_mode_name_parses() {
    for mode in ProxyMode::ALL {
        let loaded = flags_only(&["--proxy-mode", mode.as_str()]).unwrap();
        assert_eq!(loaded.config.mode, mode);
        assert_eq!(mode.as_str().parse::<ProxyMode>(), Ok(mode));
    }
}

#[test]
fn an_unknown_mode_is_refused_naming_the_field() {
    assert_eq!(
        invalid_fields(with_file(&file("mode: kernelspace\n"), &[])),
        ["mode"]
    );
    assert!(is_cli_error(&flags_only(&["--proxy-mode=fast"])));
}

#[test]
fn nftables_mode_defaults_node_ports_to_the_primary_ip() {
    let loaded = flags_only(&["--proxy-mode=nftables"]).unwrap();
    assert_eq!(
        loaded.config.node_port_addresses,
        [NodePortAddress::Primary]
    );
    assert_eq!(loaded.effective.node_port_addresses, ["primary"]);
    // Other modes keep "all local IPs".
    let loaded = flags_only(&["--proxy-mode=iptables"]).unwrap();
    assert!(loaded.config.node_port_addresses.is_empty());
}

#[test]
fn service_cidrs_come_from_the_flag_or_the_file_and_special_ranges_are_refused() {
    let loaded = flags_only(&["--service-cidrs=10.96.0.0/12,fd00:10:96::/112"]).unwrap();
    assert_eq!(
        loaded.config.service_cidrs,
        [net("10.96.0.0/12"), net("fd00:10:96::/112")]
    );
    let loaded = with_file(&file("serviceCIDRs: [192.168.50.7/24]\n"), &[]).unwrap();
    assert_eq!(loaded.config.service_cidrs, [net("192.168.50.0/24")]);
    assert!(flags_only(&[]).unwrap().config.service_cidrs.is_empty());
    // Dropping traffic to all of these would cut the node off.
    for bad in [
        "0.0.0.0/0",
        "127.0.0.0/8",
        "169.254.0.0/24",
        "::/0",
        "fe80::/64",
    ] {
        assert_eq!(
            invalid_fields(with_file(
                &file(&format!("serviceCIDRs: [\"{bad}\"]\n")),
                &[]
            )),
            ["serviceCIDRs[0]"],
            "{bad}"
        );
    }
    assert!(is_cli_error(&flags_only(&["--service-cidrs=10.96.0.0"])));
}

#[test]
fn ipv4_mapped_or_compatible_ipv6_ranges_are_refused_in_every_cidr_setting() {
    for (yaml, field) in [
        ("clusterCIDR: \"::ffff:10.244.0.0/112\"\n", "clusterCIDR"),
        (
            "nodePortAddresses: [\"::c000:201/128\"]\n",
            "nodePortAddresses[0]",
        ),
        (
            "serviceCIDRs: [\"::ffff:10.96.0.0/112\"]\n",
            "serviceCIDRs[0]",
        ),
    ] {
        assert_eq!(
            invalid_fields(with_file(&file(yaml), &[])),
            [field],
            "{yaml}"
        );
    }
    // IPv6 loopback stays a valid nodePortAddresses entry.
    assert!(with_file(&file("nodePortAddresses: [\"::1/128\"]\n"), &[]).is_ok());
}

#[test]
fn file_values_load() {
    let loaded = with_file(FULL, &[]).unwrap();
    let c = &loaded.config;
    assert_eq!(c.mode, ProxyMode::Nftables);
    assert_eq!(c.config_file, Some(PathBuf::from(CONFIG_PATH)));
    assert_eq!(
        c.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(c.hostname.as_deref(), Some("node-a.example"));
    assert_eq!(loaded.effective.hostname_override, "node-a.example");
    assert_eq!(c.bind_address, "192.0.2.10".parse::<IpAddr>().unwrap());
    assert!(c.bind_address_hard_fail);
    assert_eq!(c.healthz_bind_address, addr("192.0.2.10:10300"));
    // A bare IP gets the default port.
    assert_eq!(c.metrics_bind_address, addr("0.0.0.0:10249"));
    assert_eq!(
        c.cluster_cidrs,
        [net("10.244.0.0/16"), net("fd00:10:244::/56")]
    );
    assert_eq!(
        c.node_port_addresses,
        [
            NodePortAddress::Cidr(net("192.0.2.0/24")),
            NodePortAddress::Cidr(net("2001:db8::/64")),
        ]
    );
    assert_eq!(c.config_sync_period, Duration::from_secs(300));
    assert_eq!(c.port_range, Some(30000..=30100));
    assert_eq!(c.udp_idle_timeout, Duration::from_secs(1));
    assert_eq!(c.oom_score_adj, -500);
    assert_eq!(c.feature_gates.get("SomeGate"), Some(&true));
    // nftables mode reads the nftables section, not the iptables one.
    assert_eq!(c.masquerade_bit, 12);
    assert!(c.masquerade_all);
    assert_eq!(c.sync_period, Duration::from_secs(90));
    assert_eq!(c.min_sync_period, Duration::from_millis(250));
    assert!(!c.localhost_nodeports);
    assert_eq!(
        c.ipvs,
        Ipvs {
            scheduler: "wlc".to_owned(),
            exclude_cidrs: vec![net("198.51.100.0/24")],
            strict_arp: true,
            tcp_timeout: Some(Duration::from_secs(900)),
            tcp_fin_timeout: None,
            udp_timeout: None,
        }
    );
    assert_eq!(
        c.conntrack,
        Conntrack {
            max_per_core: 0,
            min: 1000,
            // An explicit 0s on a pointer field means "leave the kernel's value".
            tcp_established_timeout: None,
            tcp_close_wait_timeout: Some(Duration::from_secs(3600)),
            tcp_be_liberal: true,
            udp_timeout: Some(Duration::from_secs(30)),
            udp_stream_timeout: Some(Duration::from_secs(120)),
        }
    );
    assert_eq!(c.verbosity, 4);
    assert!(loaded.warnings.iter().any(|w| w.contains("SomeGate=true")));
}

#[test]
fn a_kubeadm_config_full_of_nulls_and_zeros_gets_upstream_defaults() {
    let kubeadm = with_file(KUBEADM, &[]).unwrap();
    let defaults = flags_only(&[
        "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
        "--cluster-cidr=10.244.0.0/16",
    ])
    .unwrap();
    let Config { config_file, .. } = &kubeadm.config;
    assert_eq!(config_file.as_deref(), Some(Path::new(CONFIG_PATH)));
    assert_eq!(
        Config {
            config_file: None,
            ..kubeadm.config.clone()
        },
        defaults.config
    );
    assert_eq!(kubeadm.config.sync_period, Duration::from_secs(30));
    assert_eq!(kubeadm.config.min_sync_period, Duration::from_secs(1));
    assert_eq!(kubeadm.effective.logging.flush_frequency.to_string(), "5s");
}

#[test]
fn flags_override_the_file() {
    let loaded = with_file(
        FULL,
        &[
            "--proxy-mode=iptables",
            "--hostname-override=Other",
            "--healthz-bind-address=",
            "--metrics-bind-address=[2001:db8::1]:9999",
            "--cluster-cidr=10.0.0.0/8",
            "--nodeport-addresses=primary",
            "--iptables-masquerade-bit=3",
            "--iptables-sync-period=45s",
            "--iptables-min-sync-period=0",
            "--masquerade-all=false",
            "--iptables-localhost-nodeports",
            "--config-sync-period=1h",
            "--oom-score-adj",
            "-1000",
            "--conntrack-max-per-core=10",
            "--conntrack-min=20",
            "--proxy-port-range=0-0",
            "--udp-timeout=2s",
            "--feature-gates=SomeGate=false,Other=true",
            "--kubeconfig=/root/.kube/config",
            "-v",
            "7",
        ],
    )
    .unwrap();
    let c = &loaded.config;
    assert_eq!(c.mode, ProxyMode::Iptables);
    assert_eq!(c.hostname.as_deref(), Some("other"));
    // An empty flag disables the server (a file's empty value means the default).
    assert_eq!(c.healthz_bind_address, None);
    assert_eq!(c.metrics_bind_address, addr("[2001:db8::1]:9999"));
    assert_eq!(c.cluster_cidrs, [net("10.0.0.0/8")]);
    assert_eq!(c.node_port_addresses, [NodePortAddress::Primary]);
    assert_eq!(c.masquerade_bit, 3);
    assert!(!c.masquerade_all);
    assert_eq!(c.sync_period, Duration::from_secs(45));
    // Only a flag can ask for 0: in a file, 0s means "default", as upstream.
    assert_eq!(c.min_sync_period, Duration::ZERO);
    assert!(c.localhost_nodeports);
    assert_eq!(c.config_sync_period, Duration::from_secs(3600));
    assert_eq!(c.oom_score_adj, -1000);
    assert_eq!(c.conntrack.max_per_core, 10);
    assert_eq!(c.conntrack.min, 20);
    assert_eq!(c.port_range, None);
    assert_eq!(c.udp_idle_timeout, Duration::from_secs(2));
    assert_eq!(c.feature_gates.get("SomeGate"), Some(&false));
    assert_eq!(c.feature_gates.get("Other"), Some(&true));
    assert_eq!(c.kubeconfig, Some(PathBuf::from("/root/.kube/config")));
    assert_eq!(c.verbosity, 7);
    // Settings no flag touched keep the file's values.
    assert_eq!(c.bind_address, "192.0.2.10".parse::<IpAddr>().unwrap());
    assert_eq!(c.udp_idle_timeout, Duration::from_secs(2));
    assert_eq!(c.conntrack.udp_timeout, Some(Duration::from_secs(30)));
    assert_eq!(c.ipvs.scheduler, "wlc");
}

#[test]
fn flags_not_given_leave_the_file_alone() {
    let from_file = with_file(FULL, &[]).unwrap();
    let with_unrelated_flag = with_file(FULL, &["--cleanup"]).unwrap();
    assert!(with_unrelated_flag.config.cleanup);
    assert_eq!(
        Config {
            cleanup: false,
            ..with_unrelated_flag.config
        },
        from_file.config
    );
    assert_eq!(with_unrelated_flag.effective, from_file.effective);
}

#[test]
fn iptables_sync_flags_drive_nftables_mode_and_ipvs_flags_drive_ipvs_mode() {
    let nft = flags_only(&[
        "--proxy-mode=nftables",
        "--iptables-sync-period=10s",
        "--iptables-min-sync-period=2s",
        "--ipvs-sync-period=99s",
        "--masquerade-all",
    ])
    .unwrap();
    assert_eq!(nft.config.sync_period, Duration::from_secs(10));
    assert_eq!(nft.config.min_sync_period, Duration::from_secs(2));
    assert!(nft.config.masquerade_all);
    assert!(nft.effective.nftables.masquerade_all);
    assert_eq!(nft.effective.nftables.sync_period.to_string(), "10s");

    let ipvs = flags_only(&[
        "--proxy-mode=ipvs",
        "--iptables-sync-period=10s",
        "--ipvs-sync-period=20s",
        "--ipvs-min-sync-period=5s",
    ])
    .unwrap();
    assert_eq!(ipvs.config.sync_period, Duration::from_secs(20));
    assert_eq!(ipvs.config.min_sync_period, Duration::from_secs(5));
}

#[test]
fn the_masquerade_bit_flag_does_not_reach_nftables_mode_as_upstream() {
    let loaded = flags_only(&["--proxy-mode=nftables", "--iptables-masquerade-bit=3"]).unwrap();
    assert_eq!(loaded.config.masquerade_bit, 14);
    let loaded = with_file(
        &file("mode: nftables\nnftables:\n  masqueradeBit: 3\n"),
        &[],
    )
    .unwrap();
    assert_eq!(loaded.config.masquerade_bit, 3);
}

#[test]
fn an_unknown_field_is_an_error_naming_it() {
    for (yaml, name) in [
        ("masqueradeAl: true\n", "masqueradeAl"),
        ("iptables:\n  syncPeriodd: 1s\n", "syncPeriodd"),
        ("conntrack:\n  max: null\n", "max"),
    ] {
        match with_file(&file(yaml), &[]) {
            Err(ConfigError::Parse { path, message }) => {
                assert_eq!(path, Path::new(CONFIG_PATH));
                assert!(message.contains(name), "{message:?} should name {name}");
            }
            other => panic!("expected a parse error for {yaml:?}, got {other:?}"),
        }
    }
}

#[test]
fn a_wrong_api_version_or_kind_is_an_error() {
    let wrong_version =
        "apiVersion: kubeproxy.config.k8s.io/v1beta1\nkind: KubeProxyConfiguration\n";
    match with_file(wrong_version, &[]) {
        Err(ConfigError::TypeMeta { field, found, .. }) => {
            assert_eq!(field, "apiVersion");
            assert_eq!(found, "kubeproxy.config.k8s.io/v1beta1");
        }
        other => panic!("expected a TypeMeta error, got {other:?}"),
    }
    let wrong_kind = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n";
    assert!(matches!(
        with_file(wrong_kind, &[]),
        Err(ConfigError::TypeMeta { field: "kind", .. })
    ));
    assert!(matches!(
        with_file("mode: nftables\n", &[]),
        Err(ConfigError::TypeMeta {
            field: "apiVersion",
            ..
        })
    ));
}

#[test]
fn malformed_yaml_and_unreadable_files_are_errors() {
    assert!(matches!(
        with_file("apiVersion: [unclosed\n", &[]),
        Err(ConfigError::Parse { .. })
    ));
    let result = load_with(["kube-proxy", "--config=/missing.yaml"], |_| {
        Err(io::Error::new(io::ErrorKind::NotFound, "gone"))
    });
    match result {
        Err(ConfigError::Read { path, source }) => {
            assert_eq!(path, Path::new("/missing.yaml"));
            assert_eq!(source.kind(), io::ErrorKind::NotFound);
        }
        other => panic!("expected a read error, got {other:?}"),
    }
}

#[test]
fn a_bad_cidr_is_an_error() {
    assert_eq!(
        invalid_fields(with_file(&file("clusterCIDR: 10.244.0.0\n"), &[])),
        ["clusterCIDR"]
    );
    assert_eq!(
        invalid_fields(with_file(
            &file("nodePortAddresses: [192.0.2.0/24, nope]\n"),
            &[]
        )),
        ["nodePortAddresses[1]"]
    );
    assert!(is_cli_error(&flags_only(&["--cluster-cidr=10.244.0.0/33"])));
    assert!(is_cli_error(&flags_only(&[
        "--nodeport-addresses=192.0.2.1"
    ])));
}

#[test]
fn cluster_cidr_takes_one_range_or_a_dual_stack_pair() {
    let pair = flags_only(&["--cluster-cidr=fd00:10:244::/56,10.244.0.0/16"]).unwrap();
    assert_eq!(
        pair.config.cluster_cidrs,
        [net("fd00:10:244::/56"), net("10.244.0.0/16")]
    );
    // Host bits are cleared, as Go's ParseCIDR does.
    let one = flags_only(&["--cluster-cidr=10.244.1.7/16"]).unwrap();
    assert_eq!(one.config.cluster_cidrs, [net("10.244.0.0/16")]);
    assert_eq!(
        invalid_fields(flags_only(&["--cluster-cidr=10.244.0.0/16,10.96.0.0/12"])),
        ["clusterCIDR"]
    );
    assert_eq!(
        invalid_fields(flags_only(&[
            "--cluster-cidr=10.244.0.0/16,fd00::/56,10.96.0.0/12"
        ])),
        ["clusterCIDR"]
    );
}

#[test]
fn primary_cannot_be_mixed_with_cidrs() {
    assert_eq!(
        invalid_fields(flags_only(&["--nodeport-addresses=192.0.2.0/24,primary"])),
        ["nodePortAddresses[1]"]
    );
}

#[test]
fn a_masquerade_bit_outside_0_to_31_is_an_error() {
    assert_eq!(
        invalid_fields(with_file(&file("iptables:\n  masqueradeBit: 32\n"), &[])),
        ["iptables.masqueradeBit"]
    );
    assert_eq!(
        invalid_fields(with_file(
            &file("mode: nftables\nnftables:\n  masqueradeBit: -1\n"),
            &[]
        )),
        ["nftables.masqueradeBit"]
    );
    assert!(is_cli_error(&flags_only(&["--iptables-masquerade-bit=32"])));
    let edge = flags_only(&["--iptables-masquerade-bit=31"]).unwrap();
    assert_eq!(edge.config.masquerade_bit, 31);
}

#[test]
fn a_bad_duration_is_an_error() {
    // No unit: metav1.Duration wants a string such as "30s".
    assert!(matches!(
        with_file(&file("configSyncPeriod: 30\n"), &[]),
        Err(ConfigError::Parse { .. })
    ));
    assert!(matches!(
        with_file(&file("iptables:\n  syncPeriod: soon\n"), &[]),
        Err(ConfigError::Parse { .. })
    ));
    assert!(is_cli_error(&flags_only(&["--iptables-sync-period=30"])));
    assert!(is_cli_error(&flags_only(&["--config-sync-period=1d"])));
}

#[test]
fn sync_periods_must_be_positive_and_not_below_the_minimum() {
    assert_eq!(
        invalid_fields(flags_only(&["--iptables-sync-period=-1s"])),
        ["iptables.syncPeriod", "iptables.syncPeriod"]
    );
    assert_eq!(
        invalid_fields(flags_only(&["--iptables-sync-period=0s"])),
        ["iptables.syncPeriod", "iptables.syncPeriod"]
    );
    assert_eq!(
        invalid_fields(flags_only(&[
            "--proxy-mode=nftables",
            "--iptables-min-sync-period=-1s"
        ])),
        ["nftables.minSyncPeriod"]
    );
    assert_eq!(
        invalid_fields(with_file(
            &file("mode: nftables\nnftables:\n  syncPeriod: 1s\n  minSyncPeriod: 2s\n"),
            &[]
        )),
        ["nftables.syncPeriod"]
    );
    // Equal is fine.
    let equal = flags_only(&["--iptables-sync-period=5s", "--iptables-min-sync-period=5s"]);
    assert_eq!(
        equal.unwrap().config.min_sync_period,
        Duration::from_secs(5)
    );
    // Only the active mode's section is checked, as upstream converts only that one.
    assert!(with_file(&file("mode: nftables\nipvs:\n  syncPeriod: -1s\n"), &[]).is_ok());
    assert!(invalid_fields(flags_only(&["--config-sync-period=0s"])) == ["configSyncPeriod"]);
}

#[test]
fn bind_addresses_take_ip_port_a_bare_ip_or_nothing() {
    let loaded = flags_only(&[
        "--healthz-bind-address=192.0.2.1",
        "--metrics-bind-address=::1",
    ])
    .unwrap();
    assert_eq!(loaded.config.healthz_bind_address, addr("192.0.2.1:10256"));
    assert_eq!(loaded.config.metrics_bind_address, addr("[::1]:10249"));
    assert_eq!(loaded.effective.metrics_bind_address, "[::1]:10249");

    let disabled = flags_only(&["--metrics-bind-address="]).unwrap();
    assert_eq!(disabled.config.metrics_bind_address, None);

    assert!(is_cli_error(&flags_only(&[
        "--healthz-bind-address=localhost:1"
    ])));
    assert!(is_cli_error(&flags_only(&[
        "--healthz-bind-address=192.0.2.1:0"
    ])));
    assert_eq!(
        invalid_fields(with_file(&file("healthzBindAddress: nowhere:10256\n"), &[])),
        ["healthzBindAddress"]
    );
    assert_eq!(
        invalid_fields(with_file(&file("bindAddress: 192.0.2.1:80\n"), &[])),
        ["bindAddress"]
    );
}

#[test]
fn an_ipv6_bind_address_moves_the_default_listeners_to_ipv6() {
    let loaded = with_file(&file("bindAddress: \"2001:db8::10\"\n"), &[]).unwrap();
    assert_eq!(loaded.config.healthz_bind_address, addr("[::]:10256"));
    assert_eq!(loaded.config.metrics_bind_address, addr("[::1]:10249"));
}

/// Interface names for detect-local follow the kernel's rules and cannot carry rule text.
#[test]
fn detect_local_interface_names_are_validated() {
    for bad in [
        "cbr 0",
        "a/b",
        "eth0:1",
        "veth+",
        "veth*",
        "x\"y",
        "abcdefghijklmnop",
        "..",
        "a;b",
    ] {
        assert_eq!(
            invalid_fields(flags_only(&[
                "--detect-local-mode=BridgeInterface",
                &format!("--pod-bridge-interface={bad}"),
            ])),
            ["detectLocal.bridgeInterface"],
            "{bad:?}"
        );
        let yaml = format!(
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: '{}'\n",
            bad.replace('\'', "''")
        );
        assert_eq!(
            invalid_fields(with_file(&file(&yaml), &[])),
            ["detectLocal.interfaceNamePrefix"],
            "{bad:?}"
        );
    }
    // The longest name the kernel takes.
    assert!(flags_only(&[
        "--detect-local-mode=InterfaceNamePrefix",
        "--pod-interface-name-prefix=abcdefghijklmno",
    ])
    .is_ok());
}

#[test]
fn detect_local_modes_need_their_settings() {
    assert_eq!(
        invalid_fields(flags_only(&["--detect-local-mode=BridgeInterface"])),
        ["detectLocal.bridgeInterface"]
    );
    let bridge = flags_only(&[
        "--detect-local-mode=BridgeInterface",
        "--pod-bridge-interface=cbr0",
    ])
    .unwrap();
    assert_eq!(
        bridge.config.detect_local_mode,
        LocalMode::BridgeInterface("cbr0".to_owned())
    );
    let prefix = with_file(
        &file("detectLocalMode: InterfaceNamePrefix\ndetectLocal:\n  interfaceNamePrefix: veth\n"),
        &[],
    )
    .unwrap();
    assert_eq!(
        prefix.config.detect_local_mode,
        LocalMode::InterfaceNamePrefix("veth".to_owned())
    );
    assert_eq!(
        flags_only(&["--detect-local-mode=NodeCIDR"])
            .unwrap()
            .config
            .detect_local_mode,
        LocalMode::NodeCIDR
    );
    assert_eq!(
        invalid_fields(with_file(&file("detectLocalMode: Guess\n"), &[])),
        ["detectLocalMode"]
    );
    assert!(is_cli_error(&flags_only(&["--detect-local-mode=Guess"])));
}

#[test]
fn hostname_override_is_trimmed_and_lowercased_and_must_not_be_blank() {
    let loaded = flags_only(&["--hostname-override= Worker-1 "]).unwrap();
    assert_eq!(loaded.config.hostname.as_deref(), Some("worker-1"));
    // An empty flag is "not given", as upstream.
    let loaded = with_file(FULL, &["--hostname-override="]).unwrap();
    assert_eq!(loaded.config.hostname.as_deref(), Some("node-a.example"));
    assert_eq!(
        invalid_fields(flags_only(&["--hostname-override=   "])),
        ["hostnameOverride"]
    );
    assert_eq!(
        invalid_fields(with_file(&file("hostnameOverride: \"  \"\n"), &[])),
        ["hostnameOverride"]
    );
}

#[test]
fn ipvs_settings_are_checked_only_in_ipvs_mode() {
    let yaml = file("ipvs:\n  scheduler: fastest\n  excludeCIDRs: [nope]\n  tcpTimeout: -1s\n");
    assert!(with_file(&yaml, &[]).is_ok());
    assert_eq!(
        invalid_fields(with_file(&yaml, &["--proxy-mode=ipvs"])),
        ["ipvs.scheduler", "ipvs.excludeCIDRs[0]", "ipvs.tcpTimeout"]
    );
    let ok = flags_only(&[
        "--proxy-mode=ipvs",
        "--ipvs-scheduler=mh",
        "--ipvs-strict-arp",
    ]);
    let ok = ok.unwrap();
    assert_eq!(ok.config.ipvs.scheduler, "mh");
    assert!(ok.config.ipvs.strict_arp);
}

#[test]
fn every_broken_rule_is_reported_at_once() {
    let yaml = file(
        "oomScoreAdj: 1001
clientConnection:
  burst: -1
conntrack:
  min: -1
  udpTimeout: -1s
portRange: 20-10
logging:
  format: xml
",
    );
    let result = with_file(&yaml, &[]);
    let message = result.as_ref().unwrap_err().to_string();
    assert_eq!(
        invalid_fields(result),
        [
            "conntrack.min",
            "conntrack.udpTimeout",
            "clientConnection.burst",
            "oomScoreAdj",
            "portRange",
            "logging.format",
        ]
    );
    assert!(message.contains("oomScoreAdj: \"1001\": must be within the range [-1000, 1000]"));
}

#[test]
fn bool_flags_take_an_optional_value() {
    let on = flags_only(&["--masquerade-all", "--cleanup=true"]).unwrap();
    assert!(on.config.masquerade_all);
    assert!(on.config.cleanup);
    let off = with_file(
        &file("iptables:\n  masqueradeAll: true\n"),
        &[
            "--masquerade-all=false",
            "--iptables-localhost-nodeports=false",
        ],
    )
    .unwrap();
    assert!(!off.config.masquerade_all);
    assert!(!off.config.localhost_nodeports);
    // As with Go's pflag, a bool flag's value must be attached with '='.
    assert!(is_cli_error(&flags_only(&["--masquerade-all", "false"])));
}

#[test]
fn verbosity_comes_from_v_or_the_file() {
    assert_eq!(flags_only(&["--v=3"]).unwrap().config.verbosity, 3);
    assert_eq!(flags_only(&["-v=5"]).unwrap().config.verbosity, 5);
    assert_eq!(flags_only(&["-v2"]).unwrap().config.verbosity, 2);
    let file_only = with_file(&file("logging:\n  verbosity: 6\n"), &[]).unwrap();
    assert_eq!(file_only.config.verbosity, 6);
    let both = with_file(&file("logging:\n  verbosity: 6\n"), &["-v", "1"]).unwrap();
    assert_eq!(both.config.verbosity, 1);
    let huge = with_file(&file("logging:\n  verbosity: 1000\n"), &[]).unwrap();
    assert_eq!(huge.config.verbosity, 255);
}

#[test]
fn manifests_select_standalone_mode_and_exclude_an_api_server() {
    let loaded = flags_only(&["--manifests=/etc/kube-proxy/manifests"]).unwrap();
    assert_eq!(
        loaded.config.manifests_dir,
        Some(PathBuf::from("/etc/kube-proxy/manifests"))
    );
    assert!(is_cli_error(&flags_only(&[
        "--manifests=/m",
        "--master=https://192.0.2.1:6443"
    ])));
    let master = flags_only(&["--master=https://192.0.2.1:6443"]).unwrap();
    assert_eq!(
        master.config.master.as_deref(),
        Some("https://192.0.2.1:6443")
    );
}

#[test]
fn port_ranges_parse_like_upstream() {
    assert_eq!(parse_port_range(""), Ok(None));
    assert_eq!(parse_port_range("0"), Ok(None));
    assert_eq!(parse_port_range("0-0"), Ok(None));
    assert_eq!(parse_port_range("80"), Ok(Some(80..=80)));
    assert_eq!(parse_port_range("300-2000"), Ok(Some(300..=2000)));
    assert_eq!(parse_port_range("300+10"), Ok(Some(300..=310)));
    assert!(parse_port_range("2000-300").is_err());
    assert!(parse_port_range("65535+1").is_err());
    assert!(parse_port_range("70000").is_err());
    assert!(parse_port_range("a-b").is_err());
}

#[test]
fn settings_without_effect_are_reported_as_warnings() {
    let loaded = with_file(
        &file(
            "clusterCIDR: 10.244.0.0/16
enableProfiling: true
showHiddenMetricsForVersion: \"1.30\"
iptables:
  snatNodeInternalIP: true
logging:
  vmodule:
    - filePattern: proxier
      verbosity: 4
",
        ),
        &["--feature-gates=NFTablesProxyMode=true"],
    )
    .unwrap();
    let warnings = loaded.warnings.join("\n");
    for needle in [
        "NFTablesProxyMode=true",
        "enableProfiling",
        "showHiddenMetricsForVersion",
        "snatNodeInternalIP",
        "vmodule",
    ] {
        assert!(
            warnings.contains(needle),
            "no warning about {needle}: {warnings}"
        );
    }
}

#[test]
fn exit_codes_are_zero_for_help_and_64_for_bad_configuration() {
    let help = flags_only(&["--help"]).unwrap_err();
    assert_eq!(help.exit_code(), 0);
    let text = help.to_string();
    for flag in [
        "--config",
        "--proxy-mode",
        "--kubeconfig",
        "--master",
        "--hostname-override",
        "--cluster-cidr",
        "--healthz-bind-address",
        "--metrics-bind-address",
        "--bind-address",
        "--masquerade-all",
        "--nodeport-addresses",
        "--iptables-masquerade-bit",
        "--iptables-sync-period",
        "--iptables-min-sync-period",
        "--iptables-localhost-nodeports",
        "--ipvs-scheduler",
        "--ipvs-sync-period",
        "--ipvs-min-sync-period",
        "--ipvs-strict-arp",
        "--proxy-port-range",
        "--udp-timeout",
        "--config-sync-period",
        "--detect-local-mode",
        "--oom-score-adj",
        "--conntrack-max-per-core",
        "--conntrack-min",
        "--cleanup",
        "--write-config-to",
        "--manifests",
        "-v, --v",
    ] {
        assert!(text.contains(flag), "--help does not mention {flag}");
    }
    assert!(
        !text.contains("--nftables-"),
        "nftables flags are not upstream's"
    );

    assert_eq!(flags_only(&["--no-such-flag"]).unwrap_err().exit_code(), 64);
    assert_eq!(
        with_file(&file("mode: fast\n"), &[])
            .unwrap_err()
            .exit_code(),
        error::EXIT_BAD_CONFIG
    );
    assert_eq!(with_file("{", &[]).unwrap_err().exit_code(), 64);
}

#[test]
fn write_config_to_output_round_trips() {
    for (yaml, args) in [
        (None, &[][..]),
        (Some(FULL), &[][..]),
        (Some(KUBEADM), &[][..]),
        (
            Some(FULL),
            &[
                "--proxy-mode=ipvs",
                "--write-config-to=/tmp/out.yaml",
                "-v=3",
            ][..],
        ),
    ] {
        let first = match yaml {
            Some(yaml) => with_file(yaml, args),
            None => flags_only(args),
        }
        .unwrap();
        let written = to_yaml(&first.effective).unwrap();
        let again = with_file(&written, &[]).unwrap_or_else(|e| panic!("{e}\n{written}"));
        assert_eq!(again.effective, first.effective, "{written}");
        assert_eq!(
            Config {
                config_file: None,
                write_config_to: None,
                ..again.config
            },
            Config {
                config_file: None,
                write_config_to: None,
                ..first.config
            }
        );
    }
}

#[test]
fn written_config_reads_like_upstream_output() {
    let loaded = flags_only(&["--proxy-mode=nftables"]).unwrap();
    let written = to_yaml(&loaded.effective).unwrap();
    for line in [
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1",
        "kind: KubeProxyConfiguration",
        "mode: nftables",
        "healthzBindAddress: 0.0.0.0:10256",
        "metricsBindAddress: 127.0.0.1:10249",
        "configSyncPeriod: 15m0s",
        "  syncPeriod: 30s",
        "  minSyncPeriod: 1s",
        "  masqueradeBit: 14",
        "  tcpEstablishedTimeout: 24h0m0s",
    ] {
        assert!(
            written.lines().any(|l| l.trim_end() == line),
            "no line {line:?} in:\n{written}"
        );
    }
    // Fields come in alphabetical order, as upstream writes them.
    let top: Vec<&str> = written
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('-'))
        .filter_map(|l| l.split(':').next())
        .collect();
    let mut sorted = top.clone();
    sorted.sort_unstable();
    assert_eq!(top, sorted);
}

#[test]
fn go_durations_parse() {
    let ns = |s: &str| GoDuration::parse(s).map(GoDuration::as_nanos);
    let second = 1_000_000_000;
    assert_eq!(ns("0"), Ok(0));
    assert_eq!(ns("0s"), Ok(0));
    assert_eq!(ns("1s"), Ok(second));
    assert_eq!(ns("30s"), Ok(30 * second));
    assert_eq!(ns("15m0s"), Ok(900 * second));
    assert_eq!(ns("15m"), Ok(900 * second));
    assert_eq!(ns("1h2m3.5s"), Ok(3723 * second + second / 2));
    assert_eq!(ns("250ms"), Ok(250_000_000));
    assert_eq!(ns("1.5h"), Ok(5400 * second));
    assert_eq!(ns(".5s"), Ok(second / 2));
    assert_eq!(ns("1.s"), Ok(second));
    assert_eq!(ns("-1s"), Ok(-second));
    assert_eq!(ns("+2s"), Ok(2 * second));
    assert_eq!(ns("1us"), Ok(1_000));
    assert_eq!(ns("1\u{b5}s"), Ok(1_000));
    assert_eq!(ns("1\u{3bc}s"), Ok(1_000));
    assert_eq!(ns("3ns"), Ok(3));
    assert_eq!(ns("1h1h"), Ok(7200 * second));
    assert_eq!(ns("2562047h47m16.854775807s"), Ok(i64::MAX));
    assert_eq!(ns("-2562047h47m16.854775808s"), Ok(i64::MIN));
    for bad in [
        "",
        "s",
        "30",
        "1d",
        "1.2.3s",
        ".s",
        "-",
        "1 s",
        "1s ",
        "2562047h47m16.854775808s",
        "9999999999999999999h",
    ] {
        assert!(GoDuration::parse(bad).is_err(), "{bad:?} should not parse");
    }
}

#[test]
fn go_durations_print_like_go() {
    for (nanos, text) in [
        (0, "0s"),
        (1, "1ns"),
        (1_100, "1.1\u{b5}s"),
        (2_200_000, "2.2ms"),
        (250_000_000, "250ms"),
        (1_000_000_000, "1s"),
        (1_500_000_000, "1.5s"),
        (30_000_000_000, "30s"),
        (90_000_000_000, "1m30s"),
        (900_000_000_000, "15m0s"),
        (3_600_000_000_000, "1h0m0s"),
        (3_723_500_000_000, "1h2m3.5s"),
        (86_400_000_000_000, "24h0m0s"),
        (-1_000_000_000, "-1s"),
        (i64::MAX, "2562047h47m16.854775807s"),
        (i64::MIN, "-2562047h47m16.854775808s"),
    ] {
        let d = GoDuration::from_nanos(nanos);
        assert_eq!(d.to_string(), text);
        assert_eq!(GoDuration::parse(text), Ok(d), "{text} should read back");
    }
}

#[test]
fn go_durations_convert_to_std() {
    assert_eq!(
        GoDuration::from_millis(1500).to_std(),
        Some(Duration::from_millis(1500))
    );
    assert_eq!(GoDuration::from_secs(-1).to_std(), None);
    assert_eq!(
        GoDuration::from(Duration::from_secs(7)),
        GoDuration::from_secs(7)
    );
}

#[test]
fn an_error_in_a_flag_value_names_the_flag() {
    let err = flags_only(&["--proxy-mode=nftables", "--iptables-min-sync-period=-1s"]).unwrap_err();
    assert_eq!(
        err.field_errors()[0].flag,
        Some("--iptables-min-sync-period")
    );
    assert!(err
        .to_string()
        .contains("nftables.minSyncPeriod (set by --iptables-min-sync-period): \"-1s\""));
    let err = flags_only(&["--nodeport-addresses=primary,192.0.2.0/24"]).unwrap_err();
    assert_eq!(err.field_errors()[0].field, "nodePortAddresses[0]");
    assert_eq!(err.field_errors()[0].flag, Some("--nodeport-addresses"));
    // A value from the file names no flag.
    let err = with_file(&file("oomScoreAdj: 2000\n"), &[]).unwrap_err();
    assert_eq!(err.field_errors()[0].flag, None);
}

#[test]
fn the_ebpf_flags_name_the_cgroup_root_and_the_pin_directory() {
    let c = flags_only(&["--proxy-mode", "ebpf"]).expect("loads").config;
    assert_eq!(c.mode, ProxyMode::Ebpf);
    assert_eq!(c.bpf_cgroup_root, None);
    assert_eq!(c.bpf_pin_dir, Path::new(DEFAULT_BPF_PIN_DIR));
    let c = flags_only(&[
        "--proxy-mode",
        "ebpf",
        "--bpf-cgroup-root",
        "/sys/fs/cgroup/kubepods",
        "--bpf-pin-dir",
        "/sys/fs/bpf/kp-test",
    ])
    .expect("loads")
    .config;
    assert_eq!(
        c.bpf_cgroup_root.as_deref(),
        Some(Path::new("/sys/fs/cgroup/kubepods"))
    );
    assert_eq!(c.bpf_pin_dir, Path::new("/sys/fs/bpf/kp-test"));
}

#[test]
fn the_userspace_drain_timeout_defaults_to_10s_takes_zero_and_refuses_a_negative_one() {
    let drain = |args: &[&str]| flags_only(args).map(|l| l.config.userspace_drain_timeout);
    assert_eq!(drain(&[]).unwrap(), Duration::from_secs(10));
    assert_eq!(
        drain(&["--userspace-drain-timeout=2m"]).unwrap(),
        Duration::from_secs(120)
    );
    assert_eq!(
        drain(&["--userspace-drain-timeout", "0"]).unwrap(),
        Duration::ZERO
    );
    let err = drain(&["--userspace-drain-timeout=-1s"]).unwrap_err();
    assert_eq!(err.field_errors()[0].field, "--userspace-drain-timeout");
}

#[test]
fn the_bpf_handover_idle_time_defaults_to_a_minute_takes_zero_and_refuses_a_negative_one() {
    let idle = |args: &[&str]| flags_only(args).map(|l| l.config.bpf_handover_idle);
    assert_eq!(idle(&[]).unwrap(), Duration::from_secs(60));
    assert_eq!(
        idle(&["--bpf-handover-idle=5s"]).unwrap(),
        Duration::from_secs(5)
    );
    assert_eq!(idle(&["--bpf-handover-idle", "0"]).unwrap(), Duration::ZERO);
    let err = idle(&["--bpf-handover-idle=-1s"]).unwrap_err();
    assert_eq!(err.field_errors()[0].field, "--bpf-handover-idle");
}

#[test]
fn log_format_is_text_or_json_from_the_flag_or_the_file() {
    assert_eq!(
        flags_only(&[]).unwrap().config.logging_format,
        LogFormat::Text
    );
    let json = flags_only(&["--logging-format=json"]).unwrap();
    assert_eq!(json.config.logging_format, LogFormat::Json);
    assert_eq!(json.effective.logging.format, "json");
    let file_json = with_file(&file("logging:\n  format: json\n"), &[]).unwrap();
    assert_eq!(file_json.config.logging_format, LogFormat::Json);
    let flag_wins = with_file(
        &file("logging:\n  format: json\n"),
        &["--logging-format=text"],
    )
    .unwrap();
    assert_eq!(flag_wins.config.logging_format, LogFormat::Text);
    assert!(is_cli_error(&flags_only(&["--logging-format=xml"])));
}

#[test]
fn conntrack_timeout_flags_override_the_file() {
    let yaml = file(
        "conntrack:
  tcpEstablishedTimeout: 1h
  tcpCloseWaitTimeout: 1m
  udpTimeout: 10s
",
    );
    let loaded = with_file(
        &yaml,
        &[
            "--conntrack-tcp-timeout-established=3h",
            "--conntrack-tcp-timeout-close-wait=0s",
            "--conntrack-udp-timeout-stream=2m",
            "--conntrack-tcp-be-liberal",
        ],
    )
    .unwrap();
    let c = &loaded.config.conntrack;
    assert_eq!(
        c.tcp_established_timeout,
        Some(Duration::from_secs(3 * 3600))
    );
    // 0 leaves the kernel's value, as upstream.
    assert_eq!(c.tcp_close_wait_timeout, None);
    assert_eq!(c.udp_timeout, Some(Duration::from_secs(10)));
    assert_eq!(c.udp_stream_timeout, Some(Duration::from_secs(120)));
    assert!(c.tcp_be_liberal);
    let negative = flags_only(&["--conntrack-tcp-timeout-established=-1s"]);
    assert_eq!(
        invalid_fields(negative),
        ["conntrack.tcpEstablishedTimeout"]
    );
}

#[test]
fn api_client_flags_land_in_client_connection() {
    let loaded = flags_only(&[
        "--kube-api-qps=50",
        "--kube-api-burst=100",
        "--kube-api-content-type=application/json",
    ])
    .unwrap();
    let client = &loaded.effective.client_connection;
    assert_eq!(client.qps, 50.0);
    assert_eq!(client.burst, 100);
    assert_eq!(client.content_type, "application/json");
    assert!(
        loaded.warnings.iter().any(|w| w.contains("--kube-api-qps")),
        "{:?}",
        loaded.warnings
    );
    let negative = flags_only(&["--kube-api-burst=-1"]);
    assert_eq!(invalid_fields(negative), ["clientConnection.burst"]);
}

#[test]
fn ipvs_flags_land_in_the_ipvs_section() {
    let loaded = flags_only(&[
        "--proxy-mode=ipvs",
        "--ipvs-exclude-cidrs=192.0.2.0/24,2001:db8::/32",
        "--ipvs-tcp-timeout=15m",
        "--ipvs-tcpfin-timeout=2m",
        "--ipvs-udp-timeout=5m",
    ])
    .unwrap();
    let ipvs = &loaded.config.ipvs;
    assert_eq!(
        ipvs.exclude_cidrs,
        [net("192.0.2.0/24"), net("2001:db8::/32")]
    );
    assert_eq!(ipvs.tcp_timeout, Some(Duration::from_secs(900)));
    assert_eq!(ipvs.tcp_fin_timeout, Some(Duration::from_secs(120)));
    assert_eq!(ipvs.udp_timeout, Some(Duration::from_secs(300)));
    assert!(is_cli_error(&flags_only(&[
        "--ipvs-exclude-cidrs=nonsense"
    ])));
}

#[test]
fn deprecated_and_removed_flags_warn_and_cleanup_iptables_is_cleanup() {
    let old = flags_only(&["--cleanup-iptables"]).unwrap();
    assert!(old.config.cleanup);
    assert!(old
        .warnings
        .iter()
        .any(|w| w.contains("--cleanup-iptables")));
    let loaded = flags_only(&[
        "--alsologtostderr",
        "--log-dir=/var/log",
        "--log_file=/var/log/kube-proxy.log",
        "--logtostderr=false",
        "--skip-headers",
        "--healthz-port=10256",
    ])
    .unwrap();
    for flag in [
        "--alsologtostderr",
        "--log-dir",
        "--log-file",
        "--logtostderr",
        "--skip-headers",
        "--healthz-port",
    ] {
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.contains(flag) && w.contains("deprecated")),
            "{flag}: {:?}",
            loaded.warnings
        );
    }
    // A non-zero --healthz-port leaves the address alone, as upstream; 0 disables.
    assert_eq!(loaded.config.healthz_bind_address, addr("0.0.0.0:10256"));
    let off = flags_only(&["--healthz-port=0", "--metrics-port=0"]).unwrap();
    assert_eq!(off.config.healthz_bind_address, None);
    assert_eq!(off.config.metrics_bind_address, None);
}

#[test]
fn init_only_and_bind_address_hard_fail_are_read() {
    let loaded = flags_only(&["--init-only", "--bind-address-hard-fail"]).unwrap();
    assert!(loaded.config.init_only);
    assert!(loaded.config.bind_address_hard_fail);
    assert!(!flags_only(&[]).unwrap().config.init_only);
}

#[test]
fn underscores_in_flag_names_read_as_dashes_but_values_keep_them() {
    let loaded = flags_only(&["--hostname_override=node_a", "--proxy_mode", "nftables"]).unwrap();
    assert_eq!(loaded.config.hostname.as_deref(), Some("node_a"));
    assert_eq!(loaded.config.mode, ProxyMode::Nftables);
}

#[test]
fn the_ebpf_map_sizes_default_for_30k_services_and_come_from_the_file_or_the_flags() {
    // 30,000 Services with 10 endpoints: a frontend and ten slots each, ten backends each.
    let c = flags_only(&["--proxy-mode=ebpf"]).unwrap();
    assert!(c.config.ebpf.services_map_max >= 30_000 * 11);
    assert!(c.config.ebpf.backends_map_max >= 30_000 * 10);
    assert_eq!(
        c.config.ebpf,
        Ebpf {
            services_map_max: types::DEFAULT_EBPF_SERVICES_MAP_MAX,
            backends_map_max: types::DEFAULT_EBPF_BACKENDS_MAP_MAX,
            affinity_map_max: types::DEFAULT_EBPF_AFFINITY_MAP_MAX,
            conntrack_map_max: types::DEFAULT_EBPF_CONNTRACK_MAP_MAX,
        }
    );
    // The defaults are written out with the rest of the effective configuration.
    assert_eq!(
        c.effective.ebpf.services_map_max,
        Some(types::DEFAULT_EBPF_SERVICES_MAP_MAX)
    );

    let yaml = file(
        "mode: ebpf\nebpf:\n  servicesMapMax: 1000\n  backendsMapMax: 2000\n  \
         affinityMapMax: 3000\n  conntrackMapMax: 4000\n",
    );
    let c = with_file(&yaml, &[]).unwrap().config;
    assert_eq!(
        c.ebpf,
        Ebpf {
            services_map_max: 1000,
            backends_map_max: 2000,
            affinity_map_max: 3000,
            conntrack_map_max: 4000,
        }
    );
    // A flag overrides its field only.
    let c = with_file(&yaml, &["--bpf-services-map-max=5000"])
        .unwrap()
        .config;
    assert_eq!(
        (c.ebpf.services_map_max, c.ebpf.backends_map_max),
        (5000, 2000)
    );
    let c = flags_only(&[
        "--bpf-backends-map-max=7",
        "--bpf-affinity-map-max=8",
        "--bpf-conntrack-map-max=9",
    ])
    .unwrap()
    .config;
    assert_eq!(
        (
            c.ebpf.backends_map_max,
            c.ebpf.affinity_map_max,
            c.ebpf.conntrack_map_max
        ),
        (7, 8, 9)
    );
    // A null section gets the defaults, as every section does.
    let c = with_file(&file("ebpf: null\n"), &[]).unwrap().config;
    assert_eq!(
        c.ebpf.conntrack_map_max,
        types::DEFAULT_EBPF_CONNTRACK_MAP_MAX
    );
}

#[test]
fn an_ebpf_map_size_of_zero_or_an_unknown_ebpf_field_is_an_error() {
    assert_eq!(
        invalid_fields(with_file(&file("ebpf:\n  servicesMapMax: 0\n"), &[])),
        ["ebpf.servicesMapMax"]
    );
    // clap refuses 0 and negative values before the file is merged.
    assert!(is_cli_error(&flags_only(&["--bpf-services-map-max=0"])));
    assert!(is_cli_error(&flags_only(&["--bpf-conntrack-map-max=-1"])));
    match with_file(&file("ebpf:\n  lbMapMax: 10\n"), &[]) {
        Err(ConfigError::Parse { message, .. }) => {
            assert!(message.contains("lbMapMax"), "{message}")
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    // Negative sizes in the file do not parse either.
    assert!(with_file(&file("ebpf:\n  backendsMapMax: -5\n"), &[]).is_err());
}
