//! Relaying one TCP connection both ways, with half-close preserved.
//!
//! Each direction is a pump: read until end of stream, then `shutdown(SHUT_WR)` the other
//! socket, so a client that finishes sending still gets its whole answer. The zero-copy pump
//! moves bytes socket → pipe → socket with `splice(2)`, never through user memory; the copy
//! pump reads into a buffer and writes it out. Both wait on tokio's readiness of the sockets
//! (`TcpStream::readable`/`writable` and `try_io`, the same registration `AsyncFd` gives).
//!
//! The splice pump only reads from the socket while its pipe is empty, so an `EAGAIN` from the
//! read is the socket's (a full pipe would also say `EAGAIN`, and taking that for the socket's
//! would clear a readiness the kernel does not signal again). Since every round drains its
//! pipe, the pipe goes back to a shared pool between rounds: an idle connection holds its two
//! sockets and nothing else. It falls back to copying when no pipe can be made (file limit) or
//! the kernel refuses to splice the socket.
//!
//! An error in one direction (a reset) aborts the other: both sockets stop reading (which ends
//! the other pump) and close with a reset (`SO_LINGER` 0), so the peer that did not fail gets
//! the reset too, as it would have through a kernel NAT.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use nix::fcntl::{OFlag, SpliceFFlags};
use nix::sys::socket::{self, Shutdown};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// How bytes move between the two sockets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copying {
    /// `splice(2)` through a pipe (zero copy), falling back to [`Copying::Buffer`] where the
    /// kernel refuses.
    Splice,
    /// Read into a buffer, write it out.
    Buffer,
}

/// The most one splice moves: the default pipe's capacity. Larger pipes (`F_SETPIPE_SZ`, up
/// to 1 MiB) measured no faster on loopback (2.4-2.8 GiB/s either way, see the crate's
/// `examples/relay_throughput.rs`) and would pin more kernel memory per connection.
const PIPE_SIZE: usize = 1 << 16;
/// The copy pump's buffer.
const BUFFER: usize = 64 * 1024;

/// Told every count of bytes moved, as they move (for the bytes-relayed metric).
pub type Tally<'a> = dyn Fn(u64) + Sync + 'a;

/// Bytes moved in each direction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Relayed {
    /// Client to endpoint.
    pub upstream: u64,
    /// Endpoint to client.
    pub downstream: u64,
}

/// Relays `client` ⇄ `endpoint` until both directions have ended; `bytes` counts every byte
/// moved, as it moves (for the bytes-relayed metric).
pub async fn relay(
    client: TcpStream,
    endpoint: TcpStream,
    copying: Copying,
    bytes: &Tally<'_>,
) -> Relayed {
    let aborted = AtomicBool::new(false);
    let (up, down) = tokio::join!(
        pump(&client, &endpoint, copying, bytes, &aborted),
        pump(&endpoint, &client, copying, bytes, &aborted)
    );
    Relayed {
        upstream: up,
        downstream: down,
    }
}

/// One direction; returns the bytes it moved. On an error, aborts both sockets (see the module
/// docs).
async fn pump(
    from: &TcpStream,
    to: &TcpStream,
    copying: Copying,
    bytes: &Tally<'_>,
    aborted: &AtomicBool,
) -> u64 {
    let mut moved = 0;
    let r = match copying {
        Copying::Splice => pump_splice(from, to, bytes, &mut moved).await,
        Copying::Buffer => pump_copy(from, to, bytes, &mut moved).await,
    };
    match r {
        Ok(()) if !aborted.load(Ordering::Relaxed) => {
            // Half-close: the other side may still be sending. ENOTCONN when it already reset.
            let _ = socket::shutdown(to.as_raw_fd(), Shutdown::Write);
        }
        Ok(()) => {}
        Err(e) => {
            tracing::debug!(error = %e, "relay direction failed; aborting the connection");
            aborted.store(true, Ordering::Relaxed);
            abort(to);
            abort(from);
        }
    }
    moved
}

/// Makes `s` reset on close, and ends its reads (which wakes the other direction's pump
/// without sending anything: the reset goes when the relay drops the socket).
fn abort(s: &TcpStream) {
    let _ = crate::sys::reset_on_close(s);
    let _ = socket::shutdown(s.as_raw_fd(), Shutdown::Read);
}

async fn pump_splice(
    from: &TcpStream,
    to: &TcpStream,
    bytes: &Tally<'_>,
    moved: &mut u64,
) -> io::Result<()> {
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        // A pipe only while bytes are in flight: an idle connection holds none.
        from.readable().await?;
        let pipe = match Pipe::take() {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(error = %e, "no pipe for splice; copying instead");
                return pump_copy(from, to, bytes, moved).await;
            }
        };
        // The pipe is empty here, so EAGAIN can only be the socket's.
        let n = match from.try_io(Interest::READABLE, || {
            Ok(nix::fcntl::splice(
                from.as_fd(),
                None,
                pipe.w.as_fd(),
                None,
                PIPE_SIZE,
                flags,
            )?)
        }) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                pipe.put_back();
                continue;
            }
            Err(e) if *moved == 0 && e.raw_os_error() == Some(nix::libc::EINVAL) => {
                // A socket the kernel does not splice.
                pipe.put_back();
                return pump_copy(from, to, bytes, moved).await;
            }
            Err(e) => {
                pipe.put_back();
                return Err(e);
            }
        };
        if n == 0 {
            pipe.put_back();
            return Ok(());
        }
        let mut left = n;
        while left > 0 {
            match to.try_io(Interest::WRITABLE, || {
                Ok(nix::fcntl::splice(
                    pipe.r.as_fd(),
                    None,
                    to.as_fd(),
                    None,
                    left,
                    flags,
                )?)
            }) {
                Ok(m) => {
                    left -= m;
                    *moved += m as u64;
                    bytes(m as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => to.writable().await?,
                // The pipe still holds bytes: it is closed with them, never reused.
                Err(e) => return Err(e),
            }
        }
        pipe.put_back();
    }
}

/// Empty pipes kept for the next splice; more than this many idle ones are closed.
const POOL_MAX: usize = 256;

static POOL: std::sync::Mutex<Vec<Pipe>> = std::sync::Mutex::new(Vec::new());

/// A non-blocking pipe, taken from the pool of empty ones or made.
struct Pipe {
    r: OwnedFd,
    w: OwnedFd,
}

impl Pipe {
    fn take() -> io::Result<Pipe> {
        let pooled = POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        match pooled {
            Some(p) => Ok(p),
            None => {
                let (r, w) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
                Ok(Pipe { r, w })
            }
        }
    }

    /// Returns an empty pipe to the pool (or closes it when the pool is full).
    fn put_back(self) {
        let mut pool = POOL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if pool.len() < POOL_MAX {
            pool.push(self);
        }
    }
}

async fn pump_copy(
    from: &TcpStream,
    to: &TcpStream,
    bytes: &Tally<'_>,
    moved: &mut u64,
) -> io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    loop {
        let n = loop {
            match from.try_read(&mut buf) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => from.readable().await?,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            return Ok(());
        }
        let mut off = 0;
        while off < n {
            match to.try_write(&buf[off..n]) {
                Ok(m) => {
                    off += m;
                    *moved += m as u64;
                    bytes(m as u64);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => to.writable().await?,
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests;
