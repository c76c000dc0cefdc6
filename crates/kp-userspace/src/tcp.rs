//! TCP: accept on the proxy port, recover the frontend the client addressed, ask the balancer,
//! connect to the endpoints in order until one answers, and relay.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::model::Protocol;
use kp_userspace_plan::{Arrival, Attempt, Outcome, Pick, Source};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

use crate::relay;
use crate::shared::Shared;
use crate::sys;

/// Upstream's userspace proxy's connect timeouts: the first attempt waits 250 ms, the next
/// 500 ms, then 1 s, then 2 s for every later one.
pub const CONNECT_TIMEOUTS: [Duration; 4] = [
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(2),
];

/// The timeout of attempt `i` (0-based).
pub fn connect_timeout(i: usize) -> Duration {
    CONNECT_TIMEOUTS[i.min(CONNECT_TIMEOUTS.len() - 1)]
}

/// Accepts until `stop` says so; each connection is handled on a task of its own. `arrival`:
/// how what this listener accepts arrived ([`Arrival::PodInterface`] on the pod port,
/// [`Arrival::Other`] on the proxy port); a connection from the node's own address is the
/// node's wherever it was accepted.
pub async fn serve(
    listener: TcpListener,
    arrival: Arrival,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    let shared = shared.clone();
                    tokio::spawn(async move { handle(stream, peer, arrival, shared).await });
                }
                Err(e) => {
                    // EMFILE and friends: wait a moment instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = stop.changed() => return,
        }
    }
}

/// Closes `s` with a reset, as a kernel REJECT of TCP would answer.
fn reset(s: TcpStream) {
    let _ = sys::reset_on_close(&s);
    drop(s);
}

async fn handle(client: TcpStream, peer: SocketAddr, arrival: Arrival, shared: Arc<Shared>) {
    let local = match client.local_addr() {
        Ok(l) => l,
        Err(_) => return,
    };
    let frontend = match sys::original_dst(&client, local) {
        Ok(d) => d,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "no original destination; closing");
            return reset(client);
        }
    };
    let arrival = shared.arrival(peer.ip(), arrival);
    // The pick and its Service port's series under one lock (see `Shared::port_series`).
    let (pick, series) = {
        let mut balancer = shared.balancer();
        let pick = balancer.pick_via(Protocol::Tcp, frontend, peer, arrival, Instant::now());
        let series = match &pick {
            Pick::Connect { route, .. } => Some(shared.port_series(&route.service_port)),
            _ => None,
        };
        (pick, series)
    };
    let (route, attempts, series) = match (pick, series) {
        (Pick::Connect { route, attempts }, Some(series)) => (route, attempts, series),
        // Dropping a TCP connection already accepted: close it without an answer.
        _ => return reset(client),
    };
    shared.metrics.userspace_connections.inc();
    series.connections.inc();
    let mut connected = None;
    for (i, attempt) in attempts.iter().enumerate() {
        if i > 0 {
            shared.metrics.userspace_connect_retries.inc();
            series.connect_retries.inc();
        }
        let outcome = match connect(attempt, peer, connect_timeout(i)).await {
            Ok(s) => {
                connected = Some((s, attempt.endpoint));
                Outcome::Connected
            }
            Err(e) if e.kind() == io::ErrorKind::TimedOut => Outcome::TimedOut,
            Err(e) => {
                tracing::debug!(endpoint = %attempt.endpoint, error = %e, "endpoint refused");
                Outcome::Refused
            }
        };
        shared
            .balancer()
            .report(&route, attempt.endpoint, outcome, Instant::now());
        if connected.is_some() {
            break;
        }
        shared.metrics.userspace_connect_failures.inc();
        series.connect_failures.inc();
    }
    let Some((upstream, endpoint)) = connected else {
        tracing::debug!(%frontend, %peer, "every endpoint failed; resetting the client");
        shared.metrics.userspace_connections_failed.inc();
        series.connections_failed.inc();
        return reset(client);
    };
    let _ = upstream.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let guard = shared.relay_started(&series);
    let bytes = shared.metrics.userspace_bytes_relayed.clone();
    relay::relay(client, upstream, shared.copying, &|n| {
        bytes.inc_by(n);
        series.bytes_relayed.inc_by(n);
    })
    .await;
    drop(guard);
    shared
        .balancer()
        .report(&route, endpoint, Outcome::Closed, Instant::now());
}

/// Opens a connection for `attempt`: from the node (a plain socket) or from the client's
/// address (a transparent socket bound to it, port chosen by the kernel).
async fn connect(
    attempt: &Attempt,
    client: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let socket = match attempt.endpoint {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    if attempt.source == Source::Client && client.is_ipv4() == attempt.endpoint.is_ipv4() {
        sys::set_transparent(&socket)?;
        socket.bind(SocketAddr::new(client.ip(), 0))?;
    }
    match tokio::time::timeout(timeout, socket.connect(attempt.endpoint)).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("no answer from {} in {timeout:?}", attempt.endpoint),
        )),
    }
}
