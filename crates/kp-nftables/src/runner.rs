//! Running `nft`, and the netlink session kept for element batches: with `netlink.rs`, the only
//! places this crate touches the system.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::Error;

/// Runs nft scripts and listings, optionally inside a named network namespace (tests and
/// benchmarks program namespaces they created; the proxy itself runs in its node's namespace).
/// As the dataplane's [`NftablesBackend`](crate::NftablesBackend) it also keeps the netlink
/// socket that element batches go through.
#[derive(Debug, Default)]
pub struct NftCommand {
    netns: Option<String>,
    /// The nft program; `nft` from `PATH` when unset.
    program: Option<std::path::PathBuf>,
    /// The netlink socket for element batches, opened on first use and kept (closing one after
    /// a commit costs the kernel an RCU grace period); dropped after any error.
    session: Option<crate::netlink::Session>,
}

/// A clone runs in the same namespace with the same program, and opens a socket of its own.
impl Clone for NftCommand {
    fn clone(&self) -> Self {
        NftCommand {
            netns: self.netns.clone(),
            program: self.program.clone(),
            session: None,
        }
    }
}

impl NftCommand {
    /// `nft` in the current network namespace.
    pub fn new() -> Self {
        NftCommand::default()
    }

    /// The network namespace it runs in, if not the current one.
    pub fn netns(&self) -> Option<&str> {
        self.netns.as_deref()
    }

    /// Runs `program` instead of `nft` (tests use it to make nft fail). Everything then goes
    /// through the program as text, element changes included (see
    /// [`NftCommand::netlink_elements`]).
    pub fn with_program(mut self, program: impl Into<std::path::PathBuf>) -> Self {
        self.program = Some(program.into());
        self
    }

    /// Whether element changes may bypass nft and go to the kernel over netlink (in the same
    /// namespace): true for the real nft. A stand-in program (tests) sees every change as text.
    pub fn netlink_elements(&self) -> bool {
        self.program.is_none()
    }

    /// `ip netns exec NAME nft …`.
    pub fn in_netns(name: impl Into<String>) -> Self {
        NftCommand {
            netns: Some(name.into()),
            ..NftCommand::default()
        }
    }

    /// Runs `f` on the netlink session (opening it if needed); drops the session if `f` fails,
    /// as replies may be left unread.
    pub(crate) fn with_session<T>(
        &mut self,
        f: impl FnOnce(&mut crate::netlink::Session) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let mut session = match self.session.take() {
            Some(s) => s,
            None => crate::netlink::Session::open(self.netns())?,
        };
        let r = f(&mut session);
        if r.is_ok() {
            self.session = Some(session);
        }
        r
    }

    fn command(&self) -> Command {
        let program = self
            .program
            .as_deref()
            .unwrap_or(std::path::Path::new("nft"));
        match &self.netns {
            Some(ns) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", ns]).arg(program);
                c
            }
            None => Command::new(program),
        }
    }

    /// `nft -f -` with `script` on stdin: one atomic transaction.
    pub fn run(&self, script: &str) -> Result<(), Error> {
        let mut child = self
            .command()
            .args(["-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(Error::Spawn)?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(script.as_bytes()).map_err(Error::Spawn)?;
        }
        let out = child.wait_with_output().map_err(Error::Spawn)?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        // nft reports `-:LINE:COL: Error: …`; keep the failing statement for the log.
        let failing = stderr
            .lines()
            .find_map(|l| l.strip_prefix("-:"))
            .and_then(|l| l.split(':').next())
            .and_then(|n| n.parse::<usize>().ok())
            .and_then(|n| script.lines().nth(n.saturating_sub(1)))
            .map(|l| l.chars().take(300).collect::<String>());
        Err(Error::Transaction {
            status: out.status.code(),
            stderr: stderr.chars().take(2000).collect(),
            failing_statement: failing,
        })
    }

    /// `nft -j ARGS…`, returning stdout.
    pub fn json(&self, args: &[&str]) -> Result<String, Error> {
        let out = self
            .command()
            .arg("-j")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(Error::Spawn)?;
        if !out.status.success() {
            return Err(Error::List {
                args: args.join(" "),
                stderr: String::from_utf8_lossy(&out.stderr)
                    .chars()
                    .take(2000)
                    .collect(),
            });
        }
        String::from_utf8(out.stdout).map_err(|_| Error::Parse("nft printed invalid UTF-8".into()))
    }
}
