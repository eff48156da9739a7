//! Sizes and durations as operators type them (flags, config files, LOCUS_* variables):
//! any string is parsed or refused, never a panic, and a size that parses prints back as
//! one that parses to no more than it.
use locus_proto::human::{format_size, parse_duration, parse_size};

pub fn run(data: &[u8]) {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(n) = parse_size(s) {
        let back = parse_size(&format_size(n)).expect("a formatted size parses");
        // Formatting rounds to a few digits; it must stay close.
        assert!(
            back <= n.saturating_mul(2).max(1024) && back >= n / 2,
            "{s:?}: {n} → {back}"
        );
    }
    let _ = parse_duration(s);
    let _ = locus_proto::names::check_label(s, s);
}
