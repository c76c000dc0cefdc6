//! `bench`: kube-proxy-rs's scale benchmarks. Thin: parses the command line and hands over to
//! `kp_bench`. A bad command line (an unknown flag or mode, a bad size) exits with code 64.

use std::process::ExitCode;

/// The allocator the kube-proxy binary uses, so the in-process dataplanes measure as it runs
/// them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use kp_bench::cli::{Cli, ClientCommand, Command};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(64)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let result = match cli.command {
        None => {
            if let Err(e) = kp_bench::interrupt::watch() {
                eprintln!("bench: cannot handle SIGINT/SIGTERM ({e:#}); an interrupted run leaves its namespaces behind");
            }
            let args: Vec<String> = std::env::args().collect();
            let opts = std::env::current_exe()
                .map_err(anyhow::Error::from)
                .and_then(|exe| cli.run.options(exe, &args));
            match opts {
                Ok(opts) => kp_bench::run::run(&opts).map(drop),
                Err(e) => {
                    eprintln!("bench: {e:#}");
                    return ExitCode::from(64);
                }
            }
        }
        Some(Command::Churn(args)) => {
            if let Err(e) = kp_bench::interrupt::watch() {
                eprintln!("bench: cannot handle SIGINT/SIGTERM ({e:#}); an interrupted run leaves its namespaces behind");
            }
            let argv: Vec<String> = std::env::args().collect();
            let opts = std::env::current_exe()
                .map_err(anyhow::Error::from)
                .and_then(|exe| args.options(exe, &argv));
            match opts {
                Ok(opts) => churn(&opts),
                Err(e) => {
                    eprintln!("bench: {e:#}");
                    return ExitCode::from(64);
                }
            }
        }
        Some(Command::Vm(args)) => {
            let argv: Vec<String> = std::env::args().collect();
            match std::env::current_exe()
                .map_err(anyhow::Error::from)
                .and_then(|exe| args.options(exe, &argv))
            {
                Ok(opts) => kp_bench::vm::run(&opts).map(drop),
                Err(e) => {
                    eprintln!("bench: {e:#}");
                    return ExitCode::from(64);
                }
            }
        }
        Some(Command::VmMeasure(args)) => args.run(),
        Some(command) => subcommand(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs a churn soak and prints its result line, the one line on standard output; fails (exit
/// 1) when the soak says it failed.
fn churn(opts: &kp_bench::churn::ChurnOptions) -> anyhow::Result<()> {
    let r = kp_bench::churn::run(opts)?;
    println!("{}", r.line);
    match r.failure() {
        Some(why) => Err(anyhow::anyhow!(why)),
        None => Ok(()),
    }
}

fn subcommand(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Report { results, root } => {
            let root = root.unwrap_or_else(kp_bench::cli::default_root);
            let paths = if results.is_empty() {
                vec![root.join(kp_bench::report::RESULTS_DIR).join("latest.json")]
            } else {
                results
            };
            let parts = paths
                .iter()
                .map(|p| kp_bench::report::read_results(p))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let merged = kp_bench::results::Results::merge(parts)
                .ok_or_else(|| anyhow::anyhow!("no results to report"))?;
            for f in kp_bench::report::write_all(&root, &merged, false)? {
                eprintln!("wrote {}", f.display());
            }
        }
        Command::KubeApiserver {
            services,
            endpoints,
        } => {
            if let Err(e) = kp_bench::interrupt::watch() {
                eprintln!("bench: cannot handle SIGINT/SIGTERM ({e:#}); an interrupted run leaves its namespaces behind");
            }
            let cluster = kp_bench::cluster::Cluster::new(services, endpoints);
            let started = std::time::Instant::now();
            let server = kp_test::kube_apiserver::KubeApiServer::start()?;
            let loaded = server.load_cluster(&cluster)?;
            eprintln!(
                "bench: {} holds {} objects (up and loaded in {:.1} s)",
                server.url(),
                loaded.objects,
                started.elapsed().as_secs_f64()
            );
            let ns = kp_test::netns::Netns::new("kube-apiserver")?;
            let _bridge = server.bridge_into(&ns)?;
            println!("namespace={}", ns.name());
            println!("kubeconfig={}", server.kube_proxy_kubeconfig().display());
            use std::io::Write;
            std::io::stdout().flush()?;
            // Held until standard input closes.
            std::io::copy(&mut std::io::stdin(), &mut std::io::sink())?;
        }
        Command::Manifests {
            services,
            endpoints,
            mode,
            out,
            format,
        } => {
            let mode = kp_bench::modes::by_names(&[mode])?.remove(0);
            let format = kp_bench::proxy::Format::parse(&format)?;
            let cluster = kp_bench::cluster::Cluster::new(services, endpoints);
            kp_bench::proxy::write_manifests(&out, &cluster, format)?;
            for flag in kp_bench::proxy::binary_flags(mode.as_ref()) {
                println!("{flag}");
            }
        }
        // `main` runs it (it exits 64 on bad settings); never reached.
        Command::Churn(_) | Command::Vm(_) | Command::VmMeasure(_) => {
            anyhow::bail!("run from main")
        }
        Command::DatapathServer { connect, bulk } => kp_bench::datapath::serve(connect, bulk)?,
        Command::DatapathClient(ClientCommand::Connect {
            target,
            seconds,
            threads,
            perf_ctl,
            perf_event,
        }) => {
            let perf = perf_ctl
                .map(|c| kp_bench::datapath::PerfSwitch::parse(&c, perf_event.as_deref()))
                .transpose()?;
            let samples = kp_bench::datapath::connect_run(target, seconds, threads, perf.as_ref())?;
            println!("{}", serde_json::to_string(&samples)?);
        }
        Command::DatapathClient(ClientCommand::Bulk { target, bytes }) => {
            // On a named thread, so a profile of every CPU tells the sender apart.
            let sender = std::thread::Builder::new()
                .name("kp-bulk".into())
                .spawn(move || kp_bench::datapath::bulk_run(target, bytes))?;
            let gbps = sender
                .join()
                .map_err(|_| anyhow::anyhow!("the bulk sender panicked"))??;
            println!("{gbps}");
        }
    }
    Ok(())
}
