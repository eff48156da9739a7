//! Dataset scopes: what a token narrowed by `[[token.scope]]` may reach — name patterns
//! with `*`, and the actions allowed on the datasets they match (`crate::auth` reads them
//! from the tokens file; the metadata service and nodes check them).

use serde::Deserialize;

use crate::auth::Role;

/// What a scoped token may do to a dataset in its scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// See it (list, show, ls, locality, assign), mount it, read its bytes.
    Read,
    /// Add versions to it (import, seal).
    Import,
    /// Delete its versions or the whole dataset.
    Delete,
    /// Order copies of it onto nodes (warm).
    Warm,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::Import => "import",
            Action::Delete => "delete",
            Action::Warm => "warm",
        }
    }

    /// Whether a token of `role` may be given this action: scopes narrow a role, they
    /// never widen it, so a reader's scope can hold only `read`.
    pub(crate) fn within(self, role: Role) -> bool {
        match role {
            Role::Admin => true,
            Role::Reader => self == Action::Read,
            _ => false,
        }
    }
}

/// The datasets a token reaches: rules of a name pattern (`*` matches any run of
/// characters, so `team-a-*` is every dataset named so) and the actions allowed on what
/// it matches. A dataset no rule matches is, to the token, a dataset that does not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    rules: Vec<(String, Vec<Action>)>,
}

impl Scope {
    /// A scope from (pattern, actions) rules; patterns are dataset names with `*`s.
    pub fn new(rules: Vec<(String, Vec<Action>)>) -> Result<Self, String> {
        if rules.is_empty() {
            return Err("a scope needs at least one rule".into());
        }
        for (pattern, actions) in &rules {
            let bare = pattern.replace('*', "");
            let ok = !pattern.is_empty()
                && pattern.len() <= 63
                && bare
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
            if !ok {
                return Err(format!(
                    "datasets {pattern:?}: a dataset name ([a-z0-9][a-z0-9._-]*), where * stands                      for any run of characters"
                ));
            }
            if actions.is_empty() {
                return Err(format!("datasets {pattern:?}: the rule allows no action"));
            }
        }
        Ok(Scope { rules })
    }

    pub fn allows(&self, name: &str, action: Action) -> bool {
        self.rules
            .iter()
            .any(|(p, a)| a.contains(&action) && glob(p.as_bytes(), name.as_bytes()))
    }

    pub fn sees(&self, name: &str) -> bool {
        self.rules
            .iter()
            .any(|(p, _)| glob(p.as_bytes(), name.as_bytes()))
    }

    /// Whether any rule allows `action` (on some dataset): for calls that are part of an
    /// action but name no dataset themselves (placing an import's shards).
    pub fn allows_any(&self, action: Action) -> bool {
        self.rules.iter().any(|(_, a)| a.contains(&action))
    }

    /// The rules, for `locus status` and the audit log: `team-a-*:read+import, x:read`.
    pub fn describe(&self) -> String {
        self.rules
            .iter()
            .map(|(p, a)| {
                let acts: Vec<_> = a.iter().map(|a| a.as_str()).collect();
                format!("{p}:{}", acts.join("+"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `*`-only glob, iterative with one backtrack point: linear in practice, never
/// exponential, whatever the pattern (names are at most 63 bytes anyway).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|b| *b == b'*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_pattern_matches_whole_names_with_stars_for_any_run() {
        let s = Scope::new(vec![
            ("team-a-*".into(), vec![Action::Read, Action::Import]),
            ("shared".into(), vec![Action::Read]),
            ("*-eval-*".into(), vec![Action::Warm]),
        ])
        .unwrap();
        assert!(s.allows("team-a-images", Action::Import));
        assert!(s.allows("team-a-", Action::Read));
        assert!(!s.allows("team-a-images", Action::Delete));
        assert!(!s.sees("team-b-images") && !s.sees("xteam-a-images"));
        // Whole names: a prefix or a suffix of a pattern is not a match.
        assert!(s.allows("shared", Action::Read) && !s.sees("shared2") && !s.sees("share"));
        assert!(!s.allows("shared", Action::Import));
        assert!(s.allows("x-eval-y", Action::Warm) && s.allows("a-b-eval-c-d", Action::Warm));
        assert!(!s.sees("x-eval"));
        assert!(s.allows_any(Action::Import) && !s.allows_any(Action::Delete));
        // A pattern that is not a dataset name with stars is refused, saying what is.
        let e = Scope::new(vec![("Team/A".into(), vec![Action::Read])]).unwrap_err();
        assert!(e.contains("[a-z0-9]"), "{e}");
        assert!(Scope::new(vec![("a".into(), vec![])]).is_err());
        // Many stars cost no more than a pass per star (no exponential backtracking).
        let many = Scope::new(vec![("*a*a*a*a*a*a*a*a*a*a*b".into(), vec![Action::Read])]).unwrap();
        assert!(!many.sees(&"a".repeat(63)));
    }
}
