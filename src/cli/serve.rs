//! `objectcache serve`.

/// Arguments of `objectcache serve`.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {}

/// Runs `objectcache serve`.
///
/// # Errors
/// Not built yet: always an error saying so.
pub fn run(_args: ServeArgs) -> crate::Result<()> {
    Err(crate::Error::InvalidArgument(
        "`objectcache serve` is not built yet".into(),
    ))
}
