//! Transfer-path benchmark (placeholder: the transfer helper replaces this file).

/// Arguments of `objectcache-bench transfer`.
#[derive(Debug, clap::Args)]
pub struct TransferArgs {}

/// Runs the transfer benchmark.
///
/// # Errors
/// Always, until the benchmark lands.
pub fn run(_a: TransferArgs) -> anyhow::Result<()> {
    anyhow::bail!("the transfer benchmark is not implemented yet")
}
