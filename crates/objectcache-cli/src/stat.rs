//! `objectcache stat`: what a store holds, by key group (namespace, geometry, TP rank, hash
//! algorithm): published chunks, unreferenced data, orphan markers, bytes; with `--server`,
//! what a server's node tier holds and how it has done (its `/_objectcache/tier`).

use objectcache_client::lifecycle::Inventory;

/// Arguments of `objectcache stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {
    /// Store URL (`file:///path`, a path, `s3://bucket/prefix?endpoint=...`).
    #[arg(long, env = "OBJECTCACHE_STORE", required_unless_present = "server")]
    pub store: Option<String>,
    /// Instead of a store: an ObjectCache server (`host:port`, its plain-HTTP port) whose
    /// node tier to show, per level (DRAM, disk): bytes held, objects, hits, misses, bytes
    /// served, evictions, admission refusals, and the fills from the remote store.
    #[arg(long, conflicts_with = "store")]
    pub server: Option<String>,
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
    if let Some(server) = &args.server {
        return tier(server, args.json);
    }
    // The work takes `args` (its JSON names the store), so the URL is a copy.
    let url = args.store.clone().unwrap_or_default();
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

/// `objectcache stat --server ADDR`: the node tier of the server at `addr`.
///
/// # Errors
/// [`objectcache_core::Error::Config`] when the server cannot be reached, has no node tier or
/// does not answer with tier counters.
fn tier(addr: &str, json: bool) -> objectcache_core::Result<()> {
    use objectcache_client::store::TierStats;
    use objectcache_client::transport::discovery::http_get;
    let err = |m: String| objectcache_core::Error::Config(format!("--server {addr}: {m}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| err(e.to_string()))?;
    let (status, body) = rt
        .block_on(async {
            tokio::time::timeout(
                std::time::Duration::from_secs(10),
                http_get(addr, "/_objectcache/tier", 1 << 20),
            )
            .await
        })
        .map_err(|_| err("no answer within 10 s".into()))?
        .map_err(|e| err(e.to_string()))?;
    let body = body.map_err(|e| err(e.to_string()))?;
    if status != 200 {
        return Err(err(format!(
            "HTTP {status}: {}",
            String::from_utf8_lossy(&body).trim()
        )));
    }
    let st: TierStats = serde_json::from_slice(&body)
        .map_err(|e| err(format!("the answer is not tier counters ({e})")))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&st).expect("json"));
        return Ok(());
    }
    println!(
        "{:<6} {:>14} {:>14} {:>9} {:>10} {:>10} {:>8} {:>16} {:>10} {:>8}",
        "level",
        "bytes",
        "capacity",
        "objects",
        "hits",
        "misses",
        "hit %",
        "served bytes",
        "evictions",
        "refused"
    );
    for (name, l) in [("dram", &st.dram), ("disk", &st.disk)] {
        let asked = l.hits + l.misses;
        let rate = if asked == 0 {
            "-".to_string()
        } else {
            format!("{:.1}", 100.0 * l.hits as f64 / asked as f64)
        };
        println!(
            "{:<6} {:>14} {:>14} {:>9} {:>10} {:>10} {:>8} {:>16} {:>10} {:>8}",
            name,
            l.bytes,
            l.capacity,
            l.objects,
            l.hits,
            l.misses,
            rate,
            l.bytes_served,
            l.evictions,
            l.refused
        );
    }
    println!(
        "fills from the remote store: {} ({} bytes, {:.3} s), {} misses joined a fill in \
         flight, {} corrupt objects served and not kept; disk level at start-up: {} \
         recovered, {} dropped; publish markers remembered: {} ({} reads answered without          the remote store)",
        st.fills,
        st.fill_bytes,
        st.fill_seconds,
        st.fills_shared,
        st.fills_corrupt,
        st.disk_recovered,
        st.disk_dropped,
        st.markers,
        st.marker_hits
    );
    Ok(())
}
