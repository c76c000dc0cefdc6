//! Go's `time.Duration` text form, as carried by `metav1.Duration` in the config file and by
//! duration flags (`30s`, `15m0s`, `1h2m3.5s`, `250ms`).
//!
//! Parsing follows Go's `time.ParseDuration`; printing follows `time.Duration.String`, so a
//! value written by `--write-config-to` reads exactly as upstream would write it.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

const NANOSECOND: u128 = 1;
const MICROSECOND: u128 = 1_000 * NANOSECOND;
const MILLISECOND: u128 = 1_000 * MICROSECOND;
const SECOND: u128 = 1_000 * MILLISECOND;
const MINUTE: u128 = 60 * SECOND;
const HOUR: u128 = 60 * MINUTE;

/// A signed span of time in nanoseconds, like Go's `time.Duration` (an `int64`).
///
/// It is signed because the config file may say `-1s`, and validation must be able to say
/// "must be greater than 0" about it rather than fail to parse.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GoDuration {
    nanos: i64,
}

/// Why a duration string was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {reason}")]
pub struct DurationError {
    /// The text that was refused.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl GoDuration {
    /// Zero, which the config file treats as "unset" for most durations (as upstream does).
    pub const ZERO: GoDuration = GoDuration { nanos: 0 };

    /// A duration of `nanos` nanoseconds.
    pub const fn from_nanos(nanos: i64) -> Self {
        GoDuration { nanos }
    }

    /// A duration of `secs` seconds.
    pub const fn from_secs(secs: i64) -> Self {
        GoDuration {
            nanos: secs * 1_000_000_000,
        }
    }

    /// A duration of `millis` milliseconds.
    pub const fn from_millis(millis: i64) -> Self {
        GoDuration {
            nanos: millis * 1_000_000,
        }
    }

    /// The length in nanoseconds.
    pub const fn as_nanos(self) -> i64 {
        self.nanos
    }

    /// Whether this is exactly zero.
    pub const fn is_zero(self) -> bool {
        self.nanos == 0
    }

    /// Whether this is below zero.
    pub const fn is_negative(self) -> bool {
        self.nanos < 0
    }

    /// The same span as a [`std::time::Duration`], or `None` when negative.
    pub fn to_std(self) -> Option<std::time::Duration> {
        u64::try_from(self.nanos)
            .ok()
            .map(std::time::Duration::from_nanos)
    }

    /// Parses Go's duration syntax: an optional sign, then one or more decimal numbers, each
    /// with an optional fraction and a unit (`ns`, `us`, `µs`, `μs`, `ms`, `s`, `m`, `h`).
    /// A bare `0` is also accepted, as in Go.
    pub fn parse(input: &str) -> Result<Self, DurationError> {
        let fail = |reason| DurationError {
            input: input.to_owned(),
            reason,
        };
        let mut rest = input;
        let negative = match rest.as_bytes().first() {
            Some(b'-') => {
                rest = &rest[1..];
                true
            }
            Some(b'+') => {
                rest = &rest[1..];
                false
            }
            _ => false,
        };
        if rest == "0" {
            return Ok(GoDuration::ZERO);
        }
        if rest.is_empty() {
            return Err(fail("expected a number followed by a unit, such as 30s"));
        }

        // Largest magnitude a signed 64-bit count of nanoseconds can hold for this sign.
        let limit: u128 = if negative { 1 << 63 } else { (1 << 63) - 1 };
        let mut total: u128 = 0;
        while !rest.is_empty() {
            let int_len = rest.bytes().take_while(u8::is_ascii_digit).count();
            let (int_digits, after) = rest.split_at(int_len);
            rest = after;
            let mut frac_digits = "";
            if let Some(after_dot) = rest.strip_prefix('.') {
                let frac_len = after_dot.bytes().take_while(u8::is_ascii_digit).count();
                (frac_digits, rest) = after_dot.split_at(frac_len);
            }
            if int_digits.is_empty() && frac_digits.is_empty() {
                return Err(fail("expected a number"));
            }
            let unit_len = rest
                .char_indices()
                .find(|&(_, c)| c == '.' || c.is_ascii_digit())
                .map_or(rest.len(), |(i, _)| i);
            let (unit_text, after) = rest.split_at(unit_len);
            rest = after;
            let unit = match unit_text {
                "" => return Err(fail("missing unit (one of ns, us, ms, s, m, h)")),
                "ns" => NANOSECOND,
                // Go accepts the micro sign (U+00B5) and the Greek letter mu (U+03BC).
                "us" | "\u{b5}s" | "\u{3bc}s" => MICROSECOND,
                "ms" => MILLISECOND,
                "s" => SECOND,
                "m" => MINUTE,
                "h" => HOUR,
                _ => return Err(fail("unknown unit (expected one of ns, us, ms, s, m, h)")),
            };

            let mut value: u128 = 0;
            for digit in int_digits.bytes() {
                value = value * 10 + u128::from(digit - b'0');
                if value > limit {
                    return Err(fail("out of range"));
                }
            }
            let mut amount = value * unit;
            // Like Go, digits past what the count can resolve are dropped; 18 digits are
            // already finer than a nanosecond for every unit.
            let mut numerator: u128 = 0;
            let mut scale: u128 = 1;
            for digit in frac_digits.bytes().take(18) {
                numerator = numerator * 10 + u128::from(digit - b'0');
                scale *= 10;
            }
            amount += numerator * unit / scale;
            total += amount;
            if total > limit {
                return Err(fail("out of range"));
            }
        }
        // `total` is within `limit`, so these conversions cannot fail; they are checked anyway.
        let magnitude = i128::try_from(total).map_err(|_| fail("out of range"))?;
        let signed = if negative { -magnitude } else { magnitude };
        let nanos = i64::try_from(signed).map_err(|_| fail("out of range"))?;
        Ok(GoDuration { nanos })
    }
}

impl From<std::time::Duration> for GoDuration {
    /// Saturates at Go's largest duration (about 292 years).
    fn from(d: std::time::Duration) -> Self {
        GoDuration {
            nanos: i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        }
    }
}

impl FromStr for GoDuration {
    type Err = DurationError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GoDuration::parse(s)
    }
}

/// Writes `value / scale` as a decimal with trailing zeros of the fraction removed.
fn write_scaled(f: &mut fmt::Formatter<'_>, value: u128, scale: u128) -> fmt::Result {
    let whole = value / scale;
    let fraction = value % scale;
    write!(f, "{whole}")?;
    if fraction != 0 {
        let width = (scale.ilog10()) as usize;
        let digits = format!("{fraction:0width$}");
        write!(f, ".{}", digits.trim_end_matches('0'))?;
    }
    Ok(())
}

impl fmt::Display for GoDuration {
    /// Go's `time.Duration.String`: `0s`, `250ms`, `1.5µs`, `30s`, `15m0s`, `1h2m3.5s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.nanos == 0 {
            return f.write_str("0s");
        }
        if self.nanos < 0 {
            f.write_str("-")?;
        }
        let magnitude = u128::from(self.nanos.unsigned_abs());
        if magnitude < SECOND {
            let (scale, unit) = if magnitude < MICROSECOND {
                (NANOSECOND, "ns")
            } else if magnitude < MILLISECOND {
                (MICROSECOND, "\u{b5}s")
            } else {
                (MILLISECOND, "ms")
            };
            write_scaled(f, magnitude, scale)?;
            return f.write_str(unit);
        }
        let hours = magnitude / HOUR;
        let minutes = magnitude % HOUR / MINUTE;
        let seconds = magnitude % MINUTE;
        if hours > 0 {
            write!(f, "{hours}h")?;
        }
        if hours > 0 || minutes > 0 {
            write!(f, "{minutes}m")?;
        }
        write_scaled(f, seconds, SECOND)?;
        f.write_str("s")
    }
}

impl Serialize for GoDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for GoDuration {
    /// Accepts only strings, as `metav1.Duration` does: a bare `30` has no unit and is refused.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DurationVisitor;

        impl Visitor<'_> for DurationVisitor {
            type Value = GoDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string such as \"30s\" or \"15m0s\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<GoDuration, E> {
                GoDuration::parse(v).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(DurationVisitor)
    }
}

/// `logging.flushFrequency`: component-base's `TimeOrMetaDuration` takes either a duration
/// string or a whole number of nanoseconds (kubeadm writes `flushFrequency: 0`).
pub(crate) mod time_or_meta {
    use super::GoDuration;
    use serde::de::{self, Visitor};
    use serde::Deserializer;
    use std::fmt;

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<GoDuration, D::Error> {
        struct V;

        impl Visitor<'_> for V {
            type Value = GoDuration;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string or a number of nanoseconds")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<GoDuration, E> {
                // A plain scalar such as `0` may arrive here as text.
                if let Ok(n) = v.parse::<i64>() {
                    return Ok(GoDuration::from_nanos(n));
                }
                GoDuration::parse(v).map_err(E::custom)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<GoDuration, E> {
                Ok(GoDuration::from_nanos(v))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<GoDuration, E> {
                i64::try_from(v)
                    .map(GoDuration::from_nanos)
                    .map_err(|_| E::custom("duration out of range"))
            }

            fn visit_unit<E: de::Error>(self) -> Result<GoDuration, E> {
                Ok(GoDuration::ZERO)
            }

            fn visit_none<E: de::Error>(self) -> Result<GoDuration, E> {
                Ok(GoDuration::ZERO)
            }
        }

        d.deserialize_any(V)
    }
}
