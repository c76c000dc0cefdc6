//! What the kernel test files share: the proxy as the flow table expects it, a one-port
//! Service's objects, and the concurrent-connections check (run on the host with what its
//! open-file limit allows, and in the kp-vm guest with 10k).

// Each test file uses its own part of this module.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::track::{Changes, Object, ProxyState};
use kp_metrics::Metrics;
use kp_test::lab::Lab;
use kp_userspace::{UserspaceConfig, UserspaceDataplane};
use kp_userspace_plan::BalancerConfig;

/// The settings the flow table expects: detect-local by the cluster CIDRs of both families.
pub fn config() -> UserspaceConfig {
    let defaults = UserspaceConfig::default();
    UserspaceConfig {
        balancer: BalancerConfig {
            detect_local: kp_core::node::DetectLocal::ClusterCidr(vec![
                kp_flows::CLUSTER_CIDR.parse().unwrap(),
                kp_flows::CLUSTER_CIDR6.parse().unwrap(),
            ]),
            ..defaults.balancer
        },
        // As the nftables mode's kernel test: NodePorts on the primary address only.
        node_ports: kp_core::node::NodePortAddresses::Primary,
        // The tests stop the proxy with its table in place (nobody takes over): a short drain.
        drain: Duration::from_millis(300),
        ..defaults
    }
}

/// A started proxy in `lab`'s node, synced with `state`.
pub fn proxy(lab: &Lab, state: &ProxyState) -> (UserspaceDataplane, Arc<Metrics>) {
    let metrics = Arc::new(Metrics::new());
    let mut dp = UserspaceDataplane::new(config(), Some(lab.node().name()), metrics.clone());
    dp.start().expect("start");
    let report = dp
        .sync(state, &Changes::default(), true)
        .expect("first sync");
    assert!(report.full);
    (dp, metrics)
}

/// A Service `name` at `vip`, port `port` → `target` of `protocol`, with endpoints at the
/// given pods of `lab`.
pub fn service_objects(
    lab: &Lab,
    name: &str,
    vip: &str,
    protocol: &str,
    (port, target): (u16, u16),
    pods: &[usize],
) -> (Object, Object) {
    let service = serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"clusterIP": vip, "ports": [
            {"name": "p", "protocol": protocol, "port": port, "targetPort": target}]},
    });
    let endpoints: Vec<_> = pods
        .iter()
        .map(|&i| {
            serde_json::json!({"addresses": [lab.pod_ip(i).to_string()],
                "conditions": {"ready": true}, "nodeName": kp_flows::NODE})
        })
        .collect();
    let slice = serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-abcde"), "namespace": "default",
            "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "p", "protocol": protocol, "port": target}],
        "endpoints": endpoints,
    });
    (
        Object::Service(Box::new(serde_json::from_value(service).unwrap())),
        Object::EndpointSlice(Box::new(serde_json::from_value(slice).unwrap())),
    )
}

/// How long each phase of [`relay_concurrently`] took.
#[derive(Debug)]
pub struct Phases {
    /// Lab, server and proxy up.
    pub setup: Duration,
    /// Every client connection open (handshakes with the proxy done).
    pub connect: Duration,
    /// From then until every relay was active at once (the proxy's own handshakes with the
    /// endpoint).
    pub all_active: Duration,
    /// Every connection's payload sent, echoed and checked.
    pub exchange: Duration,
    /// Every connection closed and every relay ended.
    pub close: Duration,
}

/// What one connection sends and gets back: its own index, so a byte delivered to the wrong
/// connection shows.
const PAYLOAD: usize = 8;

/// Opens `concurrent` connections from the lab's client to one Service whose one endpoint
/// echoes and holds each connection, checks that all of them are relayed at the same time
/// (the proxy's active-connections gauge reaches `concurrent`, within `patience`), that every
/// connection gets its own payload back, and that every relay ends when the clients close.
/// Needs about four descriptors per connection (client, server and proxy share the process).
pub fn relay_concurrently(concurrent: usize, patience: Duration) -> Phases {
    let t = Instant::now();
    let lab = Lab::new(1).expect("lab");
    let (svc, slice) = service_objects(&lab, "many", "10.96.100.100", "TCP", (80, 9000), &[0]);
    let state = kp_flows::load(kp_flows::NODE, vec![svc, slice]);
    let (mut dp, metrics) = proxy(&lab, &state);

    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let pod = lab.pod(0).name().to_string();
    // The server echoes each connection's payload, then holds it until the client closes.
    let server = std::thread::spawn(move || {
        kp_netlink::netns::run_in(&pod, "many-server", move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
                socket
                    .bind("0.0.0.0:9000".parse().unwrap())
                    .map_err(|e| e.to_string())?;
                let l = socket.listen(4096).map_err(|e| e.to_string())?;
                let _ = ready_tx.send(());
                let mut tasks = tokio::task::JoinSet::new();
                for _ in 0..concurrent {
                    let (mut s, _) = l.accept().await.map_err(|e| e.to_string())?;
                    tasks.spawn(async move {
                        let mut b = [0u8; PAYLOAD];
                        s.read_exact(&mut b).await?;
                        s.write_all(&b).await?;
                        let mut rest = Vec::new();
                        s.read_to_end(&mut rest).await?;
                        Ok::<_, std::io::Error>(rest.is_empty())
                    });
                }
                let mut ok = 0;
                while let Some(r) = tasks.join_next().await {
                    ok += usize::from(matches!(r, Ok(Ok(true))));
                }
                Ok::<_, String>(ok)
            })
        })
    });
    ready_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("server ready");
    let setup = t.elapsed();
    let m = metrics.clone();
    let client = kp_netlink::netns::run_in(lab.client().name(), "many-client", move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let vip: std::net::SocketAddr = "10.96.100.100:80".parse().unwrap();
            // Open them all (a thousand handshakes in flight at a time), keep them open.
            let t = Instant::now();
            let mut open = Vec::with_capacity(concurrent);
            while open.len() < concurrent {
                let mut batch = tokio::task::JoinSet::new();
                for _ in 0..1000.min(concurrent - open.len()) {
                    batch.spawn(tokio::net::TcpStream::connect(vip));
                }
                while let Some(r) = batch.join_next().await {
                    open.push(r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?);
                }
            }
            let connect = t.elapsed();
            // Every relay is up at the same time.
            let t = Instant::now();
            while m.userspace_active_connections.get() < concurrent as i64 {
                if t.elapsed() > patience {
                    return Err(format!(
                        "only {} of {concurrent} relays active after {patience:?}",
                        m.userspace_active_connections.get()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let all_active = t.elapsed();
            // Every payload out first, then every answer read: the round trips overlap.
            let t = Instant::now();
            for (i, s) in open.iter_mut().enumerate() {
                s.write_all(&(i as u64).to_le_bytes())
                    .await
                    .map_err(|e| format!("write {i}: {e}"))?;
            }
            let mut answered = 0;
            for (i, s) in open.iter_mut().enumerate() {
                let mut back = [0u8; PAYLOAD];
                s.read_exact(&mut back)
                    .await
                    .map_err(|e| format!("read {i}: {e}"))?;
                answered += usize::from(u64::from_le_bytes(back) == i as u64);
            }
            let exchange = t.elapsed();
            Ok::<_, String>((answered, connect, all_active, exchange))
        })
    })
    .expect("client namespace");
    let (answered, connect, all_active, exchange) = client.expect("client");
    assert_eq!(
        answered, concurrent,
        "connections that got their own bytes back"
    );
    // The clients closed (their runtime ended): every server task saw the end, every relay
    // ends.
    let t = Instant::now();
    let server = server
        .join()
        .expect("server thread")
        .expect("server namespace");
    assert_eq!(server, Ok(concurrent), "server connections closed cleanly");
    while metrics.userspace_active_connections.get() > 0 {
        assert!(
            t.elapsed() < patience,
            "{} relays still active after the clients closed",
            metrics.userspace_active_connections.get()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let close = t.elapsed();
    assert_eq!(metrics.userspace_connections.get(), concurrent as u64);
    // The Service port's own series counted every one of them too.
    let text = metrics.encode();
    let own = format!(
        "kubeproxy_rs_userspace_service_port_connections_total{{service_port=\"default/many:p\"}} {concurrent}\n"
    );
    assert!(text.contains(&own), "{own} not in:\n{text}");
    // Each payload once each way, nothing else.
    assert_eq!(
        metrics.userspace_bytes_relayed.get(),
        (2 * PAYLOAD * concurrent) as u64
    );
    dp.shutdown();
    dp.cleanup().expect("cleanup");
    Phases {
        setup,
        connect,
        all_active,
        exchange,
        close,
    }
}
