//! Why a configuration was refused.

use std::fmt;
use std::path::PathBuf;

/// `EX_USAGE` from sysexits.h: the exit code for a bad command line or config file.
pub const EXIT_BAD_CONFIG: i32 = 64;

/// Everything that can go wrong while turning flags and a config file into a [`super::Config`].
///
/// None of these is retryable: the same inputs give the same error. `main` prints the error
/// ([`ConfigError::print`]) and exits with [`ConfigError::exit_code`], which is 64 for all of
/// them except a request for `--help` or `--version`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The command line did not parse, or asked for `--help`/`--version` (clap renders
    /// both the message and the help text).
    #[error("{0}")]
    Cli(#[from] clap::Error),

    /// The `--config` file could not be read.
    #[error("reading config file {}: {source}", path.display())]
    Read {
        /// The file named by `--config`.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },

    /// The `--config` file is not well-formed YAML, has a value of the wrong type, or names a
    /// field that `KubeProxyConfiguration` does not have. The message comes from the YAML
    /// parser and names the field and its line.
    #[error("parsing config file {}: {message}", path.display())]
    Parse {
        /// The file named by `--config`.
        path: PathBuf,
        /// The parser's description, with the offending line.
        message: String,
    },

    /// The `--config` file has the wrong `apiVersion` or `kind`.
    #[error(
        "config file {}: {field} is {found:?}, expected {expected:?}",
        path.display()
    )]
    TypeMeta {
        /// The file named by `--config`.
        path: PathBuf,
        /// `apiVersion` or `kind`.
        field: &'static str,
        /// What the file says (empty when missing).
        found: String,
        /// What we read.
        expected: &'static str,
    },

    /// The merged configuration breaks one or more rules; every broken rule is listed, as
    /// upstream's validation aggregates them.
    #[error("invalid configuration: {}", FieldErrors(.0))]
    Invalid(Vec<FieldError>),

    /// YAML output for `--write-config-to` could not be produced.
    #[error("serializing configuration: {0}")]
    Serialize(String),
}

/// One broken rule, named by its path in `KubeProxyConfiguration` (as upstream's v1alpha1
/// field paths: `iptables.masqueradeBit`, `nodePortAddresses[1]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldError {
    /// Path of the field in the config file, e.g. `nftables.syncPeriod`.
    pub field: String,
    /// The flag that set the value, when one did (`--iptables-sync-period`).
    pub flag: Option<&'static str>,
    /// The offending value, as written.
    pub value: String,
    /// What is wrong with it.
    pub detail: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.field)?;
        if let Some(flag) = self.flag {
            write!(f, " (set by {flag})")?;
        }
        write!(f, ": {:?}: {}", self.value, self.detail)
    }
}

struct FieldErrors<'a>(&'a [FieldError]);

impl fmt::Display for FieldErrors<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// The process exit code for this error: 0 when the user asked for `--help` or
    /// `--version`, otherwise 64 (`EX_USAGE`).
    pub fn exit_code(&self) -> i32 {
        match self {
            ConfigError::Cli(e) if !e.use_stderr() => 0,
            _ => EXIT_BAD_CONFIG,
        }
    }

    /// Prints the error the way a user expects: help and version text to stdout, everything
    /// else to stderr.
    pub fn print(&self) {
        match self {
            ConfigError::Cli(e) => {
                // If even stdout/stderr are gone there is nobody left to tell.
                let _ = e.print();
            }
            other => eprintln!("kube-proxy: {other}"),
        }
    }

    /// The field errors, when this is [`ConfigError::Invalid`].
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            ConfigError::Invalid(errors) => errors,
            _ => &[],
        }
    }
}
