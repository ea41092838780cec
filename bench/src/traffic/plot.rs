//! The SVG of a workload: measured mean TTLL and the simulator's, per policy, with p99 ticks.

use super::Record;

/// Grouped bars: measured mean TTLL and the simulator's, per policy, with p99 ticks.
pub(super) fn svg(name: &str, rs: &[&Record]) -> String {
    use std::fmt::Write;
    let (w, h, left, top, bottom) = (760.0, 380.0, 70.0, 40.0, 60.0);
    let ph = h - top - bottom;
    let hi = rs
        .iter()
        .flat_map(|r| [r.ttll_s.p99, r.predicted_ttll_s.p99])
        .fold(1e-3, f64::max)
        * 1.1;
    let y = |v: f64| top + ph * (1.0 - v / hi);
    let group = (w - left - 20.0) / rs.len().max(1) as f64;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
    );
    let _ = write!(
        s,
        r#"<text x="{left}" y="20" font-size="14">traffic, {name}: mean TTLL measured (blue) and simulated (orange), p99 ticks</text>"#
    );
    let _ = write!(
        s,
        r##"<line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#000"/>"##,
        top + ph,
        w - 20.0,
        top + ph
    );
    for k in 0..=4 {
        let v = hi * k as f64 / 4.0;
        let _ = write!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">{v:.2} s</text><line x1="{left}" y1="{}" x2="{}" y2="{}" stroke="#ddd"/>"##,
            left - 6.0,
            y(v) + 4.0,
            y(v),
            w - 20.0,
            y(v)
        );
    }
    for (i, r) in rs.iter().enumerate() {
        let x0 = left + group * i as f64 + group * 0.15;
        let bw = group * 0.35;
        for (j, (st, c)) in [(r.ttll_s, "#4c72b0"), (r.predicted_ttll_s, "#dd8452")]
            .iter()
            .enumerate()
        {
            let x = x0 + bw * j as f64;
            let _ = write!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bw:.1}" height="{:.1}" fill="{c}"/>"#,
                y(st.mean),
                top + ph - y(st.mean)
            );
            let _ = write!(
                s,
                r##"<line x1="{x:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="#000" stroke-width="2"/>"##,
                y(st.p99),
                x + bw,
                y(st.p99)
            );
        }
        let _ = write!(
            s,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
            x0 + bw,
            top + ph + 18.0,
            r.policy
        );
    }
    s.push_str("</svg>");
    s
}
