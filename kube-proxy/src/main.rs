//! `kube-proxy`: the kube-proxy-rs node agent.
//!
//! Thin on purpose: it reads the configuration (exit code 64 when it is bad), sets up logging,
//! and hands over to [`kp_proxy::run`], which removes other modes' leftovers and wires the
//! sources, the dataplane and the HTTP servers together. Mirrors upstream
//! `cmd/kube-proxy/app/server.go`.
//!
//! Two subcommands of ours come first when named: `kube-proxy status` and `kube-proxy explain`
//! ([`inspect`]), which read the live rules instead of running the proxy.

mod inspect;
mod logging;

use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: at 100k Services glibc spent most of the first sync
/// consolidating freed chunks, and every thread's arena kept a read-back's worth of freed memory
/// resident (BENCHMARKS.md). Its defaults are changed before it starts so that freed memory
/// leaves the resident set at once (crates/kp-alloc). The `system-allocator` feature keeps
/// glibc's, for heap profilers that watch malloc (heaptrack; scripts/profile.sh builds it so for
/// its memory profiles).
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(sub) = args.get(1).and_then(|a| a.to_str()) {
        if inspect::is_subcommand(sub) {
            return inspect::main(sub, &args[2..]);
        }
    }
    let loaded = match kp_proxy::config::load(args) {
        Ok(l) => l,
        Err(e) => {
            e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    logging::init(loaded.config.verbosity, loaded.config.logging_format);
    #[cfg(not(feature = "system-allocator"))]
    {
        let alloc = kp_alloc::settings();
        tracing::debug!(
            arena_eager_commit = alloc.arena_eager_commit,
            purge_delay_ms = alloc.purge_delay_ms,
            "mimalloc settings (MIMALLOC_ARENA_EAGER_COMMIT and MIMALLOC_PURGE_DELAY change them)"
        );
    }
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(kp_proxy::run(loaded)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(kp_proxy::Fatal::Config(msg)) => {
            tracing::error!("{msg}");
            eprintln!("kube-proxy: {msg}");
            ExitCode::from(64)
        }
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("kube-proxy: {e}");
            ExitCode::FAILURE
        }
    }
}
