//! `objectcache-bench`: ObjectCache's benchmarks.
//!
//! - `ttft`: time to first token of a request whose prefix KV is cached, on a real model
//!   (`--mode real`, the default) or on a modeled GPU (`--mode modeled`).
//! - `transfer`: transfer paths (stock S3 ranged GETs, gather over TCP/RDMA).
//! - `traffic`: many requests on a few shared prefixes, a capped server, every policy.
//! - `vllm`: TTFT in a real vLLM per method, cross-replica.
//! - `fleet`: many vLLM replicas behind a router replaying a trace, per method and routing.

use clap::{Parser, Subcommand};

mod cost;
mod fleet;
mod traffic;
mod transfer;
mod ttft;
mod vllm;

/// ObjectCache benchmarks.
#[derive(Debug, Parser)]
#[command(name = "objectcache-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// TTFT of a request that reuses a cached prefix, with and without the cache hit.
    Ttft(ttft::TtftArgs),
    /// Transfer-path benchmark (stock S3, gather over TCP/RDMA).
    Transfer(transfer::TransferArgs),
    /// TTFT in a real vLLM through its OpenAI-compatible server, per method (recompute, vLLM's
    /// prefix cache, ObjectCacheConnector on each store, vLLM's own connectors), cross-replica.
    Vllm(vllm::VllmArgs),
    /// Many concurrent requests on a few shared prefixes against a capped server, per
    /// scheduling policy, measured beside the simulator's prediction.
    Traffic(traffic::TrafficArgs),
    /// Several vLLM replicas on one store behind a router (round-robin or prefix-aware),
    /// replaying a chat, agent or document trace: hit rate against the ideal, TTFT, bytes
    /// from the remote store, outputs against vLLM without a connector.
    Fleet(fleet::FleetArgs),
}

fn main() {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Ttft(a) => ttft::run(a),
        Command::Transfer(a) => transfer::run(a),
        Command::Vllm(a) => vllm::run(a),
        Command::Traffic(a) => traffic::run(a),
        Command::Fleet(a) => fleet::run(a),
    };
    if let Err(e) = r {
        eprintln!("objectcache-bench: {e:#}");
        let code = if e
            .downcast_ref::<ttft::acquire::ModelUnavailable>()
            .is_some()
        {
            ttft::acquire::ModelUnavailable::EXIT_CODE
        } else {
            1
        };
        std::process::exit(code);
    }
}
