//! `objectcache stat`.

/// Arguments of `objectcache stat`.
#[derive(Debug, clap::Args)]
pub struct StatArgs {}

/// Runs `objectcache stat`.
///
/// # Errors
/// Not built yet: always an error saying so.
pub fn run(_args: StatArgs) -> crate::Result<()> {
    Err(crate::Error::InvalidArgument(
        "`objectcache stat` is not built yet".into(),
    ))
}
