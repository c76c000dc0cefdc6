//! Test aid for kp-alloc: a process that allocates with mimalloc, as the kube-proxy binary
//! does, and reports the settings in force and what freeing does to its resident set.
//!
//! `kp-alloc-probe settings` prints `arena_eager_commit=N purge_delay_ms=N`;
//! `kp-alloc-probe churn` allocates and touches 64 MiB (as 1 MiB blocks, then again as 64-byte
//! ones), frees it, and prints `grown_kib=N returned_kib=N` for each.

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `VmRSS` of this process, KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// Allocates `total` bytes as blocks of `block` bytes, each written to, frees them, and prints
/// how much the resident set grew and how much of that freeing gave back.
fn churn(label: &str, total: usize, block: usize) {
    let before = rss_kib();
    let blocks: Vec<Vec<u8>> = (0..total / block)
        .map(|i| vec![i as u8 | 1; block])
        .collect();
    let peak = rss_kib();
    std::hint::black_box(&blocks);
    drop(blocks);
    let after = rss_kib();
    println!(
        "{label}: grown_kib={} returned_kib={}",
        peak.saturating_sub(before),
        peak.saturating_sub(after)
    );
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("settings") => {
            let s = kp_alloc::settings();
            println!(
                "arena_eager_commit={} purge_delay_ms={}",
                s.arena_eager_commit, s.purge_delay_ms
            );
        }
        Some("churn") => {
            // The settings are asked for so that the constructor is linked, as in kube-proxy.
            let _ = kp_alloc::settings();
            churn("large", 64 << 20, 1 << 20);
            churn("small", 64 << 20, 64);
        }
        _ => {
            eprintln!("usage: kp-alloc-probe settings|churn");
            std::process::exit(2);
        }
    }
}
