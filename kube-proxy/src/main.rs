//! `kube-proxy`: the kube-proxy-rs node agent.
//!
//! Thin on purpose: it reads the configuration (exit code 64 when it is bad), sets up logging,
//! and hands over to [`proxy::run`], which wires the sources, the dataplane and the HTTP servers
//! together. Mirrors upstream `cmd/kube-proxy/app/server.go`.

mod config;
mod proxy;

use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

fn init_logging(verbosity: u8) {
    // -v maps onto levels the way klog's verbosity is used upstream: 0-1 info, 2-3 debug, 4+
    // trace. RUST_LOG, when set, wins (handy for one module at a time).
    let level = match verbosity {
        0..=1 => "info",
        2..=3 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(format!(
            "{level},kube_client=warn,kube_runtime=info,hyper=warn,tower=warn,rustls=warn"
        ))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let loaded = match config::load(std::env::args_os()) {
        Ok(l) => l,
        Err(e) => {
            e.print();
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    init_logging(loaded.config.verbosity);
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
    match runtime.block_on(proxy::run(loaded)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(proxy::Fatal::Config(msg)) => {
            tracing::error!("{msg}");
            eprintln!("kube-proxy: {msg}");
            ExitCode::from(64)
        }
        Err(proxy::Fatal::Runtime(e)) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
