//! One backend read per slice for concurrent loads of it.
//!
//! How the gather server reads each slice once when several loads want it at the same time:
//! - **Filesystem backend** (`objectcache serve --store DIR`): unverified slices go to the
//!   socket from a read-only mapping of the chunk file (`gather/fetch.rs`); the first load's
//!   touch of a slice (and its `POSIX_FADV_WILLNEED` advice, a layer ahead) brings it into the
//!   page cache, and every concurrent load's socket write is served from those same pages:
//!   one device read per slice, whatever the number of loads.
//! - **Memory backend**: a read hands out the stored buffer itself (reference-counted), no
//!   copy and no read.
//! - **Any other backend** (gateway mode over an upstream S3 store, or a local store when the
//!   server verifies slices itself): [`Reads::read`] joins a ranged read of the same object
//!   bytes already in flight for another load instead of issuing a second one; the bytes are
//!   shared (reference-counted buffers), and each load checks and sends them on its own. A read
//!   runs in its own task, so a load that goes away does not cancel it under the others.
//!   Counted in `objectcache_server_requests_total{op="backend_read"}` and
//!   `{op="backend_read_joined"}`.

use bytes::Bytes;
use futures::future::{BoxFuture, FutureExt, Shared};
use futures::StreamExt;
use objectcache_client::error::StoreError;
use objectcache_client::store::{GetOptions, Store};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// What a shared read gives: the body's buffers, or the store's error.
pub(crate) type ReadOutput = Result<Arc<Vec<Bytes>>, Arc<StoreError>>;

type Key = (String, u64, u64);

/// Ranged backend reads in flight, by object key and byte range.
#[derive(Default)]
pub(crate) struct Reads {
    inflight: Arc<Mutex<HashMap<Key, Shared<BoxFuture<'static, ReadOutput>>>>>,
}

impl Reads {
    /// Starts a read of `range` of `key` from `store`, or joins a read of the same bytes in
    /// flight. Returns the read to await, which gives the body's buffers (their total is what
    /// the store returned: the caller checks the length), and whether this call joined
    /// another's read: known at once, so a join is counted while the read is still in flight.
    pub(crate) fn read(
        &self,
        store: &Arc<dyn Store>,
        key: &str,
        range: Range<u64>,
    ) -> (Shared<BoxFuture<'static, ReadOutput>>, bool) {
        let k = (key.to_string(), range.start, range.end);
        let mut m = self.inflight.lock().expect("reads lock");
        match m.get(&k) {
            Some(f) => (f.clone(), true),
            None => {
                let (store, key, map, k2) = (
                    store.clone(),
                    key.to_string(),
                    self.inflight.clone(),
                    k.clone(),
                );
                let task = tokio::spawn(async move {
                    let out = read_all(&*store, &key, range).await;
                    map.lock().expect("reads lock").remove(&k2);
                    out
                });
                let f = async move {
                    task.await.unwrap_or_else(|e| {
                        Err(Arc::new(StoreError::other(
                            "backend read",
                            std::io::Error::other(e.to_string()),
                        )))
                    })
                }
                .boxed()
                .shared();
                m.insert(k, f.clone());
                (f, false)
            }
        }
    }
}

async fn read_all(store: &dyn Store, key: &str, range: Range<u64>) -> ReadOutput {
    let r = store
        .get_opts(key, GetOptions { range: Some(range) })
        .await
        .map_err(Arc::new)?;
    let mut body = r.body;
    let mut parts = Vec::new();
    while let Some(b) = body.next().await {
        parts.push(b.map_err(Arc::new)?);
    }
    Ok(Arc::new(parts))
}
