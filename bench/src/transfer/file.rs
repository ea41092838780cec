//! The `file-layerwise` and `file-segment` paths' store: copies of the prefix's objects in
//! a file store on local disk.

use objectcache::store::StoreExt;
use std::sync::Arc;

/// A file store (in a new temporary folder on local disk, the working directory's file
/// system) holding copies of objects `keys` read from `store`: the prefix's chunk objects and
/// publish markers for the `file-layerwise` path, its segments and their markers for
/// `file-segment`.
pub(super) fn file_copy(
    rt: &tokio::runtime::Runtime,
    store: &Arc<dyn objectcache::store::Store>,
    keys: Vec<String>,
) -> Result<(tempfile::TempDir, Arc<dyn objectcache::store::Store>), String> {
    let dir = tempfile::Builder::new()
        .prefix("objectcache-bench-file-")
        .tempdir_in(".")
        .map_err(|e| e.to_string())?;
    let fs = objectcache::store::FsStore::new(dir.path(), objectcache::store::FsyncPolicy::Never)
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        for k in &keys {
            let b = store.get_bytes(k).await.map_err(|e| e.to_string())?;
            fs.put(k, b).await.map_err(|e| e.to_string())?;
        }
        Ok::<_, String>(())
    })?;
    Ok((dir, Arc::new(fs)))
}
