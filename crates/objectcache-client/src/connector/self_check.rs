//! The engine's store self-check (`self_check`, on by default; the checks of
//! [`crate::store::doctor`], which `objectcache doctor STORE` prints): an engine opened on a
//! remote store (an S3 or gateway store URL, [`Engine::new`](super::Engine::new)) checks it
//! once per store URL and process, in the background from its start (about ten requests and
//! a second), under the reserved prefix `_objectcache/doctor/` whose objects it removes.
//!
//! What follows from the report ([`crate::store::doctor::Mode`]):
//! - `safe`: nothing changes;
//! - `short_idle`: the server closes idle connections sooner than the client keeps them; the
//!   engine logs a warning naming the store URL setting (`idle_timeout_s`) that fits;
//! - `refused`: first-writer-wins publication or ranged reads cannot be trusted: every save
//!   fails with [`Error::Unsupported`] naming the failed check and what it saw. Loads go on:
//!   each layer slice is verified by its CRC32C, so a store that reads wrong bytes gives
//!   misses, never KV bytes.
//!
//! A save waits for the verdict while the check runs (the first save of a process, at most
//! about a second). The mode is in [`EngineMetrics::store_mode`](super::EngineMetrics).

use crate::error::Error;
use crate::store::doctor::{self, DoctorOptions, Mode, Outcome, Report};
use crate::store::Store;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::watch;

/// Where the check of one store stands: `None` while it runs.
pub(crate) type Verdict = watch::Receiver<Option<Arc<Report>>>;

/// The checks of this process, by store URL.
fn checks() -> &'static Mutex<HashMap<String, Verdict>> {
    static CHECKS: OnceLock<Mutex<HashMap<String, Verdict>>> = OnceLock::new();
    CHECKS.get_or_init(Default::default)
}

/// Whether an engine over `store` checks it: remote stores only (S3, gateways); a local
/// store is this process's own files or memory.
pub(crate) fn wanted(store: &dyn Store) -> bool {
    matches!(store.name(), "s3" | "gateways")
}

/// The check of the store at `url`: the one this process already has (running or done), or
/// one started now on `handle`. A check whose engine's runtime stopped before it ended is
/// started again by the next engine.
pub(crate) fn start(url: &str, store: Arc<dyn Store>, handle: &tokio::runtime::Handle) -> Verdict {
    let mut all = checks().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = all.get(url) {
        let done = v
            .borrow()
            .as_ref()
            .map(|r| r.failed().is_none_or(|c| !c.unfinished));
        // Running (its sender lives), or done with a verdict: shared. An unfinished check
        // (the store unreachable) or one stopped with its engine's runtime: checked again.
        if done == Some(true) || (done.is_none() && v.has_changed().is_ok()) {
            return v.clone();
        }
    }
    let (tx, rx) = watch::channel(None);
    all.insert(url.to_string(), rx.clone());
    let url = url.to_string();
    handle.spawn(async move {
        let endpoint = doctor::store_endpoint(&url);
        let r = doctor::check_store(&*store, endpoint.as_deref(), &DoctorOptions::default()).await;
        log(&url, &r);
        let _ = tx.send(Some(Arc::new(r)));
    });
    rx
}

/// Logs what the check found and what the engine does about it.
fn log(url: &str, r: &Report) {
    let seen: Vec<String> = r
        .checks
        .iter()
        .map(|c| {
            let o = match c.outcome {
                Outcome::Pass => "ok",
                Outcome::Fail => "FAIL",
                Outcome::Adjust => "adjust",
            };
            format!("{} {o}", c.name)
        })
        .collect();
    match &r.mode {
        Mode::Safe => {
            tracing::info!(store = url, checks = %seen.join(", "), "store self-check: safe")
        }
        Mode::ShortIdle {
            idle_timeout_s,
            closed_after_s,
        } => tracing::warn!(
            store = url,
            checks = %seen.join(", "),
            "store self-check: the server closed an idle connection after {closed_after_s:.1} s; \
             add idle_timeout_s={idle_timeout_s:.1} to the store URL so that no request goes out on a connection it is closing"
        ),
        Mode::Refused { .. } if !misbehaved(r) => tracing::warn!(
            store = url,
            checks = %seen.join(", "),
            "store self-check could not finish ({}); saves go on, and the next engine checks again",
            r.failed().map_or("", |c| c.detail.as_str())
        ),
        Mode::Refused { check } => tracing::error!(
            store = url,
            checks = %seen.join(", "),
            "store self-check: {check} failed ({}); saves to this store are refused (objectcache doctor STORE shows every check)",
            r.failed().map_or("", |c| c.detail.as_str())
        ),
    }
    if !r.left_behind.is_empty() {
        tracing::warn!(store = url, keys = ?r.left_behind, "store self-check: objects left behind");
    }
}

/// Waits for the check's report (`None` if the check was stopped before it ended: its
/// engine's runtime went away) and refuses a save on a refused store.
///
/// # Errors
/// [`Error::Unsupported`] naming the check that failed and what it saw.
pub(crate) async fn allow_save(v: &Verdict, url: &str) -> Result<(), Error> {
    let mut v = v.clone();
    let r = match v.wait_for(|r| r.is_some()).await {
        Ok(r) => r.clone(),
        Err(_) => None,
    };
    let Some(r) = r else { return Ok(()) };
    match &r.mode {
        Mode::Refused { .. } if !misbehaved(&r) => Ok(()),
        Mode::Refused { check } => Err(Error::Unsupported(format!(
            "store {url} failed its self-check ({check}: {}), so saves to it are refused: run objectcache doctor on it",
            r.failed().map_or("", |c| c.detail.as_str())
        ))),
        _ => Ok(()),
    }
}

/// Whether the check saw the store misbehave (a failed check that finished), rather than
/// not finishing: a store that could not be reached at the engine's start is not refused
/// for the process's life (its saves fail, or succeed, on their own), and the next engine
/// checks it again.
fn misbehaved(r: &Report) -> bool {
    r.failed().is_some_and(|c| !c.unfinished)
}

/// The mode as a number for metrics: 0 not checked (a local store, `self_check` off, or
/// the check still running), 1 safe, 2 short idle, 3 refused.
pub(crate) fn mode_code(v: Option<&Verdict>) -> u64 {
    let Some(v) = v else { return 0 };
    let r = v.borrow();
    match r.as_deref() {
        None => 0,
        Some(r) => match &r.mode {
            Mode::Safe => 1,
            Mode::ShortIdle { .. } => 2,
            Mode::Refused { .. } if misbehaved(r) => 3,
            Mode::Refused { .. } => 0,
        },
    }
}
