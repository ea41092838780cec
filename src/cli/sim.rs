//! `objectcache sim`.

/// Arguments of `objectcache sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {}

/// Runs `objectcache sim`.
///
/// # Errors
/// Not built yet: always an error saying so.
pub fn run(_args: SimArgs) -> crate::Result<()> {
    Err(crate::Error::InvalidArgument(
        "`objectcache sim` is not built yet".into(),
    ))
}
