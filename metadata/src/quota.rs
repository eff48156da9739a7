//! Team quotas on the bytes a team's datasets pin on nodes (`[[metadata_server.team]]`).
//!
//! A team is a set of dataset name patterns (the same `*` patterns as token scopes) and a
//! limit on the replicated bytes of its committed versions: each version counts its bytes
//! times its replication, the space its replicas take on nodes (blobs shared between
//! versions count once per version: the figure a team can reason about from its own
//! listings, and never less than the space taken). An import is checked when its shards
//! are placed — before any byte is sent to a node — and refused if the team's committed
//! bytes, plus what imports placed and not yet ended hold (`SessionRecord.placed_bytes`,
//! in the catalogue, so a restarted service or a new leader counts them too), plus what
//! this one would pin exceed the limit. A dataset may belong to more than one team; every one of them must
//! have room.

use locus_proto::auth::{Action, Scope};

/// One team's quota.
#[derive(Debug, Clone)]
pub struct Team {
    pub name: String,
    datasets: Scope,
    patterns: Vec<String>,
    /// Most replicated bytes its datasets' committed versions may pin, all nodes together.
    pub pinned_limit: u64,
    /// Its share of each node's cache room in thousandths (named in its read grants; the
    /// node keeps that much of its readers' cached bytes against other teams' reads).
    pub cache_permille: u32,
}

impl Team {
    pub fn new(name: &str, datasets: Vec<String>, pinned_limit: u64) -> Result<Self, String> {
        if name.is_empty() || name.len() > 63 {
            return Err(format!("team {name:?}: a name of 1 to 63 characters"));
        }
        if datasets.is_empty() {
            return Err(format!("team {name}: datasets names no pattern"));
        }
        let scope = Scope::new(datasets.iter().map(|d| (d.clone(), vec![Action::Read])).collect())
            .map_err(|e| format!("team {name}: {e}"))?;
        Ok(Team {
            name: name.to_string(),
            datasets: scope,
            patterns: datasets,
            pinned_limit,
            cache_permille: 0,
        })
    }

    /// The team with a share of each node's cache room (thousandths, at most 1000).
    pub fn with_cache_share(mut self, permille: u32) -> Self {
        self.cache_permille = permille.min(1000);
        self
    }

    pub fn covers(&self, dataset: &str) -> bool {
        self.datasets.sees(dataset)
    }

    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }
}

/// A share written as a percentage (`"25%"`, `"12.5%"`), in thousandths.
pub fn parse_share(s: &str) -> Result<u32, String> {
    let n = s
        .trim()
        .strip_suffix('%')
        .ok_or_else(|| format!("{s:?}: a percentage such as \"25%\""))?;
    let x: f64 = n
        .trim()
        .parse()
        .map_err(|_| format!("{s:?}: a percentage such as \"25%\""))?;
    if !(0.0..=100.0).contains(&x) {
        return Err(format!("{s:?}: from 0% to 100%"));
    }
    Ok((x * 10.0).round() as u32)
}

/// Refuses an import (or a warm-up) that would take `team` over its limit, saying by how
/// much and what to do; `used` is what the team's versions pin now.
pub fn check(team: &Team, used: u64, needs: u64) -> Result<(), String> {
    if used.saturating_add(needs) <= team.pinned_limit {
        return Ok(());
    }
    use locus_proto::human::format_size as b;
    Err(format!(
        "team {}'s quota would be exceeded: this pins {} more (bytes times replicas), the \
         team's datasets ({}) pin {} of the {} allowed. Delete versions it no longer needs \
         (locus dataset rm), import or warm onto fewer nodes, or have the operator raise \
         [[metadata_server.team]] pinned",
        team.name,
        b(needs),
        team.patterns.join(", "),
        b(used),
        b(team.pinned_limit)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_shares_parse_as_percentages_and_refuse_anything_else() {
        assert_eq!(parse_share("25%"), Ok(250));
        assert_eq!(parse_share(" 12.5 %"), Ok(125));
        assert_eq!(parse_share("100%"), Ok(1000));
        for bad in ["25", "0.25", "101%", "-1%", "x%", ""] {
            assert!(parse_share(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn an_import_fits_up_to_the_byte_and_a_refusal_says_the_figures() {
        let t = Team::new("vision", vec!["img-*".into(), "coco".into()], 1000).unwrap();
        assert!(t.covers("img-net") && t.covers("coco") && !t.covers("coco2"));
        assert!(check(&t, 600, 400).is_ok());
        let e = check(&t, 600, 401).unwrap_err();
        assert!(e.contains("team vision") && e.contains("img-*, coco"), "{e}");
        assert!(
            e.contains("401 B") && e.contains("600 B") && e.contains("1000 B"),
            "{e}"
        );
        // No overflow past u64::MAX into a pass.
        assert!(check(&t, u64::MAX, 1).is_err());
        assert!(Team::new("x", vec![], 1).is_err());
        assert!(Team::new("x", vec!["A".into()], 1).is_err());
    }
}
