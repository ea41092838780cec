//! The baselines a load is measured against: this process's CPU time ([`process_cpu_s`],
//! per GiB moved) and a raw loopback TCP stream ([`raw_tcp`]).

use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// CPU time of this process so far, in seconds: the sum over its threads of
/// `/proc/self/task/*/schedstat`'s run time (ns). `None` off Linux.
pub(super) fn process_cpu_s() -> Option<f64> {
    let mut ns = 0u64;
    for t in std::fs::read_dir("/proc/self/task").ok()? {
        let p = t.ok()?.path().join("schedstat");
        // A thread may exit between the listing and the read.
        if let Ok(s) = std::fs::read_to_string(p) {
            ns += s.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(ns as f64 / 1e9)
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
