//! What the engines of one process share when they are opened on the same store URL
//! ([`Engine::new`](super::Engine::new)): the lookup cache and the table of loads in flight.
//!
//! Why: in vLLM's layout for one GPU (and in its CPU build without multiprocessing), the
//! connector's scheduler side and its worker side run in one process, each with an engine.
//! With a cache per engine, the worker's save did not clear the scheduler's cached miss of the
//! same chunks: a request for that prefix within `lookup_cache_ttl` of the first lookup
//! missed. With a flight table per engine, concurrent loads of one prefix through several
//! engines of a process each fetched it (13-18x one load's bytes over 4 engines, issue 42).
//! Sharing both, a save by any of them is seen by every lookup after it, and a load follows
//! a load of the same chunks in flight in any of them (`flight.rs`).
//!
//! What is shared is keyed by the store's identity ([`crate::store::shared_identity`]: the
//! directory of a file store, the URL of an S3 store; a `memory://` store is never shared,
//! each URL opens a new one). Engines started over a store object ([`Engine::with_store`])
//! keep their own: the caller chose that object, and may give each engine a different view
//! of it (a wrapper counting requests, injecting faults).
//!
//! Entries are removed when the last engine holding them is dropped.
//!
//! [`Engine::with_store`]: super::Engine::with_store

use super::flight::Flights;
use super::markers::Known;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Instant;

/// State the engines of one process share per store.
#[derive(Default)]
pub(crate) struct Shared {
    /// marker key -> (what a lookup or save learnt of it, time of the answer)
    pub(crate) lookup_cache: Mutex<HashMap<String, (Known, Instant)>>,
    /// Loads in flight that later loads of the same chunks may follow.
    pub(crate) flights: Flights,
}

/// Every store identity with live engines, and what they share.
fn registry() -> &'static Mutex<HashMap<String, Weak<Shared>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Weak<Shared>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The state shared by the engines on the store `identity` (`None`: a state of this engine's
/// own).
pub(crate) fn for_store(identity: Option<&str>) -> Arc<Shared> {
    let Some(id) = identity else {
        return Arc::default();
    };
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    reg.retain(|_, w| w.strong_count() > 0);
    if let Some(s) = reg.get(id).and_then(Weak::upgrade) {
        return s;
    }
    let s = Arc::<Shared>::default();
    reg.insert(id.to_string(), Arc::downgrade(&s));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_state_per_identity_while_an_engine_holds_it() {
        let a = for_store(Some("fs:/tmp/shared-test-a"));
        let b = for_store(Some("fs:/tmp/shared-test-a"));
        assert!(Arc::ptr_eq(&a, &b));
        let c = for_store(Some("fs:/tmp/shared-test-c"));
        assert!(!Arc::ptr_eq(&a, &c));
        // No identity: never shared.
        assert!(!Arc::ptr_eq(&for_store(None), &for_store(None)));
        // What one holder learns, the other sees.
        a.lookup_cache
            .lock()
            .unwrap()
            .insert("m".into(), (Known::Absent, Instant::now()));
        assert!(b.lookup_cache.lock().unwrap().contains_key("m"));
        // Once every holder is gone, a later engine starts afresh.
        drop((a, b));
        let d = for_store(Some("fs:/tmp/shared-test-a"));
        assert!(d.lookup_cache.lock().unwrap().is_empty());
    }
}
