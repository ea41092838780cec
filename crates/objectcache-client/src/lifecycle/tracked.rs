//! [`TrackedStore`]: a store wrapper that records reads in an [`AccessLog`] and renews soft
//! leases in a [`LeaseTable`]; everything else passes through.

use super::{classify_key, AccessLog, LeaseTable, ObjectKind};
use crate::error::StoreResult;
use crate::store::{
    ByteStream, GetOptions, GetResult, LocalObject, ObjectMeta, PartialWrite, PutOptions,
    PutResult, RangeBody, Store,
};
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

/// A store wrapper that records reads in an [`AccessLog`] and renews soft leases in a
/// [`LeaseTable`] on every read of an object's bytes (not on a lookup's `HEAD`: probes never
/// pin); everything else passes through.
#[derive(Debug)]
pub struct TrackedStore {
    inner: Arc<dyn Store>,
    access: Arc<AccessLog>,
    leases: Arc<LeaseTable>,
    soft_lease: Duration,
}

impl TrackedStore {
    /// Wraps `inner`; every get of a data object or marker records an access and renews its
    /// entry's lease for `soft_lease` (use the load deadline, e.g. 30 s).
    pub fn new(
        inner: Arc<dyn Store>,
        access: Arc<AccessLog>,
        leases: Arc<LeaseTable>,
        soft_lease: Duration,
    ) -> Self {
        TrackedStore {
            inner,
            access,
            leases,
            soft_lease,
        }
    }
    /// A read of `key`: a use of its entry and a soft lease on it, unless it is a publish
    /// marker. Reading a marker is a lookup (lookups read markers to learn which object holds
    /// a chunk): it neither counts as use nor pins, so a lookup that loads nothing keeps
    /// nothing from eviction (case C13).
    fn note(&self, key: &str) {
        if classify_key(key).0 == ObjectKind::Marker {
            return;
        }
        self.access.record(key, SystemTime::now());
        self.leases.touch(key, self.soft_lease);
    }
}

#[async_trait]
impl Store for TrackedStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    // The data paths of the wrapped store pass through: without these, a wrapped `fs` store
    // loses sendfile (the trait's defaults say "none"). Gather is not the store's: the engine
    // holds the wrapped store's `Gateways` beside it.
    async fn open_local(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        let r = self.inner.open_local(key).await;
        if matches!(r, Ok(Some(_))) {
            self.note(key);
        }
        r
    }
    fn open_local_blocking(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        let r = self.inner.open_local_blocking(key);
        if matches!(r, Ok(Some(_))) {
            self.note(key);
        }
        r
    }
    async fn get_range_body(
        &self,
        key: &str,
        range: std::ops::Range<u64>,
    ) -> StoreResult<Option<RangeBody>> {
        self.note(key);
        self.inner.get_range_body(key, range).await
    }
    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.note(key);
        self.inner.get_opts(key, opts).await
    }
    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        let r = self.inner.put_opts(key, data, opts).await;
        if r.is_ok() {
            self.access.record(key, SystemTime::now());
        }
        r
    }
    /// A lookup's probe: passed through, neither an access nor a lease. Lookups never pin:
    /// what a probe found may be evicted until a load reads it (a lookup that loaded nothing
    /// must not keep entries from eviction, case C13).
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.inner.head(key).await
    }
    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> StoreResult<PutResult> {
        let r = self.inner.put_stream(key, body, len, opts).await;
        if r.is_ok() {
            self.access.record(key, SystemTime::now());
        }
        r
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.inner.list(prefix, limit).await
    }
    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        self.inner.list_partial(prefix).await
    }
    async fn delete_partial(&self, partial: &PartialWrite) -> StoreResult<()> {
        self.inner.delete_partial(partial).await
    }
}
