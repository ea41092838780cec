//! The records once every method ran: ratios filled in and ordered by method, then prefix
//! ([`finish`]), and the table printed at the end ([`print_table`]).

use super::{Record, METHODS};

/// Fills the ratios and orders the records by method, then prefix.
pub(super) fn finish(records: &mut [Record]) {
    let find = |m: &str, p: u32, rs: &[Record]| {
        rs.iter()
            .find(|r| r.method == m && r.prefix_tokens == p)
            .cloned()
    };
    // `recompute` and `apc` have no hybrid manager setting; a connector's records of both
    // settings are each compared with them.
    let copy = records.to_vec();
    for r in records.iter_mut() {
        let Some(t) = r.ttft_s else { continue };
        let rec = find("recompute", r.prefix_tokens, &copy).and_then(|x| x.ttft_s);
        r.vs_recompute_process = rec.map(|x| t / x);
        r.vs_recompute = if r.method == "recompute" {
            Some(1.0)
        } else {
            r.paired_ratio.or(r.vs_recompute_process)
        };
        r.vs_apc = match (
            r.vs_recompute,
            find("apc", r.prefix_tokens, &copy).and_then(|x| x.paired_ratio),
        ) {
            (Some(a), Some(b)) => Some(a / b),
            _ => None,
        };
    }
    records.sort_by_key(|r| {
        (
            METHODS
                .iter()
                .position(|m| *m == r.method)
                .unwrap_or(usize::MAX),
            r.hma.clone(),
            r.prefix_tokens,
        )
    });
}

pub(super) fn print_table(records: &[Record], runs: usize, dtype: &str) {
    println!();
    println!(
        "TTFT in vLLM at the client ({dtype}), median of {runs} (cross-replica for connectors);"
    );
    println!("x recomp: over the paired full computation in the same process (recompute: 1)");
    println!("identical: greedy output equals recompute's; =apc: equals apc's (same request)");
    println!(
        "reqs: store requests of one load; $/1k: 1,000 loads at {}",
        crate::cost::S3_STANDARD.name
    );
    if let Some(r) = records.first() {
        println!("model {} ({}), TP {}", r.model, r.family, r.tp);
    }
    println!(
        "{:<30} {:>6} {:>9} {:>9} {:>8} {:>6} {:>8} {:>11} {:>11} {:>5} {:>8} {:>9} {:>5}",
        "method",
        "prefix",
        "TTFT ms",
        "miss ms",
        "x recomp",
        "x apc",
        "ext hits",
        "bytes",
        "stored",
        "reqs",
        "$/1k",
        "identical",
        "=apc"
    );
    for r in records {
        let f = |x: Option<f64>, d: usize| x.map_or("-".to_string(), |v| format!("{v:.d$}"));
        let yes_no = |v: Option<bool>| v.map_or("-", |v| if v { "yes" } else { "NO" });
        let label = match r.hma.as_deref() {
            Some("off") => format!("{} (hma off)", r.method),
            _ => r.method.clone(),
        };
        println!(
            "{:<30} {:>6} {:>9} {:>9} {:>8} {:>6} {:>8} {:>11} {:>11} {:>5} {:>8} {:>9} {:>5}",
            label,
            r.prefix_tokens,
            f(r.ttft_s.map(|t| t * 1000.0), 1),
            f(r.ttft_miss_s.map(|t| t * 1000.0), 1),
            f(r.vs_recompute, 2),
            f(r.vs_apc, 2),
            r.external_hit_tokens.map_or("-".into(), |v| v.to_string()),
            r.bytes_loaded.map_or("-".into(), |v| v.to_string()),
            r.bytes_stored.map_or("-".into(), |v| v.to_string()),
            r.store_requests.map_or("-".into(), |v| v.to_string()),
            f(r.cost.map(|c| c.cost_usd_per_1k_loads), 5),
            yes_no(r.output_identical),
            yes_no(r.output_matches_apc),
        );
    }
    let mut notes: Vec<(&str, &str)> = Vec::new();
    for r in records {
        if let Some(n) = &r.note {
            if !notes.iter().any(|(m, _)| *m == r.method) {
                notes.push((&r.method, n));
            }
        }
    }
    for (m, n) in notes {
        println!("  {m}: {n}");
    }
}
