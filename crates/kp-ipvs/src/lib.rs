//! IPVS for kube-proxy-rs: the kernel side of the ipvs mode.
//!
//! [`Client`] speaks IPVS's generic netlink family (the messages are
//! [`kp_netlink::ipvs`]) on a `NETLINK_GENERIC` socket opened in the current network namespace
//! or a named one: it resolves the family (`CTRL_CMD_GETFAMILY` for `IPVS`), adds, changes and
//! deletes virtual services and their destinations (real servers), dumps them, and flushes.
//! One request per change, acknowledged before the next: no `ipvsadm` process.
//! [`Client::dump`] reads the whole state and [`Client::apply`] applies a `kp-ipvs-plan` plan.
//! [`ipset::Ipset`] adds and deletes set elements over nfnetlink, pipelined the same way.
//!
//! Errors keep the kernel's errno ([`Error::errno`]), so a caller tells a service that is
//! already there (`EEXIST`) or gone (`ESRCH`, `ENOENT`) from a fault; a kernel without IPVS is
//! [`Error::Unavailable`], the ipvs mode's reason to fall back.
//!
//! Upstream kube-proxy does the same through `github.com/moby/ipvs` (pkg/proxy/ipvs/util).

pub mod cleanup;
pub mod dataplane;
pub mod ipset;
pub mod link;

use std::net::IpAddr;

use kp_ipvs_plan::Change;
use kp_netlink::ipvs::{self, Destination, DestinationState, Info, Service, ServiceKey};
use kp_netlink::socket::{self, Socket};
use kp_netlink::{genl, KernelError, Protocol};

pub use kp_netlink::ipvs::{abi, Forward, Protocol as IpvsProtocol};

/// What an IPVS exchange can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The kernel has no IPVS family (the `ip_vs` module is not built or cannot be loaded).
    /// Not retryable: the mode falls back to iptables.
    #[error("IPVS is not available in {location}: the kernel has no generic netlink family IPVS (module ip_vs missing)")]
    Unavailable {
        /// `the current network namespace` or `netns NAME`.
        location: String,
    },
    /// The kernel refused `op`. Retryable for transient errnos ([`KernelError::is_transient`]);
    /// `EEXIST`, `ESRCH`, `ENOENT` describe the state, and the caller decides.
    #[error("{op}: {error}")]
    Kernel {
        /// What was asked (`add service TCP 10.96.0.10:80`).
        op: String,
        /// The errno.
        error: KernelError,
    },
    /// The socket failed (opening it, sending, receiving, a malformed answer). Retryable with a
    /// new client if the socket error is.
    #[error("{op}: {source}")]
    Socket {
        /// What was asked.
        op: String,
        /// The socket layer's error.
        #[source]
        source: socket::Error,
    },
    /// A tool the mode runs (`ipset`, `iptables-restore`, a sysctl) failed. Retryable.
    #[error("{op}: {detail}")]
    Tool {
        /// What was run.
        op: String,
        /// Its error output.
        detail: String,
    },
}

impl Error {
    /// The kernel's errno, if the kernel refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Kernel { error, .. } => Some(error.errno),
            _ => None,
        }
    }

    /// The kernel's refusal, if that is what it is.
    pub fn kernel(&self) -> Option<KernelError> {
        match self {
            Error::Kernel { error, .. } => Some(*error),
            _ => None,
        }
    }

    /// `EEXIST`: the service or destination is already there.
    pub fn is_exists(&self) -> bool {
        self.kernel().is_some_and(|e| e.is_exists())
    }

    /// `ESRCH` (no such service) or `ENOENT` (no such destination).
    pub fn is_not_found(&self) -> bool {
        self.errno()
            .is_some_and(|e| e == kp_netlink::abi::ESRCH || e == kp_netlink::abi::ENOENT)
    }
}

impl Error {
    /// As a dataplane error, with how to retry it: [`Error::Unavailable`] never, a kernel
    /// refusal by its errno, anything else with backoff.
    pub fn into_dataplane(self) -> kp_core::dataplane::DataplaneError {
        use kp_core::dataplane::{DataplaneError, Retry};
        let retry = match (&self, self.errno()) {
            (Error::Unavailable { .. }, _) => Retry::Never,
            (_, Some(n)) => Retry::of_errno(n),
            _ => Retry::WithBackoff,
        };
        DataplaneError::new(retry, self)
    }
}

/// A result of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An IPVS client: a generic netlink socket in one network namespace and IPVS's family id
/// there. Blocking; one exchange at a time.
#[derive(Debug)]
pub struct Client {
    socket: Socket,
    family: u16,
    /// Virtual servers and real servers read from the kernel so far.
    read: u64,
}

impl Client {
    /// Opens a socket in the current network namespace (`netns` `None`) or in
    /// `/var/run/netns/NAME`, and resolves IPVS's family. [`Error::Unavailable`] if the kernel
    /// has none.
    pub fn open(netns: Option<&str>) -> Result<Client> {
        let op = "open an IPVS client";
        let mut socket =
            Socket::open(Protocol::Generic, netns).map_err(|source| Error::Socket {
                op: op.into(),
                source,
            })?;
        let mut family = None;
        let answer = socket.request(
            |buf, seq| genl::get_family_request(buf, seq, abi::IPVS_GENL_NAME),
            |m| {
                family = Some(genl::parse_family(m)?.id);
                Ok(())
            },
        );
        match answer {
            Ok(_) => {}
            Err(e) if e.is_not_found() => {
                return Err(Error::Unavailable {
                    location: socket.location().to_string(),
                })
            }
            Err(source) => {
                return Err(Error::Socket {
                    op: format!("{op}: resolve the family"),
                    source,
                })
            }
        }
        let family = family.ok_or_else(|| Error::Unavailable {
            location: socket.location().to_string(),
        })?;
        Ok(Client {
            socket,
            family,
            read: 0,
        })
    }

    /// How many virtual servers and real servers this client has read from the kernel (what a
    /// sync's reads cost: a partial sync reads only its changed virtual servers' real servers).
    pub fn entries_read(&self) -> u64 {
        self.read
    }

    /// IPVS's generic netlink family id in this namespace's kernel.
    pub fn family(&self) -> u16 {
        self.family
    }

    /// Adds a virtual service (`EEXIST` if its key is taken).
    pub fn add_service(&mut self, svc: &Service) -> Result<()> {
        self.apply(&[Change::AddService(svc.clone())])
    }

    /// Changes a service's scheduler, flags, timeout or netmask (`ESRCH` if there is none).
    pub fn update_service(&mut self, svc: &Service) -> Result<()> {
        self.apply(&[Change::UpdateService(svc.clone())])
    }

    /// Deletes a service with its destinations (`ESRCH` if there is none).
    pub fn delete_service(&mut self, key: &ServiceKey) -> Result<()> {
        self.apply(&[Change::DeleteService(*key)])
    }

    /// Every virtual service of the namespace.
    pub fn services(&mut self) -> Result<Vec<Service>> {
        let family = self.family;
        let all = self
            .socket
            .dump(
                |buf, seq| ipvs::get_services(buf, family, seq),
                |all: &mut Vec<Service>, m| {
                    all.push(ipvs::parse_service(m)?);
                    Ok(())
                },
            )
            .map_err(|e| wrap("list services".into(), e))?;
        self.read += all.len() as u64;
        Ok(all)
    }

    /// Adds a destination to service `key` (`EEXIST` if it has it; `ESRCH` without the
    /// service). The kernel refuses with `EINVAL` an address that is not unicast or local in the
    /// namespace's routing: in a namespace whose loopback is down (no local table), every IPv4
    /// destination is refused so (seen on Linux 6.1).
    pub fn add_destination(&mut self, key: &ServiceKey, dest: &Destination) -> Result<()> {
        self.apply(&[Change::AddDestination(*key, *dest)])
    }

    /// Changes a destination's weight, forwarding or thresholds (`ENOENT` if the service does
    /// not have it).
    pub fn update_destination(&mut self, key: &ServiceKey, dest: &Destination) -> Result<()> {
        self.apply(&[Change::UpdateDestination(*key, *dest)])
    }

    /// Removes destination `addr:port` from service `key` (`ENOENT` if it does not have it).
    pub fn delete_destination(&mut self, key: &ServiceKey, addr: IpAddr, port: u16) -> Result<()> {
        self.apply(&[Change::DeleteDestination(*key, addr, port)])
    }

    /// The destinations of service `key`, with their connection counts (none if there is no
    /// such service).
    pub fn destinations(&mut self, key: &ServiceKey) -> Result<Vec<DestinationState>> {
        let family = self.family;
        let ipv6 = key.is_ipv6();
        let all = self
            .socket
            .dump(
                |buf, seq| ipvs::get_dests(buf, family, seq, key),
                |all: &mut Vec<DestinationState>, m| {
                    all.push(ipvs::parse_destination(m, ipv6)?);
                    Ok(())
                },
            )
            .map_err(|e| wrap(format!("list destinations of {key}"), e))?;
        self.read += all.len() as u64;
        Ok(all)
    }

    /// Every virtual service with its destinations: the state [`kp_ipvs_plan::diff`] compares
    /// with. Services and destinations are dumped one after the other, so a change between the
    /// two dumps shows at the next one.
    pub fn dump(&mut self) -> Result<Vec<(Service, Vec<DestinationState>)>> {
        let mut all = Vec::new();
        for svc in self.services()? {
            let dests = self.destinations(&svc.key)?;
            all.push((svc, dests));
        }
        Ok(all)
    }

    /// Applies a plan's changes in order. They are pipelined: up to [`PIPELINE`] requests in
    /// one datagram, each acknowledged, the kernel running them one after the other (a service
    /// before its destinations, as the plan orders them); a round trip per datagram, not per
    /// change (under an emulator, where a system call costs milliseconds, this is what a full
    /// sync's time is made of). A refusal does not stop the requests after it in the same
    /// datagram: the first one is returned, and what else was applied shows at the next diff
    /// against a dump (after a failure the mode's next sync is a full one).
    pub fn apply(&mut self, changes: &[Change]) -> Result<()> {
        let family = self.family;
        let refused = self
            .socket
            .pipeline(
                changes.len(),
                PIPELINE,
                |i, buf, seq| match &changes[i] {
                    Change::AddService(s) => ipvs::new_service(buf, family, seq, s),
                    Change::UpdateService(s) => ipvs::set_service(buf, family, seq, s),
                    Change::DeleteService(k) => ipvs::del_service(buf, family, seq, k),
                    Change::AddDestination(k, d) => ipvs::new_dest(buf, family, seq, k, d),
                    Change::UpdateDestination(k, d) => ipvs::set_dest(buf, family, seq, k, d),
                    Change::DeleteDestination(k, a, p) => {
                        ipvs::del_dest(buf, family, seq, k, *a, *p)
                    }
                },
                |_, _| false,
            )
            .map_err(|e| wrap(format!("apply {} IPVS changes", changes.len()), e))?;
        match refused {
            None => Ok(()),
            Some((i, error)) => Err(Error::Kernel {
                op: describe(&changes[i]),
                error,
            }),
        }
    }

    /// Deletes every service of the namespace (`ipvsadm -C`).
    pub fn flush(&mut self) -> Result<()> {
        let family = self.family;
        self.socket
            .request(|b, seq| ipvs::flush(b, family, seq), |_| Ok(()))
            .map(|_| ())
            .map_err(|e| wrap("flush".into(), e))
    }

    /// Sets IPVS's connection timeouts in seconds (`ipvsadm --set TCP TCPFIN UDP`); a zero
    /// leaves that one as it is (the kernel's rule, and upstream's for a zero setting).
    pub fn set_timeouts(&mut self, timeouts: Timeouts) -> Result<()> {
        use kp_netlink::genl::GenlHeader;
        let family = self.family;
        self.socket
            .request(
                |buf, seq| {
                    let header = GenlHeader {
                        cmd: abi::IPVS_CMD_SET_CONFIG,
                        version: abi::IPVS_GENL_VERSION,
                    };
                    let start = genl::begin(buf, family, kp_netlink::abi::NLM_F_ACK, seq, header);
                    kp_netlink::attr::put_u32(buf, abi::IPVS_CMD_ATTR_TIMEOUT_TCP, timeouts.tcp);
                    kp_netlink::attr::put_u32(
                        buf,
                        abi::IPVS_CMD_ATTR_TIMEOUT_TCP_FIN,
                        timeouts.tcp_fin,
                    );
                    kp_netlink::attr::put_u32(buf, abi::IPVS_CMD_ATTR_TIMEOUT_UDP, timeouts.udp);
                    kp_netlink::message::end(buf, start);
                },
                |_| Ok(()),
            )
            .map(|_| ())
            .map_err(|e| wrap(format!("set timeouts {timeouts:?}"), e))
    }

    /// IPVS's connection timeouts in seconds (`ipvsadm -L --timeout`).
    pub fn timeouts(&mut self) -> Result<Timeouts> {
        use kp_netlink::genl::GenlHeader;
        let family = self.family;
        let mut got = None;
        self.socket
            .request(
                |buf, seq| {
                    let header = GenlHeader {
                        cmd: abi::IPVS_CMD_GET_CONFIG,
                        version: abi::IPVS_GENL_VERSION,
                    };
                    let start = genl::begin(buf, family, kp_netlink::abi::NLM_F_ACK, seq, header);
                    kp_netlink::message::end(buf, start);
                },
                |m| {
                    let (_, body) = GenlHeader::parse(m.payload)?;
                    let mut t = Timeouts::default();
                    for a in kp_netlink::attr::attrs(body) {
                        let a = a?;
                        let v = kp_netlink::attr::u32_ne(Some(a.payload), "timeout")?;
                        match a.kind {
                            abi::IPVS_CMD_ATTR_TIMEOUT_TCP => t.tcp = v,
                            abi::IPVS_CMD_ATTR_TIMEOUT_TCP_FIN => t.tcp_fin = v,
                            abi::IPVS_CMD_ATTR_TIMEOUT_UDP => t.udp = v,
                            _ => {}
                        }
                    }
                    got = Some(t);
                    Ok(())
                },
            )
            .map_err(|e| wrap("get timeouts".into(), e))?;
        got.ok_or_else(|| Error::Socket {
            op: "get timeouts".into(),
            source: kp_netlink::Malformed::from("no IPVS_CMD_SET_CONFIG answer").into(),
        })
    }

    /// IPVS's version and connection table size.
    pub fn info(&mut self) -> Result<Info> {
        let family = self.family;
        let mut info = None;
        self.socket
            .request(
                |buf, seq| ipvs::get_info(buf, family, seq),
                |m| {
                    info = Some(ipvs::parse_info(m)?);
                    Ok(())
                },
            )
            .map_err(|e| wrap("get info".into(), e))?;
        info.ok_or_else(|| Error::Socket {
            op: "get info".into(),
            source: kp_netlink::Malformed::from("no IPVS_CMD_SET_INFO answer").into(),
        })
    }
}

/// IPVS's connection timeouts, in seconds (`ipvsadm --set`): established TCP, TCP after a
/// FIN, UDP. Zero in a request leaves that one unchanged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timeouts {
    /// `IPVS_CMD_ATTR_TIMEOUT_TCP` (`--ipvs-tcp-timeout`).
    pub tcp: u32,
    /// `IPVS_CMD_ATTR_TIMEOUT_TCP_FIN` (`--ipvs-tcpfin-timeout`).
    pub tcp_fin: u32,
    /// `IPVS_CMD_ATTR_TIMEOUT_UDP` (`--ipvs-udp-timeout`).
    pub udp: u32,
}

/// `addr:port`, IPv6 in brackets.
fn endpoint(addr: IpAddr, port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::new(addr, port)
}

/// How many IPVS requests [`Client::apply`] sends in one datagram: about 20 KiB of requests,
/// and their acknowledgements (an error echoes its request) well inside a receive buffer.
pub const PIPELINE: usize = 128;

/// What a change asks, as [`Client`]'s single requests word it.
fn describe(change: &Change) -> String {
    match change {
        Change::AddService(s) => format!("add service {}", s.key),
        Change::UpdateService(s) => format!("update service {}", s.key),
        Change::DeleteService(k) => format!("delete service {k}"),
        Change::AddDestination(k, d) => {
            format!("add destination {} to {k}", endpoint(d.addr, d.port))
        }
        Change::UpdateDestination(k, d) => {
            format!("update destination {} of {k}", endpoint(d.addr, d.port))
        }
        Change::DeleteDestination(k, a, p) => {
            format!("delete destination {} of {k}", endpoint(*a, *p))
        }
    }
}

fn wrap(op: String, e: socket::Error) -> Error {
    match e.kernel() {
        Some(error) => Error::Kernel { op, error },
        None => Error::Socket { op, source: e },
    }
}

/// The listing `ipvsadm -Ln` prints for these services and their destinations (numeric, no
/// header): one `PROTO ADDR:PORT SCHED [persistent N]` line per service, then one
/// `  -> ADDR:PORT Masq WEIGHT ACTIVE INACTIVE` line per destination, in the order given.
pub fn listing(services: &[(Service, Vec<DestinationState>)]) -> String {
    let mut out = String::new();
    for (svc, dests) in services {
        out.push_str(&format!("{} {}", svc.key, svc.scheduler));
        if svc.flags & abi::IP_VS_SVC_F_PERSISTENT != 0 {
            out.push_str(&format!(" persistent {}", svc.timeout));
        }
        out.push('\n');
        for d in dests {
            let dest = &d.destination;
            let forward = match dest.forward {
                Forward::Masquerade => "Masq",
                Forward::Local => "Local",
                Forward::Tunnel => "Tunnel",
                Forward::DirectRoute => "Route",
                Forward::Bypass => "Bypass",
            };
            out.push_str(&format!(
                "  -> {} {forward} {} {} {}\n",
                endpoint(dest.addr, dest.port),
                dest.weight,
                d.active_connections,
                d.inactive_connections
            ));
        }
    }
    out
}
