//! Names and references: dataset names, node ids, labels and `dataset@version` references.
//!
//! Names are restricted to `[a-z0-9][a-z0-9._-]{0,62}` so they are safe as file names, URL
//! path segments, Kubernetes annotation values and Slurm feature suffixes alike.

use std::fmt;
use std::str::FromStr;

use crate::InvalidInput;

fn check_name(field: &str, s: &str) -> Result<(), InvalidInput> {
    let bytes = s.as_bytes();
    if bytes.is_empty() {
        return Err(InvalidInput::new(field, "must not be empty"));
    }
    if bytes.len() > 63 {
        return Err(InvalidInput::new(
            field,
            format!("{s:?} is {} bytes long; at most 63 are allowed", bytes.len()),
        ));
    }
    let first_ok = bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit();
    let rest_ok = bytes
        .iter()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if !first_ok || !rest_ok {
        return Err(InvalidInput::new(
            field,
            format!("{s:?} must match [a-z0-9][a-z0-9._-]{{0,62}}"),
        ));
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $ty:ident, $field:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
        #[serde(transparent)]
        pub struct $ty(String);

        impl $ty {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $ty {
            type Error = InvalidInput;
            fn try_from(s: String) -> Result<Self, InvalidInput> {
                check_name($field, &s)?;
                Ok(Self(s))
            }
        }

        impl TryFrom<&str> for $ty {
            type Error = InvalidInput;
            fn try_from(s: &str) -> Result<Self, InvalidInput> {
                Self::try_from(s.to_string())
            }
        }

        impl FromStr for $ty {
            type Err = InvalidInput;
            fn from_str(s: &str) -> Result<Self, InvalidInput> {
                Self::try_from(s)
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<$ty> for String {
            fn from(v: $ty) -> String {
                v.0
            }
        }
    };
}

name_type!(
    /// A dataset's name, e.g. `imagenet`.
    DatasetName,
    "dataset"
);
name_type!(
    /// A cache node's id, e.g. `gpu-017`.
    NodeId,
    "node"
);

/// Which version of a dataset: a number (from 1) or the latest committed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum VersionSel {
    Latest,
    Number(u64),
}

impl VersionSel {
    /// The wire form: 0 means latest.
    pub fn to_wire(self) -> u64 {
        match self {
            VersionSel::Latest => 0,
            VersionSel::Number(n) => n,
        }
    }

    pub fn from_wire(v: u64) -> Self {
        if v == 0 {
            VersionSel::Latest
        } else {
            VersionSel::Number(v)
        }
    }
}

impl fmt::Display for VersionSel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionSel::Latest => f.write_str("latest"),
            VersionSel::Number(n) => write!(f, "{n}"),
        }
    }
}

/// `imagenet`, `imagenet@latest` or `imagenet@3`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DatasetRef {
    pub name: DatasetName,
    pub version: VersionSel,
}

impl FromStr for DatasetRef {
    type Err = InvalidInput;
    fn from_str(s: &str) -> Result<Self, InvalidInput> {
        let (name, version) = match s.split_once('@') {
            None => (s, VersionSel::Latest),
            Some((name, "latest")) => (name, VersionSel::Latest),
            Some((name, v)) => {
                let n: u64 = v.parse().map_err(|_| {
                    InvalidInput::new(
                        "version",
                        format!("{v:?} is not a version number or \"latest\" (in {s:?})"),
                    )
                })?;
                if n == 0 {
                    return Err(InvalidInput::new("version", "versions are numbered from 1"));
                }
                (name, VersionSel::Number(n))
            }
        };
        if name.is_empty() {
            return Err(InvalidInput::new("name", "no dataset name before '@'"));
        }
        Ok(DatasetRef {
            name: DatasetName::try_from(name)?,
            version,
        })
    }
}

impl fmt::Display for DatasetRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.name, self.version)
    }
}

impl TryFrom<crate::pb::VersionRef> for DatasetRef {
    type Error = InvalidInput;
    fn try_from(r: crate::pb::VersionRef) -> Result<Self, InvalidInput> {
        Ok(DatasetRef {
            name: DatasetName::try_from(r.dataset)?,
            version: VersionSel::from_wire(r.version),
        })
    }
}

impl From<&DatasetRef> for crate::pb::VersionRef {
    fn from(r: &DatasetRef) -> Self {
        crate::pb::VersionRef {
            dataset: r.name.to_string(),
            version: r.version.to_wire(),
        }
    }
}

/// Validates a node label (`zone=z1`): keys and values of at most 63 bytes from
/// `[A-Za-z0-9._/-]`, keys non-empty.
pub fn check_label(key: &str, value: &str) -> Result<(), InvalidInput> {
    let ok = |s: &str| {
        s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'/'))
    };
    if key.is_empty() || !ok(key) {
        return Err(InvalidInput::new(
            "labels",
            format!("label key {key:?} must be 1-63 characters of [A-Za-z0-9._/-]"),
        ));
    }
    if !ok(value) {
        return Err(InvalidInput::new(
            "labels",
            format!("label {key}={value:?}: values are at most 63 characters of [A-Za-z0-9._/-]"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dataset_names() {
        for ok in ["a", "imagenet", "c4.en", "0-x_y", &"a".repeat(63)] {
            assert!(DatasetName::try_from(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Imagenet",
            "-x",
            ".x",
            "a/b",
            "a b",
            "a\0",
            "ü",
            &"a".repeat(64),
        ] {
            assert!(DatasetName::try_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn dataset_refs() {
        let r: DatasetRef = "imagenet@3".parse().unwrap();
        assert_eq!(r.name.as_str(), "imagenet");
        assert_eq!(r.version, VersionSel::Number(3));
        assert_eq!(
            "imagenet".parse::<DatasetRef>().unwrap().version,
            VersionSel::Latest
        );
        assert_eq!(
            "imagenet@latest".parse::<DatasetRef>().unwrap().to_string(),
            "imagenet@latest"
        );
        for bad in ["imagenet@0", "imagenet@x", "imagenet@-1", "@3", "Bad@1", "a@1@2"] {
            assert!(bad.parse::<DatasetRef>().is_err(), "{bad}");
        }
    }

    #[test]
    fn labels() {
        assert!(check_label("zone", "z1").is_ok());
        assert!(check_label("topology.kubernetes.io/zone", "eu-1a").is_ok());
        assert!(check_label("", "x").is_err());
        assert!(check_label("k", "a b").is_err());
        assert!(check_label("k=v", "x").is_err());
    }
}
