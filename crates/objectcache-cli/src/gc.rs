//! `objectcache gc`: one collection pass over a store (see [`objectcache_client::lifecycle`] for the
//! rules: unreferenced data past the grace period, orphan markers, TTL, capacity with LRU).
//!
//! Run from a shell, no access log exists, so last use is the write time; leases of readers in
//! other processes are not visible: keep `--grace-s` and `--ttl-s` far above a load's length.

use objectcache_client::lifecycle::{collect, Policy, Reason};
use std::time::{Duration, SystemTime};

/// Arguments of `objectcache gc`.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// Store URL (`file:///path`, a path, `s3://bucket/prefix?endpoint=...`).
    #[arg(long, env = "OBJECTCACHE_STORE")]
    pub store: String,
    /// Only keys under this prefix.
    #[arg(long, default_value = "")]
    pub prefix: String,
    /// Seconds an unreferenced data object is kept (a save may be in progress).
    #[arg(long, default_value_t = 3600, allow_negative_numbers = true, value_parser = whole_number)]
    pub grace_s: u64,
    /// Delete published entries older than this many seconds.
    #[arg(long, allow_negative_numbers = true, value_parser = whole_number)]
    pub ttl_s: Option<u64>,
    /// Evict oldest entries until the prefix holds at most this many bytes.
    #[arg(long, allow_negative_numbers = true, value_parser = whole_number)]
    pub capacity_bytes: Option<u64>,
    /// Key prefix exempt from TTL and eviction (repeatable).
    #[arg(long = "pin")]
    pub pinned: Vec<String>,
    /// Most objects to list (bounds memory).
    #[arg(long, default_value_t = 10_000_000)]
    pub max_objects: usize,
    /// Print what would be deleted, delete nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Parses a count of seconds or bytes: a whole number, 0 or more (clap's own messages for
/// `-5` are "unexpected argument" or "invalid digit").
fn whole_number(s: &str) -> Result<u64, String> {
    s.parse::<u64>()
        .map_err(|_| format!("expected a whole number, 0 or more, not {s:?}"))
}

/// Runs `objectcache gc`.
///
/// # Errors
/// A bad store URL, the store's listing error, or a listing above `--max-objects`. Failed
/// deletes are reported and make the command fail after the pass.
pub fn run(args: GcArgs) -> objectcache_core::Result<()> {
    super::on_store(&args.store, |store| async move {
        let policy = Policy {
            prefix: args.prefix.clone(),
            max_objects: args.max_objects,
            grace: Duration::from_secs(args.grace_s),
            ttl: args.ttl_s.map(Duration::from_secs),
            capacity_bytes: args.capacity_bytes,
            pinned: args.pinned.clone(),
            dry_run: args.dry_run,
        };
        let rep = collect(store.as_ref(), &policy, SystemTime::now(), None, None).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rep).expect("json"));
        } else {
            let verb = if args.dry_run {
                "would delete"
            } else {
                "deleted"
            };
            for (k, r) in &rep.deleted {
                println!("{verb} {k} ({r:?})");
            }
            println!(
                "scanned {} objects; {verb} {} (unreferenced {}, orphan markers {}, expired {}, evicted {}, \
                 incomplete writes {}, incomplete TP {}); kept: {} young unreferenced or incomplete, {} pinned; bytes {} -> {}",
                rep.scanned,
                rep.deleted.len(),
                rep.count(Reason::Unreferenced),
                rep.count(Reason::OrphanMarker),
                rep.count(Reason::Expired),
                rep.count(Reason::Evicted),
                rep.count(Reason::PartialWrite),
                rep.count(Reason::IncompleteTp),
                rep.kept_young,
                rep.kept_pinned,
                rep.bytes_before,
                rep.bytes_after
            );
        }
        if !rep.errors.is_empty() {
            for (k, e) in &rep.errors {
                eprintln!("failed to delete {k}: {e}");
            }
            return Err(objectcache_core::Error::InvalidArgument(format!(
                "{} deletes failed",
                rep.errors.len()
            )));
        }
        Ok(())
    })
}
