//! The baselines a load is measured against: this process's CPU time ([`process_cpu_s`],
//! per GiB moved) and a raw loopback TCP stream ([`raw_tcp`]).

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
