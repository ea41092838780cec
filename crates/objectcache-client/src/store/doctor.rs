//! A store self-check: does this store do what ObjectCache's correctness rests on?
//!
//! S3-compatible servers differ exactly where ObjectCache relies on them. [`check_store`]
//! asks the store, through the [`Store`] trait only (so the same checks run on `file://`,
//! our server and any S3 endpoint), under a reserved prefix (`_objectcache/doctor/`) whose
//! objects it removes afterwards:
//!
//! - `create_only`: a create-only PUT (`If-None-Match: *`) of a new key succeeds, a second
//!   one of the same key is refused, and the object keeps the first writer's bytes
//!   (first-writer-wins publication; cases C10 and C17);
//! - `create_race`: [`DoctorOptions::writers`] create-only PUTs of one new key at once, each
//!   with bytes of its own: at most one is told it won, and the object holds one writer's
//!   bytes, whole (a server that is not atomic here lets two writers of one chunk both
//!   publish);
//! - `ranged_get`: ranged GETs of an object of [`DoctorOptions::object_bytes`] return exactly
//!   the bytes written, through the path loads take ([`Store::get_range_body`] where the
//!   store offers it, else [`Store::get_opts`]) and through [`Store::get_opts`] (a server that
//!   compresses or encrypts objects can get ranges wrong);
//! - `idle_close` (plain-`http://` S3 endpoints, [`probe_idle_close`]): how long the server
//!   keeps an idle keep-alive connection open, up to [`DoctorOptions::idle_wait`].
//!
//! Checksum headers are not checked: ObjectCache sends none and validates none
//! (`WhenRequired` in the S3 client), and verifies every layer slice by its own CRC32C, so a
//! server that refuses them, or returns a whole object's checksum on a range, cannot hurt
//! it.
//!
//! The [`Mode`] follows from the checks: [`Mode::Safe`]; [`Mode::ShortIdle`], safe with
//! connections reused only for a shorter time (the store URL's `idle_timeout_s`); or
//! [`Mode::Refused`], naming the failed check, when first-writer-wins or ranged reads cannot
//! be trusted. A failed or corrupt ranged read would still be a miss, never KV bytes (every
//! slice is verified); the refusal is about saves, which could publish two writers' entries.
//!
//! `objectcache doctor STORE` prints the report; about ten requests and 1 MiB each way.

use super::{GetOptions, PutMode, PutOptions, Store, StoreError, StoreExt};
use bytes::Bytes;
use serde::Serialize;
use std::ops::Range;
use std::time::{Duration, Instant};

/// What [`check_store`] does.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// Concurrent create-only PUTs of one key in `create_race`. Default 8.
    pub writers: usize,
    /// Size of `create_race`'s bodies, bytes. Default 64 KiB.
    pub race_bytes: usize,
    /// Size of `ranged_get`'s object, bytes. Default 1 MiB + 13 (not a multiple of any
    /// block or part size).
    pub object_bytes: usize,
    /// How long `idle_close` waits for the server to close an idle connection. Default 1 s:
    /// the check then says only whether the server closes idle connections within a second
    /// (raise it, e.g. to 75 s, to find a longer limit).
    pub idle_wait: Duration,
}

impl Default for DoctorOptions {
    fn default() -> Self {
        DoctorOptions {
            writers: 8,
            race_bytes: 64 << 10,
            object_bytes: (1 << 20) + 13,
            idle_wait: Duration::from_secs(1),
        }
    }
}

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The store does what ObjectCache relies on.
    Pass,
    /// It does not (or the check could not finish: the detail says which).
    Fail,
    /// Measured, and handled by a mode rather than a refusal (`idle_close`).
    Adjust,
}

/// One check's result.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// `create_only`, `create_race`, `ranged_get` or `idle_close`.
    pub name: &'static str,
    /// Its outcome.
    pub outcome: Outcome,
    /// What was seen, in words.
    pub detail: String,
    /// How long the check took, seconds.
    pub seconds: f64,
    /// The check could not finish: a request failed before it could tell (the store could
    /// not be reached, refused the credentials, timed out); `outcome` is then `Fail`, but
    /// nothing wrong was seen.
    pub unfinished: bool,
}

/// How ObjectCache can use the store, from the checks.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Mode {
    /// Every check passed: use the store as it is.
    Safe,
    /// Safe with pooled connections kept idle for at most `idle_timeout_s` seconds (store
    /// URL parameter `idle_timeout_s`): the server closed an idle connection after
    /// `closed_after_s` seconds, sooner than the client's default of 60.
    ShortIdle {
        /// What to set, seconds: half the time the server waited.
        idle_timeout_s: f64,
        /// When the server closed the idle connection, seconds.
        closed_after_s: f64,
    },
    /// Not safe: `check` failed (its detail says how).
    Refused {
        /// The name of the first failed check.
        check: &'static str,
    },
}

/// Every check's result and the mode chosen.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The key prefix this run wrote under (`_objectcache/doctor/<pid>-<nanos>-<seq>/`).
    pub prefix: String,
    /// The checks, in the order they ran.
    pub checks: Vec<Check>,
    /// The mode that follows from them.
    pub mode: Mode,
    /// Objects under the reserved prefix that could not be removed (keys), normally none.
    pub left_behind: Vec<String>,
}

impl Report {
    /// The first failed check, if any.
    pub fn failed(&self) -> Option<&Check> {
        self.checks.iter().find(|c| c.outcome == Outcome::Fail)
    }

    /// The mode from `checks`: refused at the first failure, else short idle where
    /// `idle_close` measured a close, else safe.
    fn mode_of(checks: &[Check], idle_closed_after: Option<Duration>) -> Mode {
        if let Some(c) = checks.iter().find(|c| c.outcome == Outcome::Fail) {
            return Mode::Refused { check: c.name };
        }
        match idle_closed_after {
            Some(t) => Mode::ShortIdle {
                idle_timeout_s: (t.as_secs_f64() / 2.0).max(0.01),
                closed_after_s: t.as_secs_f64(),
            },
            None => Mode::Safe,
        }
    }
}

/// The reserved key prefix of one run: `_objectcache/doctor/<pid>-<nanos>-<seq>/`, unique
/// per process and run, so concurrent runs never share a key.
fn run_prefix() -> String {
    format!("_objectcache/doctor/{}/", super::probe_id())
}

/// `n` bytes of a fixed pseudo-random sequence from `seed` (xorshift64*): distinct for
/// distinct seeds, so a mixed or shifted body never matches by chance.
fn pattern(seed: u64, n: usize) -> Bytes {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes());
    }
    out.truncate(n);
    Bytes::from(out)
}

/// Where `got` first differs from `want`, in words, or `None` when they are equal.
fn difference(got: &[u8], want: &[u8]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!(
            "{} bytes where {} were expected",
            got.len(),
            want.len()
        ));
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b)?;
    Some(format!("bytes differ from offset {i} on"))
}

/// Whether `e` is the refusal of a create-only PUT of an existing key.
fn refused(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::AlreadyExists { .. } | StoreError::Precondition { .. }
    )
}

/// How a check failed: it saw the store misbehave, or a request failed before it could tell
/// (the store could not be reached, refused the credentials, timed out).
enum Failed {
    Saw(String),
    Unfinished(String),
}

impl From<String> for Failed {
    fn from(s: String) -> Self {
        Failed::Saw(s)
    }
}

impl From<&str> for Failed {
    fn from(s: &str) -> Self {
        Failed::Saw(s.to_string())
    }
}

/// A request of a check failed with `e`: the check could not tell, unless the store itself
/// found the endpoint misbehaving ([`StoreError::Incompatible`]: the S3 store's own
/// conditional-PUT check).
fn request_failed(s: String, e: &StoreError) -> Failed {
    match e {
        StoreError::Incompatible { .. } => Failed::Saw(s),
        _ => Failed::Unfinished(s),
    }
}

fn done(name: &'static str, t0: Instant, r: Result<String, Failed>) -> Check {
    let (outcome, detail, unfinished) = match r {
        Ok(d) => (Outcome::Pass, d, false),
        Err(Failed::Saw(d)) => (Outcome::Fail, d, false),
        Err(Failed::Unfinished(d)) => (Outcome::Fail, d, true),
    };
    Check {
        name,
        outcome,
        detail,
        seconds: t0.elapsed().as_secs_f64(),
        unfinished,
    }
}

async fn create_only(store: &dyn Store, key: &str) -> Result<String, Failed> {
    let create = PutOptions {
        mode: PutMode::Create,
    };
    let (first, second) = (pattern(1, 64), pattern(2, 64));
    match store.put_opts(key, first.clone(), create).await {
        Ok(_) => {}
        Err(e) if refused(&e) => {
            return Err(format!(
                "a create-only PUT of a new key was refused ({e}): create-only PUTs are broken"
            )
            .into())
        }
        Err(e) => {
            return Err(request_failed(
                format!("a create-only PUT of a new key failed: {e}"),
                &e,
            ))
        }
    }
    match store.put_opts(key, second, create).await {
        Ok(_) => {
            return Err(
                "a second create-only PUT of an existing key was accepted: the store ignores \
                 If-None-Match, so two writers of one chunk cannot be told apart"
                    .into(),
            )
        }
        Err(e) if refused(&e) => {}
        Err(e) => {
            return Err(request_failed(
                format!("a second create-only PUT failed otherwise: {e}"),
                &e,
            ))
        }
    }
    let got = store
        .get_bytes(key)
        .await
        .map_err(|e| request_failed(format!("reading the object back failed: {e}"), &e))?;
    if let Some(d) = difference(&got, &first) {
        return Err(format!(
            "the refused second PUT changed the object ({d}): the first writer's bytes are lost"
        )
        .into());
    }
    Ok("a new key is created once; a second create-only PUT is refused and changes nothing".into())
}

async fn create_race(store: &dyn Store, key: &str, o: &DoctorOptions) -> Result<String, Failed> {
    let bodies: Vec<Bytes> = (0..o.writers.max(2))
        .map(|w| pattern(100 + w as u64, o.race_bytes))
        .collect();
    let create = PutOptions {
        mode: PutMode::Create,
    };
    let results = futures::future::join_all(
        bodies
            .iter()
            .map(|b| store.put_opts(key, b.clone(), create)),
    )
    .await;
    let winners: Vec<usize> = (0..results.len()).filter(|&i| results[i].is_ok()).collect();
    let errors: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err())
        .filter(|e| !refused(e))
        .map(ToString::to_string)
        .collect();
    let got = store
        .get_bytes(key)
        .await
        .map_err(|e| request_failed(format!("reading the object back failed: {e}"), &e))?;
    let holder = bodies.iter().position(|b| got == *b);
    let n = bodies.len();
    if winners.len() > 1 {
        return Err(format!(
            "{} of {n} concurrent create-only PUTs of one key were told they won: create-only \
             PUTs are not atomic",
            winners.len()
        )
        .into());
    }
    let Some(h) = holder else {
        return Err(format!(
            "after {n} concurrent create-only PUTs the object holds no writer's bytes whole \
             ({} bytes): writes were mixed or torn",
            got.len()
        )
        .into());
    };
    if let Some(&w) = winners.first() {
        if w != h {
            return Err(format!(
                "writer {w} was told it won, but the object holds writer {h}'s bytes"
            )
            .into());
        }
    }
    // No winner: a retried PUT whose first try landed meets its own object and is refused;
    // the object is one writer's, whole, which is what matters.
    let others = if errors.is_empty() {
        String::new()
    } else {
        format!(" ({} failed otherwise, e.g. {})", errors.len(), errors[0])
    };
    Ok(format!(
        "{n} concurrent create-only PUTs: {} told it won, the object holds one writer's bytes whole{others}",
        winners.len()
    ))
}

/// Reads `range` of `key` as loads do: [`Store::get_range_body`] where offered, into a
/// buffer, else `None`.
async fn read_as_loads(
    store: &dyn Store,
    key: &str,
    range: Range<u64>,
) -> Result<Option<Vec<u8>>, StoreError> {
    let Some(mut body) = store.get_range_body(key, range.clone()).await? else {
        return Ok(None);
    };
    let mut buf = vec![0u8; (range.end - range.start) as usize];
    let mut at = 0;
    while at < buf.len() {
        let n = body.read(&mut buf[at..]).await?;
        if n == 0 {
            break;
        }
        at += n;
    }
    buf.truncate(at);
    Ok(Some(buf))
}

async fn ranged_get(store: &dyn Store, key: &str, o: &DoctorOptions) -> Result<String, Failed> {
    let len = o.object_bytes.max(4096) as u64;
    let data = pattern(7, len as usize);
    store
        .put(key, data.clone())
        .await
        .map_err(|e| request_failed(format!("writing the test object failed: {e}"), &e))?;
    let ranges = [
        0..1,
        4093..(4093 + 65536).min(len),
        len / 2..len,
        len - 7..len,
    ];
    let mut paths = 0;
    for r in ranges {
        let want = &data[r.start as usize..r.end as usize];
        let sdk = store
            .get_opts(
                key,
                GetOptions {
                    range: Some(r.clone()),
                },
            )
            .await
            .map_err(|e| request_failed(format!("ranged GET of bytes {r:?} failed: {e}"), &e))?
            .bytes()
            .await
            .map_err(|e| request_failed(format!("ranged GET of bytes {r:?} failed: {e}"), &e))?;
        if let Some(d) = difference(&sdk, want) {
            return Err(format!("a ranged GET of bytes {r:?} returned wrong bytes: {d}").into());
        }
        if let Some(got) = read_as_loads(store, key, r.clone()).await.map_err(|e| {
            request_failed(
                format!("ranged read of bytes {r:?} (as loads read) failed: {e}"),
                &e,
            )
        })? {
            paths = 2;
            if let Some(d) = difference(&got, want) {
                return Err(format!(
                    "a ranged read of bytes {r:?} as loads read returned wrong bytes: {d}"
                )
                .into());
            }
        }
    }
    let whole = store
        .get_bytes(key)
        .await
        .map_err(|e| request_failed(format!("reading the whole object failed: {e}"), &e))?;
    if let Some(d) = difference(&whole, &data) {
        return Err(format!("the whole object read back wrong: {d}").into());
    }
    Ok(format!(
        "4 ranges of a {len}-byte object and the whole of it read back exact{}",
        if paths == 2 {
            " (the direct read path loads take, and the S3 client's)"
        } else {
            ""
        }
    ))
}

/// How long the HTTP server at `endpoint` (`http://host:port`) keeps an idle keep-alive
/// connection open, up to `wait`: sends one `HEAD /_objectcache/health` (any answer will do:
/// the ObjectCache server answers it as its health check, an S3 server as a HEAD of an
/// object), then waits for the server to close the connection. `Ok(Some(t))`: closed after
/// `t`; `Ok(None)`: still open after `wait`.
///
/// # Errors
/// A message when the endpoint is not plain `http://`, cannot be reached, or does not keep
/// the connection alive after its answer.
pub async fn probe_idle_close(endpoint: &str, wait: Duration) -> Result<Option<Duration>, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let u = url::Url::parse(endpoint).map_err(|e| format!("endpoint {endpoint:?}: {e}"))?;
    if u.scheme() != "http" {
        return Err(format!(
            "not measured at {endpoint} (only plain http:// endpoints)"
        ));
    }
    let host = u.host_str().unwrap_or("localhost").to_string();
    let port = u.port_or_known_default().unwrap_or(80);
    let mut s = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    .map_err(|_| format!("connecting to {endpoint} timed out"))?
    .map_err(|e| format!("connecting to {endpoint}: {e}"))?;
    let req = format!(
        "HEAD /_objectcache/health HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: keep-alive\r\n\r\n");
    s.write_all(req.as_bytes())
        .await
        .map_err(|e| format!("sending to {endpoint}: {e}"))?;
    // The answer's head (a HEAD answer has no body).
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .map_err(|_| format!("{endpoint} did not answer a HEAD within 5 s"))?
            .map_err(|e| format!("reading from {endpoint}: {e}"))?;
        if n == 0 {
            return Err(format!(
                "{endpoint} closed the connection without an answer"
            ));
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head).to_ascii_lowercase();
    if text.contains("\r\nconnection: close") {
        return Err(format!(
            "{endpoint} closes every connection after one answer (no keep-alive)"
        ));
    }
    let t0 = Instant::now();
    // Some servers send a body even on a HEAD (Ceph RGW does): what follows within 100 ms
    // is still the answer, not traffic on an idle connection.
    loop {
        match tokio::time::timeout(Duration::from_millis(100), s.read(&mut buf)).await {
            Err(_) => break,
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(Some(t0.elapsed())),
            Ok(Ok(_)) => {}
        }
    }
    match tokio::time::timeout(wait.saturating_sub(t0.elapsed()), s.read(&mut buf)).await {
        Err(_) => Ok(None),
        Ok(Ok(0)) | Ok(Err(_)) => Ok(Some(t0.elapsed())),
        Ok(Ok(_)) => Err(format!("{endpoint} sent bytes on an idle connection")),
    }
}

/// The endpoint an `s3://` store URL names (its first, where it names several), for
/// [`probe_idle_close`]; `None` for other URLs and for AWS S3 (no `endpoint`).
pub fn store_endpoint(store_url: &str) -> Option<String> {
    let u = url::Url::parse(store_url).ok()?;
    if u.scheme() != "s3" {
        return None;
    }
    let (_, v) = u.query_pairs().find(|(k, _)| k == "endpoint")?;
    v.split(',').next().map(|e| e.trim().to_string())
}

/// Runs the checks on `store` (and `idle_close` on `endpoint`, the S3 endpoint URL where
/// there is one) and chooses the mode. Never fails: a check that cannot finish fails, with
/// the error in its detail. Removes what it wrote (best effort: keys it could not remove are
/// in [`Report::left_behind`]).
pub async fn check_store(store: &dyn Store, endpoint: Option<&str>, o: &DoctorOptions) -> Report {
    let prefix = run_prefix();
    let mut checks = Vec::new();
    let keys = [
        format!("{prefix}create-only"),
        format!("{prefix}create-race"),
        format!("{prefix}ranged-get"),
    ];
    let t = Instant::now();
    checks.push(done("create_only", t, create_only(store, &keys[0]).await));
    let t = Instant::now();
    checks.push(done(
        "create_race",
        t,
        create_race(store, &keys[1], o).await,
    ));
    let t = Instant::now();
    checks.push(done("ranged_get", t, ranged_get(store, &keys[2], o).await));
    let mut closed_after = None;
    if let Some(ep) = endpoint {
        let t = Instant::now();
        let (outcome, detail) = match probe_idle_close(ep, o.idle_wait).await {
            Ok(None) => (
                Outcome::Pass,
                format!(
                    "an idle connection stayed open for {:.1} s (the check's wait)",
                    o.idle_wait.as_secs_f64()
                ),
            ),
            Ok(Some(after)) => {
                closed_after = Some(after);
                (
                    Outcome::Adjust,
                    format!(
                        "the server closed an idle connection after {:.2} s: pooled \
                         connections must idle less (idle_timeout_s={:.2})",
                        after.as_secs_f64(),
                        (after.as_secs_f64() / 2.0).max(0.01)
                    ),
                )
            }
            Err(e) => (Outcome::Pass, format!("not measured: {e}")),
        };
        checks.push(Check {
            name: "idle_close",
            outcome,
            detail,
            seconds: t.elapsed().as_secs_f64(),
            unfinished: false,
        });
    }
    let mut left_behind = Vec::new();
    for k in keys {
        match store.delete(&k).await {
            Ok(()) | Err(StoreError::NotFound { .. }) => {}
            Err(_) => left_behind.push(k),
        }
    }
    let mode = Report::mode_of(&checks, closed_after);
    Report {
        prefix,
        checks,
        mode,
        left_behind,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn patterns_differ_by_seed_and_differences_are_located() {
        let (a, b) = (pattern(1, 1000), pattern(2, 1000));
        assert_eq!(a.len(), 1000);
        assert_ne!(a, b);
        assert_eq!(pattern(1, 1000), a, "deterministic");
        assert_eq!(difference(&a, &a), None);
        let mut c = a.to_vec();
        c[600] ^= 1;
        assert_eq!(
            difference(&c, &a).unwrap(),
            "bytes differ from offset 600 on"
        );
        assert!(difference(&a[..10], &a)
            .unwrap()
            .contains("10 bytes where 1000"));
    }

    #[test]
    fn the_mode_is_refused_at_the_first_failure_else_short_idle_else_safe() {
        let c = |name, outcome| Check {
            name,
            outcome,
            detail: String::new(),
            seconds: 0.0,
            unfinished: false,
        };
        let pass = [
            c("create_only", Outcome::Pass),
            c("ranged_get", Outcome::Pass),
        ];
        assert_eq!(Report::mode_of(&pass, None), Mode::Safe);
        assert_eq!(
            Report::mode_of(&pass, Some(Duration::from_millis(500))),
            Mode::ShortIdle {
                idle_timeout_s: 0.25,
                closed_after_s: 0.5
            }
        );
        let fail = [
            c("create_only", Outcome::Pass),
            c("create_race", Outcome::Fail),
        ];
        assert_eq!(
            Report::mode_of(&fail, Some(Duration::from_millis(500))),
            Mode::Refused {
                check: "create_race"
            }
        );
    }

    #[tokio::test]
    async fn the_memory_store_passes_and_nothing_is_left_behind() {
        let s = MemoryStore::new();
        let r = check_store(&s, None, &DoctorOptions::default()).await;
        assert_eq!(r.mode, Mode::Safe, "{r:?}");
        assert_eq!(r.checks.len(), 3);
        assert!(r.left_behind.is_empty());
        assert!(s.list("_objectcache/", 100).await.unwrap().is_empty());
    }
}
