//! The bucket registry: bucket names, cached in memory and persisted in the store under
//! `_buckets/`.

use bytes::Bytes;
use objectcache_client::error::{StoreError, StoreResult};
use objectcache_client::store::{Store, StoreExt};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::SystemTime;

/// Store key prefix of the bucket registry.
const BUCKETS_PREFIX: &str = "_buckets/";

/// The set of buckets, cached in memory and persisted in the store (so a gateway restarted
/// over the same upstream sees its buckets again).
#[derive(Debug)]
pub struct Buckets {
    store: Arc<dyn Store>,
    known: RwLock<HashMap<String, SystemTime>>,
}

impl Buckets {
    /// Loads the registry from `store`.
    ///
    /// # Errors
    /// The store's list error.
    pub async fn load(store: Arc<dyn Store>) -> StoreResult<Self> {
        let mut known = HashMap::new();
        for m in store.list(BUCKETS_PREFIX, usize::MAX).await? {
            let name = m.key[BUCKETS_PREFIX.len()..].to_string();
            known.insert(name, m.last_modified.unwrap_or(SystemTime::UNIX_EPOCH));
        }
        Ok(Buckets {
            store,
            known: RwLock::new(known),
        })
    }

    /// `true` if the bucket exists (consulting the store on a cache miss).
    pub async fn exists(&self, name: &str) -> StoreResult<bool> {
        if self.known.read().expect("lock").contains_key(name) {
            return Ok(true);
        }
        match self.store.head(&format!("{BUCKETS_PREFIX}{name}")).await {
            Ok(m) => {
                self.known.write().expect("lock").insert(
                    name.into(),
                    m.last_modified.unwrap_or(SystemTime::UNIX_EPOCH),
                );
                Ok(true)
            }
            Err(StoreError::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates a bucket; `Ok(false)` if it already existed.
    ///
    /// # Errors
    /// A store failure.
    pub async fn create(&self, name: &str) -> StoreResult<bool> {
        let r = self
            .store
            .put_if_absent(&format!("{BUCKETS_PREFIX}{name}"), Bytes::new())
            .await?;
        self.known
            .write()
            .expect("lock")
            .entry(name.into())
            .or_insert_with(SystemTime::now);
        Ok(r == objectcache_client::store::PutIfAbsent::Written)
    }

    pub(super) async fn remove(&self, name: &str) -> StoreResult<()> {
        self.store
            .delete(&format!("{BUCKETS_PREFIX}{name}"))
            .await?;
        self.known.write().expect("lock").remove(name);
        Ok(())
    }

    pub(super) fn list(&self) -> Vec<(String, SystemTime)> {
        let mut v: Vec<_> = self
            .known
            .read()
            .expect("lock")
            .iter()
            .map(|(k, t)| (k.clone(), *t))
            .collect();
        v.sort();
        v
    }
}
