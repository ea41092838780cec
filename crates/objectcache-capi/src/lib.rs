//! # objectcache-capi
//!
//! The C ABI (`ffi/objectcache.h`): a thin layer over [`objectcache_client::connector`]. The
//! façade crate `objectcache` links it into `libobjectcache` (cdylib and staticlib) and
//! re-exports it as `objectcache::capi`; it needs neither the server nor the command line.
//!
//! Every exported function is `extern "C"` with `#[no_mangle]`, named and typed exactly as in
//! the header (checked at build time by `build.rs`, which generates the header's Rust view
//! with bindgen and asserts that every signature, struct layout and constant here matches).
//!
//! Rules kept by every export (see `docs/c-abi.md`):
//! - no panic crosses the boundary: the body runs under [`std::panic::catch_unwind`] and a
//!   panic becomes [`OBJECTCACHE_ERR_INTERNAL`];
//! - every pointer is checked (NULL, alignment, `struct_size`) before it is dereferenced;
//! - handles are opaque tokens looked up in a registry, never addresses: a released or
//!   destroyed handle is refused with [`OBJECTCACHE_ERR_INVALID_HANDLE`] instead of being
//!   dereferenced, and tokens are never reused;
//! - errors set a thread-local message read by `objectcache_last_error`.
#![warn(missing_docs)]
#![allow(unsafe_code)]
#![allow(non_camel_case_types)]

mod types;

pub use types::*;

use objectcache_client::connector::{
    ChunkStatus, Engine, EngineConfig, LayerStatus, LayerTiming, LoadHints, LoadRequest,
    MemoryKind, RegionId, RegisteredLoad,
};
use objectcache_client::error::{Error, LayerError, LayerResult, StoreError};
use objectcache_client::hash::{chunk_hashes, HashParams};
use objectcache_client::layout::{ChunkHash, Dtype, KvGeometry};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};

#[cfg(objectcache_abi_check)]
#[allow(
    dead_code,
    non_upper_case_globals,
    non_snake_case,
    clippy::all,
    missing_docs,
    unused_imports
)]
mod abi_check {
    include!(concat!(env!("OUT_DIR"), "/objectcache_abi_check.rs"));
}

mod checks;
mod convert;
mod engine;
mod errors;
mod handles;
mod library;
mod load;
mod save;

// The exports, re-exported where build.rs's check and the crate look for them
// (`crate::objectcache_*`); the helpers, for the files above and the tests below.
use checks::*;
use convert::*;
pub use engine::*;
use errors::*;
use handles::*;
pub use library::*;
pub use load::*;
pub use save::*;

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: objectcache_last_error returns a NUL-terminated string owned by this thread.
        unsafe { CStr::from_ptr(objectcache_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn load_params_hints_map_to_load_hints() {
        let h = load_hints(0, 0, 0, 4);
        assert_eq!((h.timing, h.priority), (LayerTiming::None, 128));
        assert_eq!(load_hints(1, 0, 0, 4).priority, 129);
        assert_eq!(load_hints(u32::MAX, 0, 0, 4).priority, 255);
        assert_eq!(
            load_hints(0, 0, 2500, 3).timing,
            LayerTiming::ComputeS(vec![0.0025; 3])
        );
        assert_eq!(
            load_hints(0, 40, 0, 2).timing,
            LayerTiming::DeadlinesS(vec![0.04; 2])
        );
        let LayerTiming::DeadlinesS(d) = load_hints(0, 40, 2000, 3).timing else {
            panic!("deadline and compute give deadlines");
        };
        let want = [0.040, 0.042, 0.044];
        assert!(
            d.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-12),
            "{d:?}"
        );
    }

    #[test]
    fn a_panic_becomes_internal_error_with_its_message() {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let s = guard("objectcache_test", || panic!("boom {}", 7));
        std::panic::set_hook(prev);
        assert_eq!(s, OBJECTCACHE_ERR_INTERNAL);
        assert_eq!(last(), "objectcache_test: internal error (panic): boom 7");
    }

    #[test]
    fn every_error_variant_has_its_stable_code() {
        let nf = StoreError::NotFound { key: "k".into() };
        let cases: Vec<(Error, i32)> = vec![
            (Error::InvalidArgument("x".into()), 2),
            (Error::Config("x".into()), 8),
            (Error::Store(nf), 10),
            (Error::Store(StoreError::other("fs", "disk")), 11),
            (Error::Io(std::io::Error::other("x")), 12),
            (
                Error::Layer(LayerError::Missing {
                    chunk: 0,
                    key: "k".into(),
                }),
                20,
            ),
            (
                Error::Layer(LayerError::ChecksumMismatch {
                    chunk: 0,
                    layer: 0,
                    stored: 1,
                    computed: 2,
                }),
                21,
            ),
            (
                Error::Layer(LayerError::GeometryMismatch {
                    chunk: 0,
                    reason: "r".into(),
                }),
                22,
            ),
            (
                Error::Layer(LayerError::Storage {
                    chunk: 0,
                    message: "m".into(),
                }),
                23,
            ),
            (Error::Layer(LayerError::Timeout { layer: 3 }), 24),
            (Error::Layer(LayerError::Cancelled), 25),
        ];
        for (e, code) in cases {
            let name = status_name(code).to_str().unwrap().to_string();
            assert_eq!(error_code(&e), code, "{e} -> {name}");
            assert_ne!(name, "unknown status");
        }
    }

    #[test]
    fn stale_and_wrong_kind_handles_are_refused_without_dereference() {
        // A token that was never issued, and NULL.
        let bogus: *mut objectcache_transfer = token(usize::MAX - 1);
        // SAFETY: handles are tokens looked up in the registry, never dereferenced.
        assert_eq!(
            unsafe { objectcache_transfer_release(bogus) },
            OBJECTCACHE_ERR_INVALID_HANDLE
        );
        assert!(last().contains("not live"), "{}", last());
        // SAFETY: as above.
        assert_eq!(
            unsafe { objectcache_transfer_cancel(std::ptr::null_mut()) },
            OBJECTCACHE_ERR_INVALID_HANDLE
        );
        assert!(last().contains("NULL"), "{}", last());
    }
}
