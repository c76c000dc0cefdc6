//! Helpers shared by the integration tests: a fixed clock and a minimal HTTP/1.1 client, so the
//! tests need no HTTP client crate. Everything talks to 127.0.0.1 only.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every request and socket operation gives up after this long, so a hang fails the test.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// `1_700_000_000 + secs` seconds after the epoch: 2023-11-14T22:13:20Z plus `secs`.
pub fn t(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_000 + secs)
}

/// A clock the test sets by hand.
#[derive(Clone)]
pub struct FakeClock(Arc<Mutex<SystemTime>>);

impl FakeClock {
    pub fn at(time: SystemTime) -> Self {
        FakeClock(Arc::new(Mutex::new(time)))
    }

    pub fn set(&self, time: SystemTime) {
        *self.0.lock().expect("clock lock") = time;
    }

    pub fn reader(&self) -> impl Fn() -> SystemTime + Send + Sync + 'static {
        let inner = self.0.clone();
        move || *inner.lock().expect("clock lock")
    }
}

/// A parsed HTTP response.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    /// The value of header `name` (case-insensitive), if present once or more.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// `GET path` over a fresh connection to `addr`, read until the server closes it.
pub async fn get(addr: SocketAddr, path: &str) -> std::io::Result<Reply> {
    tokio::time::timeout(TIMEOUT, get_inner(addr, path))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"))?
}

async fn get_inner(addr: SocketAddr, path: &str) -> std::io::Result<Reply> {
    let mut stream = TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8(raw).expect("response is UTF-8");
    let (head, body) = text
        .split_once("\r\n\r\n")
        .expect("response has a header block");
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("status code");
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    Ok(Reply {
        status,
        headers,
        body: body.to_string(),
    })
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}
