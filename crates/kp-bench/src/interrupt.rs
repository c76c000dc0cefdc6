//! Cleaning up after an interrupted run. SIGINT or SIGTERM would end `bench` without running its
//! destructors, leaving its network namespaces (`kpt-<pid>-…`, see `kp_test::netns`) and the
//! processes inside them (the proxy, the data-path server) behind. [`watch`] starts a thread that
//! waits for either signal, kills every process in this run's namespaces, deletes the namespaces
//! and exits with 130 (SIGINT) or 143 (SIGTERM), as a shell reports a process those signals
//! ended.

use std::process::{Command, Stdio};

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
            // The run goes on in the other threads until exit: no namespace of its may appear
            // after the listing below.
            kp_test::netns::stop_creating();
            let removed = remove_namespaces(std::process::id());
            eprintln!("bench: removed {removed} network namespaces");
            std::process::exit(code);
        })?;
    Ok(())
}

/// Kills the processes in every network namespace this process created and deletes the
/// namespaces; returns how many it deleted.
fn remove_namespaces(pid: u32) -> usize {
    let prefix = format!("kpt-{pid}-");
    let listed = Command::new("ip")
        .args(["netns", "list"])
        .stdin(Stdio::null())
        .output();
    let Ok(listed) = listed else {
        return 0;
    };
    let mut removed = 0;
    for name in String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(&prefix))
    {
        if let Ok(pids) = Command::new("ip").args(["netns", "pids", name]).output() {
            for p in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-KILL", p]).status();
            }
        }
        let deleted = Command::new("ip")
            .args(["netns", "delete", name])
            .status()
            .is_ok_and(|s| s.success());
        removed += usize::from(deleted);
    }
    removed
}
