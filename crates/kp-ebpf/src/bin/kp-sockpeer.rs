//! A test client for the socket load balancer: connects (TCP) or sends (UDP) to a frontend
//! `COUNT` times and prints, per attempt, which backend answered and what address the
//! application saw for its peer (`getpeername` for TCP, the `recvfrom` source for UDP).
//!
//! Usage: `kp-sockpeer tcp|udp ADDRESS PORT COUNT`; output lines: `BACKEND PEER` or
//! `error TEXT`. The backends are kp-echo servers (their answer starts with their name).

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

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
