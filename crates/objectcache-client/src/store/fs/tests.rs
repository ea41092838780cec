use super::read_pool::{POOLED_READS_KEPT, READ_POOL};
use super::*;
use crate::store::PutMode;
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

/// A writer killed a moment ago stays in `/proc` as a zombie until its parent reaps it: its
/// temporary file is orphaned at once all the same (it can write nothing more).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_killed_writer_not_yet_reaped_is_gone() {
    let (d, s) = store();
    s.put("b/kv/0a", Bytes::from_static(b"v")).await.unwrap();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let name = format!(".tmp-{}-{pid}-1", writer_token());
    std::fs::write(d.path().join("b/kv").join(&name), b"partial").unwrap();
    let orphaned = || async { s.list_partial("b/").await.unwrap()[0].orphaned };
    assert!(!orphaned().await, "a running writer's file is not orphaned");
    child.kill().unwrap();
    // Not reaped: wait until the kernel shows the zombie, without waiting on the child.
    let stat = format!("/proc/{pid}/stat");
    let zombie = || {
        std::fs::read_to_string(&stat)
            .map(|t| t.rsplit(')').next().unwrap().trim_start().starts_with('Z'))
            .unwrap_or(false)
    };
    let t0 = std::time::Instant::now();
    while !zombie() {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "no zombie"
        );
        std::thread::yield_now();
    }
    assert!(
        std::path::Path::new(&stat).exists(),
        "the zombie is still in /proc"
    );
    assert!(
        orphaned().await,
        "a zombie writer's file is orphaned at once"
    );
    child.wait().unwrap();
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
        let pieces: Vec<StoreResult<Bytes>> = sizes
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
    let (tx, rx) = futures::channel::mpsc::unbounded::<StoreResult<Bytes>>();
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
    let (tx, rx) = futures::channel::mpsc::unbounded::<StoreResult<Bytes>>();
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
