//! The server under hostile clients (issue 16), as a separate process (`objectcache serve`)
//! on loopback, its resident memory and open descriptors sampled every 10 ms.
//!
//! One bounded attack (about 10 s) from several client addresses at once: half-open
//! prefaces (held, or closed half way), unauthenticated gather frames announcing 16 MiB,
//! slowloris request heads, a flood of large PUTs, PUT bodies dripped slowly, GETs whose
//! bodies are never read. Checked: every hostile connection is closed by the server while
//! the attacker still holds it; the server's RSS stays under its stated limit (baseline +
//! memory budget + 64 MiB of per-connection buffers and allocator slack) and its descriptors
//! under theirs (baseline + connections allowed); a legitimate client's GETs all succeed
//! byte for byte under attack, their median under 2 s (not starved; the median's ratio to
//! its baseline is printed, not asserted: beside other tests on 2 cores it measures the
//! neighbours as much as the server); every flooded PUT is stored whole or refused with
//! 503 SlowDown. Then the connection caps, per address and overall. Figures are printed
//! as `HOSTILE|` lines (docs/reliability.md).

use crate::gather_util;
use crate::hostile_util;

use aws_sdk_s3::config::{BehaviorVersion, Credentials, Region};
use gather_util::*;
use hostile_util::*;
use objectcache::protocol::{encode_frame_header, Frame, FrameType, PREFACE, PROTOCOL_VERSION};
use std::net::SocketAddr;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const BUDGET: u64 = 128 << 20;
const CLIENT_TIMEOUT: u64 = 2;
const HANDSHAKE_TIMEOUT: u64 = 2;
const IDLE_TIMEOUT: u64 = 3;
const PER_IP: usize = 64;
const MAX_CONNS: usize = 600;
/// How long an attacker keeps at it before giving up (seconds): a connection still open then
/// was not closed by the server. Only a failing run waits this long; the server's deadlines
/// above close every hostile connection within a few seconds.
const GIVE_UP: u64 = 30;
/// A legitimate GET median under attack above this (milliseconds) means the client was
/// starved. A bound on starvation, not a speed goal: the median's ratio to its baseline is a
/// printed figure (docs/reliability.md), since on a shared 2-core machine running other
/// tests beside this one it measures the neighbours as much as the server.
const STARVED_MS: f64 = 2000.0;
/// Caps of the second server, on which the caps are counted.
const CAPS_PER_IP: usize = 16;
const CAPS_TOTAL: usize = 100;

fn server(dir: &std::path::Path) -> (ServeProcess, SocketAddr) {
    server_with(dir, HANDSHAKE_TIMEOUT, PER_IP, MAX_CONNS)
}

/// `objectcache serve` on a file store in `dir`, with the attack's budget and timeouts but
/// the given handshake deadline (seconds) and connection caps.
fn server_with(
    dir: &std::path::Path,
    handshake_secs: u64,
    per_ip: usize,
    max_conns: usize,
) -> (ServeProcess, SocketAddr) {
    let budget = BUDGET.to_string();
    let ct = CLIENT_TIMEOUT.to_string();
    let ht = handshake_secs.to_string();
    let it = IDLE_TIMEOUT.to_string();
    let per_ip = per_ip.to_string();
    let max = max_conns.to_string();
    spawn_serve(
        "127.0.0.1:0",
        dir.as_os_str(),
        &[
            "--no-fsync",
            "--memory-budget-bytes",
            &budget,
            "--max-request-bytes",
            "33554432",
            "--client-timeout-secs",
            &ct,
            "--handshake-timeout-secs",
            &ht,
            "--idle-timeout-secs",
            &it,
            "--min-client-bytes-per-s",
            "65536",
            "--max-connections-per-ip",
            &per_ip,
            "--max-connections",
            &max,
            "--shutdown-grace-secs",
            "1",
        ],
        Stdio::null(),
    )
}

fn sdk_client(addr: SocketAddr) -> aws_sdk_s3::Client {
    use aws_smithy_http_client::tls;
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https();
    let conf = aws_sdk_s3::config::Builder::new()
        .http_client(http)
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(format!("http://{addr}"))
        .force_path_style(true)
        .credentials_provider(Credentials::new(ACCESS, SECRET, None, None, "test"))
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(131).wrapping_add(seed))
        .collect()
}

/// `n` GETs of `key` by the legitimate client, each timed, on a thread and runtime of their
/// own (the attackers' tasks never delay the client's side of a GET).
async fn timed_gets(c: &aws_sdk_s3::Client, key: &str, n: usize, want: &[u8]) -> Vec<Duration> {
    let (c, key, want) = (c.clone(), key.to_string(), want.to_vec());
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let t0 = Instant::now();
                let o = c
                    .get_object()
                    .bucket(BUCKET)
                    .key(&key)
                    .send()
                    .await
                    .unwrap();
                let b = o.body.collect().await.unwrap().into_bytes();
                v.push(t0.elapsed());
                assert!(b[..] == want[..], "legitimate GET returned other bytes");
            }
            v
        })
    })
    .await
    .unwrap()
}

/// A presigned PUT of `len` bytes from `127.0.0.{src}`, sent in 1 MiB writes; the status.
async fn flood_put(addr: SocketAddr, src: u8, key: String, body: std::sync::Arc<Vec<u8>>) -> u16 {
    let extra = format!("Content-Length: {}\r\n", body.len());
    let mut s = presigned_head(src, addr, "PUT", &key, &extra).await;
    for c in body.chunks(1 << 20) {
        if s.write_all(c).await.is_err() {
            break;
        }
    }
    read_status(&mut s).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_are_dropped_and_the_server_stays_within_its_limits() {
    let _alone = crate::alone();
    raise_nofile();
    let dir = tempfile::tempdir().unwrap();
    let (p, addr) = server(dir.path());
    let pid = p.0.id();
    let legit = sdk_client(addr);
    // The legitimate client reads a 4 MiB object (a chunk object's few layers, or a small
    // chunk of a small model).
    let small = pattern(4 << 20, 1);
    legit
        .put_object()
        .bucket(BUCKET)
        .key("legit/obj")
        .body(small.clone().into())
        .send()
        .await
        .unwrap();
    // A larger object for the readers that never read.
    legit
        .put_object()
        .bucket(BUCKET)
        .key("legit/big")
        .body(pattern(32 << 20, 2).into())
        .send()
        .await
        .unwrap();
    timed_gets(&legit, "legit/obj", 20, &small).await; // warm-up
    let (rss0, fds0) = (rss_kib(pid), fds(pid));
    let mut base = timed_gets(&legit, "legit/obj", 60, &small).await;
    let (base_med, base_p90) = median_p90(&mut base);

    // --- The attack. ---------------------------------------------------------------------
    let sampler = Sampler::start(pid);
    let t_attack = Instant::now();
    let mut held = Vec::new(); // every hostile connection, held open by the attacker
                               // (a) Half-open prefaces: part of the gather preface, then nothing (held) or FIN.
    for src in 2..=4u8 {
        for i in 0..40 {
            let mut s = connect_from(src, addr).await;
            s.write_all(&PREFACE[..4]).await.unwrap();
            if i % 2 == 1 {
                s.shutdown().await.unwrap();
            }
            held.push(("half-open preface", s));
        }
    }
    // (b) Unauthenticated gather frames announcing 16 MiB (refused from their header).
    let mut junk = Vec::new();
    for _ in 0..40 {
        let mut s = connect_from(5, addr).await;
        let mut b = bytes::BytesMut::new();
        b.extend_from_slice(&PREFACE);
        Frame::Hello {
            version_min: PROTOCOL_VERSION,
            version_max: PROTOCOL_VERSION,
        }
        .encode(&mut b);
        encode_frame_header(FrameType::SaveData, 16 << 20, &mut b);
        s.write_all(&b).await.unwrap();
        junk.push(s);
    }
    // (c) Slowloris: a request head never finished, one byte every 300 ms.
    let slowloris: Vec<_> = (0..40)
        .map(|_| {
            tokio::spawn(async move {
                let mut s = connect_from(6, addr).await;
                s.write_all(
                    format!("GET /{BUCKET}/legit/obj HTTP/1.1\r\nHost: {addr}\r\nX-Slow: ")
                        .as_bytes(),
                )
                .await
                .unwrap();
                let t0 = Instant::now();
                // Whether the server closed it (a write fails) before the attacker gave up.
                let mut closed = false;
                while t0.elapsed() < Duration::from_secs(GIVE_UP) {
                    if s.write_all(b"a").await.is_err() {
                        closed = true;
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                (t0.elapsed(), closed)
            })
        })
        .collect();
    // (d) A flood of large PUTs (32 x 32 MiB, together 8x the memory budget).
    let flood_body = std::sync::Arc::new(pattern(32 << 20, 3));
    let flood: Vec<_> = (0..32)
        .map(|i| tokio::spawn(flood_put(addr, 7, format!("flood/{i}"), flood_body.clone())))
        .collect();
    // (e) PUT bodies dripped at 100 bytes/s, 64 MiB declared.
    let drips: Vec<_> = (0..16)
        .map(|i| {
            tokio::spawn(async move {
                let key = format!("drip/{i}");
                let s = presigned_head(8, addr, "PUT", &key, "Content-Length: 67108864\r\n").await;
                let t0 = Instant::now();
                let (mut rd, mut wr) = s.into_split();
                let w = tokio::spawn(async move {
                    while wr.write_all(&[7u8; 10]).await.is_ok()
                        && t0.elapsed() < Duration::from_secs(GIVE_UP)
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    wr
                });
                let mut b = vec![0u8; 4096];
                // The server answers or closes; `None` if neither before the attacker gave up.
                let n =
                    match tokio::time::timeout(Duration::from_secs(GIVE_UP + 5), rd.read(&mut b))
                        .await
                    {
                        Ok(r) => Some(r.unwrap_or(0)),
                        Err(_) => None,
                    };
                let answered = n.is_some();
                let n = n.unwrap_or(0);
                let head = String::from_utf8_lossy(&b[..n]).to_string();
                let status = http_status(&head);
                (status, head, t0.elapsed(), answered, w)
            })
        })
        .collect();
    // (f) GETs of a 32 MiB object whose bodies are never read.
    let mut readers = Vec::new();
    for _ in 0..16 {
        readers.push(presigned_head(9, addr, "GET", "legit/big", "").await);
    }
    // Meanwhile, the legitimate client.
    let mut under = timed_gets(&legit, "legit/obj", 60, &small).await;
    let (att_med, att_p90) = median_p90(&mut under);

    // Every hostile connection is closed by the server, the attacker still holding it.
    let limit = Duration::from_secs(GIVE_UP);
    for (what, s) in &mut held {
        let t = closed_within(s, limit).await;
        assert!(t.is_some(), "{what}: still open after {limit:?}");
    }
    let mut junk_codes = Vec::new();
    for s in &mut junk {
        let mut b = vec![0u8; 4096];
        let mut got = Vec::new();
        loop {
            match tokio::time::timeout(limit, s.read(&mut b)).await {
                Ok(Ok(0)) | Ok(Err(_)) => break,
                Ok(Ok(n)) => got.extend_from_slice(&b[..n]),
                Err(_) => panic!("unauthenticated 16 MiB frame: connection still open"),
            }
        }
        junk_codes.push(got.len());
    }
    assert!(
        junk_codes.iter().all(|&n| n > 0),
        "every junk connection got an error frame first"
    );
    let mut slow_max = Duration::ZERO;
    for j in slowloris {
        let (t, closed) = j.await.unwrap();
        assert!(closed, "slowloris head still open after {t:?}");
        slow_max = slow_max.max(t);
    }
    let mut drip_max = Duration::ZERO;
    for d in drips {
        let (status, head, t, answered, w) = d.await.unwrap();
        assert!(
            answered,
            "dripped PUT neither answered nor closed after {t:?}"
        );
        assert!(
            status == 400 && head.contains("RequestTimeout") || status == 0,
            "dripped PUT: {status} {head}"
        );
        drip_max = drip_max.max(t);
        drop(w.await);
    }
    for s in &mut readers {
        assert!(
            closed_within(s, Duration::from_secs(GIVE_UP))
                .await
                .is_some(),
            "slow reader still connected"
        );
    }
    let mut stored = 0;
    let mut slowed = 0;
    for f in flood {
        match f.await.unwrap() {
            200 => stored += 1,
            503 => slowed += 1,
            other => panic!("flooded PUT answered {other}"),
        }
    }
    let attack_s = t_attack.elapsed().as_secs_f64();
    let fds_after_attack = fds(pid);
    let (peak_rss, peak_fds) = sampler.stop();
    // Stored flood objects are whole.
    for i in 0..32 {
        if let Ok(h) = legit
            .head_object()
            .bucket(BUCKET)
            .key(format!("flood/{i}"))
            .send()
            .await
        {
            assert_eq!(h.content_length(), Some(32 << 20));
        }
    }
    let o = legit
        .get_object()
        .bucket(BUCKET)
        .key("flood/0")
        .send()
        .await;
    if let Ok(o) = o {
        assert!(o.body.collect().await.unwrap().into_bytes()[..] == flood_body[..]);
    }
    // Nothing of the cut PUTs is left behind.
    let partial: Vec<_> = tmp_files(dir.path()).into_iter().map(|(p, _)| p).collect();
    assert!(partial.is_empty(), "temporary files left: {partial:?}");

    let rss_limit = rss0 + (BUDGET >> 10) + (64 << 10);
    let fds_limit = fds0 + MAX_CONNS as u64 + 64;
    println!(
        "HOSTILE|attack|{attack_s:.1} s: 120 half-open prefaces, 40 unauthenticated frames announcing 16 MiB, 40 slowloris heads, 32 x 32 MiB PUTs, 16 dripped PUTs, 16 unread 32 MiB GETs|server RSS {} MiB baseline, {} MiB peak (limit {} MiB, budget {} MiB)|fds {fds0} baseline, {peak_fds} peak (limit {fds_limit}), {fds_after_attack} after|legit GET 4 MiB median {base_med:.1} ms -> {att_med:.1} ms ({:.2}x), p90 {base_p90:.1} -> {att_p90:.1} ms|slowloris heads closed within {:.1} s, dripped PUTs within {:.1} s|flood: {stored} stored whole, {slowed} SlowDown",
        rss0 >> 10,
        peak_rss >> 10,
        rss_limit >> 10,
        BUDGET >> 20,
        att_med / base_med,
        slow_max.as_secs_f64(),
        drip_max.as_secs_f64(),
    );
    assert!(
        peak_rss <= rss_limit,
        "server RSS peaked at {peak_rss} KiB, limit {rss_limit} KiB"
    );
    assert!(
        peak_fds <= fds_limit,
        "server descriptors peaked at {peak_fds}, limit {fds_limit}"
    );
    assert!(
        fds_after_attack <= fds0 + 8,
        "server holds {fds_after_attack} descriptors after the attack (baseline {fds0})"
    );
    assert!(
        att_med <= STARVED_MS,
        "legitimate GET median {att_med:.1} ms under attack ({base_med:.1} ms baseline): starved"
    );
    assert!(stored >= 1, "no flooded PUT was stored");

    // --- Connection caps. ----------------------------------------------------------------
    // A second server whose handshake deadline (60 s) cannot end a held connection during
    // these checks, so every connection closed within the window below was refused by a cap
    // (with the 2 s deadline, opening hundreds of connections on a loaded machine let the
    // deadline close early ones, freeing places and blurring the count).
    let caps_dir = tempfile::tempdir().unwrap();
    let (cp, caddr) = server_with(caps_dir.path(), 60, CAPS_PER_IP, CAPS_TOTAL);
    // One address past its cap: the extra connections are closed at once, before a byte.
    let mut conns = Vec::new();
    for _ in 0..CAPS_PER_IP + 20 {
        conns.push(connect_from(10, caddr).await);
    }
    let refused = refused_of(&mut conns).await;
    assert_eq!(
        refused,
        20,
        "{refused} of {} connections from one address refused",
        CAPS_PER_IP + 20
    );
    // Meanwhile another address is served.
    assert_eq!(http_get(caddr, "/_objectcache/health").await.0, 200);
    drop(conns);
    settle(caddr).await;
    // Overall: from many addresses, past max_connections.
    let mut conns = Vec::new();
    for i in 0..CAPS_TOTAL + 30 {
        conns.push(connect_from(20 + (i / CAPS_PER_IP) as u8, caddr).await);
    }
    let refused_total = refused_of(&mut conns).await;
    assert_eq!(
        refused_total,
        30,
        "{refused_total} of {} connections refused past max_connections {CAPS_TOTAL}",
        CAPS_TOTAL + 30
    );
    drop(conns);
    settle(caddr).await;
    assert_eq!(http_get(caddr, "/_objectcache/health").await.0, 200);
    drop(cp);
    println!(
        "HOSTILE|caps|per address {CAPS_PER_IP}: {refused} of {} refused at once, another address served; overall {CAPS_TOTAL}: {refused_total} of {} refused",
        CAPS_PER_IP + 20,
        CAPS_TOTAL + 30
    );
    // The server is still up and serves.
    assert_eq!(http_get(addr, "/_objectcache/health").await.0, 200);
    drop(p);
}

/// How many of `conns` the server closes within 6 s (it closes those past a cap at once; the
/// held ones stay open: the caps server's handshake deadline is 60 s).
async fn refused_of(conns: &mut [tokio::net::TcpStream]) -> usize {
    futures::future::join_all(
        conns
            .iter_mut()
            .map(|s| closed_within(s, Duration::from_secs(6))),
    )
    .await
    .iter()
    .filter(|t| t.is_some())
    .count()
}

/// Waits until the server's open connections are back to a handful (the ones just closed by
/// the test are gone from its count).
async fn settle(addr: SocketAddr) {
    let t0 = Instant::now();
    loop {
        let (_, m) = http_get(addr, "/_objectcache/metrics").await;
        let open = metric(&m, "objectcache_server_open_connections").unwrap_or(f64::MAX);
        if open <= 4.0 {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{open} connections still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
