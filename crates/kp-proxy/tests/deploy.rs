//! The manifests in `deploy/`: each parses as the Kubernetes object it claims to be, the
//! kustomization lists exactly them, the DaemonSet starts the binary the way kubeadm starts
//! kube-proxy, and the configuration it mounts loads through our loader with the DaemonSet's own
//! arguments, unedited. Also the kubeadm drop-in: kubeadm's arguments with the
//! `KubeProxyConfiguration` kubeadm writes.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, PodSpec, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kp_proxy::config::{load_with, Loaded, ProxyMode};
use serde::Deserialize;

/// kubeadm's kube-proxy container command (kubeadm's `KubeProxyDaemonSet19` manifest).
const KUBEADM_COMMAND: [&str; 3] = [
    "/usr/local/bin/kube-proxy",
    "--config=/var/lib/kube-proxy/config.conf",
    "--hostname-override=$(NODE_NAME)",
];

/// The node name the kubelet would put in `NODE_NAME` (spec.nodeName).
const NODE: &str = "worker-1";

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct TypeMeta {
    api_version: String,
    kind: String,
}

#[derive(Deserialize)]
struct Kustomization {
    #[serde(rename = "apiVersion")]
    api_version: String,
    kind: String,
    resources: Vec<String>,
}

/// Every manifest of deploy/ (file name, text), the kustomization excluded.
fn manifests() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(deploy_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == "kustomization.yaml" {
            continue;
        }
        assert!(
            name.ends_with(".yaml"),
            "{name}: deploy/ holds only .yaml manifests"
        );
        out.push((name, std::fs::read_to_string(&path).unwrap()));
    }
    out.sort();
    out
}

/// The one manifest of `kind`, parsed as `T`.
fn object<T: for<'de> Deserialize<'de>>(kind: &str) -> T {
    let mut found = manifests().into_iter().filter(|(_, text)| {
        serde_saphyr::from_str::<TypeMeta>(text).is_ok_and(|meta| meta.kind == kind)
    });
    let (name, text) = found
        .next()
        .unwrap_or_else(|| panic!("no {kind} in deploy/"));
    assert!(found.next().is_none(), "more than one {kind} in deploy/");
    serde_saphyr::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn pod_spec(ds: &DaemonSet) -> &PodSpec {
    ds.spec.template.spec.as_ref().expect("a pod spec")
}

fn container(spec: &PodSpec) -> &Container {
    assert_eq!(spec.containers.len(), 1, "one container");
    &spec.containers[0]
}

/// The kubelet's `$(VAR)` expansion of a command, with the container's environment (values, and
/// `fieldRef: spec.nodeName` as the node's name).
fn expand(arg: &str, c: &Container) -> String {
    let mut out = arg.to_owned();
    for var in c.env.iter().flatten() {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => v.clone(),
            (None, Some(from)) => {
                let field = from.field_ref.as_ref().expect("a fieldRef");
                assert_eq!(field.field_path, "spec.nodeName");
                NODE.to_owned()
            }
            (None, None) => String::new(),
        };
        out = out.replace(&format!("$({})", var.name), &value);
    }
    out
}

/// Reads `path` the way the container sees it: through the volume mount that holds it, from
/// the ConfigMap that volume projects.
fn read_in_container(
    path: &Path,
    spec: &PodSpec,
    config_map: &ConfigMap,
) -> std::io::Result<String> {
    let c = container(spec);
    for mount in c.volume_mounts.iter().flatten() {
        let Ok(rest) = path.strip_prefix(&mount.mount_path) else {
            continue;
        };
        let volume = spec
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .unwrap_or_else(|| panic!("mount {} has no volume", mount.name));
        let Some(source) = &volume.config_map else {
            continue;
        };
        assert_eq!(
            Some(&source.name),
            config_map.metadata.name.as_ref(),
            "the volume projects deploy/'s ConfigMap"
        );
        let key = rest.to_string_lossy();
        return config_map
            .data
            .as_ref()
            .and_then(|d| d.get(key.as_ref()))
            .cloned()
            .ok_or_else(|| std::io::Error::other(format!("the ConfigMap has no key {key}")));
    }
    Err(std::io::Error::other(format!(
        "{} is on no ConfigMap volume",
        path.display()
    )))
}

/// Loads the configuration as the DaemonSet's container would, with `config_map` mounted.
fn load_as_daemonset(ds: &DaemonSet, config_map: &ConfigMap) -> Loaded {
    let spec = pod_spec(ds);
    let c = container(spec);
    let argv: Vec<String> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .map(|a| expand(a, c))
        .collect();
    load_with(argv, |path| read_in_container(path, spec, config_map))
        .unwrap_or_else(|e| panic!("the DaemonSet's configuration does not load: {e}"))
}

#[test]
fn the_kustomization_lists_every_manifest_and_each_parses() {
    let text = std::fs::read_to_string(deploy_dir().join("kustomization.yaml")).unwrap();
    let k: Kustomization = serde_saphyr::from_str(&text).unwrap();
    assert_eq!(k.api_version, "kustomize.config.k8s.io/v1beta1");
    assert_eq!(k.kind, "Kustomization");
    let listed: BTreeSet<String> = k.resources.into_iter().collect();
    let files: BTreeSet<String> = manifests().into_iter().map(|(name, _)| name).collect();
    assert_eq!(listed, files);

    let kinds: BTreeSet<String> = manifests()
        .iter()
        .map(|(name, text)| {
            let meta: TypeMeta =
                serde_saphyr::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
            let expected_api = match meta.kind.as_str() {
                "ServiceAccount" | "ConfigMap" => "v1",
                "ClusterRoleBinding" => "rbac.authorization.k8s.io/v1",
                "DaemonSet" => "apps/v1",
                other => panic!("{name}: unexpected kind {other}"),
            };
            assert_eq!(meta.api_version, expected_api, "{name}");
            meta.kind
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet",
            "ServiceAccount"
        ]
        .map(String::from)
        .into()
    );
    // Each parses as its full type, unknown fields and all.
    let _: ServiceAccount = object("ServiceAccount");
    let _: ClusterRoleBinding = object("ClusterRoleBinding");
    let _: ConfigMap = object("ConfigMap");
    let _: DaemonSet = object("DaemonSet");
}

#[test]
fn the_service_account_is_bound_to_system_node_proxier() {
    let sa: ServiceAccount = object("ServiceAccount");
    let binding: ClusterRoleBinding = object("ClusterRoleBinding");
    assert_eq!(binding.role_ref.kind, "ClusterRole");
    assert_eq!(binding.role_ref.name, "system:node-proxier");
    assert_eq!(
        binding.role_ref.api_group.as_deref(),
        Some("rbac.authorization.k8s.io")
    );
    let subjects = binding.subjects.unwrap_or_default();
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0].kind, "ServiceAccount");
    assert_eq!(Some(&subjects[0].name), sa.metadata.name.as_ref());
    assert_eq!(subjects[0].namespace, sa.metadata.namespace);

    let ds: DaemonSet = object("DaemonSet");
    assert_eq!(pod_spec(&ds).service_account_name, sa.metadata.name);
    assert_eq!(ds.metadata.namespace, sa.metadata.namespace);
}

#[test]
fn the_daemonset_runs_like_kubeadms_kube_proxy_with_every_modes_mounts() {
    let ds: DaemonSet = object("DaemonSet");
    let spec = pod_spec(&ds);
    let c = container(spec);
    assert_eq!(
        c.command.as_deref().unwrap_or_default(),
        KUBEADM_COMMAND.map(String::from)
    );
    assert!(c.args.as_ref().is_none_or(Vec::is_empty), "{:?}", c.args);

    let node_name = c
        .env
        .iter()
        .flatten()
        .find(|e| e.name == "NODE_NAME")
        .expect("NODE_NAME");
    let field = node_name.value_from.as_ref().unwrap().field_ref.as_ref();
    assert_eq!(field.unwrap().field_path, "spec.nodeName");

    assert_eq!(spec.host_network, Some(true));
    assert_eq!(
        spec.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none()),
        "tolerates everything: {tolerations:?}"
    );
    let security = c.security_context.as_ref().unwrap();
    assert_eq!(security.privileged, Some(true));
    let strategy = ds.spec.update_strategy.as_ref().unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"));

    // mount path -> (host path, read-only)
    let mounts: Vec<(String, Option<String>, bool)> = c
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            let volume = spec
                .volumes
                .iter()
                .flatten()
                .find(|v| v.name == m.name)
                .unwrap_or_else(|| panic!("mount {} has no volume", m.name));
            let host = volume.host_path.as_ref().map(|h| h.path.clone());
            (m.mount_path.clone(), host, m.read_only == Some(true))
        })
        .collect();
    let mount = |path: &str| {
        mounts
            .iter()
            .find(|(p, _, _)| p == path)
            .unwrap_or_else(|| panic!("no mount at {path}: {mounts:?}"))
    };
    let (_, host, ro) = mount("/run/xtables.lock");
    assert_eq!(host.as_deref(), Some("/run/xtables.lock"));
    assert!(!ro, "iptables must be able to take the lock");
    let (_, host, ro) = mount("/lib/modules");
    assert_eq!(host.as_deref(), Some("/lib/modules"));
    assert!(ro, "/lib/modules is read-only");
    let (_, host, _) = mount("/sys/fs/bpf");
    assert_eq!(host.as_deref(), Some("/sys/fs/bpf"));
    let (_, host, _) = mount("/sys/fs/cgroup");
    assert_eq!(host.as_deref(), Some("/sys/fs/cgroup"));
    let (_, host, _) = mount("/var/lib/kube-proxy");
    assert_eq!(host, &None, "the config comes from the ConfigMap");
}

#[test]
fn the_daemonsets_arguments_load_the_configmaps_config_unedited() {
    let ds: DaemonSet = object("DaemonSet");
    let config_map: ConfigMap = object("ConfigMap");
    let loaded = load_as_daemonset(&ds, &config_map);
    let config = &loaded.config;
    assert_eq!(config.hostname.as_deref(), Some(NODE));
    assert_eq!(
        config.config_file.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/config.conf"))
    );
    assert_eq!(config.mode, ProxyMode::Iptables);
    // In-cluster credentials: the ServiceAccount's token.
    assert_eq!(config.kubeconfig, None);
    assert_eq!(
        config.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        config.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert!(!config.cleanup && config.write_config_to.is_none() && !config.init_only);
}

#[test]
fn kubeadms_arguments_and_configuration_load_unedited() {
    // kubeadm's ConfigMap: config.conf as kubeadm writes it (every field, null and zero
    // values included), next to its kubeconfig.conf.
    let config_map: ConfigMap = serde_saphyr::from_str(&format!(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: kube-proxy-rs\n  namespace: kube-system\n\
         data:\n  config.conf: |-\n{}",
        include_str!("../src/config/fixtures/kubeadm.yaml")
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| format!("    {l}\n"))
            .collect::<String>()
    ))
    .unwrap();
    let mut ds: DaemonSet = object("DaemonSet");
    let spec = ds.spec.template.spec.as_mut().unwrap();
    spec.containers[0].command = Some(KUBEADM_COMMAND.map(String::from).to_vec());
    let loaded = load_as_daemonset(&ds, &config_map);
    let config = &loaded.config;
    assert_eq!(config.hostname.as_deref(), Some(NODE));
    assert_eq!(
        config.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(config.cluster_cidrs, ["10.244.0.0/16".parse().unwrap()]);
    assert_eq!(config.mode, ProxyMode::Iptables);
}
