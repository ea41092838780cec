//! # objectcache-cli
//!
//! The `objectcache` command line: one subcommand per file, over the pure core (`sim`,
//! `sched`), the client (stores, lifecycle) and the server. The façade crate's `objectcache`
//! binary calls [`main`]; the façade re-exports this crate as `objectcache::cli`.

#![warn(missing_docs)]

use clap::{Parser, Subcommand};

/// ObjectCache: layerwise object-storage retrieval of prefix KV cache.
#[derive(Debug, Parser)]
#[command(name = "objectcache", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
// Parsed once per process: the size of the largest variant (`serve`'s flags) does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the ObjectCache storage server (S3 API + gather).
    Serve(serve::ServeArgs),
    /// Replay a workload in the discrete-event simulator under each scheduling policy.
    Sim(sim::SimArgs),
    /// Print what a store holds (prefixes, chunks, bytes).
    Stat(stat::StatArgs),
    /// Delete unreferenced or expired objects.
    Gc(gc::GcArgs),
    /// Check that a store does what ObjectCache relies on (create-only PUTs, ranged GETs,
    /// idle connections); exits non-zero when it refuses the store.
    Doctor(doctor::DoctorArgs),
}

pub mod doctor;
pub mod gc;
mod plot;
pub mod serve;
pub mod sim;
pub mod stat;

/// Runs `work` on the existing store at `url`, opened on a current-thread runtime (the store
/// commands, `stat` and `gc`).
///
/// # Errors
/// [`objectcache_core::Error::Io`] if the runtime cannot start, the store's error for a bad
/// URL, or what `work` returns.
fn on_store<F, Fut>(url: &str, work: F) -> objectcache_core::Result<()>
where
    F: FnOnce(std::sync::Arc<dyn objectcache_client::store::Store>) -> Fut,
    Fut: std::future::Future<Output = objectcache_core::Result<()>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let store = objectcache_client::store::open_existing_store(url).await?;
        work(store).await
    })
}

/// Parses the process arguments and runs the subcommand; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Sim(a) => sim::run(a),
        Command::Stat(a) => stat::run(a),
        Command::Gc(a) => gc::run(a),
        Command::Doctor(a) => doctor::run(a),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("objectcache: {e}");
            1
        }
    }
}
