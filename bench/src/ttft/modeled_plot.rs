//! Hand-written SVG plots of `ttft --mode modeled`: TTFT per method and context (one plot per
//! model, GPU and new-token count, log-scale TTFT), and a per-layer timeline of one point (KV
//! landing in host memory and compute per layer, per method).

use super::modeled_record::{Modeled, Record, METHODS};
use std::fmt::Write;

/// Data of the per-layer timeline plot.
pub struct TimelinePlot {
    /// Title line.
    pub title: String,
    /// Per-layer arrival at the link rate (the bound's transfer stage), seconds.
    pub bound_ready: Vec<f64>,
    /// (method, per-layer host landing times, modeled request).
    pub series: Vec<(String, Vec<f64>, Modeled)>,
}

const COLORS: &[&str] = &[
    "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
];

fn color(method: &str) -> &'static str {
    let i = METHODS
        .iter()
        .position(|m| *m == method)
        .unwrap_or(COLORS.len() - 1);
    COLORS[i % COLORS.len()]
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One grouped-bar SVG per (model, GPU, new tokens) of the single-request records, with the
/// pipeline bound as a tick per context. Returns (file name, SVG text).
pub fn ttft_plots(records: &[Record]) -> Vec<(String, String)> {
    let mut keys: Vec<(String, String, u64)> = Vec::new();
    for r in records.iter().filter(|r| r.concurrency == 1) {
        let k = (r.model.clone(), r.gpu.clone(), r.new_tokens);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.into_iter()
        .map(|(model, gpu, new)| {
            let rs: Vec<&Record> = records
                .iter()
                .filter(|r| {
                    r.concurrency == 1 && r.model == model && r.gpu == gpu && r.new_tokens == new
                })
                .collect();
            let name = format!("modeled-ttft-{model}-{gpu}-new{new}.svg");
            (
                name,
                bars(
                    &format!("{model}, {gpu}, {new} new tokens: modeled TTFT per method"),
                    &rs,
                ),
            )
        })
        .collect()
}

fn bars(title: &str, rs: &[&Record]) -> String {
    let mut ctxs: Vec<u64> = rs.iter().map(|r| r.context_tokens).collect();
    ctxs.sort_unstable();
    ctxs.dedup();
    let methods: Vec<&str> = METHODS
        .iter()
        .copied()
        .filter(|m| rs.iter().any(|r| r.method == *m))
        .collect();
    let (w, h, left, right, top, bottom) = (900.0, 460.0, 70.0, 180.0, 40.0, 50.0);
    let pw = w - left - right;
    let ph = h - top - bottom;
    let vals: Vec<f64> = rs.iter().map(|r| r.ttft_s).filter(|x| *x > 0.0).collect();
    let lo = vals.iter().copied().fold(f64::INFINITY, f64::min).max(1e-4);
    let hi = vals.iter().copied().fold(0.0, f64::max).max(lo * 10.0);
    let (l0, l1) = (lo.log10().floor(), hi.log10().ceil());
    let y = |v: f64| top + ph * (1.0 - (v.max(lo).log10() - l0) / (l1 - l0));
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="20" font-size="14">{}</text>"#,
        left,
        esc(title)
    );
    let mut e = l0 as i32;
    while e as f64 <= l1 {
        let v = 10f64.powi(e);
        let yy = y(v);
        let label = if v >= 1.0 {
            format!("{v:.0} s")
        } else {
            format!("{} ms", v * 1e3)
        };
        let _ = write!(
            s,
            r##"<line x1="{left}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{label}</text>"##,
            left + pw,
            left - 6.0,
            yy + 4.0
        );
        e += 1;
    }
    let gw = pw / ctxs.len().max(1) as f64;
    let bw = gw * 0.8 / methods.len().max(1) as f64;
    for (ci, c) in ctxs.iter().enumerate() {
        let gx = left + gw * ci as f64 + gw * 0.1;
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}K</text>"#,
            gx + gw * 0.4,
            top + ph + 18.0,
            c / 1024
        );
        for (mi, m) in methods.iter().enumerate() {
            if let Some(r) = rs.iter().find(|r| r.context_tokens == *c && r.method == *m) {
                let x = gx + bw * mi as f64;
                let yy = y(r.ttft_s);
                let _ = write!(
                    s,
                    r#"<rect x="{x:.1}" y="{yy:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{m}: {:.1} ms</title></rect>"#,
                    bw * 0.95,
                    (top + ph - yy).max(0.0),
                    color(m),
                    r.ttft_s * 1e3
                );
            }
        }
        if let Some(b) = rs
            .iter()
            .find(|r| r.context_tokens == *c)
            .and_then(|r| r.bound_ttft_s)
        {
            let yy = y(b);
            let _ = write!(
                s,
                r#"<line x1="{gx:.1}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="black" stroke-dasharray="4 2"/>"#,
                gx + gw * 0.8
            );
        }
    }
    let _ = write!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">cached prefix (tokens)</text>"#,
        left + pw / 2.0,
        h - 10.0
    );
    for (mi, m) in methods.iter().enumerate() {
        let yy = top + 18.0 * mi as f64;
        let _ = write!(
            s,
            r#"<rect x="{:.1}" y="{yy:.1}" width="12" height="12" fill="{}"/><text x="{:.1}" y="{:.1}">{m}</text>"#,
            left + pw + 15.0,
            color(m),
            left + pw + 32.0,
            yy + 10.0
        );
    }
    let yy = top + 18.0 * methods.len() as f64 + 6.0;
    let _ = write!(
        s,
        r#"<line x1="{:.1}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="black" stroke-dasharray="4 2"/><text x="{:.1}" y="{:.1}">pipeline bound</text></svg>"#,
        left + pw + 15.0,
        left + pw + 27.0,
        left + pw + 32.0,
        yy + 4.0
    );
    s
}

/// The per-layer timeline: for each method a row of compute bars per layer (one row per
/// method), and dots where each layer's KV landed in host memory; the bound's transfer stage
/// as a dashed staircase.
pub fn timeline_svg(t: &TimelinePlot) -> String {
    let layers = t.bound_ready.len().max(1);
    let tmax = t
        .series
        .iter()
        .flat_map(|(_, h, m)| h.iter().copied().chain(m.timeline.end.iter().copied()))
        .chain(t.bound_ready.iter().copied())
        .fold(0.0, f64::max)
        .max(1e-6);
    let (w, left, right, top, row) = (960.0, 60.0, 190.0, 40.0, 3.0);
    let band = layers as f64 * row + 20.0;
    let h = top + band * t.series.len() as f64 + 50.0;
    let pw = w - left - right;
    let x = |v: f64| left + pw * v / tmax;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h:.0}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{left}" y="20" font-size="14">{}</text>"#,
        esc(&t.title)
    );
    for (si, (name, host, md)) in t.series.iter().enumerate() {
        let y0 = top + band * si as f64;
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{:.1}">{name}</text><text x="{:.1}" y="{:.1}">TTFT {:.1} ms</text>"#,
            left + pw + 10.0,
            y0 + 12.0,
            left + pw + 10.0,
            y0 + 28.0,
            md.ttft_s * 1e3
        );
        for l in 0..md.timeline.start.len() {
            let yy = y0 + l as f64 * row;
            let (a, b) = (md.timeline.start[l], md.timeline.end[l]);
            let _ = write!(
                s,
                r#"<rect x="{:.2}" y="{yy:.1}" width="{:.2}" height="{:.1}" fill="{}"/>"#,
                x(a),
                (x(b) - x(a)).max(0.5),
                row * 0.8,
                color(name)
            );
            if let Some(hr) = host.get(l) {
                let _ = write!(
                    s,
                    r#"<circle cx="{:.2}" cy="{:.1}" r="1.2" fill="black"/>"#,
                    x(*hr),
                    yy + row * 0.4
                );
            }
        }
        let mut d = String::new();
        for (l, r) in t.bound_ready.iter().enumerate() {
            let yy = y0 + l as f64 * row + row * 0.4;
            let _ = write!(d, "{}{:.2},{yy:.1} ", if l == 0 { "M" } else { "L" }, x(*r));
        }
        let _ = write!(
            s,
            r##"<path d="{d}" fill="none" stroke="#999" stroke-dasharray="3 2"/>"##
        );
    }
    let yb = top + band * t.series.len() as f64;
    let _ = write!(
        s,
        r#"<line x1="{left}" x2="{:.1}" y1="{yb:.1}" y2="{yb:.1}" stroke="black"/><text x="{left}" y="{:.1}">0</text><text x="{:.1}" y="{:.1}" text-anchor="end">{:.1} ms</text><text x="{:.1}" y="{:.1}" text-anchor="middle">time since the request (bars: layer compute, top layer 0; dots: KV landed in host memory; dashed: link-rate arrival)</text></svg>"#,
        left + pw,
        yb + 16.0,
        left + pw,
        yb + 16.0,
        tmax * 1e3,
        left + pw / 2.0,
        yb + 36.0
    );
    s
}
