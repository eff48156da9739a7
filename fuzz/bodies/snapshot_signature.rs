//! A snapshot's manifest and SIGNATURE as restore and verify read them from a bucket
//! anyone with write access may have changed: parsed and judged without a panic, and
//! never trusted unless signed by the trusted key (which the fuzzer does not hold).

pub fn run(data: &[u8]) {
    // manifest.json, a 0xFF byte, SIGNATURE.
    let (m, s) = match data.iter().position(|b| *b == 0xFF) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(manifest) = serde_json::from_slice::<locus_backup::SnapshotManifest>(m) else {
        return;
    };
    let sig = if s.is_empty() {
        Ok(None)
    } else {
        serde_json::from_slice::<locus_backup::sign::Signature>(s)
            .map(Some)
            .map_err(|e| e.to_string())
    };
    let trusted = "11".repeat(32);
    for allow in [false, true] {
        let trust = locus_backup::sign::Trust::from_args(std::slice::from_ref(&trusted), allow).unwrap();
        let id = manifest.id.clone();
        if let Ok(locus_backup::sign::Checked::Trusted(k)) = trust.judge(&id, &manifest, sig.clone()) {
            panic!("trusted without the key's signature: {k}");
        }
    }
}
