use super::*;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Runs `body` on a runtime whose one thread has entered a network namespace this test creates
/// (and deletes on drop), so the test's traffic never crosses the machine's own loopback. Needs
/// root; `false` (after a loud message) when the test must be skipped.
fn in_own_netns<F, Fut>(tag: &str, body: F) -> bool
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()>,
{
    if !kp_test::netns::require_root() {
        return false;
    }
    let ns = kp_test::netns::Netns::new(tag).expect("a namespace of the test's own");
    kp_netlink::netns::run_in(ns.name(), tag, move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(body());
        Ok::<(), io::Error>(())
    })
    .expect("the test's thread ran in its namespace (a panic there is the test's failure)")
    .expect("a runtime");
    true
}

/// A relay on the namespace's loopback: returns the client's end, the endpoint's end, and the relay task.
async fn relayed(
    copying: Copying,
) -> (
    TcpStream,
    TcpStream,
    tokio::task::JoinHandle<Relayed>,
    Arc<AtomicU64>,
) {
    let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(front.local_addr().unwrap())
        .await
        .unwrap();
    let (accepted, _) = front.accept().await.unwrap();
    let to_endpoint = TcpStream::connect(back.local_addr().unwrap())
        .await
        .unwrap();
    let (endpoint, _) = back.accept().await.unwrap();
    let bytes = Arc::new(AtomicU64::new(0));
    let b = bytes.clone();
    let task = tokio::spawn(async move {
        relay(accepted, to_endpoint, copying, &|n| {
            b.fetch_add(n, Ordering::Relaxed);
        })
        .await
    });
    (client, endpoint, task, bytes)
}

/// Deterministic bytes, different at every offset modulo a prime.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

async fn half_close_keeps_the_answer(copying: Copying) {
    let (mut client, mut endpoint, task, bytes) = relayed(copying).await;
    let request = pattern(300_000, 7);
    let answer = pattern(500_000, 3);
    let server = tokio::spawn(async move {
        // The endpoint reads to the end of the request, then answers.
        let mut got = Vec::new();
        endpoint.read_to_end(&mut got).await.unwrap();
        endpoint.write_all(&pattern(500_000, 3)).await.unwrap();
        endpoint.shutdown().await.unwrap();
        got
    });
    client.write_all(&request).await.unwrap();
    client.shutdown().await.unwrap();
    let mut got = Vec::new();
    client.read_to_end(&mut got).await.unwrap();
    assert_eq!(server.await.unwrap(), request);
    assert!(got == answer, "answer differs ({} bytes)", got.len());
    let r = task.await.unwrap();
    assert_eq!(
        r,
        Relayed {
            upstream: 300_000,
            downstream: 500_000
        }
    );
    assert_eq!(bytes.load(Ordering::Relaxed), 800_000);
}

#[test]
#[ignore = "needs root"]
fn splice_relays_both_ways_after_the_client_half_closes() {
    in_own_netns("relay-splice", || {
        half_close_keeps_the_answer(Copying::Splice)
    });
}

#[test]
#[ignore = "needs root"]
fn copying_relays_both_ways_after_the_client_half_closes() {
    in_own_netns("relay-copy", || {
        half_close_keeps_the_answer(Copying::Buffer)
    });
}

#[test]
#[ignore = "needs root"]
fn a_reset_endpoint_resets_the_client_and_ends_the_relay() {
    in_own_netns("relay-reset", a_reset_endpoint_resets_the_client);
}

async fn a_reset_endpoint_resets_the_client() {
    let (mut client, endpoint, task, _) = relayed(Copying::Splice).await;
    client.write_all(b"hello").await.unwrap();
    crate::sys::reset_on_close(&endpoint).unwrap();
    drop(endpoint);
    let r = tokio::time::timeout(std::time::Duration::from_secs(5), task)
        .await
        .expect("relay ends")
        .unwrap();
    assert_eq!(r.downstream, 0);
    let mut buf = [0u8; 8];
    let read = client.read(&mut buf).await;
    assert!(
        matches!(&read, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
        "{read:?}"
    );
}
