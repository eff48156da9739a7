//! Leading and taking part in elections: how a leader confirms it still leads before it
//! serves a call, when a member may answer stale-tolerant reads itself, and why a member
//! that rejoins with an empty data dir stays out of elections until it has caught up.

use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;
use tonic::Status;

use super::{Group, Raft};

/// A member that rejoins with an empty data dir (`--join`) takes no part in elections as
/// a candidate until it has applied everything its leader had committed when it last
/// heard from it; it still votes. Until then it cannot win an election (its log is behind
/// every other member's), but calling one raises the term, unseats the leader and restarts
/// whatever that leader was sending it: a member catching up from a 2.3 GB snapshot of a
/// 10M-entry catalogue missed a heartbeat every few seconds while it received, called an
/// election each time, and never finished. (openraft 0.9 has no pre-vote, which would
/// keep such a candidate from disturbing anyone.)
pub(super) fn stay_out_of_elections_until_caught_up(
    raft: &Raft,
    leader_commit: Arc<std::sync::atomic::AtomicU64>,
) {
    raft.runtime_config().elect(false);
    tracing::info!("rejoining: this member calls no election until it has caught up with the leader");
    let raft = raft.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let (applied, stopped) = {
                let m = raft.metrics();
                let m = m.borrow();
                (
                    m.last_applied.map_or(0, |l| l.index + 1),
                    m.running_state.is_err(),
                )
            };
            if stopped {
                return;
            }
            let seen = leader_commit.load(std::sync::atomic::Ordering::SeqCst);
            if seen > 0 && applied >= seen {
                raft.runtime_config().elect(true);
                tracing::info!(
                    applied = applied - 1,
                    "caught up with the leader: this member takes part in elections again"
                );
                return;
            }
        }
    });
}

/// How long a call waits for its member to be confirmed as leader before it is refused.
const LINEARIZE_BUDGET: Duration = Duration::from_secs(5);

impl Group {
    /// Waits until this member is confirmed leader by a quorum and has applied every entry
    /// committed before now: what it then reads is at least as new as any acknowledged
    /// write.
    ///
    /// One confirmation round gives each follower one heartbeat interval to answer. With a
    /// member down, one slow answer from the other (its disk busy writing a snapshot or a
    /// flush) fails the round although nobody else leads: the round is tried again while
    /// this member still believes it leads, within the same 5 s, rather than failing the
    /// caller's request. A member that learns of a newer leader fails at once.
    pub async fn linearize(&self) -> Result<(), Status> {
        let deadline = tokio::time::Instant::now() + LINEARIZE_BUDGET;
        let mut last = None;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match tokio::time::timeout(left, self.raft.ensure_linearizable()).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => {
                    let retry = matches!(
                        e.api_error(),
                        Some(openraft::error::CheckIsLeaderError::QuorumNotEnough(_))
                    ) && self.is_leader();
                    if !retry {
                        return Err(Status::unavailable(format!(
                            "metadata member {} cannot serve this now: {e}",
                            self.name
                        )));
                    }
                    tracing::debug!(error = %e, "leadership not confirmed by a quorum in one round; again");
                    last = Some(e.to_string());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(_) => break,
            }
        }
        Err(Status::unavailable(format!(
            "metadata member {} could not reach a quorum within {} s{}",
            self.name,
            LINEARIZE_BUDGET.as_secs(),
            last.map(|e| format!(": {e}")).unwrap_or_default()
        )))
    }

    /// Whether this member may answer stale-tolerant reads (locality, assignment) from its
    /// own catalogue: it leads and a quorum acknowledged it within the last 2 s (a leader
    /// cut off from the others stops, as its view of the nodes ages), or it took the
    /// leader's liveness view within the last 2 s.
    pub fn may_answer_stale_reads(&self) -> bool {
        let fresh_leader = {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.state == ServerState::Leader
                && m.current_leader == Some(self.id)
                && m.millis_since_quorum_ack.is_some_and(|ms| ms < 2000)
        };
        fresh_leader
            || self
                .liveness_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some_and(|t| t.elapsed() < Duration::from_secs(2))
    }
}
