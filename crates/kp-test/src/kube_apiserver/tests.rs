use super::*;
use crate::cluster::{cluster_ip, ChangeStream};

/// The tests that start API servers run one at a time: `stop_all` stops every server this
/// process started, another test's too (CI once saw 3 where this module's test started 2).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Starts a real API server, or says loudly why this machine cannot.
fn start_or_skip(test: &str) -> Option<KubeApiServer> {
    if let Some(why) = unavailable() {
        eprintln!("SKIPPED {test}: no real API server here: {why}");
        return None;
    }
    Some(KubeApiServer::start().expect("the API server starts"))
}

#[test]
fn a_small_cluster_loads_lists_back_and_the_server_stops_on_drop() {
    let _serial = serial();
    let Some(server) =
        start_or_skip("a_small_cluster_loads_lists_back_and_the_server_stops_on_drop")
    else {
        return;
    };
    let (dir, port) = (server.dir().to_path_buf(), server.port());
    assert!(server.admin_kubeconfig().is_file());
    assert!(server.kube_proxy_kubeconfig().is_file());

    let cluster = Cluster::new(30, 3);
    let loaded = server.load_cluster(&cluster).expect("the cluster loads");
    // The Namespace, the Node, 30 Services and 30 slices.
    assert_eq!(loaded.objects, 62);
    // The Node's addresses and the LoadBalancers' (5% of 30: Services 10-14) ingress.
    assert_eq!(loaded.statuses, 1 + 5);
    assert_eq!(server.count("Service", Some(NAMESPACE)).unwrap(), 30);
    assert_eq!(server.count("EndpointSlice", Some(NAMESPACE)).unwrap(), 30);
    assert_eq!(server.count("Node", None).unwrap(), 1);
    // The API server's own `kubernetes` Service is there too, outside the generated range.
    let kubernetes = server
        .get("Service", Some("default"), "kubernetes")
        .unwrap();
    assert_eq!(kubernetes["spec"]["clusterIP"], "10.96.0.1");

    let svc = server
        .get("Service", Some(NAMESPACE), &Cluster::service_name(0))
        .unwrap();
    assert_eq!(svc["spec"]["clusterIP"], cluster_ip(0).to_string());
    assert_eq!(svc["spec"]["type"], "NodePort");
    assert_eq!(svc["spec"]["ports"][0]["nodePort"], 30000);
    // What a real server adds, that the fake does not.
    assert!(svc["metadata"]["managedFields"].is_array());
    let lb = server
        .get("Service", Some(NAMESPACE), &Cluster::service_name(10))
        .unwrap();
    assert_eq!(
        lb["status"]["loadBalancer"]["ingress"],
        cluster.service_json(10)["status"]["loadBalancer"]["ingress"]
    );
    let node = server.get("Node", None, crate::cluster::NODE_NAME).unwrap();
    assert_eq!(node["status"]["addresses"][0]["address"], "192.0.2.1");

    // A change replaces the slice; reading it back shows the new endpoint.
    let mut stream = ChangeStream::new(&cluster);
    let change = stream.next_change();
    let before = server
        .get(
            "EndpointSlice",
            Some(NAMESPACE),
            &Cluster::slice_name(change.service),
        )
        .unwrap();
    let version = server.replace(&change.slice).unwrap();
    let after = server
        .get(
            "EndpointSlice",
            Some(NAMESPACE),
            &Cluster::slice_name(change.service),
        )
        .unwrap();
    assert_eq!(after["metadata"]["resourceVersion"], version.as_str());
    assert_ne!(
        before["metadata"]["resourceVersion"],
        after["metadata"]["resourceVersion"]
    );
    assert_eq!(
        after["endpoints"][change.slot]["addresses"][0],
        change.new.to_string()
    );

    // The API server validates: a ClusterIP outside its range is refused.
    let mut outside = cluster.service_json(1);
    outside["metadata"]["name"] = json!("outside");
    outside["spec"]["clusterIP"] = json!("10.200.0.1");
    outside["spec"]["clusterIPs"] = json!(["10.200.0.1"]);
    let refused = server.load(vec![outside], 1).unwrap_err().to_string();
    assert!(refused.contains("outside"), "{refused}");

    drop(server);
    assert!(!dir.exists(), "{} is left behind", dir.display());
    assert!(free(port), "something still listens on 127.0.0.1:{port}");
}

#[test]
fn two_servers_run_side_by_side_on_their_own_ports() {
    let _serial = serial();
    let Some(a) = start_or_skip("two_servers_run_side_by_side_on_their_own_ports") else {
        return;
    };
    let b = KubeApiServer::start().expect("a second API server starts");
    assert_ne!(a.port(), b.port());
    assert_ne!(a.etcd_port(), b.etcd_port());
    assert_ne!(a.dir(), b.dir());
    a.load_cluster(&Cluster::new(2, 1)).unwrap();
    assert_eq!(a.count("Service", Some(NAMESPACE)).unwrap(), 2);
    // b holds nothing of a's.
    assert_eq!(b.count("Service", Some(NAMESPACE)).unwrap(), 0);
    assert_eq!(stop_all(), 2);
    assert!(!a.dir().exists() && !b.dir().exists());
}

#[test]
#[ignore = "needs root"]
fn a_namespace_reaches_the_server_through_the_bridge() {
    let _serial = serial();
    if !crate::require_root() {
        eprintln!("SKIPPED a_namespace_reaches_the_server_through_the_bridge: needs root");
        return;
    }
    let Some(server) = start_or_skip("a_namespace_reaches_the_server_through_the_bridge") else {
        return;
    };
    let ns = Netns::new("kapi").unwrap();
    ns.ip(&["link", "set", "lo", "up"]).unwrap();
    let url = format!("{}/readyz", server.url());
    let ca = server.ca_cert().display().to_string();
    let curl = |ns: &Netns| ns.run(&["curl", "-sS", "--max-time", "5", "--cacert", &ca, &url]);
    // Not reachable before the bridge: the namespace's loopback is its own.
    assert!(curl(&ns).is_err());
    let bridge = server.bridge_into(&ns).unwrap();
    assert_eq!(curl(&ns).unwrap().trim(), "ok");
    drop(bridge);
    assert!(curl(&ns).is_err());
}

#[test]
fn upstream_kube_proxy_unpacks_and_matches_its_digest() {
    let archive = k8s_dir().join(format!("kube-proxy-{UPSTREAM_VERSION}.xz"));
    if !archive.is_file() {
        eprintln!(
            "SKIPPED upstream_kube_proxy_unpacks_and_matches_its_digest: no {}",
            archive.display()
        );
        return;
    }
    let bin = upstream_kube_proxy().unwrap();
    let out = Command::new(&bin).arg("--version").output().unwrap();
    assert!(out.status.success());
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains(UPSTREAM_VERSION), "{version}");
    // Found in the cache the second time, and the same file.
    assert_eq!(upstream_kube_proxy().unwrap(), bin);
}
