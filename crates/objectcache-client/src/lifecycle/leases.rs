//! What keeps an entry alive or recent in this process: the last use of each entry
//! ([`AccessLog`]) and leases on keys ([`LeaseTable`]: explicit [`Lease`]s and soft leases).

use super::{classify_key, ObjectKind};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Last access time per entry, fed by a [`TrackedStore`].
///
/// [`TrackedStore`]: super::TrackedStore
#[derive(Debug, Default)]
pub struct AccessLog {
    last: Mutex<HashMap<String, SystemTime>>,
}

impl AccessLog {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }
    /// Records a use of the entry that `key` belongs to, at `t`.
    pub fn record(&self, key: &str, t: SystemTime) {
        let (kind, id) = classify_key(key);
        if kind == ObjectKind::Other {
            return;
        }
        let mut m = self.last.lock().expect("lock");
        let v = m.entry(id).or_insert(t);
        if *v < t {
            *v = t;
        }
    }
    /// Last recorded use of an entry id.
    pub fn last_use(&self, id: &str) -> Option<SystemTime> {
        self.last.lock().expect("lock").get(id).copied()
    }
    pub(super) fn forget(&self, id: &str) {
        self.last.lock().expect("lock").remove(id);
    }
}

/// In-process leases on keys: a leased key is never deleted by [`collect`].
///
/// [`collect`]: super::collect()
#[derive(Debug, Default)]
pub struct LeaseTable {
    /// key -> (explicit holders, soft lease end)
    leases: Mutex<HashMap<String, (u32, Option<Instant>)>>,
}

/// An explicit lease on some keys; dropping it releases them.
#[derive(Debug)]
pub struct Lease {
    table: Arc<LeaseTable>,
    keys: Vec<String>,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut m = self
            .table
            .leases
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for k in &self.keys {
            if let Some(v) = m.get_mut(k) {
                v.0 = v.0.saturating_sub(1);
                if v.0 == 0 && v.1.is_none_or(|t| t <= Instant::now()) {
                    m.remove(k);
                }
            }
        }
    }
}

impl LeaseTable {
    /// An empty table.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
    /// Leases `keys` (data objects or markers: the whole entry is kept) until the guard drops.
    pub fn acquire(self: &Arc<Self>, keys: impl IntoIterator<Item = String>) -> Lease {
        let keys: Vec<String> = keys.into_iter().map(|k| classify_key(&k).1).collect();
        let mut m = self.leases.lock().expect("lock");
        for k in &keys {
            m.entry(k.clone()).or_insert((0, None)).0 += 1;
        }
        Lease {
            table: self.clone(),
            keys,
        }
    }
    /// Extends `key`'s entry's soft lease to at least `now + d`.
    pub fn touch(&self, key: &str, d: Duration) {
        let id = classify_key(key).1;
        let until = Instant::now() + d;
        let mut m = self.leases.lock().expect("lock");
        let v = m.entry(id).or_insert((0, None));
        if v.1.is_none_or(|t| t < until) {
            v.1 = Some(until);
        }
    }
    /// Whether an entry id (or key) is leased now.
    pub fn is_leased(&self, key_or_id: &str) -> bool {
        let id = classify_key(key_or_id).1;
        let mut m = self.leases.lock().expect("lock");
        let now = Instant::now();
        match m.get(&id) {
            Some((n, soft)) if *n > 0 || soft.is_some_and(|t| t > now) => true,
            Some(_) => {
                m.remove(&id);
                false
            }
            None => false,
        }
    }
}
