//! `objectcache doctor STORE`: checks that a store does what ObjectCache's correctness rests
//! on (create-only PUTs honoured and atomic, ranged GETs exact, how long idle connections
//! live), prints one line per check and the mode chosen, and exits non-zero when the store
//! is refused. The checks are `objectcache_client::store::doctor`'s.

use objectcache_client::store::doctor::{
    check_store, store_endpoint, DoctorOptions, Mode, Outcome,
};
use std::time::Duration;

/// Arguments of `objectcache doctor`.
#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Store URL (`file:///path`, a path, `s3://bucket/prefix?endpoint=...`).
    #[arg(env = "OBJECTCACHE_STORE")]
    pub store: String,
    /// Also write the report as JSON to this file.
    #[arg(long, value_name = "PATH")]
    pub json: Option<std::path::PathBuf>,
    /// How long to wait for the server to close an idle connection, seconds (plain-http S3
    /// endpoints). The check sees only limits shorter than this; 75 covers common servers.
    #[arg(long, default_value_t = 1.0)]
    pub idle_wait: f64,
    /// Concurrent create-only PUTs of one key in the race check.
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
}

/// Runs `objectcache doctor`.
///
/// # Errors
/// A bad store URL or `--idle-wait`, the JSON file that cannot be written, or
/// [`objectcache_core::Error::Unsupported`] naming the failed check when the store is refused.
pub fn run(args: DoctorArgs) -> objectcache_core::Result<()> {
    if !(args.idle_wait.is_finite() && args.idle_wait >= 0.0) {
        return Err(objectcache_core::Error::InvalidArgument(format!(
            "--idle-wait must be a number of seconds, not {}",
            args.idle_wait
        )));
    }
    let opts = DoctorOptions {
        writers: args.writers.max(2),
        idle_wait: Duration::from_secs_f64(args.idle_wait),
        ..DoctorOptions::default()
    };
    let endpoint = store_endpoint(&args.store);
    let url = args.store.clone();
    super::on_store(&url, |store| async move {
        let report = check_store(store.as_ref(), endpoint.as_deref(), &opts).await;
        println!("store: {}", args.store);
        for c in &report.checks {
            let word = match c.outcome {
                Outcome::Pass => "ok",
                Outcome::Fail => "FAIL",
                Outcome::Adjust => "adjust",
            };
            println!(
                "{:<12} {:<6} {} ({:.2} s)",
                c.name, word, c.detail, c.seconds
            );
        }
        for k in &report.left_behind {
            println!("left behind: {k} (delete it by hand)");
        }
        let mode = match &report.mode {
            Mode::Safe => "safe: use the store as it is".to_string(),
            Mode::ShortIdle { idle_timeout_s, .. } => {
                format!("short-idle: safe with idle_timeout_s={idle_timeout_s:.2} in the store URL")
            }
            Mode::Refused { check } => format!("refused: {check} failed"),
        };
        println!("mode: {mode}");
        if let Some(p) = &args.json {
            let v = serde_json::json!({ "store": args.store, "prefix": report.prefix,
                                        "checks": report.checks,
                                        "mode": report.mode, "left_behind": report.left_behind });
            std::fs::write(p, serde_json::to_vec_pretty(&v).expect("json"))?;
        }
        match report.failed() {
            Some(c) => Err(objectcache_core::Error::Unsupported(format!(
                "the store fails the {} check: {}",
                c.name, c.detail
            ))),
            None => Ok(()),
        }
    })
}
