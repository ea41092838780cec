//! The baselines a load is measured against: this process's CPU time ([`process_cpu_s`],
//! per GiB moved), a raw loopback TCP stream of one reused buffer ([`raw_tcp`]), and a raw
//! stream of the load's own bytes ([`raw_same_bytes`]: its chunk files, sent with
//! `sendfile(2)` into a destination of the load's size).

use std::path::{Path, PathBuf};
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// CPU time of this process so far, in seconds: `CLOCK_PROCESS_CPUTIME_ID` (user and system
/// time of all its threads, those that have exited included, in nanoseconds). Summing the
/// live threads' `/proc/self/task/*/schedstat` instead, as this did before 2026-12-05, lost
/// the time of a thread that exited between two readings (the runtime's idle blocking-pool
/// threads exit after 10 s), which gave negative figures. `None` if the clock cannot be read.
pub(super) fn process_cpu_s() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration; the clock id is a
    // constant the C library defines.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9)
}

/// CPU seconds per GiB between two [`process_cpu_s`] readings.
pub(super) fn per_gib(before: Option<f64>, after: Option<f64>, bytes: u64) -> Option<f64> {
    Some((after? - before?) / (bytes as f64 / (1u64 << 30) as f64))
}

/// Raw loopback TCP: `bytes` through one connection in 16 MiB writes into a reused 16 MiB
/// read buffer; bytes per second.
pub(super) async fn raw_tcp(bytes: u64) -> std::io::Result<(f64, Option<f64>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = l.accept().await?;
        let mut buf = vec![0u8; 16 << 20];
        let mut got = 0u64;
        loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                return Ok::<u64, std::io::Error>(got);
            }
            got += n as u64;
        }
    });
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let buf = vec![7u8; 16 << 20];
    let cpu0 = process_cpu_s();
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < bytes {
        let n = (bytes - sent).min(buf.len() as u64) as usize;
        s.write_all(&buf[..n]).await?;
        sent += n as u64;
    }
    s.shutdown().await?;
    let got = reader.await.expect("reader task")?;
    let secs = t0.elapsed().as_secs_f64();
    Ok((got as f64 / secs, per_gib(cpu0, process_cpu_s(), got)))
}

/// The regular files under `dir` (recursively) of exactly `len` bytes, in path order: the
/// per-chunk objects of a prefix saved in the in-process server's directory store (every
/// full chunk's object has one length; markers and segment objects have others).
pub(super) fn files_of_len(dir: &Path, len: u64) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let t = e.file_type()?;
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() && e.metadata()?.len() == len {
                out.push(e.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Raw loopback TCP over the load's own bytes: `files` (the prefix's chunk objects, as the
/// server sends them) go through one connection with `sendfile(2)`, file after file, and are
/// read into `dest` (the load's size, touched beforehand, as a load's reused buffers are),
/// until `dest` is full. Sender and receiver are this process's threads, so the CPU time
/// covers both, as [`raw_tcp`]'s does; the working set is the load's: its distinct bytes out
/// of the page cache into a destination as large as the load's, where [`raw_tcp`] writes one
/// 16 MiB buffer that stays in the CPU's caches. Returns bytes per second and CPU seconds
/// per GiB.
///
/// # Errors
/// A socket or file error, or `files` holding fewer bytes than `dest`.
pub(super) fn raw_same_bytes(
    files: &[PathBuf],
    dest: &mut [u8],
) -> std::io::Result<(f64, Option<f64>)> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let want = dest.len() as u64;
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = l.local_addr()?;
    let files = files.to_vec();
    let cpu0 = process_cpu_s();
    let t0 = Instant::now();
    let sender = std::thread::spawn(move || -> std::io::Result<u64> {
        let s = std::net::TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        let mut sent = 0u64;
        for f in &files {
            if sent == want {
                break;
            }
            let file = std::fs::File::open(f)?;
            let len = file.metadata()?.len().min(want - sent);
            let mut off: libc::off_t = 0;
            while (off as u64) < len {
                let n = (len - off as u64).min(1 << 30) as usize;
                // SAFETY: both descriptors are open for the call (the socket and the file are
                // owned here), and `off` is a valid, writable offset the kernel advances.
                let r = unsafe { libc::sendfile(s.as_raw_fd(), file.as_raw_fd(), &mut off, n) };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(e);
                }
                if r == 0 {
                    break;
                }
            }
            sent += off as u64;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        Ok(sent)
    });
    let (mut r, _) = l.accept()?;
    let mut got = 0usize;
    while got < dest.len() {
        let n = r.read(&mut dest[got..])?;
        if n == 0 {
            break;
        }
        got += n;
    }
    let sent = sender.join().expect("sender thread")?;
    let secs = t0.elapsed().as_secs_f64();
    if (got as u64) < want || sent < want {
        return Err(std::io::Error::other(format!(
            "raw same-bytes stream: the chunk files held {sent} bytes, {want} wanted"
        )));
    }
    Ok((
        got as f64 / secs,
        per_gib(cpu0, process_cpu_s(), got as u64),
    ))
}
