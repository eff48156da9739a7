//! Where wire meets catalogue: catalogue errors as gRPC statuses, the caller's principal,
//! and the checks every handler shares on what a request carries.

use locus_proto::{pb, DatasetRef, NodeId};
use tonic::{Request, Status};

use crate::auth::Principal;
use crate::catalog::CatalogError;
use crate::store::StoreError;

/// Maps catalogue errors to gRPC codes. Storage failures are logged here, where they
/// are handled; the caller gets a message without internals.
pub fn to_status(e: CatalogError) -> Status {
    match e {
        CatalogError::Invalid(e) => Status::invalid_argument(e.to_string()),
        CatalogError::NotFound(m) => Status::not_found(m),
        CatalogError::Precondition(m) => Status::failed_precondition(m),
        CatalogError::Taken(m) => Status::already_exists(m),
        CatalogError::Store(StoreError::TooLarge(m)) => {
            tracing::warn!("{m}");
            Status::resource_exhausted(m)
        }
        CatalogError::Store(e) => {
            tracing::error!("metadata store failure: {e}");
            Status::unavailable(format!("the metadata store failed: {e}"))
        }
        CatalogError::Corrupt { table, reason } => {
            tracing::error!(table, "corrupt metadata record: {reason}");
            Status::data_loss(format!("corrupt metadata record in {table}: {reason}"))
        }
        CatalogError::Internal(m) => {
            tracing::error!("{m}");
            Status::internal(m)
        }
    }
}

pub(super) fn principal<T>(req: &Request<T>) -> Result<Principal, Status> {
    // The auth layer puts a principal on every request it lets through. A request without
    // one reached a handler around it (a wiring mistake): it is refused, never served
    // with some default trust.
    req.extensions().get::<Principal>().cloned().ok_or_else(|| {
        tracing::error!("a call reached the service without passing the auth layer; refused");
        Status::internal("this call was not authenticated (a server wiring fault); refused")
    })
}

/// A node-role caller acts only for the node its token is named after: a token leaked
/// from one node cannot register, heartbeat or read pin lists for another. Admin may act
/// for any node; without tokens there is no one to bind.
pub(super) fn check_node_caller(p: &Principal, id: &NodeId) -> Result<(), Status> {
    if p.role == Some(crate::auth::Role::Node) && p.name != id.as_str() {
        return Err(Status::permission_denied(format!(
            "this token is node {:?}'s; node {id} must present its own (a [[token]] with name \
             \"{id}\" and role \"node\" in the tokens file)",
            p.name
        )));
    }
    Ok(())
}

pub(super) fn version_ref(r: Option<pb::VersionRef>) -> Result<DatasetRef, Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("ref: a dataset reference is required"))?;
    Ok(DatasetRef::try_from(r).map_err(|e| e.within("ref"))?)
}

pub(super) fn page_limit(limit: u32) -> usize {
    match limit {
        0 => 1000,
        n => n.min(10_000) as usize,
    }
}
