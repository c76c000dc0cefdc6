//! Bulk throughput of the relay on loopback, splice against copy: `relay_throughput [MiB]`.
//! Run it inside a network namespace of its own (`ip netns exec`), in release mode. Prints one
//! line per mode: MiB moved, seconds, GiB/s, and the CPU time the process used.

use std::time::Instant;

use kp_userspace::relay::{relay, Copying};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn cpu_seconds() -> f64 {
    let u = nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF);
    u.map_or(0.0, |u| {
        let t = u.user_time() + u.system_time();
        t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6
    })
}

async fn one(copying: Copying, mib: usize) -> std::io::Result<()> {
    let front = TcpListener::bind("127.0.0.1:0").await?;
    let back = TcpListener::bind("127.0.0.1:0").await?;
    let mut client = TcpStream::connect(front.local_addr()?).await?;
    let (accepted, _) = front.accept().await?;
    let upstream = TcpStream::connect(back.local_addr()?).await?;
    let (mut endpoint, _) = back.accept().await?;
    let relay = tokio::spawn(async move { relay(accepted, upstream, copying, &|_| {}).await });
    let sink = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0usize;
        loop {
            let n = endpoint.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(total);
            }
            total += n;
        }
    });
    let chunk = vec![0x5au8; 1 << 20];
    let cpu = cpu_seconds();
    let start = Instant::now();
    for _ in 0..mib {
        client.write_all(&chunk).await?;
    }
    client.shutdown().await?;
    let got = sink.await.map_err(std::io::Error::other)??;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu;
    relay.await.map_err(std::io::Error::other)?;
    assert_eq!(got, mib << 20);
    println!(
        "{copying:?}: {mib} MiB in {secs:.2} s = {:.2} GiB/s, process CPU {cpu:.2} s",
        mib as f64 / 1024.0 / secs
    );
    Ok(())
}

fn main() -> std::io::Result<()> {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1024);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        for _ in 0..2 {
            one(Copying::Buffer, mib).await?;
            one(Copying::Splice, mib).await?;
        }
        Ok(())
    })
}
