//! Lifecycle of stored KV: inventory, capacity limit with LRU eviction, TTLs, garbage
//! collection of unreferenced objects, and leases that keep an object alive under its reader.
//!
//! ## What an entry is
//! A published chunk is a pair of objects (see [`crate::layout::KeyBuilder`]):
//! `…/kv/{hash}` (the data object) and `…/pub/{hash}` (its publish marker, written after the
//! data is durable). Lookup reads only markers, so deleting an entry deletes the **marker
//! first**, then the data: a reader never finds a marker whose data is already gone (except a
//! reader that passed lookup earlier, which leases protect).
//!
//! A chunk saved in format v2 has no data object: its marker (64 bytes) names the segment
//! object (`…/seg/{digest}`) that holds it with the other chunks of its save. Collection reads
//! each such marker (one GET) and counts the segment **by reference**: the entry is published
//! while the segment it names is present with the length the marker gives, and the segment
//! lives while any published entry names it. Deleting the last such entry (TTL, eviction,
//! an incomplete tensor-parallel chunk) deletes the segment after its marker, with the same
//! reason; a segment's bytes count as freed only then. A read of a segment is a use of every
//! chunk in it (LRU), and a lease on a segment key keeps the segment.
//!
//! ## Rules of [`collect`] (in this order)
//! 0. **Incomplete writes** ([`Store::list_partial`]: temporary files a killed writer left)
//!    are deleted when their writer is known to be gone, or once older than `grace` (a write
//!    in progress keeps its file's modification time fresh).
//! 1. **Unreferenced data** (a data object with no marker, or a segment no marker names: a
//!    save interrupted between its two phases, or a crashed writer) is deleted once older than
//!    `grace`, the longest a save may take between writing its data and its markers.
//! 2. **Orphan markers** (a marker whose data object is missing, or that names a segment that
//!    is missing or of another length) are deleted at once: they would make lookup report a
//!    chunk that cannot load.
//!
//! A listing is not a snapshot (a save may write a data object, then its marker, while the
//! listing walks past): before deleting half an entry (rules 1 and 2), collection checks again
//! that the other half is still absent, and before deleting a segment that it was not written
//! again since it was listed (its length, write time and entity tag).
//! 3. **TTL**: a published entry not used for `ttl` (last use = the latest of its last access
//!    seen by an [`AccessLog`] and its write time) is deleted, unless pinned or leased.
//! 4. **Capacity**: while the bytes held exceed `capacity_bytes`, the least recently used
//!    published entry that is neither pinned nor leased is deleted.
//!
//! A chunk's tensor-parallel ranks (keys equal but for their `tp{rank}-{world}` component)
//! are one unit for rules 3 and 4: kept, expired and evicted together (leased or pinned if
//! any rank is). A chunk published for some ranks only (another rank's entry missing: a
//! failed save, a lost object) is deleted for every rank once its newest object is older than
//! `grace` (reason `IncompleteTp`), so ranks never disagree about a chunk. Lookups check
//! every rank's marker (`Engine::lookup`), so ranks agree on every hit meanwhile.
//!
//! Objects whose keys are not data objects, markers or segments are never touched.
//!
//! ## Leases, and the trade-off
//! Lookups never pin: a lookup's probes (marker `HEAD`s) take no lease and do not count as
//! use, so entries that were probed but not loaded can be evicted (case C13). What is held at
//! any moment is what loads in flight read: `Engine::load` and the server's gather loads hold
//! explicit leases on their chunks' entries from start to end (released on completion,
//! cancel, failure, and with the process); ranged GETs through the server's S3 API renew soft
//! leases.
//!
//! A load reads one object with several ranged GETs spread over its duration (layer by
//! layer), so deleting the object between two of them turns the rest of the load into a miss.
//! A [`LeaseTable`] keeps keys alive while held:
//! - explicit leases ([`LeaseTable::acquire`]), released when the guard drops;
//! - soft leases: a [`TrackedStore`] renews a key's lease for `soft_lease` on every read, so
//!   an object read within the last `soft_lease` (set it to the load deadline) is kept.
//!
//! The table lives **in the process** that collects (the embedded store, or the server that
//! fronts a store): no extra request per load and no stale lease left behind by a crashed
//! reader, but a reader in *another* process is not seen. For a store shared by several
//! processes, run collection where the reads happen (the server), or rely on `grace`/`ttl`
//! being far longer than a load; the alternative, lease objects in the store, costs one PUT and
//! one DELETE per load and leaves stale leases behind crashed readers until they expire. A
//! reader that loses the race still gets a per-chunk miss, never wrong bytes (every slice is
//! checked by its CRC32C).
//!
//! ## Access times
//! Object stores do not record reads (S3 has no access time), so LRU needs an [`AccessLog`]
//! fed by a [`TrackedStore`] in the reading process; without one, last use is the write time
//! (first-in, first-out by age), which is what `objectcache gc` run from a shell gets.
//!
//! ## Where things are
//! Entries and the inventory in `inventory.rs`, access times and leases in `leases.rs`, the
//! tracking store wrapper in `tracked.rs`, collection in `collect.rs`, segment references in
//! `segments.rs`.
//!
//! [`Store::list_partial`]: crate::store::Store::list_partial

mod collect;
mod inventory;
mod leases;
mod segments;
#[cfg(test)]
mod tests;
mod tracked;

pub use collect::{collect, collect_with, GcReport, Policy, Reason};
pub use inventory::{classify_key, entry_published, Entry, Inventory, ObjectKind, Stats};
pub use leases::{AccessLog, Lease, LeaseTable};
pub use segments::{MarkerMemo, MEMO_MARGIN};
pub use tracked::TrackedStore;
