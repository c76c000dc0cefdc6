//! UDP: one session per client address (and the local address its datagrams were redirected
//! to), to one endpoint, until it idles out.
//!
//! The first datagram of a session costs one ctnetlink GET: the conntrack entry whose reply
//! tuple is (the local address it arrived at, the proxy port) → (the client) holds the frontend
//! the client addressed as its original destination. Later datagrams go straight to the
//! session's connected socket. Replies leave the listener from the address the requests
//! arrived at (`IP_PKTINFO` source), so conntrack un-NATs them to the frontend's address.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kp_core::model::Protocol;
use kp_metrics::UserspacePortSeries;
use kp_userspace_plan::{Arrival, Outcome, Pick, RouteId, Source};
use tokio::io::Interest;
use tokio::net::UdpSocket;

use crate::shared::{Generation, Shared};
use crate::sys;

/// The largest datagram relayed.
const DATAGRAM: usize = 65_536;

/// One client's session.
struct Session {
    upstream: Arc<UdpSocket>,
    /// When the client last sent.
    last: Mutex<Instant>,
    /// The Service, and the syncs its pick had seen: a later sync of the Service makes the
    /// next datagram pick again.
    service: kp_core::model::ServiceKey,
    generation: Generation,
    /// Its Service port's metric series.
    series: UserspacePortSeries,
    /// Ends the session's reply task when the session is replaced.
    stop: tokio::sync::Notify,
}

type Sessions = Mutex<HashMap<(SocketAddr, IpAddr), Arc<Session>>>;

/// Receives until `stop` says so. `arrival`: how what this socket receives arrived
/// ([`Arrival::PodInterface`] on the pod port, [`Arrival::Other`] on the proxy port), as for
/// TCP ([`crate::tcp::serve`]).
pub async fn serve(
    listener: Arc<UdpSocket>,
    arrival: Arrival,
    shared: Arc<Shared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let sessions: Arc<Sessions> = Arc::new(Mutex::new(HashMap::new()));
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let mut buf = vec![0u8; DATAGRAM];
    loop {
        let got = tokio::select! {
            r = listener.async_io(Interest::READABLE, || sys::recv_with_local(&*listener, &mut buf)) => r,
            _ = stop.changed() => return,
        };
        let got = match got {
            Ok(g) => g,
            Err(e) => {
                tracing::debug!(error = %e, "UDP receive failed");
                continue;
            }
        };
        let data = &buf[..got.len];
        let key = (got.peer, got.local);
        let mut existing = lock(&sessions).get(&key).cloned();
        if let Some(s) = &existing {
            if shared.generation(&s.service) != s.generation {
                // Its Service changed since the pick (an endpoint removed, say): pick again.
                lock(&sessions).remove(&key);
                s.stop.notify_one();
                existing = None;
            }
        }
        let session = match existing {
            Some(s) => s,
            None => match open(
                &listener,
                &shared,
                &sessions,
                (got.peer, arrival),
                got.local,
                port,
            )
            .await
            {
                Some(s) => s,
                None => continue,
            },
        };
        *lock(&session.last) = Instant::now();
        // Waits only while the socket's buffer is full (or its readiness is not known yet, on a
        // fresh socket).
        match session.upstream.send(data).await {
            Ok(n) => {
                shared.metrics.userspace_bytes_relayed.inc_by(n as u64);
                session.series.bytes_relayed.inc_by(n as u64);
            }
            Err(e) => tracing::debug!(error = %e, "UDP send to the endpoint failed"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Opens a session for `peer`'s datagrams that arrived at `local` (by `arrival`, the
/// listener's): finds the frontend, picks
/// the endpoint, connects a socket to it and starts returning its replies.
async fn open(
    listener: &Arc<UdpSocket>,
    shared: &Arc<Shared>,
    sessions: &Arc<Sessions>,
    (peer, arrival): (SocketAddr, Arrival),
    local: IpAddr,
    port: u16,
) -> Option<Arc<Session>> {
    let here = SocketAddr::new(local, port);
    // A netlink exchange of a few microseconds; blocking the loop for it is cheaper than a
    // thread hop.
    let frontend = match kp_conntrack::Conntrack::new().get_by_reply(Protocol::Udp, here, peer) {
        Ok(Some(entry)) => SocketAddr::new(entry.orig_dst, entry.orig_dport),
        Ok(None) => {
            tracing::debug!(%peer, %here, "no conntrack entry for a UDP datagram; ignoring it");
            return None;
        }
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot look up a UDP datagram's frontend");
            return None;
        }
    };
    let arrival = shared.arrival(peer.ip(), arrival);
    // The pick, the generation it was made in and its Service port's series, under one lock
    // (see `Shared::synced` and `Shared::port_series`).
    let (pick, generation, series) = {
        let mut balancer = shared.balancer();
        let pick = balancer.pick_via(Protocol::Udp, frontend, peer, arrival, Instant::now());
        let (generation, series) = match &pick {
            Pick::Connect { route, .. } => (
                shared.generation(&route.service_port.service),
                Some(shared.port_series(&route.service_port)),
            ),
            _ => ((0, 0), None),
        };
        (pick, generation, series)
    };
    let (Pick::Connect { route, attempts }, Some(series)) = (pick, series) else {
        return None;
    };
    // UDP has no handshake to refuse: the first attempt is the session's endpoint.
    let attempt = *attempts.first()?;
    let upstream = match connect(attempt.endpoint, attempt.source, peer).await {
        Ok(s) => Arc::new(s),
        Err(e) => {
            tracing::debug!(endpoint = %attempt.endpoint, error = %e, "cannot open a UDP session");
            shared
                .balancer()
                .report(&route, attempt.endpoint, Outcome::Refused, Instant::now());
            shared.metrics.userspace_connect_failures.inc();
            series.connect_failures.inc();
            return None;
        }
    };
    shared
        .balancer()
        .report(&route, attempt.endpoint, Outcome::Connected, Instant::now());
    let session = Arc::new(Session {
        upstream,
        last: Mutex::new(Instant::now()),
        service: route.service_port.service.clone(),
        generation,
        series,
        stop: tokio::sync::Notify::new(),
    });
    lock(sessions).insert((peer, local), session.clone());
    shared.udp_session_started();
    shared.metrics.userspace_udp_sessions.inc();
    shared.metrics.userspace_udp_sessions_created.inc();
    session.series.udp_sessions.inc();
    session.series.udp_sessions_created.inc();
    tokio::spawn(replies(
        listener.clone(),
        shared.clone(),
        sessions.clone(),
        session.clone(),
        (peer, local),
        route,
        attempt.endpoint,
    ));
    Some(session)
}

/// A socket connected to `endpoint`, from the node or from the client's address.
async fn connect(
    endpoint: SocketAddr,
    source: Source,
    client: SocketAddr,
) -> std::io::Result<UdpSocket> {
    let bind: SocketAddr = match (source, endpoint) {
        (Source::Client, _) if client.is_ipv4() == endpoint.is_ipv4() => {
            SocketAddr::new(client.ip(), 0)
        }
        (_, SocketAddr::V4(_)) => "0.0.0.0:0".parse().map_err(std::io::Error::other)?,
        (_, SocketAddr::V6(_)) => "[::]:0".parse().map_err(std::io::Error::other)?,
    };
    let fd = sys::bound_socket(bind, nix::sys::socket::SockType::Datagram, |fd| {
        if source == Source::Client {
            sys::set_transparent(fd)?;
        }
        Ok(())
    })?;
    let socket = UdpSocket::from_std(std::net::UdpSocket::from(fd))?;
    socket.connect(endpoint).await?;
    Ok(socket)
}

thread_local! {
    /// The buffer replies pass through: one per runtime thread, not one per session.
    static REPLY: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(vec![0u8; DATAGRAM]);
}

/// Sends every reply queued on `upstream` to the client `key.0`, from local address `key.1`;
/// the bytes sent. A reply the listener cannot take at once is dropped, as a full socket
/// buffer drops datagrams.
fn relay_replies(
    listener: &UdpSocket,
    upstream: &UdpSocket,
    key: (SocketAddr, IpAddr),
) -> std::io::Result<u64> {
    REPLY.with(|buf| {
        let mut buf = buf.borrow_mut();
        let mut sent = 0u64;
        loop {
            let n = match upstream.try_recv(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(sent),
                Err(e) => return Err(e),
            };
            match sys::send_from(listener, &buf[..n], key.1, key.0) {
                Ok(m) => sent += m as u64,
                Err(e) => tracing::debug!(error = %e, "UDP reply to the client dropped"),
            }
        }
    })
}

/// Returns the endpoint's replies to the client until the session idles out.
async fn replies(
    listener: Arc<UdpSocket>,
    shared: Arc<Shared>,
    sessions: Arc<Sessions>,
    session: Arc<Session>,
    key: (SocketAddr, IpAddr),
    route: RouteId,
    endpoint: SocketAddr,
) {
    let timeout = shared.udp_timeout;
    loop {
        let idle_for = lock(&session.last).elapsed();
        // The session idles out when neither side sent for the whole timeout.
        let Some(wait) = timeout.checked_sub(idle_for).filter(|w| !w.is_zero()) else {
            break;
        };
        let ready = tokio::select! {
            r = tokio::time::timeout(wait, session.upstream.readable()) => r,
            _ = session.stop.notified() => break,
        };
        let relayed = match ready {
            Err(_) => continue,
            Ok(Ok(())) => relay_replies(&listener, &session.upstream, key),
            Ok(Err(e)) => Err(e),
        };
        match relayed {
            Ok(0) => {}
            Ok(bytes) => {
                *lock(&session.last) = Instant::now();
                shared.metrics.userspace_bytes_relayed.inc_by(bytes);
                session.series.bytes_relayed.inc_by(bytes);
            }
            Err(e) => {
                // ECONNREFUSED: the endpoint's port is closed (ICMP unreachable).
                tracing::debug!(%endpoint, error = %e, "UDP endpoint failed");
                shared
                    .balancer()
                    .report(&route, endpoint, Outcome::Refused, Instant::now());
                break;
            }
        }
    }
    let mut map = lock(&sessions);
    if map.get(&key).is_some_and(|s| Arc::ptr_eq(s, &session)) {
        map.remove(&key);
    }
    drop(map);
    shared.udp_session_ended();
    shared.metrics.userspace_udp_sessions.dec();
    session.series.udp_sessions.dec();
    shared
        .balancer()
        .report(&route, endpoint, Outcome::Closed, Instant::now());
}
