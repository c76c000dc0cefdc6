//! Cleaning up after an interrupted run. SIGINT or SIGTERM would end `bench` without running its
//! destructors, leaving its network namespaces (`kpt-<pid>-…`, see `kp_test::netns`) and the
//! processes inside them (the proxy, the data-path server) behind. [`watch`] starts a thread that
//! waits for either signal, kills every process in this run's namespaces, deletes the namespaces
//! and exits with 130 (SIGINT) or 143 (SIGTERM), as a shell reports a process those signals
//! ended.

use tokio::signal::unix::{signal, SignalKind};

/// Handles SIGINT and SIGTERM from now on (the handlers are in place when this returns).
pub fn watch() -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()?;
    let (mut interrupt, mut terminate) = runtime.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::interrupt())?,
            signal(SignalKind::terminate())?,
        ))
    })?;
    std::thread::Builder::new()
        .name("kp-interrupt".into())
        .spawn(move || {
            let code = runtime.block_on(async {
                tokio::select! {
                    _ = interrupt.recv() => 130,
                    _ = terminate.recv() => 143,
                }
            });
            eprintln!("bench: interrupted; removing this run's network namespaces");
            // The run goes on in the other threads until exit: `remove_own` first closes
            // namespace creation, so none of its namespaces can appear after the listing.
            let removed = kp_test::netns::remove_own();
            eprintln!("bench: removed {removed} network namespaces");
            // The real API servers (etcd, kube-apiserver) run outside the namespaces.
            let stopped = kp_test::kube_apiserver::stop_all();
            if stopped > 0 {
                eprintln!("bench: stopped {stopped} real API servers");
            }
            // The ebpf mode's cgroups and bpffs mounts, once their processes are gone.
            let removed = crate::ebpf::remove_own();
            if removed > 0 {
                eprintln!("bench: removed {removed} cgroups and bpffs mounts of the ebpf mode");
            }
            std::process::exit(code);
        })?;
    Ok(())
}
