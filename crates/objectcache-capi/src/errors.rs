//! Errors on their way to C: the stable status codes of the crate's errors, the calling
//! thread's last message, and [`guard`], which every export's body runs under.

use super::*;

/// An error on its way to C: a status code and a message.
#[derive(Debug)]
pub(super) struct CErr {
    pub(super) code: objectcache_status,
    pub(super) msg: String,
}

pub(super) fn err(code: objectcache_status, msg: impl Into<String>) -> CErr {
    CErr {
        code,
        msg: msg.into(),
    }
}

pub(super) fn invalid(msg: impl Into<String>) -> CErr {
    err(OBJECTCACHE_ERR_INVALID_ARGUMENT, msg)
}

/// The stable status code of a layer miss.
pub(super) fn layer_code(e: &LayerError) -> objectcache_status {
    match e {
        LayerError::Missing { .. } => OBJECTCACHE_ERR_LAYER_MISSING,
        LayerError::ChecksumMismatch { .. } => OBJECTCACHE_ERR_LAYER_CHECKSUM,
        LayerError::GeometryMismatch { .. } => OBJECTCACHE_ERR_LAYER_GEOMETRY,
        LayerError::Storage { .. } => OBJECTCACHE_ERR_LAYER_STORAGE,
        // A stall is a timeout of progress; the message says which.
        LayerError::Timeout { .. } | LayerError::Stalled { .. } => OBJECTCACHE_ERR_LAYER_TIMEOUT,
        LayerError::Cancelled => OBJECTCACHE_ERR_CANCELLED,
        LayerError::Device { .. } => OBJECTCACHE_ERR_LAYER_DEVICE,
        // `LayerError` is `#[non_exhaustive]` (objectcache-core): a kind added there reads as
        // a storage miss until it gets a code of its own; the message names it.
        _ => OBJECTCACHE_ERR_LAYER_STORAGE,
    }
}

/// The stable status code of a crate error.
pub(super) fn error_code(e: &Error) -> objectcache_status {
    match e {
        Error::InvalidArgument(_) => OBJECTCACHE_ERR_INVALID_ARGUMENT,
        Error::Config(_) => OBJECTCACHE_ERR_CONFIG,
        Error::Format(_) => OBJECTCACHE_ERR_FORMAT,
        Error::Store(StoreError::NotFound { .. }) => OBJECTCACHE_ERR_NOT_FOUND,
        Error::Store(_) => OBJECTCACHE_ERR_STORE,
        Error::Layer(l) => layer_code(l),
        Error::Io(_) => OBJECTCACHE_ERR_IO,
        Error::Busy(_) => OBJECTCACHE_ERR_BUSY,
        Error::Unsupported(_) => OBJECTCACHE_ERR_UNSUPPORTED,
        // `Error` is `#[non_exhaustive]` (objectcache-core): a kind added there reads as
        // internal until it gets a code of its own; the message names it.
        _ => OBJECTCACHE_ERR_INTERNAL,
    }
}

impl From<Error> for CErr {
    fn from(e: Error) -> Self {
        err(error_code(&e), e.to_string())
    }
}

impl From<LayerError> for CErr {
    fn from(e: LayerError) -> Self {
        err(layer_code(&e), e.to_string())
    }
}

thread_local! {
    pub(super) static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs an export's body: catches panics, maps errors to codes and records the message.
pub(super) fn guard(
    func: &str,
    f: impl FnOnce() -> Result<objectcache_status, CErr>,
) -> objectcache_status {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let what = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(err(
            OBJECTCACHE_ERR_INTERNAL,
            format!("internal error (panic): {what}"),
        ))
    });
    match r {
        Ok(code) => code,
        Err(e) => {
            set_last_error(&format!("{func}: {}", e.msg));
            e.code
        }
    }
}
