//! What another mode's start (after its first sync) and `--cleanup` do to this mode's state,
//! without cutting the relays of a userspace proxy that still drains.
//!
//! A relay that keeps the client's address answers from a transparent socket: the endpoint's
//! replies reach it only through the table's reply mark (`mangle-prerouting`) and the policy
//! routing. Removing those while the old proxy still relays would send the replies on to the
//! client, which resets the connection. So while TCP sockets on the old proxy's ports are open,
//! the table is replaced, in one transaction, by its return path alone (the mark rule, whose
//! comment names the port, and the pod port of a proxy with detect-local by interface); the old proxy deletes it at its exit, and a later removal deletes
//! it once no relay is left (a proxy that was killed).

use kp_nftables::NftCommand;
use kp_userspace_plan::names::{FAMILY, MANGLE_PREROUTING, SERVICES, TABLE};

use crate::routing::PolicyRouting;
use crate::Error;

/// The comment of the return path's rule, before the port.
const RETURN_PATH: &str = "return-path-port-";
/// In that comment, before the pod port (when the proxy had one).
const RETURN_PATH_POD: &str = "-pod-";

/// What [`remove`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removed {
    /// The table and the policy routing are gone.
    Gone,
    /// Relays of a stopping proxy on `port` are open: only their return path is left.
    ReturnPathKept {
        /// The old proxy's port.
        port: u16,
        /// TCP connections open on it (and on its pod port, if it had one).
        relays: usize,
    },
}

/// A proxy's ports: the proxy port, and with detect-local by interface the pod port, where the
/// table sends what arrives on the pods' interface(s).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ports {
    /// The proxy port.
    pub proxy: u16,
    /// The pod port.
    pub pod: Option<u16>,
}

impl Ports {
    /// Each port.
    fn each(self) -> impl Iterator<Item = u16> {
        std::iter::once(self.proxy).chain(self.pod)
    }

    /// The return path rule's comment naming them.
    fn comment(self) -> String {
        match self.pod {
            Some(pod) => format!("{RETURN_PATH}{}{RETURN_PATH_POD}{pod}", self.proxy),
            None => format!("{RETURN_PATH}{}", self.proxy),
        }
    }

    /// The ports a return path rule's comment names.
    fn of_comment(comment: &str) -> Option<Ports> {
        let rest = comment.strip_prefix(RETURN_PATH)?;
        Some(match rest.split_once(RETURN_PATH_POD) {
            Some((proxy, pod)) => Ports {
                proxy: proxy.parse().ok()?,
                pod: Some(pod.parse().ok()?),
            },
            None => Ports {
                proxy: rest.parse().ok()?,
                pod: None,
            },
        })
    }
}

/// What the kernel's table says about the proxy's ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Port {
    /// No table.
    None,
    /// A whole table whose redirect rules send connections to these ports.
    Redirect(Ports),
    /// Only the return path of a proxy on these ports is left.
    ReturnPath(Ports),
    /// A table that names no port (an empty one, or another version's).
    Unknown,
}

/// Reads the table's proxy port.
pub(crate) fn port(nft: &NftCommand) -> Result<Port, Error> {
    let json = match nft.json(&["list", "table", FAMILY, TABLE]) {
        Ok(j) => j,
        Err(kp_nftables::Error::List { stderr, .. })
            if stderr.contains("No such file or directory") =>
        {
            return Ok(Port::None)
        }
        Err(e) => return Err(e.into()),
    };
    parse_port(&json)
}

fn parse_port(json: &str) -> Result<Port, Error> {
    let doc: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| kp_nftables::Error::Parse(format!("nft -j list table: {e}")))?;
    let items = doc["nftables"].as_array().into_iter().flatten();
    let mut kept = None;
    let (mut proxy, mut pod) = (None, None);
    for rule in items.filter_map(|i| i.get("rule")) {
        let comment = rule["comment"].as_str().unwrap_or_default();
        if rule["chain"].as_str() == Some(SERVICES) {
            let exprs = rule["expr"].as_array().into_iter().flatten();
            if let Some(p) = exprs.filter_map(|e| e["redirect"]["port"].as_u64()).next() {
                let Ok(p) = u16::try_from(p) else {
                    return Ok(Port::Unknown);
                };
                // The pod port's rules (`redirect-pod-*`) come first; the others name the
                // proxy port.
                let slot = if comment.starts_with("redirect-pod-") {
                    &mut pod
                } else {
                    &mut proxy
                };
                slot.get_or_insert(p);
            }
        }
        kept = kept.or(Ports::of_comment(comment));
    }
    Ok(match (proxy, kept) {
        (Some(proxy), _) => Port::Redirect(Ports { proxy, pod }),
        (None, Some(ports)) => Port::ReturnPath(ports),
        (None, None) => Port::Unknown,
    })
}

/// TCP sockets with local port `port` that are not listening or closed (the client side of
/// every relay of a proxy on that port), in namespace `netns` (`None`: the caller's).
pub fn open_relays(netns: Option<&str>, port: u16) -> Result<usize, Error> {
    let count = move || -> std::io::Result<usize> {
        let mut n = 0;
        for file in ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"] {
            let text = match std::fs::read_to_string(file) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            n += count_open(&text, port);
        }
        Ok(n)
    };
    let fail = |detail: String| Error::Runtime(format!("reading the open TCP sockets: {detail}"));
    match netns {
        None => count().map_err(|e| fail(e.to_string())),
        Some(name) => kp_netlink::netns::run_in(name, "kp-us-relays", count)
            .map_err(|e| fail(e.to_string()))?
            .map_err(|e| fail(e.to_string())),
    }
}

/// The sockets of a `/proc/net/tcp` listing on local port `port` in a state a relay has
/// (not LISTEN `0A`, TIME_WAIT `06` or CLOSE `07`).
fn count_open(listing: &str, port: u16) -> usize {
    listing
        .lines()
        .skip(1)
        .filter(|line| {
            let mut fields = line.split_whitespace().skip(1);
            let local = fields.next().unwrap_or_default();
            let state = fields.nth(1).unwrap_or_default();
            let local_port = local
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok());
            local_port == Some(port) && !matches!(state, "0A" | "06" | "07")
        })
        .count()
}

/// Removes the table and the policy routing, unless a stopping proxy still relays (see the
/// module's documentation).
pub fn remove(
    nft: &NftCommand,
    routing: &PolicyRouting,
    netns: Option<&str>,
) -> Result<Removed, Error> {
    let ports = match port(nft)? {
        Port::Redirect(p) | Port::ReturnPath(p) => Some(p),
        Port::None | Port::Unknown => None,
    };
    let mut relays = 0;
    for p in ports.iter().flat_map(|p| p.each()) {
        relays += open_relays(netns, p)?;
    }
    match ports {
        Some(ports) if relays > 0 => {
            nft.run(&return_path_only(ports, routing.mark))?;
            Ok(Removed::ReturnPathKept {
                port: ports.proxy,
                relays,
            })
        }
        _ => {
            delete_all(nft, routing, netns)?;
            Ok(Removed::Gone)
        }
    }
}

/// Deletes the table (if any) and the policy routing.
pub(crate) fn delete_all(
    nft: &NftCommand,
    routing: &PolicyRouting,
    netns: Option<&str>,
) -> Result<(), Error> {
    nft.run(&format!(
        "add table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n"
    ))?;
    routing.remove(netns)
}

/// One transaction: the table replaced by its reply-mark rule alone, whose comment names the
/// proxy's ports.
fn return_path_only(ports: Ports, mark: u32) -> String {
    let comment = ports.comment();
    format!(
        "add table {FAMILY} {TABLE}\n\
         delete table {FAMILY} {TABLE}\n\
         add table {FAMILY} {TABLE}\n\
         add chain {FAMILY} {TABLE} {MANGLE_PREROUTING} {{ type filter hook prerouting priority -150; policy accept; }}\n\
         add rule {FAMILY} {TABLE} {MANGLE_PREROUTING} meta l4proto {{ tcp, udp }} socket transparent 1 meta mark set {mark:#x} accept comment \"{comment}\"\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_relays_are_the_sockets_on_the_port_that_neither_listen_nor_closed() {
        // /proc/net/tcp: port 0x9A0B = 39435 listening, two established relays on it (one
        // IPv4-mapped local address), one in TIME_WAIT, and a connection on another port.
        let listing = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:9A0B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n\
   1: 0A00000A:9A0B 0400F40A:D431 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n\
   2: 0A00000A:9A0B 0400F40A:D432 08 00000000:00000000 00:00000000 00000000     0        0 3 1\n\
   3: 0A00000A:9A0B 0400F40A:D433 06 00000000:00000000 00:00000000 00000000     0        0 4 1\n\
   4: 0A00000A:1F90 0400F40A:D434 01 00000000:00000000 00:00000000 00000000     0        0 5 1\n";
        assert_eq!(count_open(listing, 0x9A0B), 2);
        assert_eq!(count_open(listing, 0x1F90), 1);
        assert_eq!(count_open(listing, 80), 0);
    }

    #[test]
    fn the_port_comes_from_the_redirect_or_from_the_return_path_left() {
        let rule = |chain: &str, comment: &str, last: &str| {
            format!(
                r#"{{"rule": {{"family": "inet", "table": "kube-proxy-userspace", "chain": "{chain}", "comment": "{comment}", "expr": [{last}]}}}}"#
            )
        };
        let doc = |rules: &[String]| format!(r#"{{"nftables": [{}]}}"#, rules.join(", "));
        let whole = doc(&[
            rule(MANGLE_PREROUTING, "transparent", r#"{"accept": null}"#),
            rule(
                SERVICES,
                "redirect-vips-v4",
                r#"{"redirect": {"port": 40001}}"#,
            ),
        ]);
        let ports = |proxy, pod| Ports { proxy, pod };
        assert_eq!(
            parse_port(&whole).unwrap(),
            Port::Redirect(ports(40001, None))
        );
        // With detect-local by interface the pod port's rules come first.
        let with_pod = doc(&[
            rule(
                SERVICES,
                "redirect-pod-vips-v4",
                r#"{"redirect": {"port": 40002}}"#,
            ),
            rule(
                SERVICES,
                "redirect-vips-v4",
                r#"{"redirect": {"port": 40001}}"#,
            ),
        ]);
        assert_eq!(
            parse_port(&with_pod).unwrap(),
            Port::Redirect(ports(40001, Some(40002)))
        );
        let left = doc(&[rule(
            MANGLE_PREROUTING,
            "return-path-port-40001",
            r#"{"accept": null}"#,
        )]);
        assert_eq!(
            parse_port(&left).unwrap(),
            Port::ReturnPath(ports(40001, None))
        );
        assert_eq!(parse_port(&doc(&[])).unwrap(), Port::Unknown);
        // The transaction that leaves the return path names the ports and the mark, and
        // reads back as them.
        let tx = return_path_only(ports(40001, None), 0x4000_0000);
        assert!(tx.contains("mark set 0x40000000 accept comment \"return-path-port-40001\""));
        let tx_pod = return_path_only(ports(40001, Some(40002)), 0x4000_0000);
        let comment = "return-path-port-40001-pod-40002";
        assert!(
            tx_pod.contains(&format!("accept comment \"{comment}\"")),
            "{tx_pod}"
        );
        let left = doc(&[rule(MANGLE_PREROUTING, comment, r#"{"accept": null}"#)]);
        assert_eq!(
            parse_port(&left).unwrap(),
            Port::ReturnPath(ports(40001, Some(40002)))
        );
        assert!(tx.contains("delete table inet kube-proxy-userspace"));
    }
}
