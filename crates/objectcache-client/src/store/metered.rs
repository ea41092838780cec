//! [`MeteredStore`]: a store that counts the requests and bytes it passes to the store it
//! wraps, for what a remote store bills (requests, bytes out) and for benchmarks that compare
//! the bytes a store served with the distinct bytes asked.

use super::{
    ByteStream, GetOptions, GetResult, LocalObject, ObjectMeta, PartialWrite, PutOptions,
    PutResult, RangeBody, Store,
};
use crate::error::StoreResult;
use async_trait::async_trait;
use bytes::Bytes;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a [`MeteredStore`] has passed on since it was made (counters only grow).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MeteredStats {
    /// GET-class requests: whole and ranged GETs (also those read into the caller's memory,
    /// [`Store::get_range_body`]) and HEADs; what S3 bills at the GET price.
    pub gets: u64,
    /// PUT-class requests: PUTs, streamed PUTs and LISTs; what S3 bills at the PUT price.
    pub puts: u64,
    /// DELETEs (free on S3).
    pub deletes: u64,
    /// Bytes of the ranges read (what the reads asked for and the store answered), bytes.
    pub read_bytes: u64,
    /// Bytes written by PUTs (a streamed PUT of unknown length counts 0), bytes.
    pub written_bytes: u64,
    /// Time spent in GET-class requests, summed: from the call to the store's answer (for a
    /// GET, the start of its body; a body read later is not counted).
    pub get_time: Duration,
    /// Time spent in PUT-class requests, summed: from the call to the store's acknowledgement
    /// (a PUT's bytes are then durable there), LISTs included.
    pub put_time: Duration,
}

#[derive(Debug, Default)]
struct Counters {
    gets: AtomicU64,
    puts: AtomicU64,
    deletes: AtomicU64,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    get_nanos: AtomicU64,
    put_nanos: AtomicU64,
}

/// `op`'s answer, its time added to `nanos`.
async fn timed<T>(nanos: &AtomicU64, op: impl std::future::Future<Output = T>) -> T {
    let t0 = Instant::now();
    let r = op.await;
    since(nanos, t0);
    r
}

/// Adds the time since `t0` to `nanos`.
fn since(nanos: &AtomicU64, t0: Instant) {
    let d = u64::try_from(t0.elapsed().as_nanos()).unwrap_or(u64::MAX);
    nanos.fetch_add(d, Relaxed);
}

/// A store that counts what it passes to `inner` ([`MeteredStore::stats`]) and otherwise
/// behaves as `inner` does: every operation, errors included, is `inner`'s. Objects opened
/// as local files ([`Store::open_local`]) are read outside the store and are not counted:
/// meter a remote store (the server wraps its backend in gateway mode), not a directory.
#[derive(Debug)]
pub struct MeteredStore {
    inner: Arc<dyn Store>,
    c: Counters,
}

impl MeteredStore {
    /// A store counting what it passes to `inner`, from zero.
    pub fn new(inner: Arc<dyn Store>) -> Self {
        MeteredStore {
            inner,
            c: Counters::default(),
        }
    }

    /// The counts so far.
    pub fn stats(&self) -> MeteredStats {
        MeteredStats {
            gets: self.c.gets.load(Relaxed),
            puts: self.c.puts.load(Relaxed),
            deletes: self.c.deletes.load(Relaxed),
            read_bytes: self.c.read_bytes.load(Relaxed),
            written_bytes: self.c.written_bytes.load(Relaxed),
            get_time: Duration::from_nanos(self.c.get_nanos.load(Relaxed)),
            put_time: Duration::from_nanos(self.c.put_nanos.load(Relaxed)),
        }
    }
}

#[async_trait]
impl Store for MeteredStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    async fn open_local(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        self.inner.open_local(key).await
    }
    fn open_local_blocking(&self, key: &str) -> StoreResult<Option<LocalObject>> {
        self.inner.open_local_blocking(key)
    }
    async fn get_range_body(&self, key: &str, range: Range<u64>) -> StoreResult<Option<RangeBody>> {
        let len = range.end - range.start;
        let t0 = Instant::now();
        let r = self.inner.get_range_body(key, range).await;
        // `Ok(None)`: declined, the caller reads with `get_opts` (counted there).
        if !matches!(r, Ok(None)) {
            self.c.gets.fetch_add(1, Relaxed);
            since(&self.c.get_nanos, t0);
        }
        if let Ok(Some(_)) = &r {
            self.c.read_bytes.fetch_add(len, Relaxed);
        }
        r
    }
    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
        self.c.gets.fetch_add(1, Relaxed);
        let r = timed(&self.c.get_nanos, self.inner.get_opts(key, opts)).await?;
        self.c
            .read_bytes
            .fetch_add(r.range.end - r.range.start, Relaxed);
        Ok(r)
    }
    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        self.c.puts.fetch_add(1, Relaxed);
        self.c.written_bytes.fetch_add(data.len() as u64, Relaxed);
        timed(&self.c.put_nanos, self.inner.put_opts(key, data, opts)).await
    }
    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> StoreResult<PutResult> {
        self.c.puts.fetch_add(1, Relaxed);
        self.c.written_bytes.fetch_add(len.unwrap_or(0), Relaxed);
        timed(
            &self.c.put_nanos,
            self.inner.put_stream(key, body, len, opts),
        )
        .await
    }
    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        self.inner.list_partial(prefix).await
    }
    async fn delete_partial(&self, partial: &PartialWrite) -> StoreResult<()> {
        self.inner.delete_partial(partial).await
    }
    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
        self.c.gets.fetch_add(1, Relaxed);
        timed(&self.c.get_nanos, self.inner.head(key)).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.c.deletes.fetch_add(1, Relaxed);
        self.inner.delete(key).await
    }
    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        self.c.puts.fetch_add(1, Relaxed);
        timed(&self.c.put_nanos, self.inner.list(prefix, limit)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{MemoryStore, StoreExt};

    /// A memory store that answers every request 30 ms late.
    #[derive(Debug)]
    struct Slow(MemoryStore);

    const LATE: Duration = Duration::from_millis(30);

    #[async_trait]
    impl Store for Slow {
        fn name(&self) -> &'static str {
            "slow"
        }
        async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
            tokio::time::sleep(LATE).await;
            self.0.get_opts(key, opts).await
        }
        async fn put_opts(
            &self,
            key: &str,
            data: Bytes,
            opts: PutOptions,
        ) -> StoreResult<PutResult> {
            tokio::time::sleep(LATE).await;
            self.0.put_opts(key, data, opts).await
        }
        async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
            tokio::time::sleep(LATE).await;
            self.0.head(key).await
        }
        async fn delete(&self, key: &str) -> StoreResult<()> {
            self.0.delete(key).await
        }
        async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
            self.0.list(prefix, limit).await
        }
    }

    #[tokio::test]
    async fn counts_requests_and_bytes_and_keeps_the_inner_stores_answers() {
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let m = MeteredStore::new(inner.clone());
        m.put("a", Bytes::from(vec![7u8; 1000])).await.unwrap();
        let r = m
            .get_opts(
                "a",
                GetOptions {
                    range: Some(100..300),
                },
            )
            .await
            .unwrap();
        assert_eq!(r.range, 100..300);
        assert_eq!(m.head("a").await.unwrap().size, 1000);
        // A miss is the inner store's error, and still a request.
        assert!(m.head("missing").await.is_err());
        m.delete("a").await.unwrap();
        let st = m.stats();
        assert_eq!(
            st,
            MeteredStats {
                gets: 3,
                puts: 1,
                deletes: 1,
                read_bytes: 200,
                written_bytes: 1000,
                get_time: st.get_time,
                put_time: st.put_time,
            }
        );
        // Each class's time is its own requests': a store that takes `LATE` (30 ms) for
        // every request, counted in the class of the request, errors included.
        let slow = MeteredStore::new(Arc::new(Slow(MemoryStore::new())));
        slow.put("b", Bytes::from_static(b"xyz")).await.unwrap();
        let after_put = slow.stats();
        assert!(after_put.put_time >= LATE, "{after_put:?}");
        assert_eq!(after_put.get_time, Duration::ZERO);
        assert!(slow.head("b").await.is_ok());
        assert!(slow.head("gone").await.is_err());
        let after_heads = slow.stats();
        assert!(after_heads.get_time >= 2 * LATE, "{after_heads:?}");
        assert_eq!(after_heads.put_time, after_put.put_time);
        assert!(
            inner.head("a").await.is_err(),
            "the delete reached the inner store"
        );
    }
}
