//! `kp-fuzz`: the long fuzzing run. `kp-fuzz --objects 1000000 --seed 1` generates that many
//! objects, prints the figures every few seconds and a final report, and exits 1 if any
//! invariant broke (2 on a bad command line).

use std::process::ExitCode;
use std::time::Duration;

use kp_fuzz::Options;

const USAGE: &str = "usage: kp-fuzz [--objects N] [--seed S] [--plan-every K] [--progress SECONDS]";

/// The command line: `(options, progress interval)`, or what is wrong with it.
fn parse(args: &[String]) -> Result<(Options, Duration), String> {
    let mut opts = Options::new(1, 1_000_000);
    let mut every = Duration::from_secs(5);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || -> Result<u64, String> {
            let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
            v.replace('_', "")
                .parse()
                .map_err(|e| format!("{flag} {v:?}: {e}"))
        };
        match flag.as_str() {
            "--objects" => opts.objects = value()?,
            "--seed" => opts.seed = value()?,
            "--plan-every" => opts.plan_every = value()?.max(1),
            "--progress" => every = Duration::from_secs(value()?.max(1)),
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok((opts, every))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (opts, every) = match parse(&args) {
        Ok(p) => p,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("kp-fuzz: {e}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "kp-fuzz: {} objects from seed {}, a plan every ~{} objects",
        opts.objects, opts.seed, opts.plan_every
    );
    let report = kp_fuzz::run_with(&opts, every, |r| {
        eprintln!("progress: {}", r.summary());
    });
    print!("{report}");
    println!("final: {}", report.summary());
    if report.violation_count() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
