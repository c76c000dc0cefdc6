//! RFC 3339 timestamps as Go's `time.Time` JSON encoding writes them (`RFC3339Nano`, UTC).
//!
//! Go trims trailing zeros from the fraction and drops it when it is zero, so a whole second
//! reads `2023-11-14T22:13:20Z` and a half second `2023-11-14T22:13:20.5Z`. Go's zero time, which
//! upstream prints for "never updated", is `0001-01-01T00:00:00Z`. A hand-written formatter keeps
//! this crate free of a date library for one function.

use std::time::{SystemTime, UNIX_EPOCH};

/// What Go prints for the zero `time.Time`: upstream's `lastUpdated` before any sync.
pub(crate) const ZERO_TIME: &str = "0001-01-01T00:00:00Z";

const SECS_PER_DAY: i64 = 86_400;

/// Formats `t` in UTC, with the fraction trimmed as Go's `RFC3339Nano` does.
pub fn format(t: SystemTime) -> String {
    let (secs, nanos) = unix_parts(t);
    let days = secs.div_euclid(SECS_PER_DAY);
    let second_of_day = secs.rem_euclid(SECS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    let mut out = format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}",
        second_of_day / 3600,
        second_of_day % 3600 / 60,
        second_of_day % 60,
    );
    if nanos > 0 {
        let fraction = format!("{nanos:09}");
        out.push('.');
        out.push_str(fraction.trim_end_matches('0'));
    }
    out.push('Z');
    out
}

/// Formats an optional time, printing Go's zero time for `None`.
pub(crate) fn format_or_zero(t: Option<SystemTime>) -> String {
    t.map_or_else(|| ZERO_TIME.to_string(), format)
}

/// Whole seconds since the Unix epoch (floored, so negative before 1970) and the nanoseconds
/// past them.
fn unix_parts(t: SystemTime) -> (i64, u32) {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => (
            i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
            d.subsec_nanos(),
        ),
        Err(before) => {
            let d = before.duration();
            let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
            match d.subsec_nanos() {
                0 => (-secs, 0),
                n => (-secs - 1, 1_000_000_000 - n),
            }
        }
    }
}

/// Days since 1970-01-01 to a proleptic Gregorian (year, month, day): Howard Hinnant's
/// `civil_from_days`, which counts in 400-year eras so it needs no tables or loops.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of each year.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097); // [0, 146096]
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365; // [0, 399]
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100); // [0, 365]
    let month_from_march = (5 * day_of_year + 2) / 153; // [0, 11]
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1; // [1, 31]
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    // Both are within their ranges by construction, so the casts cannot truncate.
    (year, month as u32, day as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64, nanos: u32) -> SystemTime {
        UNIX_EPOCH + Duration::new(secs, nanos)
    }

    #[test]
    fn the_epoch_is_midnight_on_new_years_day_1970() {
        assert_eq!(format(UNIX_EPOCH), "1970-01-01T00:00:00Z");
    }

    #[test]
    fn whole_seconds_have_no_fraction() {
        assert_eq!(format(at(1_700_000_000, 0)), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn fractions_are_trimmed_like_go_rfc3339nano() {
        assert_eq!(
            format(at(1_700_000_000, 500_000_000)),
            "2023-11-14T22:13:20.5Z"
        );
        assert_eq!(
            format(at(1_700_000_000, 123_456_789)),
            "2023-11-14T22:13:20.123456789Z"
        );
        assert_eq!(
            format(at(1_700_000_000, 1_000)),
            "2023-11-14T22:13:20.000001Z"
        );
    }

    #[test]
    fn leap_days_and_month_ends_are_right() {
        // 2024-02-29T12:00:00Z and the next day.
        assert_eq!(format(at(1_709_208_000, 0)), "2024-02-29T12:00:00Z");
        assert_eq!(
            format(at(1_709_208_000 + 86_400, 0)),
            "2024-03-01T12:00:00Z"
        );
        // 2000 is a leap year (divisible by 400), 2100 is not.
        assert_eq!(format(at(951_782_400, 0)), "2000-02-29T00:00:00Z");
        assert_eq!(format(at(4_107_542_400, 0)), "2100-03-01T00:00:00Z");
        assert_eq!(format(at(1_735_689_599, 0)), "2024-12-31T23:59:59Z");
    }

    #[test]
    fn times_before_1970_floor_to_the_previous_second() {
        assert_eq!(
            format(UNIX_EPOCH - Duration::from_secs(1)),
            "1969-12-31T23:59:59Z"
        );
        assert_eq!(
            format(UNIX_EPOCH - Duration::from_millis(250)),
            "1969-12-31T23:59:59.75Z"
        );
    }

    #[test]
    fn year_one_matches_gos_zero_time() {
        // Seconds from 0001-01-01 to 1970-01-01.
        let year_one = UNIX_EPOCH - Duration::from_secs(62_135_596_800);
        assert_eq!(format(year_one), ZERO_TIME);
        assert_eq!(format_or_zero(None), ZERO_TIME);
    }
}
