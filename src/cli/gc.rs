//! `objectcache gc`.

/// Arguments of `objectcache gc`.
#[derive(Debug, clap::Args)]
pub struct GcArgs {}

/// Runs `objectcache gc`.
///
/// # Errors
/// Not built yet: always an error saying so.
pub fn run(_args: GcArgs) -> crate::Result<()> {
    Err(crate::Error::InvalidArgument(
        "`objectcache gc` is not built yet".into(),
    ))
}
