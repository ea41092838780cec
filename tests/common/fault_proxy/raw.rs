//! Raw mode of the fault proxy: a byte pipe whose server-to-client stream a rule per
//! connection breaks after a byte offset.

use super::{Inner, RawFault, STALL_FOR};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Records bytes forwarded on raw connection `conn` (found by number: the log may have been
/// cleared while the connection lives on, e.g. a pooled or stalled one).
fn raw_sent(inn: &Inner, conn: u64, sent: u64) {
    if let Some(e) = inn.raw_log.lock().unwrap().iter_mut().find(|e| e.0 == conn) {
        e.2 = sent;
    }
}

pub(super) async fn raw_conn(inn: Arc<Inner>, client: TcpStream, conn: u64) -> std::io::Result<()> {
    let upstream = TcpStream::connect(inn.upstream).await?;
    let _ = upstream.set_nodelay(true);
    let rule = inn.raw_rule.lock().unwrap().clone();
    let fault = rule.map(|r| r(conn)).unwrap_or(RawFault::Pass);
    inn.raw_log.lock().unwrap().push((conn, fault.clone(), 0));
    let (mut cr, mut cw) = client.into_split();
    let (mut ur, mut uw) = upstream.into_split();
    // Client to server: plain copy.
    let c2s = tokio::spawn(async move {
        // Owns the client's read half: aborting this task drops it.
        let _ = tokio::io::copy(&mut cr, &mut uw).await;
        let _ = uw.shutdown().await;
    });
    let mut sent: u64 = 0;
    let mut buf = vec![0u8; 64 << 10];
    let result: std::io::Result<()> = async {
        loop {
            let n = ur.read(&mut buf).await?;
            if n == 0 {
                let _ = cw.shutdown().await;
                return Ok(());
            }
            let mut piece = buf[..n].to_vec();
            let end = sent + n as u64;
            match &fault {
                RawFault::Pass => cw.write_all(&piece).await?,
                RawFault::FlipAt(o) | RawFault::XorAt(o, _) => {
                    let mask = match &fault {
                        RawFault::XorAt(_, m) => *m,
                        _ => 0xff,
                    };
                    if (sent..end).contains(o) {
                        piece[(o - sent) as usize] ^= mask;
                    }
                    cw.write_all(&piece).await?;
                }
                RawFault::ResetAfter(o) | RawFault::CloseAfter(o) | RawFault::StallAfter(o) => {
                    if end > *o {
                        let k = (o - sent.min(*o)) as usize;
                        cw.write_all(&piece[..k]).await?;
                        cw.flush().await?;
                        sent += k as u64;
                        raw_sent(&inn, conn, sent);
                        match fault {
                            RawFault::ResetAfter(_) => {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                                // Zero linger, no FIN: closing the socket sends an RST.
                                let _ = cw.as_ref().set_zero_linger();
                                cw.forget();
                                c2s.abort();
                                return Ok(());
                            }
                            RawFault::CloseAfter(_) => {
                                let _ = cw.shutdown().await;
                                return Ok(());
                            }
                            _ => {
                                inn.stalls.lock().unwrap().push(std::time::Instant::now());
                                tokio::time::sleep(STALL_FOR).await;
                                return Ok(());
                            }
                        }
                    }
                    cw.write_all(&piece).await?;
                }
                RawFault::Drip { bytes, every } => {
                    for p in piece.chunks((*bytes).max(1)) {
                        cw.write_all(p).await?;
                        cw.flush().await?;
                        tokio::time::sleep(*every).await;
                    }
                }
            }
            sent = end;
            raw_sent(&inn, conn, sent);
        }
    }
    .await;
    c2s.abort();
    result
}
