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

type Client = RaftClient<InterceptedService<Channel, BearerToken>>;

fn client(addr: &str, token: Option<&str>, tls: bool) -> Result<Client, Status> {
    let scheme = if tls { "https" } else { "http" };
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

/// Asks the member at `addr` its name and API URL (`asker`: this member's name).
pub async fn hello(addr: &str, token: Option<&str>, tls: bool, asker: &str) -> Result<pb::RaftHello, Status> {
    let mut c = client(addr, token, tls)?;
    let req = pb::RaftHelloRequest { asker: asker.into() };
    let r = tokio::time::timeout(Duration::from_secs(3), c.hello(req))
        .await
        .map_err(|_| Status::unavailable(format!("member at {addr} did not answer within 3 s")))??;
    Ok(r.into_inner())
}

/// Makes a `Peer` per member the leader replicates to.
pub struct Network {
    token: Option<String>,
    tls: bool,
}

impl Network {
    pub fn new(token: Option<String>, tls: bool) -> Self {
        Self { token, tls }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Peer;

    async fn new_client(&mut self, target: u64, node: &Member) -> Peer {
        Peer {
            target,
            client: client(&node.addr, self.token.as_deref(), self.tls),
        }
    }
}

pub struct Peer {
    target: u64,
    client: Result<Client, Status>,
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
            Ok(c) => c.clone(),
            Err(s) => return Err(RPCError::Unreachable(Unreachable::new(s))),
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
            bincode::deserialize(&r.body).map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
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
        self.call("snapshot", &rpc, &option).await
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
    /// The catalogue, once open (for `Liveness`).
    catalog: Arc<OnceLock<Arc<crate::Catalog>>>,
}

impl RaftService {
    pub fn new(
        raft: Raft,
        name: String,
        api_url: String,
        catalog: Arc<OnceLock<Arc<crate::Catalog>>>,
    ) -> Self {
        Self {
            raft,
            name,
            api_url,
            catalog,
        }
    }

    pub fn server(self) -> pb::raft_server::RaftServer<RaftService> {
        pb::raft_server::RaftServer::new(self)
            .max_decoding_message_size(MAX_RAFT_MESSAGE)
            .max_encoding_message_size(MAX_RAFT_MESSAGE)
    }
}

fn decode<T: serde::de::DeserializeOwned>(m: pb::RaftMessage) -> Result<T, Status> {
    bincode::deserialize(&m.body)
        .map_err(|e| Status::invalid_argument(format!("undecodable Raft message: {e}")))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Response<pb::RaftMessage>, Status> {
    let body = bincode::serialize(v).map_err(|e| Status::internal(format!("encoding a Raft answer: {e}")))?;
    Ok(Response::new(pb::RaftMessage { body }))
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn append(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let rpc: AppendEntriesRequest<TypeConfig> = decode(req.into_inner())?;
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
        let rpc: InstallSnapshotRequest<TypeConfig> = decode(req.into_inner())?;
        encode(&self.raft.install_snapshot(rpc).await)
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
        let asker = req.into_inner().asker;
        let asker_had_data = !asker.is_empty() && {
            let m = self.raft.metrics();
            let m = m.borrow();
            m.replication
                .as_ref()
                .and_then(|r| r.get(&super::member_id(&asker)))
                .is_some_and(|matched| matched.is_some_and(|l| l.index > 0))
        };
        Ok(Response::new(pb::RaftHello {
            name: self.name.clone(),
            api_url: self.api_url.clone(),
            asker_had_data,
        }))
    }
}

/// Who may call the Raft port: members, presenting an admin token.
pub struct RaftPolicy;

impl locus_proto::auth::Policy for RaftPolicy {
    fn prefix(&self) -> &'static str {
        "/locus.metadata.v1.Raft/"
    }
    fn access(&self, method: &str) -> Option<locus_proto::auth::Access> {
        matches!(
            method,
            "Append" | "Vote" | "InstallSnapshot" | "Hello" | "Liveness"
        )
        .then_some(locus_proto::auth::Access::Admin)
    }
}
