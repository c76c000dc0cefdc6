//! A test client for the socket load balancer: connects (TCP) or sends (UDP) to a frontend
//! `COUNT` times and prints, per attempt, which backend answered and what address the
//! application saw for its peer (`getpeername` for TCP, the `recvfrom` source for UDP).
//!
//! Usage: `kp-sockpeer tcp|udp ADDRESS PORT COUNT`; output lines: `BACKEND PEER` or
//! `error TEXT`. The backends are kp-echo servers (their answer starts with their name).
//!
//! `kp-sockpeer connects MILLIS ADDRESS:PORT...` starts non-blocking TCP connects to the
//! targets in turn for MILLIS ms and closes each at once: what the socket hooks answer at the
//! call itself, as fast as it can be asked (nothing waits for a backend). One line per target:
//! `TARGET attempts N refused R timedout T` (ECONNREFUSED and ETIMEDOUT from the call: a hook's
//! reject and drop; anything else, such as EINPROGRESS, let the call through).

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(2);

fn tcp(target: SocketAddr) -> Result<String, String> {
    let mut s =
        TcpStream::connect_timeout(&target, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    let peer = s.peer_addr().map_err(|e| format!("getpeername: {e}"))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let backend = body.split_whitespace().next().unwrap_or("none");
    Ok(format!("{backend} {peer}"))
}

fn udp(target: SocketAddr) -> Result<String, String> {
    let bind: SocketAddr = match target.ip() {
        IpAddr::V4(_) => "0.0.0.0:0",
        IpAddr::V6(_) => "[::]:0",
    }
    .parse()
    .map_err(|e| format!("{e}"))?;
    let s = UdpSocket::bind(bind).map_err(|e| format!("bind: {e}"))?;
    s.set_read_timeout(Some(TIMEOUT))
        .map_err(|e| e.to_string())?;
    s.send_to(b"hello", target)
        .map_err(|e| format!("sendto: {e}"))?;
    let mut buf = [0u8; 1500];
    let (n, from) = s
        .recv_from(&mut buf)
        .map_err(|e| format!("recvfrom: {e}"))?;
    let text = String::from_utf8_lossy(&buf[..n]);
    let backend = text.split_whitespace().next().unwrap_or("none").to_string();
    Ok(format!("{backend} {from}"))
}

/// `connects`: counts of what the calls to each target answered.
fn connects(millis: u64, targets: &[SocketAddr]) {
    use nix::errno::Errno;
    use nix::sys::socket::{
        connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn, SockaddrIn6,
    };
    use std::os::fd::AsRawFd;
    let deadline = std::time::Instant::now() + Duration::from_millis(millis);
    let mut counts = vec![[0u64; 3]; targets.len()];
    while std::time::Instant::now() < deadline {
        for (target, count) in targets.iter().zip(counts.iter_mut()) {
            let family = match target {
                SocketAddr::V4(_) => AddressFamily::Inet,
                SocketAddr::V6(_) => AddressFamily::Inet6,
            };
            let fd = match socket(family, SockType::Stream, SockFlag::SOCK_NONBLOCK, None) {
                Ok(fd) => fd,
                Err(e) => {
                    eprintln!("socket: {e}");
                    std::process::exit(1);
                }
            };
            count[0] += 1;
            let called = match target {
                SocketAddr::V4(a) => connect(fd.as_raw_fd(), &SockaddrIn::from(*a)),
                SocketAddr::V6(a) => connect(fd.as_raw_fd(), &SockaddrIn6::from(*a)),
            };
            match called {
                Err(Errno::ECONNREFUSED) => count[1] += 1,
                Err(Errno::ETIMEDOUT) => count[2] += 1,
                _ => {}
            }
        }
    }
    for (target, [attempts, refused, timedout]) in targets.iter().zip(counts) {
        println!("{target} attempts {attempts} refused {refused} timedout {timedout}");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, millis, targets @ ..] = args.as_slice() {
        if mode == "connects" {
            let millis = millis.parse::<u64>();
            let targets: Result<Vec<SocketAddr>, _> = targets.iter().map(|t| t.parse()).collect();
            let (Ok(millis), Ok(targets)) = (millis, targets) else {
                eprintln!("usage: kp-sockpeer connects MILLIS ADDRESS:PORT...");
                std::process::exit(64);
            };
            connects(millis, &targets);
            return;
        }
    }
    let usage = "usage: kp-sockpeer tcp|udp ADDRESS PORT COUNT";
    let [proto, addr, port, count] = args.as_slice() else {
        eprintln!("{usage}");
        std::process::exit(64);
    };
    let (Ok(ip), Ok(port), Ok(count)) = (
        addr.parse::<IpAddr>(),
        port.parse::<u16>(),
        count.parse::<usize>(),
    ) else {
        eprintln!("{usage}");
        std::process::exit(64);
    };
    let target = SocketAddr::new(ip, port);
    for _ in 0..count {
        let result = match proto.as_str() {
            "tcp" => tcp(target),
            "udp" => udp(target),
            _ => {
                eprintln!("{usage}");
                std::process::exit(64);
            }
        };
        match result {
            Ok(line) => println!("{line}"),
            Err(e) => println!("error {e}"),
        }
    }
}
