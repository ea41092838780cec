//! The filesystem store's temporary files: their names (which writer, whether it still
//! runs), creation with `O_EXCL`, commit by rename or link, and streamed writes in 2 MiB
//! steps.

use super::{create_parent, io_err, meta_of, FsyncPolicy, OVER_KEYS, UNDER_OBJECT};
use crate::error::{StoreError, StoreResult};
use crate::store::{PutMode, PutResult};
use bytes::Bytes;
use std::io::Write;
use std::path::{Path, PathBuf};

pub(super) const TMP_PREFIX: &str = ".tmp-";

/// A temporary file's writer is this process's kin when its token is [`writer_token`]: same
/// boot and PID namespace, so its PID can be checked.
pub(super) fn writer_token() -> &'static str {
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
pub(super) fn orphaned(name: &str) -> bool {
    let mut it = name.strip_prefix(TMP_PREFIX).unwrap_or("").split('-');
    let (Some(tok), Some(pid)) = (it.next(), it.next()) else {
        return false;
    };
    let me = writer_token();
    if tok != me || me == "nohost00" || !cfg!(target_os = "linux") {
        return false;
    }
    match pid.parse::<u32>() {
        Ok(pid) if pid != std::process::id() => !process_runs(pid),
        _ => false,
    }
}

/// Whether process `pid` of this host still runs: its `/proc/<pid>/stat` exists and its state
/// is neither zombie (`Z`: exited, not yet reaped by its parent; it can write nothing more)
/// nor dead (`X`). A killed writer stays in `/proc` as a zombie until its parent reaps it
/// (0.5-2.5 s seen under vLLM), so existence alone would keep its temporary file that long.
fn process_runs(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat"))
    else {
        return false;
    };
    // `pid (comm) S ...`: comm may hold spaces and parentheses, so the state is the first field
    // after the last ')'.
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X" | "x"))
}

/// A write's temporary file: removed when dropped, unless committed.
pub(super) struct TmpFile {
    path: PathBuf,
    pub(super) file: std::fs::File,
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
    pub(super) fn create(path: PathBuf, dir: &Path, key: &str) -> StoreResult<Self> {
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
    pub(super) fn commit(
        mut self,
        path: &Path,
        mode: PutMode,
        fsync: FsyncPolicy,
        key: &str,
    ) -> StoreResult<PutResult> {
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
pub(super) const WRITE_STEP: u64 = 2 << 20;

/// Takes the first `n` bytes of `pending` (which holds at least `n`) off its front, splitting
/// a piece if need be (no copy: the two parts share its buffer).
pub(super) fn take_bytes(pending: &mut Vec<Bytes>, n: u64) -> Vec<Bytes> {
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
pub(super) fn write_pieces(f: &mut std::fs::File, pieces: &[Bytes]) -> std::io::Result<()> {
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
