//! kp-echo: the backend and the client of kube-proxy-rs's network-namespace tests.
//!
//! `kp-echo serve` answers every TCP connection with a minimal HTTP/1.1 response and every UDP
//! datagram with one datagram; both carry `NAME CLIENT_IP:PORT`, so a test learns which backend
//! answered and which source address the backend saw (was the client masqueraded?).
//!
//! `kp-echo request` prints one line per attempt, which the library's `Outcome::parse` reads:
//! `NAME CLIENT_IP`, or `timeout`, `refused`, `unreachable`, `reset`, or `error MESSAGE`. These
//! are results, not failures: it exits 0 for all of them and 64 only for a usage error.
//!
//! `kp-echo stream` holds one TCP connection open and sends a numbered line every interval,
//! each echoed back by the server (the connection's first line, `STREAM`, switches the server
//! from HTTP to echoing): a long-lived connection whose every gap and reset is seen, for tests
//! that restart or switch the proxy under it. It prints one line at the end:
//! `stream NAME sent=N echoed=N max_gap_ms=G` followed by ` failed=WHY` if it broke.
//!
//! `kp-echo resolver` holds one connected UDP socket, as a DNS resolver keeps one, and sends a
//! query every interval: one line per query, `OUTCOME at=MS` (the `request` words; MS since it
//! started). After an error other than a timeout (the socket was destroyed, or refused) it opens
//! a new socket for the next query; after a timeout it keeps the socket.
//!
//! SCTP (`--sctp`, `request sctp`) uses one-to-one style sockets (`SOCK_STREAM`,
//! `IPPROTO_SCTP`), which behave like TCP sockets for everything kp-echo does, so it shares the
//! TCP code. Where the kernel lacks SCTP, binding or connecting reports the kernel's error.
//!
//! Std only apart from socket2, which `--src-ip`/`--src-port` need (std cannot bind a TCP socket
//! before connecting) and which opens SCTP sockets.

use std::io::{self, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
    UdpSocket,
};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

const USAGE: &str = "\
usage:
  kp-echo serve --name NAME [--tcp PORT]... [--udp PORT]... [--sctp PORT]...
  kp-echo request tcp|udp|sctp HOST PORT [--timeout-ms N] [--src-port P] [--src-ip IP]
                  [--count N | --duration-ms N]
  kp-echo stream tcp HOST PORT [--interval-ms N] [--duration-ms N] [--timeout-ms N] [--src-port P]
                 [--src-ip IP]
  kp-echo resolver udp HOST PORT [--interval-ms N] [--duration-ms N] [--timeout-ms N]

serve listens on every address (IPv4 and IPv6) and prints `kp-echo NAME ready` once all ports
are bound. request prints one line per attempt: `NAME CLIENT_IP` for an answer, else `timeout`,
`refused`, `unreachable`, `reset` or `error MESSAGE` (with --duration-ms, followed by
` ms=N`, the attempt's time); it exits 0 for all of these. stream keeps
one connection, sends a line every interval for the duration and prints
`stream NAME sent=N echoed=N max_gap_ms=G [failed=WHY]`. resolver keeps one connected UDP
socket (a new one after an error other than a timeout), queries every interval for the
duration and prints `OUTCOME at=MS` per query.";

/// Exit code for a usage error (sysexits' EX_USAGE), as for a bad config elsewhere.
const EX_USAGE: u8 = 64;

/// Words `request` prints for a failed attempt; a backend may not be named after one.
const RESERVED: [&str; 5] = ["timeout", "refused", "unreachable", "reset", "error"];

/// How long the server waits for the rest of a request, and for the client to close after the
/// answer (so closing never turns unread bytes into a RST).
const SERVER_IO_TIMEOUT: Duration = Duration::from_secs(1);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("serve") => ServeArgs::parse(&args[1..]).map(serve),
        Some("request") => RequestArgs::parse(&args[1..]).map(request),
        Some("stream") => RequestArgs::parse(&args[1..]).map(stream),
        Some("resolver") => RequestArgs::parse(&args[1..]).and_then(resolver),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown command `{other}`")),
        None => Err("missing command".to_string()),
    };
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("kp-echo: {message}\n\n{USAGE}");
            ExitCode::from(EX_USAGE)
        }
    }
}

/// Arguments of `kp-echo serve`.
#[derive(Debug, PartialEq)]
struct ServeArgs {
    name: String,
    tcp: Vec<u16>,
    udp: Vec<u16>,
    sctp: Vec<u16>,
}

impl ServeArgs {
    fn parse(args: &[String]) -> Result<ServeArgs, String> {
        let mut name = None;
        let mut tcp = Vec::new();
        let mut udp = Vec::new();
        let mut sctp = Vec::new();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let mut value = || {
                it.next()
                    .map(String::as_str)
                    .ok_or_else(|| format!("{flag} needs a value"))
            };
            match flag.as_str() {
                "--name" => name = Some(value()?.to_string()),
                "--tcp" => tcp.push(parse_port(flag, value()?)?),
                "--udp" => udp.push(parse_port(flag, value()?)?),
                "--sctp" => sctp.push(parse_port(flag, value()?)?),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        let name = name.ok_or("--name is required")?;
        if name.is_empty() || name.chars().any(char::is_whitespace) {
            return Err(format!("--name `{name}` must be one non-empty word"));
        }
        if RESERVED.contains(&name.as_str()) {
            return Err(format!("--name `{name}` is reserved for request results"));
        }
        if tcp.is_empty() && udp.is_empty() && sctp.is_empty() {
            return Err("give at least one --tcp, --udp or --sctp port".to_string());
        }
        Ok(ServeArgs {
            name,
            tcp,
            udp,
            sctp,
        })
    }
}

fn parse_port(flag: &str, value: &str) -> Result<u16, String> {
    match value.parse::<u16>() {
        Ok(0) | Err(_) => Err(format!("{flag}: `{value}` is not a port (1-65535)")),
        Ok(port) => Ok(port),
    }
}

/// Binds every port first (so `ready` means ready), then serves forever.
fn serve(args: ServeArgs) -> ExitCode {
    let mut streams = Vec::new();
    let stream_ports = (args.tcp.iter().map(|&p| (Proto::Tcp, p)))
        .chain(args.sctp.iter().map(|&p| (Proto::Sctp, p)));
    for (proto, port) in stream_ports {
        match bind_any(Type::STREAM, proto.socket_protocol(), port).and_then(|s| {
            s.listen(1024)?;
            // A one-to-one SCTP socket accepts, reads, writes and shuts down through the same
            // calls as TCP, which is all TcpListener and TcpStream do with it.
            Ok(TcpListener::from(s))
        }) {
            Ok(listener) => streams.push(listener),
            Err(e) => return bind_failed(proto.as_str(), port, &e),
        }
    }
    let mut udp = Vec::new();
    for &port in &args.udp {
        match bind_any(Type::DGRAM, Protocol::UDP, port) {
            Ok(socket) => udp.push(UdpSocket::from(socket)),
            Err(e) => return bind_failed("udp", port, &e),
        }
    }

    let mut threads = Vec::new();
    for listener in streams {
        let name = args.name.clone();
        threads.push(thread::spawn(move || accept_loop(&listener, &name)));
    }
    for socket in udp {
        let name = args.name.clone();
        threads.push(thread::spawn(move || udp_loop(&socket, &name)));
    }
    println!("kp-echo {} ready", args.name);
    let _ = io::stdout().flush();
    for t in threads {
        let _ = t.join();
    }
    ExitCode::FAILURE
}

fn bind_failed(proto: &str, port: u16, e: &io::Error) -> ExitCode {
    eprintln!("kp-echo: cannot bind {proto} port {port}: {e}");
    ExitCode::FAILURE
}

/// A socket bound to `port` on every address: one dual-stack IPv6 socket (set explicitly, so
/// the namespace's `bindv6only` does not matter), or IPv4 only where IPv6 is unavailable.
fn bind_any(ty: Type, proto: Protocol, port: u16) -> io::Result<Socket> {
    let dual = Socket::new(Domain::IPV6, ty, Some(proto)).and_then(|s| {
        s.set_only_v6(false)?;
        s.set_reuse_address(true)?;
        s.bind(&SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)).into())?;
        Ok(s)
    });
    if dual.is_ok() {
        return dual;
    }
    let v4 = Socket::new(Domain::IPV4, ty, Some(proto))?;
    v4.set_reuse_address(true)?;
    v4.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)).into())?;
    Ok(v4)
}

/// IPv4 clients of a dual-stack socket appear as `::ffff:a.b.c.d`; report them as IPv4.
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

fn accept_loop(listener: &TcpListener, name: &str) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                let name = name.to_string();
                thread::spawn(move || {
                    if let Err(e) = answer_tcp(stream, &name) {
                        eprintln!("kp-echo: tcp connection: {e}");
                    }
                });
            }
            Err(e) => {
                // Out of descriptors and the like: back off instead of spinning.
                eprintln!("kp-echo: accept: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn answer_tcp(mut stream: TcpStream, name: &str) -> io::Result<()> {
    let peer = canonical(stream.peer_addr()?);
    stream.set_read_timeout(Some(SERVER_IO_TIMEOUT))?;
    stream.set_write_timeout(Some(SERVER_IO_TIMEOUT))?;

    let mut request = Vec::new();
    let mut chunk = [0u8; 4096];
    while !request_complete(&request) && request.len() < 64 * 1024 {
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => request.extend_from_slice(&chunk[..n]),
        }
    }

    if let Some(rest) = request.strip_prefix(STREAM_HELLO) {
        return echo_stream(stream, name, peer, rest);
    }
    let body = format!("{name} {peer}\n");
    let response = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes())?;
    // Close our side first and drain until the client closes: closing with unread input would
    // send a RST that can overtake the answer.
    stream.shutdown(Shutdown::Write)?;
    while let Ok(n) = stream.read(&mut chunk) {
        if n == 0 {
            break;
        }
    }
    Ok(())
}

/// The first line of a `kp-echo stream` connection.
const STREAM_HELLO: &[u8] = b"STREAM\n";

/// A `stream` connection: say who answers, then echo every byte until the client closes.
fn echo_stream(
    mut stream: TcpStream,
    name: &str,
    peer: SocketAddr,
    early: &[u8],
) -> io::Result<()> {
    stream.write_all(format!("{name} {peer}\n").as_bytes())?;
    stream.write_all(early)?;
    // The client sends at its own pace for as long as the test runs.
    stream.set_read_timeout(None)?;
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk)? {
            0 => return stream.shutdown(Shutdown::Write),
            n => stream.write_all(&chunk[..n])?,
        }
    }
}

/// Whether `request` holds a whole request: an HTTP head ending in a blank line, or one line of
/// something that is not HTTP.
fn request_complete(request: &[u8]) -> bool {
    if request.windows(4).any(|w| w == b"\r\n\r\n") || request.windows(2).any(|w| w == b"\n\n") {
        return true;
    }
    match request.iter().position(|&b| b == b'\n') {
        Some(end) => !String::from_utf8_lossy(&request[..end]).contains(" HTTP/"),
        None => false,
    }
}

fn udp_loop(socket: &UdpSocket, name: &str) {
    let mut buf = [0u8; 65536];
    loop {
        match socket.recv_from(&mut buf) {
            Ok((_, from)) => {
                let body = format!("{name} {}\n", canonical(from));
                if let Err(e) = socket.send_to(body.as_bytes(), from) {
                    eprintln!("kp-echo: udp reply to {from}: {e}");
                }
            }
            Err(e) => {
                eprintln!("kp-echo: udp receive: {e}");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Proto {
    Tcp,
    Udp,
    Sctp,
}

impl Proto {
    fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Sctp => "sctp",
        }
    }

    fn socket_protocol(self) -> Protocol {
        match self {
            Proto::Tcp => Protocol::TCP,
            Proto::Udp => Protocol::UDP,
            Proto::Sctp => Protocol::from(IPPROTO_SCTP),
        }
    }
}

/// `IPPROTO_SCTP` from `<netinet/in.h>`.
const IPPROTO_SCTP: i32 = 132;

/// Arguments of `kp-echo request`.
#[derive(Debug, PartialEq)]
struct RequestArgs {
    proto: Proto,
    host: String,
    dst: SocketAddr,
    timeout: Duration,
    src_ip: Option<IpAddr>,
    src_port: Option<u16>,
    count: usize,
    /// `stream` only: time between two lines.
    interval: Duration,
    /// How long to keep sending: `stream` (default 1 s), and `request`, which then makes
    /// attempts one after another until it has passed, instead of `count` of them.
    duration: Option<Duration>,
}

impl RequestArgs {
    fn parse(args: &[String]) -> Result<RequestArgs, String> {
        let mut positional = Vec::new();
        let mut timeout = Duration::from_millis(2000);
        let mut src_ip = None;
        let mut src_port = None;
        let mut count = 1;
        let mut interval = Duration::from_millis(10);
        let mut duration = None;
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            if !arg.starts_with("--") {
                positional.push(arg.as_str());
                continue;
            }
            let value = it
                .next()
                .map(String::as_str)
                .ok_or_else(|| format!("{arg} needs a value"))?;
            match arg.as_str() {
                "--timeout-ms" => match value.parse::<u64>() {
                    Ok(ms) if ms > 0 => timeout = Duration::from_millis(ms),
                    _ => return Err(format!("--timeout-ms: `{value}` is not a positive number")),
                },
                "--src-port" => src_port = Some(parse_port(arg, value)?),
                "--src-ip" => {
                    src_ip = Some(
                        parse_ip(value)
                            .ok_or_else(|| format!("--src-ip: `{value}` is not an IP"))?,
                    )
                }
                "--interval-ms" | "--duration-ms" => match value.parse::<u64>() {
                    Ok(ms) if ms > 0 && arg == "--interval-ms" => {
                        interval = Duration::from_millis(ms)
                    }
                    Ok(ms) if ms > 0 => duration = Some(Duration::from_millis(ms)),
                    _ => return Err(format!("{arg}: `{value}` is not a positive number")),
                },
                "--count" => match value.parse::<usize>() {
                    Ok(n) if n > 0 => count = n,
                    _ => return Err(format!("--count: `{value}` is not a positive number")),
                },
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        let [proto, host, port] = positional[..] else {
            return Err("request needs PROTO HOST PORT".to_string());
        };
        let proto = match proto {
            "tcp" => Proto::Tcp,
            "udp" => Proto::Udp,
            "sctp" => Proto::Sctp,
            other => return Err(format!("unknown protocol `{other}` (tcp, udp or sctp)")),
        };
        let port = parse_port("PORT", port)?;
        let dst = resolve(host, port, src_ip)?;
        if let Some(src) = src_ip {
            if src.is_ipv4() != dst.is_ipv4() {
                return Err(format!(
                    "--src-ip {src} and {} are of different families",
                    dst.ip()
                ));
            }
        }
        Ok(RequestArgs {
            proto,
            host: host.to_string(),
            dst,
            timeout,
            src_ip,
            src_port,
            count,
            interval,
            duration,
        })
    }

    /// The local address to bind, if the caller chose one.
    fn source(&self) -> Option<SocketAddr> {
        if self.src_ip.is_none() && self.src_port.is_none() {
            return None;
        }
        let ip = self.src_ip.unwrap_or(match self.dst {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        });
        Some(SocketAddr::new(ip, self.src_port.unwrap_or(0)))
    }
}

fn parse_ip(text: &str) -> Option<IpAddr> {
    text.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// An IP literal as is; a name through the resolver, preferring the source address's family.
fn resolve(host: &str, port: u16, src: Option<IpAddr>) -> Result<SocketAddr, String> {
    if let Some(ip) = parse_ip(host) {
        return Ok(SocketAddr::new(ip, port));
    }
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve `{host}`: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| src.is_none_or(|s| s.is_ipv4() == a.is_ipv4()))
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("`{host}` has no addresses"))
}

fn request(args: RequestArgs) -> ExitCode {
    let stdout = io::stdout();
    let start = Instant::now();
    let mut made = 0;
    while match args.duration {
        Some(d) => start.elapsed() < d,
        None => made < args.count,
    } {
        made += 1;
        let began = Instant::now();
        let mut line = match args.proto {
            Proto::Tcp | Proto::Sctp => request_stream(&args),
            Proto::Udp => request_udp(&args),
        }
        .unwrap_or_else(|e| classify(&e));
        // In a timed run, how long the attempt took: an answer that needed a retransmitted SYN
        // (a packet lost, then a second chance) shows as a second or more.
        if args.duration.is_some() {
            line.push_str(&format!(" ms={}", began.elapsed().as_millis()));
        }
        let mut out = stdout.lock();
        if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
            // Nobody is reading any more.
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `kp-echo stream`: one connection, a numbered line every interval, each read back.
fn stream(args: RequestArgs) -> ExitCode {
    let mut report = StreamReport::default();
    let failed = run_stream(&args, &mut report).err().map(|e| classify(&e));
    let mut line = format!(
        "stream {} sent={} echoed={} max_gap_ms={}",
        report.backend.as_deref().unwrap_or("-"),
        report.sent,
        report.echoed,
        report.max_gap.as_millis()
    );
    if let Some(why) = failed {
        line.push_str(&format!(" failed={}", why.replace(' ', "_")));
    }
    println!("{line}");
    ExitCode::SUCCESS
}

/// What a `stream` run saw.
#[derive(Default)]
struct StreamReport {
    backend: Option<String>,
    sent: u64,
    echoed: u64,
    /// The longest time between two echoes (or from the start to the first).
    max_gap: Duration,
}

fn run_stream(args: &RequestArgs, report: &mut StreamReport) -> io::Result<()> {
    if args.proto != Proto::Tcp {
        return Err(io::Error::other("stream speaks TCP only"));
    }
    let socket = new_socket(args, Type::STREAM, Protocol::TCP)?;
    socket.connect_timeout(&args.dst.into(), args.timeout)?;
    let mut stream = TcpStream::from(socket);
    stream.set_read_timeout(Some(args.timeout))?;
    stream.set_write_timeout(Some(args.timeout))?;
    stream.set_nodelay(true)?;
    stream.write_all(STREAM_HELLO)?;
    let mut reader = io::BufReader::new(stream.try_clone()?);
    let mut hello = String::new();
    io::BufRead::read_line(&mut reader, &mut hello)?;
    report.backend = hello.split_whitespace().next().map(str::to_string);
    let start = Instant::now();
    let mut last = start;
    let mut line = String::new();
    let duration = args.duration.unwrap_or(Duration::from_secs(1));
    while start.elapsed() < duration {
        let n = report.sent;
        stream.write_all(format!("{n}\n").as_bytes())?;
        report.sent += 1;
        line.clear();
        if io::BufRead::read_line(&mut reader, &mut line)? == 0 {
            return Err(io::ErrorKind::ConnectionReset.into());
        }
        if line.trim() != n.to_string() {
            return Err(io::Error::other(format!("echo {line:?} for {n}")));
        }
        report.echoed += 1;
        report.max_gap = report.max_gap.max(last.elapsed());
        last = Instant::now();
        thread::sleep(args.interval);
    }
    stream.shutdown(Shutdown::Write)?;
    Ok(())
}

/// The time left before `deadline`, or a timeout error once it has passed.
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::ErrorKind::TimedOut.into())
    } else {
        Ok(left)
    }
}

fn new_socket(args: &RequestArgs, ty: Type, proto: Protocol) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(args.dst), ty, Some(proto))?;
    if let Some(src) = args.source() {
        // A fixed source port is reused attempt after attempt.
        socket.set_reuse_address(true)?;
        socket.bind(&src.into())?;
    }
    Ok(socket)
}

/// One TCP connection or SCTP association: an HTTP GET, and the answer read to its end.
fn request_stream(args: &RequestArgs) -> io::Result<String> {
    let deadline = Instant::now() + args.timeout;
    let socket = new_socket(args, Type::STREAM, args.proto.socket_protocol())?;
    socket.connect_timeout(&args.dst.into(), args.timeout)?;
    let mut stream = TcpStream::from(socket);
    stream.set_write_timeout(Some(remaining(deadline)?))?;
    let host = match args.dst {
        SocketAddr::V6(_) if parse_ip(&args.host).is_some() => format!("[{}]", args.dst.ip()),
        _ => args.host.clone(),
    };
    let head = format!(
        "GET / HTTP/1.1\r\nHost: {host}:{}\r\nUser-Agent: kp-echo\r\nConnection: close\r\n\r\n",
        args.dst.port()
    );
    stream.write_all(head.as_bytes())?;

    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        stream.set_read_timeout(Some(remaining(deadline)?))?;
        match stream.read(&mut chunk)? {
            0 => break,
            n => answer.extend_from_slice(&chunk[..n]),
        }
    }
    Ok(parse_answer(&answer))
}

fn request_udp(args: &RequestArgs) -> io::Result<String> {
    let deadline = Instant::now() + args.timeout;
    let socket = connected_udp(args)?;
    query(&socket, remaining(deadline)?)
}

/// A UDP socket connected to the destination, so an ICMP port unreachable comes back as
/// ECONNREFUSED (and the socket hooks of ebpf mode pick its backend at connect).
fn connected_udp(args: &RequestArgs) -> io::Result<UdpSocket> {
    let socket = new_socket(args, Type::DGRAM, Protocol::UDP)?;
    socket.connect(&args.dst.into())?;
    Ok(UdpSocket::from(socket))
}

/// One datagram on a connected socket and its answer, waited for up to `timeout`.
fn query(socket: &UdpSocket, timeout: Duration) -> io::Result<String> {
    socket.send(b"kp-echo\n")?;
    let mut buf = [0u8; 65536];
    socket.set_read_timeout(Some(timeout))?;
    let n = socket.recv(&mut buf)?;
    Ok(parse_answer(&buf[..n]))
}

/// `kp-echo resolver`: one connected UDP socket, a query every interval.
fn resolver(args: RequestArgs) -> Result<ExitCode, String> {
    if args.proto != Proto::Udp {
        return Err("resolver speaks UDP only".to_string());
    }
    let start = Instant::now();
    let duration = args.duration.unwrap_or(Duration::from_secs(1));
    let stdout = io::stdout();
    let mut socket: Option<UdpSocket> = None;
    while start.elapsed() < duration {
        let result = match &socket {
            Some(s) => query(s, args.timeout),
            None => connected_udp(&args).and_then(|s| {
                let answer = query(&s, args.timeout);
                socket = Some(s);
                answer
            }),
        };
        let line = match result {
            Ok(line) => line,
            Err(e) => {
                if !matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) {
                    socket = None;
                }
                classify(&e)
            }
        };
        let mut out = stdout.lock();
        let written = writeln!(out, "{line} at={}", start.elapsed().as_millis());
        if written.and_then(|()| out.flush()).is_err() {
            return Ok(ExitCode::FAILURE);
        }
        drop(out);
        thread::sleep(args.interval);
    }
    Ok(ExitCode::SUCCESS)
}

/// `NAME CLIENT_IP` from an answer (HTTP or a bare UDP body), or an `error` line.
fn parse_answer(answer: &[u8]) -> String {
    let text = String::from_utf8_lossy(answer);
    let body = match text.find("\r\n\r\n") {
        Some(at) => &text[at + 4..],
        None => &text[..],
    };
    let mut words = body.split_whitespace();
    match (words.next(), words.next().map(str::parse::<SocketAddr>)) {
        (Some(name), Some(Ok(client))) => format!("{name} {}", client.ip()),
        _ if text.is_empty() => "error empty answer".to_string(),
        _ => format!("error unexpected answer: {}", one_line(&text, 80)),
    }
}

/// The line `request` prints for an I/O error.
fn classify(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => "refused".to_string(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => "timeout".to_string(),
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
            "unreachable".to_string()
        }
        io::ErrorKind::ConnectionReset => "reset".to_string(),
        _ => format!("error {}", one_line(&e.to_string(), 200)),
    }
}

fn one_line(text: &str, max: usize) -> String {
    text.chars()
        .take(max)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect::<String>()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn serve_takes_repeated_ports_and_refuses_reserved_names() {
        let args = ServeArgs::parse(&strings(&[
            "--name", "pod-a", "--tcp", "80", "--tcp", "8080", "--udp", "53", "--sctp", "3868",
        ]));
        assert_eq!(
            args,
            Ok(ServeArgs {
                name: "pod-a".into(),
                tcp: vec![80, 8080],
                udp: vec![53],
                sctp: vec![3868],
            })
        );
        assert!(ServeArgs::parse(&strings(&["--name", "a", "--sctp", "9"])).is_ok());
        assert!(ServeArgs::parse(&strings(&["--name", "timeout", "--tcp", "80"])).is_err());
        assert!(ServeArgs::parse(&strings(&["--name", "a"])).is_err());
        assert!(ServeArgs::parse(&strings(&["--name", "a", "--tcp", "0"])).is_err());
    }

    #[test]
    fn request_parses_options_in_any_order() {
        let args = RequestArgs::parse(&strings(&[
            "--count",
            "3",
            "udp",
            "fd00::1",
            "--src-ip",
            "fd00::2",
            "53",
            "--timeout-ms",
            "250",
        ]))
        .unwrap();
        assert_eq!(args.proto, Proto::Udp);
        assert_eq!(args.dst, "[fd00::1]:53".parse().unwrap());
        assert_eq!(args.count, 3);
        assert_eq!(args.timeout, Duration::from_millis(250));
        assert_eq!(args.source(), Some("[fd00::2]:0".parse().unwrap()));
    }

    #[test]
    fn request_speaks_sctp_through_the_stream_code() {
        let args = RequestArgs::parse(&strings(&["sctp", "10.96.0.132", "3868"])).unwrap();
        assert_eq!(args.proto, Proto::Sctp);
        assert_eq!(args.proto.socket_protocol(), Protocol::from(132));
        assert!(RequestArgs::parse(&strings(&["quic", "10.0.0.1", "80"])).is_err());
    }

    #[test]
    fn request_rejects_a_source_of_the_other_family() {
        let err = RequestArgs::parse(&strings(&["tcp", "10.0.0.1", "80", "--src-ip", "fd00::2"]));
        assert!(err.unwrap_err().contains("different families"));
    }

    #[test]
    fn answers_are_read_from_http_and_bare_bodies() {
        let http = b"HTTP/1.1 200 OK\r\nContent-Length: 23\r\n\r\npod-a 10.244.1.11:40000\n";
        assert_eq!(parse_answer(http), "pod-a 10.244.1.11");
        assert_eq!(
            parse_answer(b"pod-b [2001:db8::2]:5353\n"),
            "pod-b 2001:db8::2"
        );
        assert_eq!(parse_answer(b""), "error empty answer");
        assert!(parse_answer(b"HTTP/1.1 404 Not Found\r\n\r\nnope").starts_with("error unexpected"));
    }

    #[test]
    fn a_request_is_complete_at_the_blank_line_or_after_one_raw_line() {
        assert!(!request_complete(b"GET / HTTP/1.1\r\nHost: x\r\n"));
        assert!(request_complete(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"));
        assert!(request_complete(b"hello\n"));
        assert!(!request_complete(b"hello"));
    }

    #[test]
    fn errors_map_to_the_documented_words() {
        let word = |kind: io::ErrorKind| classify(&kind.into());
        assert_eq!(word(io::ErrorKind::ConnectionRefused), "refused");
        assert_eq!(word(io::ErrorKind::WouldBlock), "timeout");
        assert_eq!(word(io::ErrorKind::HostUnreachable), "unreachable");
        assert_eq!(word(io::ErrorKind::NetworkUnreachable), "unreachable");
        assert_eq!(word(io::ErrorKind::ConnectionReset), "reset");
        assert!(word(io::ErrorKind::PermissionDenied).starts_with("error "));
    }
}
