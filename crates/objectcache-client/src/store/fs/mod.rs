//! The embedded default store: one file per object under a root directory.
//!
//! Writes are crash-safe: the bytes go to a temporary file in the same directory
//! (`.tmp-{writer}-{pid}-{seq}`, never listed as an object), which is then renamed over the
//! key's path, so a reader sees the old object or the new one. Create-only puts use
//! `link(2)` from the temporary file, which fails atomically if the key exists. Streamed
//! puts ([`Store::put_stream`]) write the pieces to the temporary file as they arrive, in
//! 2 MiB-aligned steps (so that the file is cached in large folios).
//!
//! An object's file is never written once it is committed: nothing opens it for writing
//! (temporary files are created with `O_EXCL`, so not even a name collision reopens one), and
//! it is replaced only by renaming another file over its path. Readers rely on it: the server
//! sends objects with `sendfile(2)` and maps them into memory for S3 GETs
//! (`server/s3/mapped.rs`), which is sound only while the mapped file never changes or
//! shrinks ([`super::LocalObject`]).
//!
//! A write that fails or is cancelled removes its temporary file. One whose process was
//! killed leaves it behind: [`Store::list_partial`] reports such files (with their size, so
//! `objectcache stat` counts them), marking as orphaned those whose writer was a process of
//! this host (same boot, same PID namespace: the `{writer}` token) that no longer runs;
//! `objectcache gc` deletes orphaned ones and any older than its grace period, and the
//! server deletes orphaned ones at start-up ([`Store::delete_partial`]).
//!
//! Keys the filesystem cannot hold are refused as [`StoreError::InvalidKey`], never as an
//! OS error: a path segment over 255 bytes, a key whose prefix is an object (`a/b` exists,
//! `a/b/c` is written), or a key that is a prefix of other keys (`a/b/c` exists, `a/b` is
//! written). Reading such a key is a miss.
//!
//! Fsync policy ([`FsyncPolicy`]): with `Always` (the default) the temporary file is
//! `fsync`ed before the rename and the directory after it, so a completed put survives power
//! loss; with `Never` a crash may lose recent puts but never exposes a partial object (rename
//! is atomic). A cache can choose `Never`: a lost entry is a miss, not corruption.

use super::{
    check_stream_len, resolve_range, validate_key, ByteStream, GetOptions, GetResult, ObjectMeta,
    PartialWrite, PutOptions, PutResult, Store,
};
use crate::error::{StoreError, StoreResult};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

mod read_pool;
mod tmp;

use read_pool::{into_bytes, read_buffer, READ_CHUNK};
use tmp::{orphaned, take_bytes, write_pieces, writer_token, TmpFile, TMP_PREFIX, WRITE_STEP};

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
    /// Writes to files in progress at once, at most (one per core): a flood of puts takes
    /// turns on the disk and the CPU rather than one blocking thread each, so reads keep
    /// their share.
    writers: std::sync::Arc<tokio::sync::Semaphore>,
}

/// Longest path segment most filesystems hold (`NAME_MAX`), bytes.
const MAX_SEGMENT_LEN: usize = 255;

impl FsStore {
    /// Opens (creating if needed) a store rooted at `root`.
    ///
    /// # Errors
    /// [`StoreError::Other`] if the directory cannot be created.
    pub fn new(root: impl AsRef<Path>, fsync: FsyncPolicy) -> StoreResult<Self> {
        let root = root.as_ref().to_path_buf();
        std::fs::create_dir_all(&root)
            .map_err(|e| StoreError::other("fs", format!("create {}: {e}", root.display())))?;
        Ok(FsStore {
            root,
            fsync,
            writers: std::sync::Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
        })
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn path(&self, key: &str) -> StoreResult<PathBuf> {
        validate_key(key)?;
        if key.split('/').any(|s| s.starts_with(TMP_PREFIX)) {
            return Err(StoreError::InvalidKey {
                key: key.into(),
                reason: "segments starting with .tmp- are reserved",
            });
        }
        if key.split('/').any(|s| s.len() > MAX_SEGMENT_LEN) {
            return Err(StoreError::InvalidKey {
                key: key.into(),
                reason: "a path segment is longer than 255 bytes (the filesystem store's limit)",
            });
        }
        Ok(self.root.join(key))
    }

    /// A turn to write a file (one of `writers`), held while the blocking write runs.
    async fn writer_turn(&self) -> tokio::sync::OwnedSemaphorePermit {
        let writers = self.writers.clone();
        writers.acquire_owned().await.expect("never closed")
    }

    /// Where a put of `key` goes: the object's path, its directory, and a fresh temporary
    /// file's path in that directory (renamed or linked into place on commit).
    fn write_paths(&self, key: &str) -> StoreResult<(PathBuf, PathBuf, PathBuf)> {
        let path = self.path(key)?;
        let dir = path
            .parent()
            .expect("key has a parent under root")
            .to_path_buf();
        let tmp = self.tmp_path(&dir);
        Ok((path, dir, tmp))
    }

    /// A fresh temporary file path in `dir`: the sequence number is process-wide, so that
    /// two stores on one root in one process never pick the same name.
    fn tmp_path(&self, dir: &Path) -> PathBuf {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        dir.join(format!(
            "{TMP_PREFIX}{}-{}-{}",
            writer_token(),
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ))
    }
}

fn io_err(key: &str, e: std::io::Error) -> StoreError {
    use std::io::ErrorKind as K;
    match e.kind() {
        // `a/b/c` when `a/b` is an object: there is no such object.
        K::NotFound | K::NotADirectory => StoreError::NotFound { key: key.into() },
        _ => StoreError::other("fs", format!("{key}: {e}")),
    }
}

/// Reason of [`StoreError::InvalidKey`] for a key below an object.
const UNDER_OBJECT: &str =
    "a prefix of this key is an object (the filesystem store cannot hold both)";
/// Reason of [`StoreError::InvalidKey`] for a key that prefixes other keys.
const OVER_KEYS: &str =
    "this key is a prefix of other keys (the filesystem store cannot hold both)";

/// Creates `dir` (the key's parent) and its parents; a file on the way is [`UNDER_OBJECT`].
fn create_parent(dir: &Path, key: &str) -> StoreResult<()> {
    std::fs::create_dir_all(dir).map_err(|e| {
        let mut p = Some(dir);
        while let Some(d) = p {
            if std::fs::symlink_metadata(d).is_ok_and(|m| !m.is_dir()) {
                return StoreError::InvalidKey {
                    key: key.into(),
                    reason: UNDER_OBJECT,
                };
            }
            p = d.parent();
        }
        io_err(key, e)
    })
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
#[allow(unsafe_code)] // `LocalObject::new`: this store never writes a committed object's file
fn open_file(path: &Path, key: &str) -> StoreResult<Option<super::LocalObject>> {
    let file = std::fs::File::open(path).map_err(|e| io_err(key, e))?;
    let m = file.metadata().map_err(|e| io_err(key, e))?;
    if !m.is_file() {
        return Err(StoreError::NotFound { key: key.into() });
    }
    // SAFETY: the filesystem store never writes to a committed object's file: every put
    // writes a temporary file it created with `O_EXCL` (`TmpFile`) and renames or links it
    // over the key's path, and a delete unlinks the name; `file` is read-only and `meta`'s
    // size is its length (`meta_of`).
    Ok(Some(unsafe {
        super::LocalObject::new(file, meta_of(key, &m))
    }))
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> StoreResult<T> + Send + 'static,
) -> StoreResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::other("fs", format!("blocking task failed: {e}")))?
}

#[async_trait]
impl Store for FsStore {
    fn name(&self) -> &'static str {
        "fs"
    }

    async fn open_local(&self, key: &str) -> StoreResult<Option<super::LocalObject>> {
        let path = self.path(key)?;
        let key = key.to_string();
        blocking(move || open_file(&path, &key)).await
    }

    fn open_local_blocking(&self, key: &str) -> StoreResult<Option<super::LocalObject>> {
        open_file(&self.path(key)?, key)
    }

    async fn get_opts(&self, key: &str, opts: GetOptions) -> StoreResult<GetResult> {
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
                    // Read into uninitialised capacity (a fresh buffer) or a pooled one: no
                    // zeroing pass before the read.
                    let mut buf = read_buffer(n);
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
                    into_bytes(buf),
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

    async fn put_opts(&self, key: &str, data: Bytes, opts: PutOptions) -> StoreResult<PutResult> {
        let (path, dir, tmp) = self.write_paths(key)?;
        let fsync = self.fsync;
        let key = key.to_string();
        let turn = self.writer_turn().await;
        blocking(move || {
            let _turn = turn;
            let mut t = TmpFile::create(tmp, &dir, &key)?;
            t.file.write_all(&data).map_err(|e| io_err(&key, e))?;
            t.commit(&path, opts.mode, fsync, &key)
        })
        .await
    }

    async fn put_stream(
        &self,
        key: &str,
        body: ByteStream,
        len: Option<u64>,
        opts: PutOptions,
    ) -> StoreResult<PutResult> {
        let (path, dir, tmp) = self.write_paths(key)?;
        let fsync = self.fsync;
        let key = key.to_string();
        let mut t = blocking({
            let key = key.clone();
            move || TmpFile::create(tmp, &dir, &key)
        })
        .await?;
        // Pieces go to the file in 2 MiB-aligned steps ([`WRITE_STEP`]): one `writev(2)` on
        // the blocking pool as soon as the pieces received cover the next step boundary, the
        // rest kept for the next one (so at most a step and the pieces that arrived together
        // are held). Each piece is dropped (its memory given back) once written. An error or
        // a dropped future drops the temporary file, which removes it.
        let mut got = 0u64;
        let mut written = 0u64;
        let mut pending: Vec<Bytes> = Vec::new();
        let mut body = body.ready_chunks(64);
        loop {
            let next = body.next().await;
            let end = next.is_none();
            if let Some(pieces) = next {
                for p in pieces {
                    let p = p?;
                    got += p.len() as u64;
                    if !p.is_empty() {
                        pending.push(p);
                    }
                }
                if len.is_some_and(|n| got > n) {
                    check_stream_len(&key, got, len)?;
                }
            }
            // Whole steps now; everything at the end.
            let upto = if end {
                got
            } else {
                got / WRITE_STEP * WRITE_STEP
            };
            if upto > written {
                let now = take_bytes(&mut pending, upto - written);
                let k = key.clone();
                let turn = self.writer_turn().await;
                t = blocking(move || {
                    let _turn = turn;
                    write_pieces(&mut t.file, &now).map_err(|e| io_err(&k, e))?;
                    Ok(t)
                })
                .await?;
                written = upto;
            }
            if end {
                break;
            }
        }
        check_stream_len(&key, got, len)?;
        blocking(move || t.commit(&path, opts.mode, fsync, &key)).await
    }

    async fn list_partial(&self, prefix: &str) -> StoreResult<Vec<PartialWrite>> {
        let root = self.root.clone();
        let prefix = prefix.to_string();
        blocking(move || {
            let mut out = Vec::new();
            walk(&root, &prefix, |rel, name, ent| {
                if !name.starts_with(TMP_PREFIX) {
                    return Ok(());
                }
                // A writer's file may vanish (committed) between the listing and the stat.
                let Ok(m) = ent.metadata() else { return Ok(()) };
                if m.is_file() {
                    out.push(PartialWrite {
                        id: if rel.is_empty() {
                            name.to_string()
                        } else {
                            format!("{rel}/{name}")
                        },
                        size: m.len(),
                        last_modified: m.modified().ok(),
                        orphaned: orphaned(name),
                    });
                }
                Ok(())
            })?;
            out.sort_by(|a, b| a.id.cmp(&b.id));
            Ok(out)
        })
        .await
    }

    async fn delete_partial(&self, partial: &PartialWrite) -> StoreResult<()> {
        let id = partial.id.clone();
        let (dir, name) = match id.rsplit_once('/') {
            Some((d, n)) => (d, n),
            None => ("", id.as_str()),
        };
        if !name.starts_with(TMP_PREFIX)
            || name.contains(['/', '\\'])
            || (!dir.is_empty() && validate_key(dir).is_err())
        {
            return Err(StoreError::InvalidKey {
                key: id.clone(),
                reason: "not a temporary file of this store",
            });
        }
        let path = self.root.join(&id);
        blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::other(
                "fs",
                format!("remove temporary file {id}: {e}"),
            )),
        })
        .await
    }

    async fn head(&self, key: &str) -> StoreResult<ObjectMeta> {
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

    async fn delete(&self, key: &str) -> StoreResult<()> {
        let path = self.path(key)?;
        let key = key.to_string();
        blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) => match io_err(&key, e) {
                StoreError::NotFound { .. } => Ok(()),
                e => Err(e),
            },
        })
        .await
    }

    async fn list(&self, prefix: &str, limit: usize) -> StoreResult<Vec<ObjectMeta>> {
        let root = self.root.clone();
        let prefix = prefix.to_string();
        blocking(move || {
            let mut out = Vec::new();
            walk(&root, &prefix, |rel, name, ent| {
                if name.starts_with(TMP_PREFIX) {
                    return Ok(());
                }
                let k = if rel.is_empty() {
                    name.to_string()
                } else {
                    format!("{rel}/{name}")
                };
                if k.starts_with(&prefix) {
                    // An object deleted between the listing and the stat is not listed.
                    if let Ok(m) = ent.metadata() {
                        if m.is_file() {
                            out.push(meta_of(&k, &m));
                        }
                    }
                }
                Ok(())
            })?;
            out.sort_by(|a, b| a.key.cmp(&b.key));
            out.truncate(limit);
            Ok(out)
        })
        .await
    }
}

/// Walks the directories under `root` that can hold keys starting with `prefix`, calling
/// `f(dir_key, name, entry)` for every file (objects and temporary files) in them.
fn walk(
    root: &Path,
    prefix: &str,
    mut f: impl FnMut(&str, &str, &std::fs::DirEntry) -> StoreResult<()>,
) -> StoreResult<()> {
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
        root.to_path_buf()
    } else {
        root.join(base)
    };
    let mut stack = vec![(start, base.to_string())];
    while let Some((dir, rel)) = stack.pop() {
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
                ) =>
            {
                continue
            }
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
            let ft = ent.file_type().map_err(|e| StoreError::other("fs", e))?;
            if ft.is_dir() {
                let k = if rel.is_empty() {
                    name
                } else {
                    format!("{rel}/{name}")
                };
                if prefix.starts_with(&k) || k.starts_with(prefix) {
                    stack.push((ent.path(), k));
                }
            } else if ft.is_file() {
                f(&rel, &name, &ent)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
