//! The dataplane: a runtime in the node's namespace, the four listeners, the balancer, the
//! redirect table and the policy routing, behind [`Dataplane`].

use std::collections::HashSet;
use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kp_core::dataplane::{Dataplane, DataplaneError, SyncReport};
use kp_core::model::{Protocol, ServiceKey, ServicePortName};
use kp_core::node::{NodeContext, NodePortAddresses};
use kp_core::track::{Changes, ProxyState};
use kp_metrics::Metrics;
use kp_nftables::NftCommand;
use kp_userspace_plan::{Arrival, Balancer, BalancerConfig};
use tokio::net::{TcpListener, UdpSocket};
use tokio::runtime::Runtime;

use crate::relay::Copying;
use crate::routing::PolicyRouting;
use crate::shared::Shared;
use crate::table::Table;
use crate::{sys, tcp, udp, Error};

/// How often the balancer forgets expired affinity entries and quarantines.
const EXPIRE_EVERY: Duration = Duration::from_secs(1);
/// How often a stopping proxy checks whether its redirect rules still reach it.
const REACH_POLL: Duration = Duration::from_millis(100);
/// How long the TCP listeners keep accepting once the rules no longer reach the proxy: a
/// connection redirected just before may still be finishing its handshake.
const LINGER: Duration = Duration::from_millis(200);
/// The log line of a proxy that serves on after a stop (tests wait for it).
pub const SERVING_ON: &str = "stopping: serving on while the redirect rules send connections here";
/// The log line of a proxy that stopped accepting (tests wait for it).
pub const STOPPED_ACCEPTING: &str = "stopped accepting new connections";

/// Tries at a free port when the range is empty (another process may take the port between
/// the first listener and the last).
const PORT_TRIES: usize = 32;

/// The mode's settings.
#[derive(Clone, Debug)]
pub struct UserspaceConfig {
    /// The balancer's: scheduler, masquerading, detect-local, passive health.
    pub balancer: BalancerConfig,
    /// Where NodePorts answer.
    pub node_ports: NodePortAddresses,
    /// Ports the proxy may listen on (`--proxy-port-range`); `None` takes a free one.
    pub port_range: Option<RangeInclusive<u16>>,
    /// How long a UDP session lives without traffic (`--udp-timeout`).
    pub udp_timeout: Duration,
    /// How relays move bytes.
    pub copying: Copying,
    /// The mark and routing table of the transparent return path.
    pub routing: PolicyRouting,
    /// The longest a stopping proxy ([`UserspaceDataplane::shutdown`]) serves on, from the
    /// stop: it keeps accepting while its redirect rules send connections to it, then lets
    /// running relays and UDP sessions finish. Zero stops at once.
    pub drain: Duration,
    /// Whether a SIGTERM or SIGINT during the drain ends it at once (the binary, which already
    /// handles both signals; a library user's process keeps their default action).
    pub signal_ends_drain: bool,
}

impl Default for UserspaceConfig {
    fn default() -> Self {
        UserspaceConfig {
            balancer: BalancerConfig {
                scheduler: kp_userspace_plan::Scheduler::RoundRobin,
                masquerade_all: false,
                detect_local: kp_core::node::DetectLocal::None,
                quarantine: Duration::from_secs(10),
            },
            node_ports: NodePortAddresses::AllLocal,
            port_range: None,
            udp_timeout: Duration::from_millis(250),
            copying: Copying::Splice,
            routing: crate::routing::DEFAULT,
            drain: Duration::from_secs(10),
            signal_ends_drain: false,
        }
    }
}

/// The listening sockets: TCP and UDP, IPv4 and IPv6, on the proxy port, and with
/// detect-local by interface the same four on the pod port
/// ([`kp_userspace_plan::RedirectConfig::pod_port`]), where the redirect table sends what
/// arrives on the pods' interface(s).
pub struct Listeners {
    /// The proxy port.
    pub port: u16,
    /// The pod port, when bound: the proxy port's sibling.
    pub pod_port: Option<u16>,
    /// Each socket with how what it accepts arrived (the pod port's:
    /// [`Arrival::PodInterface`]).
    tcp: Vec<(std::net::TcpListener, Arrival)>,
    udp: Vec<(std::net::UdpSocket, Arrival)>,
}

/// The four sockets on one port.
struct PortSockets {
    port: u16,
    tcp: Vec<std::net::TcpListener>,
    udp: Vec<std::net::UdpSocket>,
}

impl Listeners {
    /// Binds TCP and UDP, IPv4 and IPv6, on one port of `range` (any free port when `None`),
    /// in the calling thread's network namespace, and with `pod_port` the same on its sibling,
    /// which must be free too (and in the range). A family the namespace does not have (IPv6
    /// disabled) is left out.
    pub fn bind(range: Option<&RangeInclusive<u16>>, pod_port: bool) -> Result<Listeners, Error> {
        match range {
            Some(r) => {
                for port in r.clone() {
                    let sibling = kp_userspace_plan::layout::pod_port(port);
                    if pod_port && !sibling.is_some_and(|p| r.contains(&p)) {
                        continue;
                    }
                    if let Ok(l) = Listeners::bind_port(port, pod_port) {
                        return Ok(l);
                    }
                }
                Err(Error::NoPort {
                    range: format!("{}-{}", r.start(), r.end()),
                })
            }
            None => {
                let mut last = None;
                for _ in 0..PORT_TRIES {
                    match Listeners::bind_port(0, pod_port) {
                        Ok(l) => return Ok(l),
                        Err(e) => last = Some(e),
                    }
                }
                Err(last.unwrap_or(Error::NoPort {
                    range: "any".into(),
                }))
            }
        }
    }

    /// All four on `port` (0: the kernel picks one), and with `pod_port` all four on its
    /// sibling too.
    fn bind_port(port: u16, pod_port: bool) -> Result<Listeners, Error> {
        let main = PortSockets::bind(port)?;
        let pod = match pod_port {
            false => None,
            true => {
                let sibling = kp_userspace_plan::layout::pod_port(main.port).ok_or_else(|| {
                    Error::NoPort {
                        range: format!("{} and the next", main.port),
                    }
                })?;
                Some(PortSockets::bind(sibling)?)
            }
        };
        let mut l = Listeners {
            port: main.port,
            pod_port: pod.as_ref().map(|p| p.port),
            tcp: Vec::new(),
            udp: Vec::new(),
        };
        for (sockets, arrival) in [Some(main), pod]
            .into_iter()
            .flatten()
            .zip([Arrival::Other, Arrival::PodInterface])
        {
            l.tcp.extend(sockets.tcp.into_iter().map(|t| (t, arrival)));
            l.udp.extend(sockets.udp.into_iter().map(|u| (u, arrival)));
        }
        Ok(l)
    }
}

impl PortSockets {
    /// All four on `port` (0: the kernel picks the first one's, and the rest follow).
    fn bind(port: u16) -> Result<PortSockets, Error> {
        let at = |ip: IpAddr, port| SocketAddr::new(ip, port);
        let v4 = at(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
        let fail = |addr| move |source| Error::Listen { addr, source };
        let tcp4 = listen_tcp(v4).map_err(fail(v4))?;
        let port = tcp4.local_addr().map_err(fail(v4))?.port();
        let v4 = at(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port);
        let v6 = at(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port);
        let udp4 = bind_udp(v4).map_err(fail(v4))?;
        let mut tcp = vec![tcp4];
        let mut udp = vec![udp4];
        match listen_tcp(v6).and_then(|t| Ok((t, bind_udp(v6)?))) {
            Ok((t, u)) => {
                tcp.push(t);
                udp.push(u);
            }
            Err(e)
                if e.raw_os_error() == Some(nix::libc::EAFNOSUPPORT)
                    || e.raw_os_error() == Some(nix::libc::EADDRNOTAVAIL) =>
            {
                tracing::warn!(error = %e, "no IPv6 in this namespace; proxying IPv4 only");
            }
            Err(source) => return Err(Error::Listen { addr: v6, source }),
        }
        Ok(PortSockets { port, tcp, udp })
    }
}

/// The backlog of the TCP listeners: every Service's new connections queue on one socket.
const BACKLOG: i32 = 4096;

/// A non-blocking listening-side socket of `kind` bound to `addr` (IPv6 only for an IPv6
/// address: IPv4 has its own sockets).
fn bound(
    addr: SocketAddr,
    kind: nix::sys::socket::SockType,
) -> std::io::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{self, SockType};
    sys::bound_socket(addr, kind, |fd| {
        if addr.is_ipv6() {
            sys::set_v6only(fd)?;
        }
        if kind == SockType::Stream {
            // A restarted proxy rebinds its port while old connections linger in TIME_WAIT.
            // Not for UDP, where it would let two sockets share the port.
            socket::setsockopt(fd, socket::sockopt::ReuseAddr, &true)?;
        }
        Ok(())
    })
}

/// A TCP listener on `addr` with [`BACKLOG`].
fn listen_tcp(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use nix::sys::socket::{self, Backlog, SockType};
    let fd = bound(addr, SockType::Stream)?;
    socket::listen(&fd, Backlog::new(BACKLOG).map_err(std::io::Error::from)?)?;
    Ok(std::net::TcpListener::from(fd))
}

/// A UDP socket on `addr` that reports each datagram's local address.
fn bind_udp(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    let fd = bound(addr, nix::sys::socket::SockType::Datagram)?;
    sys::set_recv_pktinfo(&fd, addr.is_ipv6())?;
    Ok(std::net::UdpSocket::from(fd))
}

/// Raises the soft limit of open files to the hard one, as Go's runtime does for upstream's
/// kube-proxy: each relayed TCP connection holds two descriptors (and a pipe's two more while
/// bytes are in flight), and a container's soft limit is often 1024.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => tracing::info!(from = soft, to = hard, "raised the open-file limit"),
            Err(e) => tracing::warn!(error = %e, soft, "cannot raise the open-file limit"),
        },
        _ => {}
    }
}

/// The userspace dataplane.
pub struct UserspaceDataplane {
    cfg: UserspaceConfig,
    netns: Option<String>,
    shared: Arc<Shared>,
    runtime: Option<Runtime>,
    /// Stops the TCP listeners.
    stop_tcp: Option<tokio::sync::watch::Sender<bool>>,
    /// Stops the UDP listeners (after the drain: they relay the open sessions until then).
    stop_udp: Option<tokio::sync::watch::Sender<bool>>,
    port: Option<u16>,
    /// The pod port, once started with detect-local by interface.
    pod_port: Option<u16>,
    table: Table,
    next_expire: Instant,
    /// SCTP Service ports already warned about (once each).
    sctp_warned: HashSet<ServicePortName>,
}

/// The SCTP ports of `keys` in `state` not in `warned` yet, now added to it: the proxy has no
/// SCTP socket, so the table rejects their frontends and each is worth one warning.
fn unwarned_sctp_ports<'a>(
    warned: &mut HashSet<ServicePortName>,
    state: &ProxyState,
    keys: impl Iterator<Item = &'a ServiceKey>,
) -> Vec<ServicePortName> {
    let mut out = Vec::new();
    for key in keys {
        for port in state.service_ports(key) {
            if port.name.protocol == Protocol::Sctp && warned.insert(port.name.clone()) {
                out.push(port.name.clone());
            }
        }
    }
    out
}

impl UserspaceDataplane {
    /// A dataplane that has bound and programmed nothing yet; `netns` is the namespace to
    /// proxy in (`None`: the process's own).
    pub fn new(cfg: UserspaceConfig, netns: Option<&str>, metrics: Arc<Metrics>) -> Self {
        let shared = Arc::new(Shared::new(
            Balancer::new(cfg.balancer.clone()),
            metrics.clone(),
            cfg.copying,
            cfg.udp_timeout,
        ));
        let nft = netns.map_or_else(NftCommand::new, NftCommand::in_netns);
        UserspaceDataplane {
            table: Table::new(
                nft,
                cfg.routing.mark,
                cfg.node_ports != NodePortAddresses::AllLocal,
            ),
            cfg,
            netns: netns.map(str::to_string),
            shared,
            runtime: None,
            stop_tcp: None,
            stop_udp: None,
            port: None,
            pod_port: None,
            next_expire: Instant::now() + EXPIRE_EVERY,
            sctp_warned: HashSet::new(),
        }
    }

    /// The proxy port, once started.
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// The pod port, once started with detect-local by interface: where the redirect table
    /// sends what arrives on the pods' interface(s).
    pub fn pod_port(&self) -> Option<u16> {
        self.pod_port
    }

    /// The last nft text sent (tests and debugging).
    pub fn last_transaction(&self) -> &str {
        self.table.last_transaction()
    }

    /// Runs `f` on one of the runtime's threads (in the proxy's namespace) and waits for it.
    fn on_runtime<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, Error> {
        let rt = self.runtime.as_ref().ok_or(Error::NotStarted)?;
        let (tx, rx) = std::sync::mpsc::channel();
        rt.spawn(async move {
            let _ = tx.send(f());
        });
        rx.recv()
            .map_err(|_| Error::Runtime("the proxy's runtime stopped".into()))
    }

    /// A runtime whose threads all enter the proxy's namespace before running anything.
    fn build_runtime(&self) -> Result<Runtime, Error> {
        let ns = match &self.netns {
            Some(name) => {
                let path =
                    kp_netlink::netns::path(name).map_err(|e| Error::Runtime(e.to_string()))?;
                Some(Arc::new(File::open(&path).map_err(|e| {
                    Error::Runtime(format!("{}: {e}", path.display()))
                })?))
            }
            None => None,
        };
        let failed = Arc::new(AtomicBool::new(false));
        let f = failed.clone();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kp-userspace")
            .enable_all()
            .on_thread_start(move || {
                if let Some(ns) = &ns {
                    if let Err(e) =
                        nix::sched::setns(ns.as_ref(), nix::sched::CloneFlags::CLONE_NEWNET)
                    {
                        tracing::error!(error = %e, "a proxy thread cannot enter its namespace");
                        f.store(true, Ordering::SeqCst);
                    }
                }
            })
            .build()
            .map_err(|e| Error::Runtime(e.to_string()))?;
        // The workers started with the runtime; a thread started later that fails to enter
        // stops its own work (see `failed` in `start`).
        if failed.load(Ordering::SeqCst) {
            rt.shutdown_background();
            return Err(Error::Runtime("cannot enter the network namespace".into()));
        }
        Ok(rt)
    }

    /// See [`Dataplane::start`].
    pub fn start(&mut self) -> Result<u16, Error> {
        if let Some(p) = self.port {
            return Ok(p);
        }
        raise_open_file_limit();
        let rt = self.build_runtime()?;
        self.runtime = Some(rt);
        let range = self.cfg.port_range.clone();
        // With detect-local by interface the table sends what arrives on the pods'
        // interface(s) to the pod port: what is accepted there is a pod's.
        let pod_port = self.cfg.balancer.detect_local.interface().is_some();
        let listeners = self.on_runtime(move || Listeners::bind(range.as_ref(), pod_port))??;
        let (port, pod_port) = (listeners.port, listeners.pod_port);
        self.cfg.routing.install(self.netns.as_deref())?;
        let (tcp_tx, tcp_rx) = tokio::sync::watch::channel(false);
        let (udp_tx, udp_rx) = tokio::sync::watch::channel(false);
        let shared = self.shared.clone();
        let registered = self.on_runtime(move || -> std::io::Result<()> {
            for (t, arrival) in listeners.tcp {
                let l = TcpListener::from_std(t)?;
                tokio::spawn(tcp::serve(l, arrival, shared.clone(), tcp_rx.clone()));
            }
            for (u, arrival) in listeners.udp {
                let u = Arc::new(UdpSocket::from_std(u)?);
                tokio::spawn(udp::serve(u, arrival, shared.clone(), udp_rx.clone()));
            }
            Ok(())
        })?;
        registered.map_err(|source| Error::Listen {
            addr: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
            source,
        })?;
        self.stop_tcp = Some(tcp_tx);
        self.stop_udp = Some(udp_tx);
        self.port = Some(port);
        self.pod_port = pod_port;
        tracing::info!(
            port,
            pod_port,
            "userspace proxy listening (TCP and UDP, IPv4 and IPv6)"
        );
        Ok(port)
    }

    /// The node's addresses in the proxy's namespace (what counts as "from the node").
    fn local_addresses(&self) -> HashSet<IpAddr> {
        let read = || -> HashSet<IpAddr> {
            nix::ifaddrs::getifaddrs()
                .map(|it| {
                    it.filter_map(|i| {
                        let a = i.address?;
                        a.as_sockaddr_in()
                            .map(|s| IpAddr::V4(s.ip()))
                            .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
                    })
                    .collect()
                })
                .unwrap_or_default()
        };
        self.on_runtime(read).unwrap_or_default()
    }

    /// See [`Dataplane::sync`].
    pub fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, Error> {
        let port = self.port.ok_or(Error::NotStarted)?;
        let node =
            NodeContext::resolve(&self.cfg.balancer.detect_local, &self.cfg.node_ports, state);
        if full || changes.node_changed {
            let mut addrs = self.local_addresses();
            addrs.extend(node.node_ips.iter().copied());
            self.shared.set_node_addresses(addrs);
        }
        // The balancer first: a frontend the kernel starts redirecting has its route already.
        {
            let mut balancer = self.shared.balancer();
            balancer.sync(state, &node, changes, full);
            // Under the balancer's lock, so a UDP pick and the generation it records are of
            // the same sync.
            self.shared.synced(changes, full || changes.node_changed);
            // Under it too: no pick made after this returns a port whose series it deletes.
            self.shared.forget_gone_ports(state, changes, full);
        }
        let keys: Vec<&ServiceKey> = if full || changes.node_changed {
            state.service_keys().collect()
        } else {
            changes.services.iter().collect()
        };
        for name in unwarned_sctp_ports(&mut self.sctp_warned, state, keys.into_iter()) {
            tracing::warn!(
                service_port = %name,
                "SCTP is not proxied in userspace mode: this Service port's frontends are rejected"
            );
        }
        let (full, operations) = self.table.sync(state, &node, changes, full, port)?;
        Ok(SyncReport {
            full,
            operations,
            no_local_endpoints: (0, 0),
        })
    }

    /// See [`Dataplane::verify`].
    pub fn verify(&mut self) -> Result<Vec<String>, Error> {
        self.table.verify()
    }

    /// See [`Dataplane::cleanup`]: the table of both families, the rules and the routes.
    pub fn cleanup(&mut self) -> Result<(), Error> {
        let table = self.table.cleanup();
        let routing = self.cfg.routing.remove(self.netns.as_deref());
        table.and(routing)
    }

    /// See [`Dataplane::shutdown`]: a graceful stop that refuses nothing the kernel still
    /// sends here, bounded by [`UserspaceConfig::drain`] from the call.
    ///
    /// 1. While the redirect table sends connections to this proxy's port (checked every
    ///    [`REACH_POLL`]), it keeps accepting TCP and UDP as before: during a mode switch the
    ///    next mode's proxy starts, syncs, and only then removes this table; a new userspace
    ///    proxy points the table at its own port.
    /// 2. Once the rules no longer reach it, the TCP listeners close (after [`LINGER`], for
    ///    handshakes redirected just before); running relays and UDP sessions (whose datagrams
    ///    conntrack still sends here) go on until they end.
    /// 3. It returns when nothing runs, or at the drain's end (what still runs is cut), or at
    ///    a second SIGTERM/SIGINT with [`UserspaceConfig::signal_ends_drain`].
    ///
    /// Nobody takes over while the rules stay (a plain stop, or a pod whose successor starts
    /// only after it exited): it serves until the drain's end and exits; the rules stay in
    /// place, as every mode leaves them, for the next start.
    pub fn shutdown(&mut self) {
        let deadline = Instant::now() + self.cfg.drain;
        let interrupted = self.watch_for_a_second_signal();
        let ended = |i: &AtomicBool| i.load(Ordering::SeqCst) || Instant::now() >= deadline;
        let mut why = "the drain timeout passed";
        if let (Some(port), false) = (self.port, self.cfg.drain.is_zero()) {
            tracing::info!(
                port,
                drain_timeout = ?self.cfg.drain,
                "{SERVING_ON} (until they go, at most the drain timeout; a second signal stops at once)"
            );
            let mut read_failed = false;
            loop {
                match self.table.redirects_to(port) {
                    Ok(true) => {}
                    Ok(false) => {
                        why = "the redirect rules no longer send connections here";
                        break;
                    }
                    Err(e) if !read_failed => {
                        read_failed = true;
                        tracing::warn!(error = %e, "cannot read the redirect table; serving on until the drain timeout");
                    }
                    Err(_) => {}
                }
                if ended(&interrupted) {
                    break;
                }
                std::thread::sleep(
                    REACH_POLL.min(deadline.saturating_duration_since(Instant::now())),
                );
            }
            if !ended(&interrupted) {
                std::thread::sleep(LINGER.min(deadline.saturating_duration_since(Instant::now())));
            }
        }
        if interrupted.load(Ordering::SeqCst) {
            why = "a second signal";
        }
        if let Some(stop) = self.stop_tcp.take() {
            let _ = stop.send(true);
        }
        tracing::info!(
            reason = why,
            connections = self.shared.relays(),
            udp_sessions = self.shared.udp_sessions(),
            "{STOPPED_ACCEPTING}; letting the running ones finish"
        );
        let running = |s: &Shared| s.relays() > 0 || s.udp_sessions() > 0;
        while running(&self.shared) && !ended(&interrupted) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (left, sessions) = (self.shared.relays(), self.shared.udp_sessions());
        if left > 0 || sessions > 0 {
            tracing::info!(
                connections = left,
                udp_sessions = sessions,
                "stopping with connections still open"
            );
        } else {
            tracing::info!("every relay has ended; stopped");
        }
        if let Some(stop) = self.stop_udp.take() {
            let _ = stop.send(true);
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
        // Another mode kept this proxy's return path for its relays: it goes with them.
        if let Some(port) = self.port.take() {
            let nft = self.table.nft();
            let left = crate::leftovers::port(nft);
            let ours = matches!(left, Ok(crate::leftovers::Port::ReturnPath(p)) if p.proxy == port);
            if ours {
                match crate::leftovers::delete_all(nft, &self.cfg.routing, self.netns.as_deref()) {
                    Ok(()) => {
                        tracing::info!("removed the return path kept for this proxy's relays")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot remove the return path kept for this proxy's relays")
                    }
                }
            }
        }
    }

    /// A flag set by a SIGTERM or SIGINT that arrives from now on, when
    /// [`UserspaceConfig::signal_ends_drain`] asks for it (never set otherwise).
    fn watch_for_a_second_signal(&self) -> Arc<AtomicBool> {
        let flag = Arc::new(AtomicBool::new(false));
        let (Some(rt), true) = (&self.runtime, self.cfg.signal_ends_drain) else {
            return flag;
        };
        let (set, (ready_tx, ready_rx)) = (flag.clone(), std::sync::mpsc::channel());
        rt.spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let term = signal(SignalKind::terminate());
            let int = signal(SignalKind::interrupt());
            let _ = ready_tx.send(());
            let (Ok(mut term), Ok(mut int)) = (term, int) else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            set.store(true, Ordering::SeqCst);
        });
        // The handlers are in place before the drain starts.
        let _ = ready_rx.recv_timeout(Duration::from_secs(1));
        flag
    }
}

impl Drop for UserspaceDataplane {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Not `drop`: dropping a runtime from inside another one's thread panics.
            rt.shutdown_background();
        }
    }
}

impl Dataplane for UserspaceDataplane {
    fn mode(&self) -> &'static str {
        "userspace"
    }

    fn start(&mut self) -> Result<(), DataplaneError> {
        UserspaceDataplane::start(self)
            .map(|_| ())
            .map_err(Error::into_dataplane)
    }

    fn sync(
        &mut self,
        state: &ProxyState,
        changes: &Changes,
        full: bool,
    ) -> Result<SyncReport, DataplaneError> {
        UserspaceDataplane::sync(self, state, changes, full).map_err(Error::into_dataplane)
    }

    fn verify(&mut self) -> Result<Vec<String>, DataplaneError> {
        UserspaceDataplane::verify(self).map_err(Error::into_dataplane)
    }

    fn cleanup(&mut self) -> Result<(), DataplaneError> {
        UserspaceDataplane::cleanup(self).map_err(Error::into_dataplane)
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.runtime.as_ref().map(|_| self.next_expire)
    }

    fn tick(&mut self, now: Instant) -> Result<(), DataplaneError> {
        self.shared.balancer().expire(now);
        self.next_expire = now + EXPIRE_EVERY;
        Ok(())
    }

    fn shutdown(&mut self) {
        UserspaceDataplane::shutdown(self);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sctp_service_port_is_warned_about_once_and_no_other_port_is() {
        let state = kp_flows::state();
        let mut warned = HashSet::new();
        let first = unwarned_sctp_ports(&mut warned, &state, state.service_keys());
        assert!(!first.is_empty());
        assert!(
            first.iter().all(|n| n.protocol == Protocol::Sctp),
            "{first:?}"
        );
        let sctp_ports = state
            .service_keys()
            .flat_map(|k| state.service_ports(k).iter())
            .filter(|p| p.name.protocol == Protocol::Sctp)
            .count();
        assert_eq!(first.len(), sctp_ports);
        // A later sync of the same Services warns about nothing again.
        assert!(unwarned_sctp_ports(&mut warned, &state, state.service_keys()).is_empty());
    }
}
