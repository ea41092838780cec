//! The embedded default store: one file per object under a root directory.
//!
//! Writes are crash-safe: the bytes go to a temporary file in the same directory
//! (`.tmp-<random>` prefix, never listed), which is then renamed over the key's path, so a
//! reader sees the old object or the new one. Create-only puts use `link(2)` from the
//! temporary file, which fails atomically if the key exists.
//!
//! Fsync policy ([`FsyncPolicy`]): with `Always` (the default) the temporary file is
//! `fsync`ed before the rename and the directory after it, so a completed put survives power
//! loss; with `Never` a crash may lose recent puts but never exposes a partial object (rename
//! is atomic). A cache can choose `Never`: a lost entry is a miss, not corruption.

use super::{
    resolve_range, validate_key, GetOptions, GetResult, ObjectMeta, PutMode, PutOptions, PutResult,
    Store,
};
use crate::error::StoreError;
use async_trait::async_trait;
use bytes::Bytes;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// When the filesystem store calls `fsync`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Sync file and directory on every put (durable on return).
    #[default]
    Always,
    /// Never sync (atomic but not durable across power loss).
    Never,
}

/// A store on a local directory.
#[derive(Debug)]
pub struct FsStore {
    root: PathBuf,
    fsync: FsyncPolicy,
    seq: AtomicU64,
}

const TMP_PREFIX: &str = ".tmp-";
/// Bytes read per body chunk.
const READ_CHUNK: usize = 4 << 20;

impl FsStore {
    /// Opens (creating if needed) a store rooted at `root`.
    ///
    /// # Errors
    /// [`StoreError::Other`] if the directory cannot be created.
    pub fn new(root: impl AsRef<Path>, fsync: FsyncPolicy) -> Result<Self, StoreError> {
        let root = root.as_ref().to_path_buf();
        std::fs::create_dir_all(&root)
            .map_err(|e| StoreError::other("fs", format!("create {}: {e}", root.display())))?;
        Ok(FsStore {
            root,
            fsync,
            seq: AtomicU64::new(0),
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> Result<PathBuf, StoreError> {
        validate_key(key)?;
        if key.split('/').any(|s| s.starts_with(TMP_PREFIX)) {
            return Err(StoreError::InvalidKey {
                key: key.into(),
                reason: "segments starting with .tmp- are reserved",
            });
        }
        Ok(self.root.join(key))
    }
}

fn io_err(key: &str, e: std::io::Error) -> StoreError {
    if e.kind() == std::io::ErrorKind::NotFound {
        StoreError::NotFound { key: key.into() }
    } else {
        StoreError::other("fs", format!("{key}: {e}"))
    }
}

fn meta_of(key: &str, m: &std::fs::Metadata) -> ObjectMeta {
    let t = m.modified().ok();
    let etag = t
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| format!("{:x}-{:x}", m.len(), d.as_nanos()));
    ObjectMeta {
        key: key.into(),
        size: m.len(),
        last_modified: t,
        etag,
    }
}

/// Opens the object file at `path` (for `key`) with its metadata; a directory is `NotFound`.
fn open_file(path: &Path, key: &str) -> Result<Option<super::LocalObject>, StoreError> {
    let file = std::fs::File::open(path).map_err(|e| io_err(key, e))?;
    let m = file.metadata().map_err(|e| io_err(key, e))?;
    if !m.is_file() {
        return Err(StoreError::NotFound { key: key.into() });
    }
    Ok(Some(super::LocalObject {
        meta: meta_of(key, &m),
        file,
    }))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::other("fs", format!("blocking task failed: {e}")))?
}

#[async_trait]
impl Store for FsStore {
    fn name(&self) -> &'static str {
        "fs"
    }

    async fn open_local(&self, key: &str) -> Result<Option<super::LocalObject>, StoreError> {
        let path = self.path(key)?;
        let key = key.to_string();
        blocking(move || open_file(&path, &key)).await
    }

    fn open_local_blocking(&self, key: &str) -> Result<Option<super::LocalObject>, StoreError> {
        open_file(&self.path(key)?, key)
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> Result<GetResult, StoreError> {
        let path = self.path(key)?;
        let key = key.to_string();
        let (file, meta, range) = blocking({
            let key = key.clone();
            move || {
                let f = std::fs::File::open(&path).map_err(|e| io_err(&key, e))?;
                let m = f.metadata().map_err(|e| io_err(&key, e))?;
                if !m.is_file() {
                    return Err(StoreError::NotFound { key });
                }
                let range = resolve_range(&key, opts.range, m.len())?;
                Ok((f, meta_of(&key, &m), range))
            }
        })
        .await?;
        let start = range.start;
        let len = range.end - range.start;
        // Stream the range in READ_CHUNK pieces, each read on the blocking pool.
        let body = futures::stream::try_unfold(
            (file, start, len, key),
            |(mut f, pos, left, key)| async move {
                if left == 0 {
                    return Ok(None);
                }
                let n = left.min(READ_CHUNK as u64) as usize;
                let (f, buf) = blocking(move || {
                    // Read into uninitialised capacity: no zeroing pass before the read.
                    let mut buf = Vec::with_capacity(n);
                    f.seek(SeekFrom::Start(pos)).map_err(|e| io_err(&key, e))?;
                    let got = (&mut f)
                        .take(n as u64)
                        .read_to_end(&mut buf)
                        .map_err(|e| io_err(&key, e))?;
                    if got != n {
                        return Err(StoreError::other(
                            "fs",
                            format!("short read of {key}: {got} of {n} bytes at offset {pos}"),
                        ));
                    }
                    Ok((f, (buf, key)))
                })
                .await?;
                let (buf, key) = buf;
                Ok(Some((
                    Bytes::from(buf),
                    (f, pos + n as u64, left - n as u64, key),
                )))
            },
        );
        Ok(GetResult {
            meta,
            range,
            body: Box::pin(body),
        })
    }

    async fn put_opts(
        &self,
        key: &str,
        data: Bytes,
        opts: PutOptions,
    ) -> Result<PutResult, StoreError> {
        let path = self.path(key)?;
        let dir = path
            .parent()
            .expect("key has a parent under root")
            .to_path_buf();
        let tmp = dir.join(format!(
            "{TMP_PREFIX}{}-{}",
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let fsync = self.fsync;
        let key = key.to_string();
        blocking(move || {
            std::fs::create_dir_all(&dir).map_err(|e| io_err(&key, e))?;
            let write = || -> std::io::Result<()> {
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&data)?;
                if fsync == FsyncPolicy::Always {
                    f.sync_all()?;
                }
                Ok(())
            };
            if let Err(e) = write() {
                let _ = std::fs::remove_file(&tmp);
                return Err(io_err(&key, e));
            }
            let r = match opts.mode {
                PutMode::Overwrite => std::fs::rename(&tmp, &path),
                PutMode::Create => {
                    let r = std::fs::hard_link(&tmp, &path);
                    let _ = std::fs::remove_file(&tmp);
                    r
                }
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(StoreError::AlreadyExists { key });
                }
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(io_err(&key, e));
                }
            }
            if fsync == FsyncPolicy::Always {
                std::fs::File::open(&dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| io_err(&key, e))?;
            }
            let m = std::fs::metadata(&path).map_err(|e| io_err(&key, e))?;
            Ok(PutResult {
                etag: meta_of(&key, &m).etag,
            })
        })
        .await
    }

    async fn head(&self, key: &str) -> Result<ObjectMeta, StoreError> {
        let path = self.path(key)?;
        let key = key.to_string();
        blocking(move || {
            let m = std::fs::metadata(&path).map_err(|e| io_err(&key, e))?;
            if !m.is_file() {
                return Err(StoreError::NotFound { key });
            }
            Ok(meta_of(&key, &m))
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), StoreError> {
        let path = self.path(key)?;
        let key = key.to_string();
        blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&key, e)),
        })
        .await
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<ObjectMeta>, StoreError> {
        let root = self.root.clone();
        let prefix = prefix.to_string();
        blocking(move || {
            // Start the walk at the deepest directory fully named by the prefix.
            let base = match prefix.rfind('/') {
                Some(i) => &prefix[..i],
                None => "",
            };
            // The directory part must be a valid key itself: no `..` climbing out of the root.
            if !base.is_empty() {
                validate_key(base)?;
            }
            let start = if base.is_empty() {
                root.clone()
            } else {
                root.join(base)
            };
            let mut out = Vec::new();
            let mut stack = vec![(start, base.to_string())];
            while let Some((dir, rel)) = stack.pop() {
                let rd = match std::fs::read_dir(&dir) {
                    Ok(rd) => rd,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => {
                        return Err(StoreError::other(
                            "fs",
                            format!("list {}: {e}", dir.display()),
                        ))
                    }
                };
                for ent in rd {
                    let ent = ent.map_err(|e| StoreError::other("fs", e))?;
                    let name = ent.file_name().to_string_lossy().to_string();
                    if name.starts_with(TMP_PREFIX) {
                        continue;
                    }
                    let k = if rel.is_empty() {
                        name
                    } else {
                        format!("{rel}/{name}")
                    };
                    let ft = ent.file_type().map_err(|e| StoreError::other("fs", e))?;
                    if ft.is_dir() {
                        if prefix.starts_with(&k) || k.starts_with(&prefix) {
                            stack.push((ent.path(), k));
                        }
                    } else if ft.is_file() && k.starts_with(&prefix) {
                        let m = ent.metadata().map_err(|e| StoreError::other("fs", e))?;
                        out.push(meta_of(&k, &m));
                    }
                }
            }
            out.sort_by(|a, b| a.key.cmp(&b.key));
            out.truncate(limit);
            Ok(out)
        })
        .await
    }
}
