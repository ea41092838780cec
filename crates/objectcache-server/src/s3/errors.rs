//! Store errors as the S3 errors a client sees.

use objectcache_client::error::StoreError;
use s3s::{s3_error, S3Error};

/// Maps a store error to the S3 error a client sees, naming the key the error carries.
/// Prefer [`map_err_as`], which names the key as the client sent it.
pub fn map_err(e: StoreError) -> S3Error {
    let key = match &e {
        StoreError::NotFound { key }
        | StoreError::AlreadyExists { key }
        | StoreError::Precondition { key }
        | StoreError::InvalidRange { key, .. }
        | StoreError::InvalidKey { key, .. } => key.clone(),
        _ => String::new(),
    };
    map_err_as(e, &key)
}

/// Maps a store error to the S3 error a client sees: a 4xx with its S3 code for what the
/// client can change (a missing key, a key this store cannot hold, a bad range), naming the
/// key as `shown` (the client's own spelling, never the store key with its bucket or tenant
/// namespace). Backend failures are `500 InternalError` or `503 SlowDown` with no backend
/// text, OS error or path: those go to the server's log only.
pub fn map_err_as(e: StoreError, shown: &str) -> S3Error {
    match e {
        StoreError::NotFound { .. } => s3_error!(NoSuchKey, "no such key: {shown}"),
        StoreError::AlreadyExists { .. } => {
            s3_error!(PreconditionFailed, "object already exists: {shown}")
        }
        StoreError::Precondition { .. } => {
            s3_error!(PreconditionFailed, "precondition failed: {shown}")
        }
        StoreError::InvalidRange {
            start, end, size, ..
        } => {
            s3_error!(
                InvalidRange,
                "range {start}..{end} outside {shown} of {size} bytes"
            )
        }
        StoreError::InvalidKey { reason, .. }
            if (reason.contains("1024 bytes") && !shown.is_empty())
                || reason.contains("255 bytes") =>
        {
            s3_error!(KeyTooLongError, "invalid key {shown:?}: {reason}")
        }
        StoreError::InvalidKey { reason, .. } => {
            s3_error!(InvalidArgument, "invalid key {shown:?}: {reason}")
        }
        StoreError::PermissionDenied { .. } => {
            tracing::warn!(error = %e, "backend refused the server's credentials");
            s3_error!(InternalError, "the storage backend refused the request")
        }
        StoreError::NotImplemented { operation, backend } => {
            s3_error!(
                NotImplemented,
                "{operation} is not implemented by {backend}"
            )
        }
        // Gateway mode over an upstream that cannot do what is asked (e.g. conditional PUT).
        StoreError::Incompatible { message, .. } => {
            s3_error!(NotImplemented, "the upstream store: {message}")
        }
        StoreError::Timeout { .. } => {
            tracing::warn!(error = %e, "backend timed out");
            s3_error!(SlowDown, "the storage backend is slow; retry")
        }
        other => {
            tracing::warn!(error = %other, key = shown, "backend failure");
            s3_error!(InternalError, "internal error (logged by the server)")
        }
    }
}
