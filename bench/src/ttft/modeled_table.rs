//! `ttft --mode modeled`, the printed results: the table of every record and the goals
//! (TTFT over the bound, against local and recompute) checked at the end.

use super::modeled_record::Record;

fn ms(x: f64) -> String {
    if x.is_finite() {
        format!("{:.1}", x * 1e3)
    } else {
        "-".into()
    }
}

pub(super) fn print_table(records: &[Record]) {
    println!(
        "{:<18} {:<20} {:>5} {:>7} {:>6} {:>4} {:<20} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}",
        "method",
        "model",
        "gpu",
        "context",
        "new",
        "conc",
        "policy",
        "TTFT ms",
        "added ms",
        "added %",
        "xfer ms",
        "bound ms",
        "/bound"
    );
    for r in records {
        println!(
            "{:<18} {:<20} {:>5} {:>7} {:>6} {:>4} {:<20} {:>10} {:>10} {:>8.1} {:>10} {:>10} {:>8}",
            r.method,
            r.model,
            r.gpu,
            r.context_tokens,
            r.new_tokens,
            r.concurrency,
            r.policy,
            ms(r.ttft_s),
            ms(r.added_ttft_s),
            r.added_ttft_pct,
            ms(r.transfer_time_s),
            r.bound_ttft_s.map(ms).unwrap_or_else(|| "-".into()),
            r.ttft_over_bound.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into()),
        );
    }
}

pub(super) fn print_goals(records: &[Record]) {
    let single = |m: &'static str| {
        records
            .iter()
            .filter(move |r| r.method == m && r.concurrency == 1)
    };
    if let Some(w) = single("gather-tcp").max_by(|a, b| {
        a.ttft_over_bound
            .unwrap_or(0.0)
            .total_cmp(&b.ttft_over_bound.unwrap_or(0.0))
    }) {
        println!(
            "goal gather-tcp within 5% of the pipeline bound: worst {:.3}x ({} {} ctx {} new {}) -> {}",
            w.ttft_over_bound.unwrap_or(f64::NAN),
            w.model,
            w.gpu,
            w.context_tokens,
            w.new_tokens,
            if w.ttft_over_bound.unwrap_or(f64::INFINITY) <= 1.05 { "met" } else { "not met" }
        );
    }
    for r in single("gather-tcp").filter(|r| r.context_tokens == 65536 && r.model.contains("8b")) {
        let ideal = r
            .bound_h2d_ttft_s
            .map_or(f64::NAN, |b| (b - r.local_ttft_s) / r.local_ttft_s * 100.0);
        println!(
            "goal 64K added TTFT <= 3% over local layerwise: {} {} new {}: {:.1}% ({:.1} ms; the link+h2d pipeline bound itself: {ideal:.1}%) -> {}",
            r.model,
            r.gpu,
            r.new_tokens,
            r.added_ttft_pct,
            r.added_ttft_s * 1e3,
            if r.added_ttft_pct <= 3.0 { "met" } else { "not met" }
        );
    }
    for r in single("gather-tcp+planner").filter(|r| r.context_tokens == 4096) {
        println!(
            "goal 4K added TTFT <= 0.8x pure transfer ({:.1} ms) through the planner: {} {} new {}: {:.1} ms = {:.2}x (loads {} tokens) -> {}",
            r.pure_transfer_s * 1e3,
            r.model,
            r.gpu,
            r.new_tokens,
            r.added_ttft_s * 1e3,
            r.added_over_pure_transfer,
            r.loaded_tokens,
            if r.added_over_pure_transfer <= 0.8 { "met" } else { "not met" }
        );
    }
}
