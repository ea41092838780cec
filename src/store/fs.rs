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
    PartialWrite, PutMode, PutOptions, PutResult, Store,
};
use crate::error::StoreError;
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
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
    /// Writes to files in progress at once, at most (one per core): a flood of puts takes
    /// turns on the disk and the CPU rather than one blocking thread each, so reads keep
    /// their share.
    writers: std::sync::Arc<tokio::sync::Semaphore>,
}

const TMP_PREFIX: &str = ".tmp-";
/// Longest path segment most filesystems hold (`NAME_MAX`), bytes.
const MAX_SEGMENT_LEN: usize = 255;
/// A temporary file's writer is this process's kin when its token is [`writer_token`]: same
/// boot and PID namespace, so its PID can be checked.
fn writer_token() -> &'static str {
    static T: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        use sha2::Digest;
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
        let ns = std::fs::read_link("/proc/self/ns/pid")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        if boot.is_empty() || ns.is_empty() {
            // Without both, no writer's liveness can be judged: grace periods only.
            return "nohost00".into();
        }
        let d = sha2::Sha256::digest(format!("{boot}|{ns}").as_bytes());
        hex::encode(&d[..4])
    })
}

/// Whether the temporary file `name` belongs to a writer of this host that no longer runs.
fn orphaned(name: &str) -> bool {
    let mut it = name.strip_prefix(TMP_PREFIX).unwrap_or("").split('-');
    let (Some(tok), Some(pid)) = (it.next(), it.next()) else {
        return false;
    };
    let me = writer_token();
    if tok != me || me == "nohost00" || !cfg!(target_os = "linux") {
        return false;
    }
    match pid.parse::<u32>() {
        Ok(pid) if pid != std::process::id() => !Path::new("/proc").join(pid.to_string()).exists(),
        _ => false,
    }
}
/// Bytes read per body chunk.
const READ_CHUNK: usize = 4 << 20;

/// Reads of at least this many bytes use pooled [`READ_CHUNK`] buffers ([`read_buffer`]).
const POOLED_READ_MIN: usize = 256 << 10;

/// Most pooled read buffers kept between reads, process-wide (8 x 4 MiB = 32 MiB).
const POOLED_READS_KEPT: usize = 8;

/// Read buffers kept for the next read. A load reads tens of MiB in pieces of up to
/// [`READ_CHUNK`]; with a fresh buffer per piece, the allocator hands each one back to the
/// OS when the piece is dropped, and the next read faults the pages in again, zeroed by the
/// kernel. Measured on a 94 MB load from the file store (30 layers x 32 chunks of
/// SmolLM2-135M, through the C ABI): 55-59 ms of CPU against 36 ms with glibc told to keep
/// freed memory (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824`),
/// which this pool does for read buffers only.
static READ_POOL: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// An empty buffer for a read of `n` bytes: a pooled [`READ_CHUNK`] one for large reads,
/// else a fresh one of capacity `n`.
fn read_buffer(n: usize) -> Vec<u8> {
    if !(POOLED_READ_MIN..=READ_CHUNK).contains(&n) {
        return Vec::with_capacity(n);
    }
    let pooled = READ_POOL.lock().unwrap_or_else(|e| e.into_inner()).pop();
    let mut v = pooled.unwrap_or_else(|| Vec::with_capacity(READ_CHUNK));
    v.clear();
    v
}

/// A read's bytes; a pooled buffer goes back to [`READ_POOL`] when the last `Bytes` of it
/// is dropped.
fn into_bytes(buf: Vec<u8>) -> Bytes {
    if buf.capacity() == READ_CHUNK {
        Bytes::from_owner(PooledRead(buf))
    } else {
        Bytes::from(buf)
    }
}

/// A pooled read buffer lent to `Bytes`.
struct PooledRead(Vec<u8>);

impl AsRef<[u8]> for PooledRead {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for PooledRead {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        let mut pool = READ_POOL.lock().unwrap_or_else(|e| e.into_inner());
        if pool.len() < POOLED_READS_KEPT {
            pool.push(v);
        }
    }
}

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
            writers: std::sync::Arc::new(tokio::sync::Semaphore::new(
                std::thread::available_parallelism().map_or(2, |n| n.get()),
            )),
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
        if key.split('/').any(|s| s.len() > MAX_SEGMENT_LEN) {
            return Err(StoreError::InvalidKey {
                key: key.into(),
                reason: "a path segment is longer than 255 bytes (the filesystem store's limit)",
            });
        }
        Ok(self.root.join(key))
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
fn create_parent(dir: &Path, key: &str) -> Result<(), StoreError> {
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

/// A write's temporary file: removed when dropped, unless committed.
struct TmpFile {
    path: PathBuf,
    file: std::fs::File,
    committed: bool,
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl TmpFile {
    fn create(path: PathBuf, dir: &Path, key: &str) -> Result<Self, StoreError> {
        create_parent(dir, key)?;
        // A new file or none (`O_EXCL`): an existing name is never opened for writing, let
        // alone truncated. A create-only put's temporary name stays linked to the committed
        // object until it is removed, so truncating a file of that name would rewrite the
        // object in place.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| io_err(key, e))?;
        Ok(TmpFile {
            path,
            file,
            committed: false,
        })
    }

    /// Makes the written bytes the object at `path` (see the module documentation).
    fn commit(
        mut self,
        path: &Path,
        mode: PutMode,
        fsync: FsyncPolicy,
        key: &str,
    ) -> Result<PutResult, StoreError> {
        if fsync == FsyncPolicy::Always {
            self.file.sync_all().map_err(|e| io_err(key, e))?;
        }
        let r = match mode {
            PutMode::Overwrite => std::fs::rename(&self.path, path),
            PutMode::Create => std::fs::hard_link(&self.path, path),
        };
        match r {
            Ok(()) => {
                // Renamed: nothing left to remove. Linked: the temporary name goes on drop.
                self.committed = mode == PutMode::Overwrite;
            }
            Err(e) => {
                use std::io::ErrorKind as K;
                let dir_there = std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
                return Err(match e.kind() {
                    _ if dir_there => StoreError::InvalidKey {
                        key: key.into(),
                        reason: OVER_KEYS,
                    },
                    K::AlreadyExists => StoreError::AlreadyExists { key: key.into() },
                    K::NotADirectory => StoreError::InvalidKey {
                        key: key.into(),
                        reason: UNDER_OBJECT,
                    },
                    _ => io_err(key, e),
                });
            }
        }
        let dir = path.parent().expect("key has a parent under root");
        if fsync == FsyncPolicy::Always {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io_err(key, e))?;
        }
        let m = std::fs::metadata(path).map_err(|e| io_err(key, e))?;
        Ok(PutResult {
            etag: meta_of(key, &m).etag,
        })
    }
}

/// A streamed put writes its temporary file in steps of this many bytes, each starting and
/// ending at a multiple of it (but the last): ext4 and xfs then cache the file in folios of
/// up to 2 MiB, where a write of a few hundred KiB gets folios of its own size. A reader that
/// maps the object (the server's S3 GETs) maps a 2 MiB folio with one page-table entry instead
/// of 512, and every read of the file handles fewer, larger folios.
const WRITE_STEP: u64 = 2 << 20;

/// Takes the first `n` bytes of `pending` (which holds at least `n`) off its front, splitting
/// a piece if need be (no copy: the two parts share its buffer).
fn take_bytes(pending: &mut Vec<Bytes>, n: u64) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut left = n as usize;
    let mut used = 0;
    for p in pending.iter_mut() {
        if left == 0 {
            break;
        }
        if p.len() <= left {
            left -= p.len();
            out.push(std::mem::take(p));
            used += 1;
        } else {
            out.push(p.split_to(left));
            left = 0;
        }
    }
    pending.drain(..used);
    out
}

/// Writes all of `pieces` to `f`, as few `writev(2)` calls as the OS takes.
fn write_pieces(f: &mut std::fs::File, pieces: &[Bytes]) -> std::io::Result<()> {
    let (mut i, mut off) = (0, 0);
    while i < pieces.len() {
        let slices: Vec<std::io::IoSlice<'_>> = std::iter::once(&pieces[i][off..])
            .chain(pieces[i + 1..].iter().map(|p| &p[..]))
            .map(std::io::IoSlice::new)
            .collect();
        let mut n = match f.write_vectored(&slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        while n > 0 {
            let rest = pieces[i].len() - off;
            if n < rest {
                off += n;
                n = 0;
            } else {
                n -= rest;
                i += 1;
                off = 0;
            }
        }
    }
    Ok(())
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
fn open_file(path: &Path, key: &str) -> Result<Option<super::LocalObject>, StoreError> {
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
        let tmp = self.tmp_path(&dir);
        let fsync = self.fsync;
        let key = key.to_string();
        let turn = self
            .writers
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
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
    ) -> Result<PutResult, StoreError> {
        let path = self.path(key)?;
        let dir = path
            .parent()
            .expect("key has a parent under root")
            .to_path_buf();
        let tmp = self.tmp_path(&dir);
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
                let turn = self
                    .writers
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
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

    async fn list_partial(&self, prefix: &str) -> Result<Vec<PartialWrite>, StoreError> {
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

    async fn delete_partial(&self, partial: &PartialWrite) -> Result<(), StoreError> {
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
            Err(e) => match io_err(&key, e) {
                StoreError::NotFound { .. } => Ok(()),
                e => Err(e),
            },
        })
        .await
    }

    async fn list(&self, prefix: &str, limit: usize) -> Result<Vec<ObjectMeta>, StoreError> {
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
    mut f: impl FnMut(&str, &str, &std::fs::DirEntry) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
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
mod tests {
    use super::*;
    use crate::store::StoreExt;

    fn store() -> (tempfile::TempDir, FsStore) {
        let d = tempfile::tempdir().unwrap();
        let s = FsStore::new(d.path(), FsyncPolicy::Never).unwrap();
        (d, s)
    }

    /// Pooled read buffers carry only their own read's bytes: objects of other contents and
    /// sizes read one after another (each buffer back in the pool before the next read) and
    /// while the body pieces of earlier reads are still held come back byte-exact.
    #[tokio::test]
    async fn pooled_read_buffers_carry_only_their_own_read() {
        async fn pieces(s: &FsStore, key: &str, range: Option<std::ops::Range<u64>>) -> Vec<Bytes> {
            let mut body = s.get_opts(key, GetOptions { range }).await.unwrap().body;
            let mut v = Vec::new();
            while let Some(b) = body.next().await {
                v.push(b.unwrap());
            }
            v
        }
        let (_d, s) = store();
        let sizes = [READ_CHUNK + 12_345, 300 << 10, 2 * READ_CHUNK, 1 << 20];
        let objs: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (j * 31 + i * 7 + j / 4099) as u8).collect())
            .collect();
        for (i, o) in objs.iter().enumerate() {
            s.put(&format!("b/pool/{i}"), Bytes::from(o.clone()))
                .await
                .unwrap();
        }
        let mut held = Vec::new();
        for round in 0..3 {
            for (i, o) in objs.iter().enumerate() {
                let key = format!("b/pool/{i}");
                let whole = pieces(&s, &key, None).await;
                assert!(whole.concat() == o[..], "round {round}, object {i}");
                // A ranged read inside the object, off the buffer boundaries.
                let r = 1000..(o.len() as u64 - 77);
                let part = pieces(&s, &key, Some(r.clone())).await;
                assert!(
                    part.concat() == o[r.start as usize..r.end as usize],
                    "round {round}, range of object {i}"
                );
                if round == 1 {
                    held.push((i, whole));
                }
            }
        }
        for (i, b) in held {
            assert!(
                b.concat() == objs[i][..],
                "held pieces of object {i} changed"
            );
        }
        let kept = READ_POOL.lock().unwrap().len();
        assert!(kept <= POOLED_READS_KEPT, "{kept} buffers kept");
    }

    #[tokio::test]
    async fn keys_the_filesystem_cannot_hold_are_invalid_keys_never_os_errors() {
        let (_d, s) = store();
        let long = format!("b/{}/x", "s".repeat(300));
        let e = s.put(&long, Bytes::from_static(b"v")).await.unwrap_err();
        assert!(
            matches!(e, StoreError::InvalidKey { reason, .. } if reason.contains("255 bytes")),
            "{e:?}"
        );
        // Below an object: refused; reading it is a miss.
        s.put("b/a/obj", Bytes::from_static(b"v")).await.unwrap();
        let e = s
            .put("b/a/obj/under", Bytes::from_static(b"v"))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                StoreError::InvalidKey {
                    reason: UNDER_OBJECT,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(matches!(
            s.get_bytes("b/a/obj/under").await,
            Err(StoreError::NotFound { .. })
        ));
        assert!(matches!(
            s.head("b/a/obj/under").await,
            Err(StoreError::NotFound { .. })
        ));
        s.delete("b/a/obj/under").await.unwrap();
        // A prefix of other keys: refused, overwrite and create-only alike (never "already
        // exists": a directory is not an object).
        s.put("b/p/q/r", Bytes::from_static(b"v")).await.unwrap();
        for mode in [PutMode::Overwrite, PutMode::Create] {
            let e = s
                .put_opts("b/p/q", Bytes::from_static(b"v"), PutOptions { mode })
                .await
                .unwrap_err();
            assert!(
                matches!(
                    e,
                    StoreError::InvalidKey {
                        reason: OVER_KEYS,
                        ..
                    }
                ),
                "{mode:?}: {e:?}"
            );
        }
        assert_eq!(
            s.get_bytes("b/p/q/r").await.unwrap(),
            Bytes::from_static(b"v")
        );
        // None of the refused writes left a temporary file.
        assert!(s.list_partial("").await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn temporary_files_of_gone_writers_are_found_and_reclaimed() {
        let (d, s) = store();
        s.put("b/kv/0a", Bytes::from_static(b"v")).await.unwrap();
        let dir = d.path().join("b/kv");
        // A writer of this host that no longer runs (a child that exited), one that still
        // runs (this process), one of another host: only the first is orphaned.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let me = writer_token();
        let files = [
            (format!(".tmp-{me}-{dead}-7"), 5000usize),
            (format!(".tmp-{me}-{}-8", std::process::id()), 300),
            (".tmp-0badc0de-1-9".to_string(), 70),
        ];
        for (n, len) in &files {
            std::fs::write(dir.join(n), vec![1u8; *len]).unwrap();
        }
        let found = s.list_partial("b/").await.unwrap();
        assert_eq!(found.len(), 3, "{found:?}");
        assert_eq!(found.iter().map(|p| p.size).sum::<u64>(), 5370);
        let orphaned: Vec<_> = found
            .iter()
            .filter(|p| p.orphaned)
            .map(|p| p.id.clone())
            .collect();
        if cfg!(target_os = "linux") {
            assert_eq!(orphaned, vec![format!("b/kv/{}", files[0].0)]);
        }
        // Objects never include them; deleting one deletes exactly it.
        assert_eq!(s.list("b/", 100).await.unwrap().len(), 1);
        s.delete_partial(&found[0]).await.unwrap();
        assert_eq!(s.list_partial("").await.unwrap().len(), 2);
        // Only temporary files can be deleted this way.
        for id in ["b/kv/0a", "../x/.tmp-1", "b/../../.tmp-1"] {
            let p = PartialWrite {
                id: id.into(),
                size: 0,
                last_modified: None,
                orphaned: true,
            };
            assert!(s.delete_partial(&p).await.is_err(), "{id}");
        }
        assert!(s.exists("b/kv/0a").await.unwrap());
    }

    /// A streamed put stores exactly the bytes it was given, however its pieces fall across
    /// the 2 MiB write steps (empty pieces, pieces straddling a step boundary, one byte).
    #[tokio::test]
    async fn streamed_puts_store_their_bytes_whatever_the_pieces() {
        let (_d, s) = store();
        let step = WRITE_STEP as usize;
        let cases: Vec<Vec<usize>> = vec![
            vec![1],
            vec![step],
            vec![0, step - 1, 0, 2, step - 1, 3],
            vec![3 * step + 5],
            vec![700_000; 10],
            vec![step / 2 + 1, step, step, 17],
        ];
        for (i, sizes) in cases.into_iter().enumerate() {
            let total: usize = sizes.iter().sum();
            let data: Vec<u8> = (0..total).map(|j| (j * 13 + j / 1021 + i) as u8).collect();
            let mut at = 0;
            let pieces: Vec<Result<Bytes, StoreError>> = sizes
                .iter()
                .map(|&n| {
                    at += n;
                    Ok(Bytes::copy_from_slice(&data[at - n..at]))
                })
                .collect();
            let key = format!("b/steps/{i}");
            let body = futures::stream::iter(pieces).boxed();
            s.put_stream(&key, body, Some(total as u64), PutOptions::default())
                .await
                .unwrap();
            assert!(s.get_bytes(&key).await.unwrap()[..] == data[..], "case {i}");
        }
    }

    #[tokio::test]
    async fn a_streamed_put_writes_as_it_receives_and_leaves_nothing_when_cut() {
        let (d, s) = store();
        // The temporary file grows while the body is still arriving (in 2 MiB steps).
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, StoreError>>();
        let put = tokio::spawn({
            let s = FsStore::new(d.path(), FsyncPolicy::Never).unwrap();
            async move {
                s.put_stream("b/kv/1", rx.boxed(), Some(3 << 20), PutOptions::default())
                    .await
            }
        });
        tx.unbounded_send(Ok(Bytes::from(vec![3u8; 2 << 20])))
            .unwrap();
        let grown = loop {
            let p = s.list_partial("b/").await.unwrap();
            if let Some(p) = p.first().filter(|p| p.size == 2 << 20) {
                break p.clone();
            }
            tokio::task::yield_now().await;
        };
        assert!(!grown.orphaned, "its writer runs");
        assert!(matches!(
            s.head("b/kv/1").await,
            Err(StoreError::NotFound { .. })
        ));
        // The client goes away: the put fails and its temporary file goes with it.
        tx.unbounded_send(Err(StoreError::other("test", "client gone")))
            .unwrap();
        assert!(put.await.unwrap().is_err());
        assert!(s.list_partial("").await.unwrap().is_empty());
        assert!(matches!(
            s.head("b/kv/1").await,
            Err(StoreError::NotFound { .. })
        ));
        // A dropped (cancelled) put leaves nothing either.
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<Bytes, StoreError>>();
        tx.unbounded_send(Ok(Bytes::from(vec![3u8; 2 << 20])))
            .unwrap();
        let put = tokio::spawn({
            let s = FsStore::new(d.path(), FsyncPolicy::Never).unwrap();
            async move {
                s.put_stream("b/kv/2", rx.boxed(), None, PutOptions::default())
                    .await
            }
        });
        while !s
            .list_partial("")
            .await
            .unwrap()
            .iter()
            .any(|p| p.size == 2 << 20)
        {
            tokio::task::yield_now().await;
        }
        put.abort();
        assert!(put.await.unwrap_err().is_cancelled());
        // (The file goes when the put's last blocking write returns, if one was running.)
        let t0 = std::time::Instant::now();
        while !s.list_partial("").await.unwrap().is_empty() {
            assert!(
                t0.elapsed().as_secs() < 10,
                "a cancelled put left its temporary file"
            );
            tokio::task::yield_now().await;
        }
        drop(tx);
    }
}
