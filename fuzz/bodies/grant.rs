//! What a node checks every call's bearer token with (`locus_proto::grant::Verifier`),
//! and the metadata service's grant-key ring as it reads it back from its store: any bytes
//! are refused or accepted without a panic, and nothing the fuzzer makes passes for a
//! grant of the cluster's key (it would have to forge an Ed25519 signature).

fn verifier() -> &'static (locus_proto::grant::Verifier, String) {
    static V: std::sync::OnceLock<(locus_proto::grant::Verifier, String)> = std::sync::OnceLock::new();
    V.get_or_init(|| {
        let der = locus_proto::grant::GrantKey::generate_pkcs8().unwrap();
        let key = locus_proto::grant::GrantKey::from_pkcs8(&der).unwrap();
        let v = locus_proto::grant::Verifier::new("n1");
        v.set("c1", vec![key.public().to_vec()]);
        // One genuine grant, so the fuzzer's mutations start from the real shape.
        let real = key.sign(&locus_proto::grant::GrantBody {
            cluster_id: "c1".into(),
            node: "n1".into(),
            operation: "read".into(),
            expires_unix_ms: u64::MAX,
            ..Default::default()
        });
        (v, real)
    })
}

pub fn run(data: &[u8]) {
    let (v, real) = verifier();
    if data.first() == Some(&b'{') {
        let _ = locus_metadata::grant_keys::KeyRing::decode(data, "fuzz");
        return;
    }
    for method in ["ReadBlob", "WriteBlob", "UploadBlobs", "ImportObject"] {
        if let Ok((op, g)) = v.verify(data, method, 1_000_000) {
            assert!(op.allows(method));
            // Only the genuine grant itself verifies.
            assert_eq!(data, real.as_bytes(), "a forged grant passed: {g:?}");
        }
    }
}
