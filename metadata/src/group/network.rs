//! The members' Raft RPCs over gRPC (`locus.metadata.v1.Raft`, on each member's raft
//! port): openraft's requests and answers travel bincode-encoded in `RaftMessage.body`; an
//! error openraft returned on the far side comes back inside the body too, so only
//! transport failures are gRPC errors.

use std::time::Duration;

use locus_proto::client::BearerToken;
use locus_proto::pb;
use locus_proto::pb::raft_client::RaftClient;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use std::sync::{Arc, OnceLock};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use tonic::{Request, Response, Status};

use super::{Member, Raft, TypeConfig};

/// Largest Raft message: one entry per message (`max_payload_entries`), a manifest page of
/// at most the API's message size, or a 4 MiB snapshot piece; with room to spare.
pub const MAX_RAFT_MESSAGE: usize = 2 * locus_proto::MAX_MESSAGE_BYTES;

/// Refuses a change too large for one Raft message, before it is proposed. An entry the
/// leader appends but cannot send is never committed, and every write behind it waits for
/// it: the whole group stops taking changes (a 3M-entry version's delete did that, when
/// it listed its index rows).
pub fn fits_one_message(batch: &crate::store::Batch) -> Result<(), crate::store::StoreError> {
    // Room for the rest of an AppendEntries message (term, indexes, framing).
    const ROOM: usize = 1 << 20;
    let size = batch.encoded_len_hint();
    if size + ROOM <= MAX_RAFT_MESSAGE {
        return Ok(());
    }
    Err(crate::store::StoreError::TooLarge(format!(
        "a change of {} MiB ({} writes) is larger than a metadata group sends in one \
         message ({} MiB); it was refused before it reached the log, and nothing changed",
        size >> 20,
        batch.len(),
        (MAX_RAFT_MESSAGE - ROOM) >> 20
    )))
}

type Client = RaftClient<InterceptedService<Channel, BearerToken>>;

fn client(addr: &str, token: Option<&str>, tls: bool) -> Result<Client, Status> {
    let scheme = if tls { "https" } else { "http" };
    // The same rule every client follows: a token (here the member secret, and with it
    // the catalogue and the grant keys in the log) never crosses a network in clear
    // unless the operator said the network is trusted.
    if !tls {
        locus_proto::tls::check_plaintext(&format!("http://{addr}"), token.is_some())
            .map_err(|e| Status::failed_precondition(format!("member at {addr}: {e}")))?;
    }
    let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| Status::invalid_argument(format!("member address {addr:?}: {e}")))?
        .connect_timeout(Duration::from_secs(1))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5));
    if tls {
        let cfg = locus_proto::tls::client_config(None)
            .map_err(|e| Status::failed_precondition(format!("TLS to member {addr}: {e}")))?;
        ep = ep
            .tls_config(cfg)
            .map_err(|e| Status::failed_precondition(format!("TLS to member {addr}: {e}")))?;
    }
    let token = match token {
        Some(t) => Some(
            format!("Bearer {t}")
                .parse()
                .map_err(|_| Status::invalid_argument("the member token cannot be sent in a header"))?,
        ),
        None => None,
    };
    Ok(
        RaftClient::with_interceptor(ep.connect_lazy(), BearerToken::new(token))
            .max_decoding_message_size(MAX_RAFT_MESSAGE)
            .max_encoding_message_size(MAX_RAFT_MESSAGE),
    )
}

/// A member's proof that it holds the group's member secret: BLAKE3 keyed with a key
/// derived from the secret, over the asker's challenge and the answerer's own name (so a
/// stranger cannot relay another member's answer as its own).
pub(crate) fn member_proof(secret: &str, challenge: &[u8], name: &str) -> [u8; 32] {
    let key = blake3::derive_key("locus metadata member proof v1", secret.as_bytes());
    let mut h = blake3::Hasher::new_keyed(&key);
    h.update(&(challenge.len() as u64).to_be_bytes());
    h.update(challenge);
    h.update(name.as_bytes());
    *h.finalize().as_bytes()
}

/// The leader's liveness rows, from its raft port.
pub async fn liveness(
    addr: &str,
    token: Option<&str>,
    tls: bool,
) -> Result<Vec<(String, u64, crate::catalog::NodeStats)>, Status> {
    let mut c = client(addr, token, tls)?;
    let r = tokio::time::timeout(
        Duration::from_secs(2),
        c.liveness(pb::RaftHelloRequest::default()),
    )
    .await
    .map_err(|_| Status::unavailable(format!("member at {addr} did not answer within 2 s")))??;
    decode(r.into_inner())
}

/// Asks the member at `addr` its name and API URL (`asker`: this member's name). Sends no
/// token. With a member secret, the answer must prove the answerer holds it too and is
/// the member `expect` names (when given): anything else is refused before this member
/// sends it a token, a log entry or a caller's call.
pub async fn hello(
    addr: &str,
    secret: Option<&str>,
    tls: bool,
    asker: &str,
    expect: Option<&str>,
) -> Result<pb::RaftHello, Status> {
    let mut c = client(addr, None, tls)?;
    let challenge: [u8; 32] = locus_proto::grant::random_bytes();
    let req = pb::RaftHelloRequest {
        asker: asker.into(),
        challenge: if secret.is_some() {
            challenge.to_vec()
        } else {
            vec![]
        },
    };
    let r = tokio::time::timeout(Duration::from_secs(3), c.hello(req))
        .await
        .map_err(|_| Status::unavailable(format!("member at {addr} did not answer within 3 s")))??
        .into_inner();
    if let Some(want) = expect {
        if r.name != want {
            return Err(Status::failed_precondition(format!(
                "{addr} answers as member {:?}, not {want}",
                r.name
            )));
        }
    }
    if let Some(secret) = secret {
        let good = member_proof(secret, &challenge, &r.name);
        // Constant time: a near miss must not tell a guesser how near.
        let ok = r.proof.len() == 32
            && blake3::Hash::from(good)
                == blake3::Hash::from_bytes(r.proof[..].try_into().expect("32 bytes"));
        if !ok {
            tracing::warn!(addr, claimed = %r.name, "a raft port did not prove it holds the member secret; nothing was sent to it");
            return Err(Status::permission_denied(format!(
                "{addr} (answering as {:?}) does not prove it holds this group's member secret: it \
                 is not a member, or was given another --member-token-file (every member must \
                 hold the same secret); nothing was sent to it",
                r.name
            )));
        }
    }
    Ok(r)
}

/// Makes a `Peer` per member the leader replicates to.
pub struct Network {
    token: Option<String>,
    tls: bool,
    me: String,
}

impl Network {
    pub fn new(token: Option<String>, tls: bool, me: String) -> Self {
        Self { token, tls, me }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &Member) -> Peer {
        Peer {
            target,
            node: node.clone(),
            me: self.me.clone(),
            token: self.token.clone(),
            tls: self.tls,
            client: None,
        }
    }
}

/// One member the leader sends to. It is sent nothing (no token, no entry, no snapshot
/// holding the grant keys) until it has proved it holds the member secret: `members
/// add-learner` naming a host someone else controls hands that host nothing.
pub struct Peer {
    target: u64,
    node: Member,
    me: String,
    token: Option<String>,
    tls: bool,
    client: Option<Client>,
}
type RpcErr<E> = RPCError<u64, Member, E>;

impl Peer {
    async fn call<Req, Resp, E>(
        &mut self,
        method: &'static str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RpcErr<E>>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
        E: serde::de::DeserializeOwned + std::error::Error,
    {
        let c = match &self.client {
            Some(c) => c.clone(),
            None => {
                let verified = hello(
                    &self.node.addr,
                    self.token.as_deref(),
                    self.tls,
                    &self.me,
                    Some(&self.node.name),
                )
                .await
                .and_then(|_| client(&self.node.addr, self.token.as_deref(), self.tls));
                match verified {
                    Ok(c) => {
                        self.client = Some(c.clone());
                        c
                    }
                    Err(s) => return Err(RPCError::Unreachable(Unreachable::new(&s))),
                }
            }
        };
        let body = bincode::serialize(req).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        let msg = pb::RaftMessage { body };
        let fut = async move {
            let mut c = c;
            match method {
                "append" => c.append(msg).await,
                "vote" => c.vote(msg).await,
                _ => c.install_snapshot(msg).await,
            }
        };
        let r = match tokio::time::timeout(option.hard_ttl(), fut).await {
            Err(_) => {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{method} timed out"));
                return Err(RPCError::Network(NetworkError::new(&e)));
            }
            Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
                return Err(RPCError::Unreachable(Unreachable::new(&s)))
            }
            Ok(Err(s)) => return Err(RPCError::Network(NetworkError::new(&s))),
            Ok(Ok(r)) => r.into_inner(),
        };
        let decoded: Result<Resp, E> =
            decode_bytes(&r.body).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        decoded.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RpcErr<RaftError<u64>>> {
        self.call("append", &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, RpcErr<RaftError<u64, InstallSnapshotError>>> {
        self.call("snapshot", &SnapshotChunk::from(rpc), &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RpcErr<RaftError<u64>>> {
        self.call("vote", &rpc, &option).await
    }
}

/// The Raft port's service: hands each message to the local Raft.
pub struct RaftService {
    raft: Raft,
    name: String,
    api_url: String,
    /// The member secret, to prove membership in Hello answers.
    secret: Option<String>,
    /// The catalogue, once open (for `Liveness`).
    catalog: Arc<OnceLock<Arc<crate::Catalog>>>,
    /// One more than the highest commit index a leader sent here (`Group::leader_commit`).
    leader_commit: Arc<std::sync::atomic::AtomicU64>,
}

impl RaftService {
    pub fn new(
        raft: Raft,
        name: String,
        api_url: String,
        secret: Option<String>,
        catalog: Arc<OnceLock<Arc<crate::Catalog>>>,
        leader_commit: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        Self {
            raft,
            name,
            api_url,
            secret,
            catalog,
            leader_commit,
        }
    }

    pub fn server(self) -> pb::raft_server::RaftServer<RaftService> {
        pb::raft_server::RaftServer::new(self)
            .max_decoding_message_size(MAX_RAFT_MESSAGE)
            .max_encoding_message_size(MAX_RAFT_MESSAGE)
    }
}

fn decode<T: serde::de::DeserializeOwned>(m: pb::RaftMessage) -> Result<T, Status> {
    decode_bytes(&m.body).map_err(|e| Status::invalid_argument(format!("undecodable Raft message: {e}")))
}

/// bincode 1 as `bincode::serialize` writes it, read with a bound: a length prefix that
/// claims more than the message holds is refused before anything is allocated for it
/// (`bincode::deserialize` has no limit, and would try).
pub(crate) fn decode_bytes<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, bincode::Error> {
    use bincode::Options;
    bincode::options()
        .with_fixint_encoding()
        .allow_trailing_bytes()
        .with_limit(b.len() as u64)
        .deserialize(b)
}

/// Decodes a Raft message body as the raft port does (`kind`: 0 append, 1 vote, 2
/// snapshot): for fuzzing the parser members run on what the network gives them.
pub fn decode_for_fuzzing(kind: u8, body: &[u8]) -> bool {
    match kind % 3 {
        0 => decode_bytes::<AppendEntriesRequest<TypeConfig>>(body).is_ok(),
        1 => decode_bytes::<VoteRequest<u64>>(body).is_ok(),
        _ => decode_bytes::<SnapshotChunk>(body).is_ok(),
    }
}

/// `InstallSnapshotRequest` laid out as bincode lays it out, with the piece of snapshot
/// read and written as one byte string. openraft's `Vec<u8>` goes through serde's
/// sequence, one call per byte: a member receiving a 2.3 GB snapshot spent half its CPU
/// there, answered heartbeats late, called elections, and each new term started the
/// transfer over. The bytes on the wire are the same either way (a u64 length, then the
/// bytes), so members of older builds read these and are read.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(bound = "")]
struct SnapshotChunk {
    vote: openraft::Vote<u64>,
    meta: openraft::SnapshotMeta<u64, Member>,
    offset: u64,
    #[serde(with = "byte_string")]
    data: Vec<u8>,
    done: bool,
}

impl From<InstallSnapshotRequest<TypeConfig>> for SnapshotChunk {
    fn from(r: InstallSnapshotRequest<TypeConfig>) -> Self {
        SnapshotChunk {
            vote: r.vote,
            meta: r.meta,
            offset: r.offset,
            data: r.data,
            done: r.done,
        }
    }
}

impl From<SnapshotChunk> for InstallSnapshotRequest<TypeConfig> {
    fn from(c: SnapshotChunk) -> Self {
        InstallSnapshotRequest {
            vote: c.vote,
            meta: c.meta,
            offset: c.offset,
            data: c.data,
            done: c.done,
        }
    }
}

mod byte_string {
    use serde::de::{Deserializer, Error, SeqAccess, Visitor};

    pub fn serialize<S: serde::Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_byte_buf<E: Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
            fn visit_bytes<E: Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Vec<u8>, A::Error> {
                let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 20));
                while let Some(b) = a.next_element::<u8>()? {
                    v.push(b);
                }
                Ok(v)
            }
        }
        d.deserialize_byte_buf(V)
    }
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Response<pb::RaftMessage>, Status> {
    let body = bincode::serialize(v).map_err(|e| Status::internal(format!("encoding a Raft answer: {e}")))?;
    Ok(Response::new(pb::RaftMessage { body }))
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn append(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let rpc: AppendEntriesRequest<TypeConfig> = decode(req.into_inner())?;
        if let Some(c) = rpc.leader_commit {
            self.leader_commit
                .fetch_max(c.index + 1, std::sync::atomic::Ordering::SeqCst);
        }
        encode(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let rpc: VoteRequest<u64> = decode(req.into_inner())?;
        encode(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        req: Request<pb::RaftMessage>,
    ) -> Result<Response<pb::RaftMessage>, Status> {
        let rpc: SnapshotChunk = decode(req.into_inner())?;
        encode(&self.raft.install_snapshot(rpc.into()).await)
    }

    async fn liveness(
        &self,
        _req: Request<pb::RaftHelloRequest>,
    ) -> Result<Response<pb::RaftMessage>, Status> {
        let rows = match self.catalog.get() {
            Some(c) if c.acting() => c.liveness(),
            _ => {
                return Err(Status::failed_precondition(format!(
                    "member {} is not leading",
                    self.name
                )))
            }
        };
        encode(&rows)
    }

    async fn hello(&self, req: Request<pb::RaftHelloRequest>) -> Result<Response<pb::RaftHello>, Status> {
        let q = req.into_inner();
        if q.challenge.len() > 64 {
            return Err(Status::invalid_argument("challenge: at most 64 bytes"));
        }
        let asker = q.asker;
        let asker_had_data = !asker.is_empty() && {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.replication
                .as_ref()
                .and_then(|r| r.get(&super::member_id(&asker)))
                .is_some_and(|matched| matched.is_some_and(|l| l.index > 0))
        };
        let proof = match &self.secret {
            Some(s) if !q.challenge.is_empty() => member_proof(s, &q.challenge, &self.name).to_vec(),
            _ => Vec::new(),
        };
        Ok(Response::new(pb::RaftHello {
            name: self.name.clone(),
            api_url: self.api_url.clone(),
            asker_had_data,
            proof,
        }))
    }
}

/// Who may call the Raft port: members, presenting the member token; Hello with no token
/// (it must be answered before an asker will present one, and tells a stranger only the
/// member's name and API address).
pub struct RaftPolicy;

impl locus_proto::auth::Policy for RaftPolicy {
    fn prefix(&self) -> &'static str {
        "/locus.metadata.v1.Raft/"
    }
    fn access(&self, method: &str) -> Option<locus_proto::auth::Access> {
        use locus_proto::auth::Access;
        match method {
            "Append" | "Vote" | "InstallSnapshot" | "Liveness" => Some(Access::Member),
            "Hello" => Some(Access::Open),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_larger_than_one_raft_message_is_refused_before_it_is_proposed() {
        let mut b = crate::store::Batch::default();
        let row = vec![7u8; 1 << 20];
        for i in 0..(MAX_RAFT_MESSAGE >> 20) - 2 {
            b.put(crate::store::Table::Entries, (i as u32).to_be_bytes(), &row);
        }
        fits_one_message(&b).expect("a change that fits");
        b.put(crate::store::Table::Entries, b"one more", &row);
        b.put(crate::store::Table::Entries, b"and another", &row);
        let e = fits_one_message(&b).unwrap_err().to_string();
        assert!(
            e.contains("larger than a metadata group sends in one message"),
            "{e}"
        );
        assert!(e.contains("64 MiB") && e.contains("63 MiB"), "{e}");
    }

    fn request(data: Vec<u8>) -> InstallSnapshotRequest<TypeConfig> {
        let mut nodes = std::collections::BTreeMap::new();
        nodes.insert(
            7u64,
            Member {
                name: "m1".into(),
                addr: "127.0.0.1:1".into(),
            },
        );
        let membership = openraft::Membership::new(vec![[7u64].into_iter().collect()], nodes);
        InstallSnapshotRequest {
            vote: openraft::Vote::new_committed(3, 7),
            meta: openraft::SnapshotMeta {
                last_log_id: Some(openraft::LogId::new(openraft::CommittedLeaderId::new(3, 7), 42)),
                last_membership: openraft::StoredMembership::new(None, membership),
                snapshot_id: "42-1".into(),
            },
            offset: 4 << 20,
            data,
            done: false,
        }
    }

    #[test]
    fn a_snapshot_piece_is_the_same_bytes_as_openraft_encodes_and_decodes_both_ways() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let theirs = bincode::serialize(&request(data.clone())).unwrap();
        let ours = bincode::serialize(&SnapshotChunk::from(request(data.clone()))).unwrap();
        assert_eq!(ours, theirs, "members of older builds read what this one sends");
        let back: InstallSnapshotRequest<TypeConfig> = decode_bytes::<SnapshotChunk>(&theirs).unwrap().into();
        assert_eq!(back, request(data.clone()), "and this one reads what they send");
        let empty = bincode::serialize(&request(Vec::new())).unwrap();
        let back: InstallSnapshotRequest<TypeConfig> = decode_bytes::<SnapshotChunk>(&empty).unwrap().into();
        assert!(back.data.is_empty());
    }

    #[test]
    fn a_snapshot_piece_claiming_more_bytes_than_its_message_holds_is_refused() {
        let mut b = bincode::serialize(&SnapshotChunk::from(request(vec![1, 2, 3]))).unwrap();
        // The data's u64 length sits right before its three bytes and the `done` flag.
        let at = b.len() - 1 - 3 - 8;
        assert_eq!(b[at..at + 8], 3u64.to_le_bytes());
        b[at..at + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(decode_bytes::<SnapshotChunk>(&b).is_err());
        assert!(!decode_for_fuzzing(2, &b));
    }
}
