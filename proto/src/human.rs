//! Formats for people: byte sizes (`4MiB`, `1.5 GB` in, `1.2 GiB` out), durations
//! (`30s`, `5m`, `250ms`) and timestamps (RFC 3339, UTC).

use crate::InvalidInput;

/// Parses a size. Binary (`KiB`, `MiB`, ...) and decimal (`KB`, `MB`, ...) units; a bare
/// letter (`k`, `m`, `g`, `t`) is binary, as in most storage tools.
pub fn parse_size(s: &str) -> Result<u64, InvalidInput> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || InvalidInput::new("size", format!("{s:?} is not a size such as 512MiB or 2TB"));
    let n: f64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        // `format_size` prints EiB for the largest sizes: what it prints must parse.
        "e" | "eib" => 1 << 60,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "eb" => 1_000_000_000_000_000_000,
        _ => return Err(bad()),
    };
    let v = n * mult as f64;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    if v > u64::MAX as f64 {
        return Err(InvalidInput::new(
            "size",
            format!("{s:?} is too large (at most 16 EiB)"),
        ));
    }
    Ok(v.round() as u64)
}

/// Formats a byte count for people: `0 B`, `512 B`, `4.0 KiB`, `1.2 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", UNITS[i])
}

/// Parses a duration: `250ms`, `30s`, `5m`, `2h`, `1d`, or several summed (`1h30m`,
/// `2m30s`); a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, InvalidInput> {
    let bad = || {
        InvalidInput::new(
            "duration",
            format!("{s:?} is not a duration such as 30s, 5m or 1h30m"),
        )
    };
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut secs = 0.0f64;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (num, after) = rest.split_at(split);
        let n: f64 = num.parse().map_err(|_| bad())?;
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_len);
        secs += match unit.trim() {
            "ms" => n / 1000.0,
            "" | "s" => n,
            "m" | "min" => n * 60.0,
            "h" => n * 3600.0,
            "d" => n * 86400.0,
            _ => return Err(bad()),
        };
        rest = next.trim_start();
    }
    std::time::Duration::try_from_secs_f64(secs).map_err(|_| bad())
}

/// The Julian day number of 1970-01-01.
const EPOCH_JULIAN_DAY: i64 = 2_440_588;

/// Days since 1970-01-01 → (year, month, day), proleptic Gregorian; None beyond the
/// years ±9999.
pub fn civil_from_days(days: i64) -> Option<(i64, u32, u32)> {
    let jd = i32::try_from(days.checked_add(EPOCH_JULIAN_DAY)?).ok()?;
    let d = time::Date::from_julian_day(jd).ok()?;
    Some((
        i64::from(d.year()),
        u32::from(u8::from(d.month())),
        u32::from(d.day()),
    ))
}

/// (year, month, day), proleptic Gregorian → days since 1970-01-01; the inverse of
/// `civil_from_days`. None for a date that does not exist (a 13th month, February 30).
pub fn days_from_civil(y: i64, m: u32, d: u32) -> Option<i64> {
    let month = time::Month::try_from(u8::try_from(m).ok()?).ok()?;
    let date = time::Date::from_calendar_date(i32::try_from(y).ok()?, month, u8::try_from(d).ok()?).ok()?;
    Some(i64::from(date.to_julian_day()) - EPOCH_JULIAN_DAY)
}

/// Formats milliseconds since the Unix epoch as RFC 3339 in UTC:
/// `2026-11-29T15:39:08.123Z`.
pub fn format_time_ms(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let millis = ms.rem_euclid(1000);
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let Some((y, m, d)) = civil_from_days(days) else {
        return format!("{ms} ms after 1970-01-01");
    };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_and_civil_dates_round_trip() {
        for days in (-800_000..800_000).step_by(97) {
            let (y, m, d) = civil_from_days(days).unwrap();
            assert_eq!(days_from_civil(y, m, d), Some(days), "{y}-{m}-{d}");
        }
        assert_eq!(days_from_civil(2026, 11, 30), Some(20_787));
        assert_eq!(civil_from_days(0), Some((1970, 1, 1)));
        assert_eq!(civil_from_days(11_016), Some((2000, 2, 29)));
        // Dates that do not exist, and days no calendar year holds, are refused.
        assert_eq!(days_from_civil(2026, 2, 29), None);
        assert_eq!(days_from_civil(2026, 13, 1), None);
        assert_eq!(days_from_civil(2026, 4, 31), None);
        assert_eq!(civil_from_days(i64::MAX), None);
        assert_eq!(
            format_time_ms(i64::MAX),
            format!("{} ms after 1970-01-01", i64::MAX)
        );
    }

    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("1.5h").unwrap(), Duration::from_secs(5400));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("5 fortnights").is_err());
        // Several units summed, as people write them.
        assert_eq!(parse_duration("1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(parse_duration("2m 30s").unwrap(), Duration::from_secs(150));
        assert_eq!(parse_duration("1s500ms").unwrap(), Duration::from_millis(1500));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("1h30x").is_err());
        assert!(parse_duration("h").is_err());
    }

    #[test]
    fn times() {
        assert_eq!(format_time_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(format_time_ms(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(format_time_ms(1_795_966_748_123), "2026-11-29T15:39:08.123Z");
    }

    /// Found by the `human` fuzz target: 19 nines printed as "8.7 EiB", which did not
    /// parse back. Every size `format_size` prints parses to within its rounding.
    #[test]
    fn every_printed_size_parses_back_close_to_itself() {
        for n in [
            9_999_999_999_999_999_999u64,
            u64::MAX,
            1 << 60,
            1023,
            1024,
            5 << 40,
        ] {
            let back = parse_size(&format_size(n)).unwrap();
            assert!(back.abs_diff(n) <= n / 20, "{n} → {} → {back}", format_size(n));
        }
        assert_eq!(parse_size("2EiB").unwrap(), 2 << 60);
        // 16 EiB is one byte past u64 and is read as u64::MAX (what `format_size` prints
        // for it); anything larger is refused.
        assert_eq!(parse_size("16EiB").unwrap(), u64::MAX);
        let e = parse_size("17EiB").unwrap_err();
        assert!(e.reason.contains("too large"), "past u64: {e:?}");
    }

    #[test]
    fn parse() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("4m").unwrap(), 4 << 20);
        assert_eq!(parse_size("1.5 GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("2TB").unwrap(), 2_000_000_000_000);
        assert!(parse_size("lots").is_err());
        assert!(parse_size("4 parsecs").is_err());
        assert!(parse_size("").is_err());
    }

    #[test]
    fn format() {
        assert_eq!(format_size(0), "0 B");
        assert_eq!(format_size(1023), "1023 B");
        assert_eq!(format_size(4096), "4.0 KiB");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
    }
}
