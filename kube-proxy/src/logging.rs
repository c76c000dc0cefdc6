//! Log output: one event is one line, whatever the objects it names hold.
//!
//! Every field of every event (the message too) is written through
//! [`kp_core::logsafe::ControlsEscaped`], so a control character that came from a Kubernetes object
//! (a Service named `a\nb`, a manifest file name with a carriage return, a NUL in a label) is
//! printed as an escape and can neither forge a log line nor reach the terminal. Doing it
//! here, in the one formatter every event passes through, covers fields added later too.

use std::fmt;

use kp_core::logsafe::ControlsEscaped;
use tracing::field::Field;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::{debug_fn, Writer};
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::EnvFilter;

/// The filter for `-v` (klog's verbosity as upstream uses it: 0-1 info, 2-3 debug, 4+ trace).
/// `RUST_LOG`, when set, wins (handy for one module at a time).
fn filter(verbosity: u8) -> EnvFilter {
    let level = match verbosity {
        0..=1 => "info",
        2..=3 => "debug",
        _ => "trace",
    };
    EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::new(format!(
            "{level},kube_client=warn,kube_runtime=info,hyper=warn,tower=warn,rustls=warn"
        ))
    })
}

/// Writes one field: the message bare, any other as `name=value`, both escaped.
fn escaped_field(w: &mut Writer<'_>, field: &Field, value: &dyn fmt::Debug) -> fmt::Result {
    // `%x` fields reach here as a Debug wrapper that prints their Display form.
    let text = format!("{value:?}");
    if field.name() == "message" {
        write!(w, "{}", ControlsEscaped(&text))
    } else {
        write!(w, "{}={}", field.name(), ControlsEscaped(&text))
    }
}

/// A subscriber that writes escaped events to `writer`.
fn subscriber<W>(verbosity: u8, ansi: bool, writer: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter(verbosity))
        .with_ansi(ansi)
        .fmt_fields(debug_fn(escaped_field).delimited(" "))
        .with_writer(writer)
        .finish()
}

/// Sends every event of the process to stderr (colours only on a terminal).
pub fn init(verbosity: u8) {
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // Fails only if a subscriber is already set, which `main` does once.
    let _ = tracing::subscriber::set_global_default(subscriber(verbosity, ansi, std::io::stderr));
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'w self) -> Buffer {
            self.clone()
        }
    }

    /// Defect: a rejected object's name was logged raw, so a name holding a newline forged a
    /// second log line, and CR and NUL bytes reached the log. Each event is one line now, for
    /// fields formatted with `%`, `?` and in the message alike.
    #[test]
    fn a_hostile_name_in_any_field_stays_on_one_escaped_line() {
        let out = Buffer::default();
        let name = "api\nINFO kube_proxy: forged\r\0\u{1b}[2K";
        tracing::subscriber::with_default(subscriber(0, false, out.clone()), || {
            tracing::warn!(error = %name, object = ?name, "skipping {name}");
            tracing::info!(file = %name, "second");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text:?}");
        for line in &lines {
            assert!(!line.chars().any(char::is_control), "{line:?}");
        }
        assert!(
            lines[0].contains(
                "skipping api\\nINFO kube_proxy: forged\\r\\0\\u{1b}[2K error=api\\nINFO"
            ),
            "{}",
            lines[0]
        );
        assert!(lines[1].contains("second file=api\\n"), "{}", lines[1]);
    }

    #[test]
    fn plain_fields_print_as_the_default_formatter_does() {
        let out = Buffer::default();
        tracing::subscriber::with_default(subscriber(0, false, out.clone()), || {
            tracing::info!(mode = "nftables", count = 3, "starting kube-proxy-rs");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        assert!(
            text.contains("starting kube-proxy-rs mode=\"nftables\" count=3"),
            "{text}"
        );
    }
}
