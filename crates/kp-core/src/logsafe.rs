//! Text from Kubernetes objects, made safe to put in a log line.
//!
//! Object names, file names and field values are chosen by whoever writes the object. Written
//! raw, a name holding a newline forges a second log line, a carriage return hides the start of
//! one on a terminal, an escape sequence recolours or clears it, and a NUL truncates the line
//! for some collectors. [`Escaped`] prints every control character (C0, DEL and C1) as a Rust
//! escape (`\n`, `\r`, `\t`, `\0`, `\u{1b}`) and a backslash as `\\`, so one event is always
//! one line and the escaped text reads back unambiguously. Everything else, other Unicode
//! included, is kept.

use std::borrow::Cow;
use std::fmt;

/// Displays a string with its control characters and backslashes escaped (see the module
/// docs). For text taken from an object, wherever it is shown.
#[derive(Clone, Copy, Debug)]
pub struct Escaped<'a>(pub &'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0, needs_escape)
    }
}

/// Displays a string with its control characters escaped, backslashes kept: for a whole log
/// field, which may already hold text escaped by [`Escaped`] (escaping its backslashes again
/// would print `\\n` for a name's newline). No control character gets through either way.
#[derive(Clone, Copy, Debug)]
pub struct ControlsEscaped<'a>(pub &'a str);

impl fmt::Display for ControlsEscaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_escaped(f, self.0, char::is_control)
    }
}

fn write_escaped(f: &mut fmt::Formatter<'_>, s: &str, escape: fn(char) -> bool) -> fmt::Result {
    let mut rest = s;
    while let Some(i) = rest.find(escape) {
        f.write_str(&rest[..i])?;
        let c = rest[i..].chars().next().unwrap_or_default();
        match c {
            '\\' => f.write_str("\\\\")?,
            '\n' => f.write_str("\\n")?,
            '\r' => f.write_str("\\r")?,
            '\t' => f.write_str("\\t")?,
            '\0' => f.write_str("\\0")?,
            c => write!(f, "\\u{{{:x}}}", c as u32)?,
        }
        rest = &rest[i + c.len_utf8()..];
    }
    f.write_str(rest)
}

fn needs_escape(c: char) -> bool {
    c == '\\' || c.is_control()
}

/// `s` with its control characters escaped; borrowed when there is nothing to escape.
pub fn escape(s: &str) -> Cow<'_, str> {
    if s.contains(needs_escape) {
        Cow::Owned(Escaped(s).to_string())
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_never_survive_and_plain_text_is_untouched() {
        assert_eq!(escape("web/api"), "web/api");
        assert!(matches!(escape("näme-ü"), Cow::Borrowed(_)));
        let hostile = "api\nWARN forged line\r\0\u{1b}[2J\u{7f}\u{85}\t\\";
        let out = escape(hostile);
        assert_eq!(
            out,
            "api\\nWARN forged line\\r\\0\\u{1b}[2J\\u{7f}\\u{85}\\t\\\\"
        );
        assert!(!out.chars().any(char::is_control), "{out:?}");
    }

    #[test]
    fn a_backslash_is_escaped_so_an_escape_cannot_be_forged() {
        // Without escaping `\`, the name `a\nb` (backslash, n) would print exactly like a
        // name holding a real newline.
        assert_ne!(escape("a\\nb"), escape("a\nb"));
    }

    #[test]
    fn a_log_field_escapes_controls_once_and_keeps_escaped_text_as_it_is() {
        let field = format!("Service {}: bad\r", Escaped("a\nb"));
        assert_eq!(ControlsEscaped(&field).to_string(), "Service a\\nb: bad\\r");
    }
}
