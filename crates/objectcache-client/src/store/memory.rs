//! In-memory store: the reference backend, for tests and single-process caches.

use super::{
    validate_key, GetOptions, GetResult, ObjectMeta, PutMode, PutOptions, PutResult, Store,
};
use crate::error::{StoreError, StoreResult};
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::SystemTime;

/// A store holding objects in a `BTreeMap` in process memory. Cheap to clone bytes out of:
/// gets return slices of the stored [`Bytes`] without copying.
#[derive(Debug, Default)]
pub struct MemoryStore {
    objects: Mutex<BTreeMap<String, (Bytes, SystemTime, u64)>>,
    next_etag: std::sync::atomic::AtomicU64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }
    /// Total bytes stored.
    pub fn total_bytes(&self) -> u64 {
        self.objects
            .lock()
            .expect("lock")
            .values()
            .map(|v| v.0.len() as u64)
            .sum()
    }
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        validate_key(key)?;
        let (data, t, etag) = self
            .objects
            .lock()
            .expect("lock")
            .get(key)
            .cloned()
            .ok_or_else(|| StoreError::NotFound { key: key.into() })?;
        let meta = ObjectMeta {
            key: key.into(),
            size: data.len() as u64,
            last_modified: Some(t),
            etag: Some(etag.to_string()),
        };
        GetResult::in_memory(meta, &data, opts.range)
    }

    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        validate_key(key)?;
        let etag = self
            .next_etag
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let mut m = self.objects.lock().expect("lock");
        if opts.mode == PutMode::Create && m.contains_key(key) {
            return Err(StoreError::AlreadyExists { key: key.into() });
        }
        m.insert(key.to_string(), (data, SystemTime::now(), etag));
        Ok(PutResult {
            etag: Some(etag.to_string()),
        })
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        validate_key(key)?;
        let m = self.objects.lock().expect("lock");
        let (d, t, e) = m
            .get(key)
            .ok_or_else(|| StoreError::NotFound { key: key.into() })?;
        Ok(ObjectMeta {
            key: key.into(),
            size: d.len() as u64,
            last_modified: Some(*t),
            etag: Some(e.to_string()),
        })
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        validate_key(key)?;
        self.objects.lock().expect("lock").remove(key);
        Ok(())
    }

    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        let m = self.objects.lock().expect("lock");
        Ok(m.range(prefix.to_string()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit)
            .map(|(k, (d, t, e))| ObjectMeta {
                key: k.clone(),
                size: d.len() as u64,
                last_modified: Some(*t),
                etag: Some(e.to_string()),
            })
            .collect())
    }
}
