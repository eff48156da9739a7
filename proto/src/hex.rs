//! Lower-case hex, for keys, signatures and grants in text form.

pub fn encode(b: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        s.push(DIGITS[(x >> 4) as usize] as char);
        s.push(DIGITS[(x & 15) as usize] as char);
    }
    s
}

/// None unless `s` is an even number of hex digits.
pub fn decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip_and_refusals() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(super::decode(&super::encode(&b)).unwrap(), b);
        assert_eq!(super::encode(&[0xab, 0x01]), "ab01");
        for bad in ["a", "zz", "+1", "é0"] {
            assert_eq!(super::decode(bad), None, "{bad}");
        }
    }
}
