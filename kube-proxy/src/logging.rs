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

/// `--logging-format=json`: one JSON object per event, with upstream's keys (`ts` in seconds
/// since the epoch, `v` the verbosity, `msg`), then the event's fields and `level`/`target`.
/// Escaping is JSON's own, so a hostile name cannot break a line here either.
struct JsonLines;

/// Collects an event's fields as `"key":value` pairs of a JSON object.
#[derive(Default)]
struct JsonFields(String);

impl JsonFields {
    fn push(&mut self, key: &str, raw_value: &str) {
        if !self.0.is_empty() {
            self.0.push(',');
        }
        json_string(&mut self.0, key);
        self.0.push(':');
        self.0.push_str(raw_value);
    }

    fn push_str(&mut self, key: &str, value: &str) {
        let mut quoted = String::with_capacity(value.len() + 2);
        json_string(&mut quoted, value);
        self.push(key, &quoted);
    }
}

/// Appends `s` as a JSON string literal (RFC 8259 escapes; every control character escaped).
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

impl tracing::field::Visit for JsonFields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let key = if field.name() == "message" {
            "msg"
        } else {
            field.name()
        };
        self.push_str(key, &format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.record_debug(field, &format_args!("{value}"));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.push(field.name(), &value.to_string());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.push(field.name(), &value.to_string());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.push(field.name(), if value { "true" } else { "false" });
    }
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonLines
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let meta = event.metadata();
        // klog's verbosity of the level: info is V(0), debug V(2), trace V(4).
        let v = match *meta.level() {
            tracing::Level::TRACE => 4,
            tracing::Level::DEBUG => 2,
            _ => 0,
        };
        let mut fields = JsonFields::default();
        fields.push("ts", &format!("{ts:.6}"));
        fields.push("v", &v.to_string());
        fields.push_str("level", &meta.level().as_str().to_lowercase());
        fields.push_str("target", meta.target());
        event.record(&mut fields);
        let line = format!("{{{}}}", fields.0);
        writeln!(writer, "{line}")
    }
}

/// A subscriber that writes one JSON object per event to `writer`.
fn json_subscriber<W>(verbosity: u8, writer: W) -> impl tracing::Subscriber + Send + Sync
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter(verbosity))
        .with_ansi(false)
        .event_format(JsonLines)
        .with_writer(writer)
        .finish()
}

/// Sends every event of the process to stderr, as text (colours only on a terminal) or JSON.
pub fn init(verbosity: u8, format: kp_proxy::config::LogFormat) {
    // Fails only if a subscriber is already set, which `main` does once.
    let _ = match format {
        kp_proxy::config::LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
            tracing::subscriber::set_global_default(subscriber(verbosity, ansi, std::io::stderr))
        }
        kp_proxy::config::LogFormat::Json => {
            tracing::subscriber::set_global_default(json_subscriber(verbosity, std::io::stderr))
        }
    };
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
    fn json_format_writes_one_object_per_event_with_upstreams_keys() {
        let out = Buffer::default();
        let name = "api\n\"quoted\"";
        tracing::subscriber::with_default(json_subscriber(0, out.clone()), || {
            tracing::info!(mode = "nftables", count = 3, "starting {name}");
            tracing::warn!(error = %name, "second");
            tracing::debug!("not at -v=0");
        });
        let text = String::from_utf8(out.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["msg"], format!("starting {name}"), "{text}");
        assert_eq!(lines[0]["mode"], "nftables");
        assert_eq!(lines[0]["count"], 3);
        assert_eq!(lines[0]["v"], 0);
        assert!(lines[0]["ts"].as_f64().unwrap() > 1.6e9, "{text}");
        assert_eq!(lines[1]["level"], "warn");
        assert_eq!(lines[1]["error"], name);
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
