//! `objectcache stat`: what a store holds, by key group (namespace, geometry, TP rank, hash
//! algorithm): published chunks, unreferenced data, orphan markers, bytes.

use objectcache_client::lifecycle::Inventory;

/// Arguments of `objectcache stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {
    /// Store URL (`file:///path`, a path, `s3://bucket/prefix?endpoint=...`).
    #[arg(long, env = "OBJECTCACHE_STORE")]
    pub store: String,
    /// Only keys under this prefix (e.g. a namespace followed by `/`).
    #[arg(long, default_value = "")]
    pub prefix: String,
    /// Most objects to list (bounds memory).
    #[arg(long, default_value_t = 10_000_000)]
    pub max_objects: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `objectcache stat`.
///
/// # Errors
/// A bad store URL, or the store's listing error.
pub fn run(args: StatArgs) -> objectcache_core::Result<()> {
    // The work takes `args` (its JSON names the store), so the URL is a copy.
    let url = args.store.clone();
    super::on_store(&url, |store| async move {
        let inv = Inventory::scan(store.as_ref(), &args.prefix, args.max_objects).await?;
        let total = inv.stats();
        let groups = inv.stats_by_group();
        if args.json {
            let v = serde_json::json!({ "store": args.store, "prefix": args.prefix,
                                        "total": total, "groups": groups });
            println!("{}", serde_json::to_string_pretty(&v).expect("json"));
            return Ok(());
        }
        println!(
            "{:<60} {:>10} {:>12} {:>8} {:>14}",
            "group", "published", "unreferenced", "orphans", "bytes"
        );
        for (g, s) in &groups {
            println!(
                "{:<60} {:>10} {:>12} {:>8} {:>14}",
                g, s.published, s.unreferenced_data, s.orphan_markers, s.bytes
            );
        }
        println!(
            "{:<60} {:>10} {:>12} {:>8} {:>14}",
            "total", total.published, total.unreferenced_data, total.orphan_markers, total.bytes
        );
        if total.segments > 0 || total.segment_markers > 0 {
            println!(
                "{} segment objects (format v2) holding {} bytes, named by {} markers",
                total.segments, total.segment_bytes, total.segment_markers
            );
        }
        if total.other_objects > 0 {
            println!("{} other objects (not touched by gc)", total.other_objects);
        }
        if total.partial_writes > 0 {
            println!(
                "{} incomplete writes holding {} bytes (temporary files; gc reclaims those \
                 whose writer is gone or that are older than its grace period)",
                total.partial_writes, total.partial_bytes
            );
        }
        Ok(())
    })
}
