//! Tests of `auth`: the throttle, token files (scopes included), anonymous callers.
use super::*;

#[test]
fn a_throttle_admits_its_share_a_window_and_counts_the_rest() {
    let t = Throttle::new(3, Duration::from_millis(200));
    let first: Vec<_> = (0..10).map(|_| t.admit()).collect();
    assert_eq!(&first[..3], &[Some(0), Some(0), Some(0)]);
    assert!(first[3..].iter().all(Option::is_none));
    std::thread::sleep(Duration::from_millis(250));
    // The next window's first line carries what the last one dropped.
    assert_eq!(t.admit(), Some(7));
    assert_eq!(t.admit(), Some(0));
}

#[test]
fn token_file() {
    let dir = std::env::temp_dir().join(format!("locus-tokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("tokens.toml");
    let digest = blake3::hash(b"reader-secret-0123456789").to_hex().to_string();
    std::fs::write(
        &p,
        format!(
            "[[token]]\nname = \"ops\"\nrole = \"admin\"\ntoken = \"admin-secret-0123456789\"\n\
             [[token]]\nname = \"job\"\nrole = \"reader\"\nblake3 = \"{digest}\"\n"
        ),
    )
    .unwrap();
    // Plain secrets that others may read: refused, saying how to fix it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = TokenSet::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("other users may read it") && e.contains("chmod 600"),
        "{e}"
    );
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    let set = TokenSet::load(&p).unwrap();
    assert_eq!(set.authenticate(b"reader-secret-0123456789").unwrap().name, "job");
    // Digests only may be shared.
    let digests = dir.join("digests.toml");
    std::fs::write(
        &digests,
        format!("[[token]]\nname = \"job\"\nrole = \"reader\"\nblake3 = \"{digest}\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&digests, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(TokenSet::load(&digests).is_ok());
    assert!(set.authenticate(b"reader-secret-012345678").is_none());
    std::fs::write(
        &p,
        "[[token]]\nname = \"x\"\nrole = \"root\"\ntoken = \"0123456789abcdef\"\n",
    )
    .unwrap();
    assert!(TokenSet::load(&p).is_err());
    std::fs::write(
        &p,
        "[[token]]\nname = \"x\"\nrole = \"admin\"\ntoken = \"short\"\n",
    )
    .unwrap();
    assert!(TokenSet::load(&p).is_err());
    std::fs::write(&p, "").unwrap();
    assert!(TokenSet::load(&p).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_token_file_narrows_tokens_to_datasets_and_never_widens_a_role() {
    let dir = std::env::temp_dir().join(format!("locus-scoped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("tokens.toml");
    let write = |text: &str| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    };
    write(
        "[[token]]\nname = \"team-a\"\nrole = \"admin\"\ntoken = \"team-a-secret-0123456789\"\n\
         [[token.scope]]\ndatasets = [\"a-*\"]\n\
         [[token.scope]]\ndatasets = [\"shared\"]\nactions = [\"read\"]\n\
         [[token]]\nname = \"job\"\nrole = \"reader\"\ntoken = \"job-secret-0123456789ab\"\n\
         [[token.scope]]\ndatasets = [\"a-*\"]\n\
         [[token]]\nname = \"ops\"\nrole = \"admin\"\ntoken = \"ops-secret-0123456789ab\"\n",
    );
    let set = TokenSet::load(&p).unwrap();
    let team = set.authenticate(b"team-a-secret-0123456789").unwrap();
    // An admin's scope without actions allows all an admin may do, on its datasets.
    assert!(team.may("a-x", Action::Delete) && team.may("a-x", Action::Import));
    assert!(team.may("shared", Action::Read) && !team.may("shared", Action::Delete));
    assert!(!team.sees("b-x"));
    let job = set.authenticate(b"job-secret-0123456789ab").unwrap();
    assert!(job.may("a-x", Action::Read) && !job.may("a-x", Action::Import));
    let ops = set.authenticate(b"ops-secret-0123456789ab").unwrap();
    assert!(!ops.is_scoped() && ops.may("anything", Action::Delete));

    // A reader given import, or a node given a scope: refused, saying why.
    write(
        "[[token]]\nname = \"job\"\nrole = \"reader\"\ntoken = \"job-secret-0123456789ab\"\n\
         [[token.scope]]\ndatasets = [\"a-*\"]\nactions = [\"read\", \"import\"]\n",
    );
    let e = TokenSet::load(&p).unwrap_err().to_string();
    assert!(e.contains("never") && e.contains("widens"), "{e}");
    write(
        "[[token]]\nname = \"n1\"\nrole = \"node\"\ntoken = \"n1-secret-0123456789ab\"\n\
         [[token.scope]]\ndatasets = [\"a-*\"]\n",
    );
    let e = TokenSet::load(&p).unwrap_err().to_string();
    assert!(e.contains("takes no scope"), "{e}");
    write(
        "[[token]]\nname = \"job\"\nrole = \"reader\"\ntoken = \"job-secret-0123456789ab\"\n\
         [[token.scope]]\ndatasets = [\"A B\"]\n",
    );
    assert!(TokenSet::load(&p).unwrap_err().to_string().contains("\"A B\""));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_tokens_means_anonymous() {
    let p = check(None, "CommitVersion", Some(Access::Admin), None, None).unwrap();
    assert_eq!(p.role_name(), "anonymous");
}
