//! kp-ipvsctl: IPVS by hand through kube-proxy-rs's client (no ipvsadm needed), for operators
//! and for the tests that run in a VM with a real IPVS kernel.
//!
//! Exit codes: 0 done, 1 the kernel or the socket refused (the message says which errno), 64 a
//! usage error.

use std::net::SocketAddr;
use std::process::ExitCode;

use kp_ipvs::{listing, Client, IpvsProtocol};
use kp_netlink::ipvs::{Destination, Service, ServiceKey};

const USAGE: &str = "\
usage: kp-ipvsctl [--netns NAME] COMMAND
  list                                  services and destinations as ipvsadm -Ln lists them
  dump                                  the same, one Rust value per line (Service, DestinationState)
  add-service tcp|udp|sctp VIP:PORT SCHEDULER
  del-service tcp|udp|sctp VIP:PORT
  add-dest tcp|udp|sctp VIP:PORT RIP:PORT WEIGHT     masqueraded
  set-dest tcp|udp|sctp VIP:PORT RIP:PORT WEIGHT
  del-dest tcp|udp|sctp VIP:PORT RIP:PORT
  flush
  info";

const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut netns = None;
    if args.first().map(String::as_str) == Some("--netns") {
        if args.len() < 2 {
            return usage("--netns needs a name");
        }
        netns = Some(args.remove(1));
        args.remove(0);
    }
    let words: Vec<&str> = args.iter().map(String::as_str).collect();
    let Some((&command, rest)) = words.split_first() else {
        return usage("no command");
    };
    let mut client = match Client::open(netns.as_deref()) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    let result = match (command, rest) {
        ("list", []) => client.dump().map(|all| print!("{}", listing(&all))),
        ("dump", []) => client.dump().map(|all| {
            for (svc, dests) in all {
                println!("{svc:?}");
                for d in dests {
                    println!("{d:?}");
                }
            }
        }),
        ("add-service", [proto, vip, sched]) => match key(proto, vip) {
            Ok(k) => client.add_service(&Service::new(k, sched)),
            Err(e) => return usage(&e),
        },
        ("del-service", [proto, vip]) => match key(proto, vip) {
            Ok(k) => client.delete_service(&k),
            Err(e) => return usage(&e),
        },
        ("add-dest" | "set-dest", [proto, vip, rip, weight]) => {
            let (k, r, w) = match (key(proto, vip), addr(rip), weight.parse::<u32>()) {
                (Ok(k), Ok(r), Ok(w)) => (k, r, w),
                _ => return usage("bad service, destination or weight"),
            };
            let d = Destination::masquerade(r.ip(), r.port(), w);
            if command == "add-dest" {
                client.add_destination(&k, &d)
            } else {
                client.update_destination(&k, &d)
            }
        }
        ("del-dest", [proto, vip, rip]) => match (key(proto, vip), addr(rip)) {
            (Ok(k), Ok(r)) => client.delete_destination(&k, r.ip(), r.port()),
            _ => return usage("bad service or destination"),
        },
        ("flush", []) => client.flush(),
        ("info", []) => client.info().map(|i| {
            println!(
                "IP Virtual Server version {}.{}.{} (size={})",
                i.version >> 16,
                (i.version >> 8) & 0xff,
                i.version & 0xff,
                i.connection_table_size
            )
        }),
        _ => {
            return usage(&format!(
                "unknown command or arguments: {}",
                words.join(" ")
            ))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn key(proto: &str, vip: &str) -> Result<ServiceKey, String> {
    let protocol = match proto {
        "tcp" => IpvsProtocol::Tcp,
        "udp" => IpvsProtocol::Udp,
        "sctp" => IpvsProtocol::Sctp,
        other => return Err(format!("protocol {other}: tcp, udp or sctp")),
    };
    let a = addr(vip)?;
    Ok(ServiceKey::Addr {
        addr: a.ip(),
        protocol,
        port: a.port(),
    })
}

fn addr(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("{s}: ADDR:PORT ([ADDR]:PORT for IPv6)"))
}

fn usage(why: &str) -> ExitCode {
    eprintln!("kp-ipvsctl: {why}\n{USAGE}");
    ExitCode::from(EX_USAGE)
}

fn fail(e: kp_ipvs::Error) -> ExitCode {
    eprintln!("kp-ipvsctl: {e}");
    ExitCode::FAILURE
}
