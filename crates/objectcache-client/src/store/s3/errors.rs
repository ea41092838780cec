//! One mapping of every S3 request failure to a [`StoreError`].

use super::{Addressing, BACKEND};
use crate::error::StoreError;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};

/// What a request was doing, for [`map_error`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    Get,
    Put,
    PutCreate,
    Head,
    Delete,
    List,
    /// A request on the bucket itself (HEAD or create bucket).
    Bucket,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Get => "GET",
            Op::Put | Op::PutCreate => "PUT",
            Op::Head => "HEAD",
            Op::Delete => "DELETE",
            Op::List => "LIST",
            Op::Bucket => "bucket request",
        }
    }
}

/// Context that [`map_error`] needs about the store.
pub(super) struct ErrCtx<'a> {
    /// The bucket.
    pub(super) bucket: &'a str,
    /// The endpoint's host name, where known.
    pub(super) host: Option<&'a str>,
    /// The endpoint URL.
    pub(super) endpoint: &'a str,
    /// The addressing style in use.
    pub(super) addressing: Addressing,
}

/// Turns an SDK failure into a [`StoreError`]: the one place where HTTP statuses and S3 error
/// codes get their meaning.
///
/// | status / failure | error |
/// |---|---|
/// | 404 (`NoSuchKey`, `NotFound`) | [`StoreError::NotFound`] |
/// | 404 `NoSuchBucket` | `Other`, naming the bucket and, for virtual-hosted, suggesting path-style |
/// | 412 on a create-only PUT (also 409 `ConditionalRequestConflict`) | [`StoreError::AlreadyExists`] |
/// | 412 otherwise | [`StoreError::Precondition`] |
/// | 416 | [`StoreError::InvalidRange`] (size 0 here; the caller fills it in) |
/// | 401, 403 | [`StoreError::PermissionDenied`] |
/// | 301, 307, `PermanentRedirect`, `AuthorizationHeaderMalformed` | `Other`, suggesting the other addressing or region |
/// | timeouts | [`StoreError::Timeout`] |
/// | DNS or connect failure | `Other`; for virtual-hosted, suggesting path-style |
/// | anything else (5xx after retries, ...) | `Other` with status, code and message |
pub(super) fn map_error<E>(
    cx: &ErrCtx<'_>,
    op: Op,
    key: &str,
    err: SdkError<E, aws_smithy_runtime_api::http::Response>,
) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let status = err.raw_response().map(|r| r.status().as_u16());
    let code = err.code().unwrap_or("").to_string();
    let server_msg = err.message().unwrap_or("").to_string();
    let other_way = match cx.addressing {
        Addressing::Path => Addressing::Virtual,
        Addressing::Virtual => Addressing::Path,
    };
    let detail = || {
        let mut s = match op {
            Op::List => format!("LIST under {key:?}"),
            _ => format!("{} {key}", op.name()),
        };
        if let Some(st) = status {
            s.push_str(&format!(": HTTP {st}"));
        }
        if !code.is_empty() {
            s.push_str(&format!(" {code}"));
        }
        if !server_msg.is_empty() {
            s.push_str(&format!(": {server_msg}"));
        }
        if status.is_none() {
            s.push_str(&format!(" at {}: {}", cx.endpoint, causes(&err)));
        }
        s
    };
    match &err {
        SdkError::TimeoutError(_) => {
            return StoreError::Timeout {
                backend: BACKEND,
                message: format!("{} {key} to {}", op.name(), cx.endpoint),
            }
        }
        SdkError::DispatchFailure(d) if d.is_timeout() => {
            return StoreError::Timeout {
                backend: BACKEND,
                message: detail(),
            }
        }
        SdkError::DispatchFailure(d) if d.is_io() && cx.addressing == Addressing::Virtual => {
            return StoreError::Other {
                backend: BACKEND,
                message: format!(
                    "{}; with virtual-hosted addressing the request goes to host {}.{}, which did not resolve or connect: if {} serves buckets as path segments or has no wildcard DNS, use addressing=path",
                    detail(),
                    cx.bucket,
                    cx.host.unwrap_or("<endpoint host>"),
                    cx.endpoint
                ),
            };
        }
        SdkError::DispatchFailure(_) | SdkError::ConstructionFailure(_) => {
            return StoreError::Other {
                backend: BACKEND,
                message: detail(),
            }
        }
        _ => {}
    }
    match (status, code.as_str()) {
        (_, "NoSuchBucket") | (Some(404), _) if code == "NoSuchBucket" || op == Op::Bucket => {
            let hint = match cx.addressing {
                Addressing::Virtual => format!(
                    "; with virtual-hosted addressing the endpoint must take the bucket from the Host header: if {} expects it in the path, use addressing=path",
                    cx.endpoint
                ),
                Addressing::Path => String::new(),
            };
            StoreError::Other { backend: BACKEND, message: format!("bucket {:?} does not exist at {} ({}){hint}", cx.bucket, cx.endpoint, detail()) }
        }
        (Some(404), _) | (_, "NoSuchKey") | (_, "NotFound") => StoreError::NotFound { key: key.to_string() },
        (Some(412), _) | (Some(409), "ConditionalRequestConflict") if op == Op::PutCreate => {
            StoreError::AlreadyExists { key: key.to_string() }
        }
        (Some(412), _) => StoreError::Precondition { key: key.to_string() },
        (Some(416), _) | (_, "InvalidRange") => StoreError::InvalidRange { key: key.to_string(), start: 0, end: 0, size: 0 },
        (Some(301) | Some(307), _) | (_, "PermanentRedirect") | (_, "AuthorizationHeaderMalformed") => StoreError::Other {
            backend: BACKEND,
            message: format!(
                "{}; the endpoint redirects requests for bucket {:?}: it wants {other_way} addressing (addressing={other_way}) or another region",
                detail(),
                cx.bucket
            ),
        },
        (Some(401) | Some(403), _) => StoreError::PermissionDenied { backend: BACKEND, message: detail() },
        _ => StoreError::Other { backend: BACKEND, message: detail() },
    }
}

/// An error and its causes in one line, outermost first, joined by ": " (a cause whose text
/// an earlier one already holds is left out). The SDK's own display of the chain
/// (`DisplayErrorContext`) ends in a `Debug` dump of the whole error, which no user should
/// have to read.
pub(super) fn causes(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut cur = Some(err);
    while let Some(e) = cur {
        let text = e.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        cur = e.source();
    }
    parts.join(": ")
}
