//! The SVG plot of `objectcache-bench vllm`: TTFT against the shared prefix length, one line
//! per method (log-scale TTFT), drawn with plotters.

use super::{Record, METHODS};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

pub(crate) const COLORS: &[RGBColor] = &[
    RGBColor(0x4c, 0x72, 0xb0),
    RGBColor(0x8c, 0x8c, 0x8c),
    RGBColor(0x55, 0xa8, 0x68),
    RGBColor(0xdd, 0x84, 0x52),
    RGBColor(0xc4, 0x4e, 0x52),
    RGBColor(0x81, 0x72, 0xb3),
    RGBColor(0x93, 0x78, 0x60),
];

/// Writes the plot of the records that ran to `path`.
///
/// # Errors
/// The file cannot be written, or no record has a TTFT.
pub fn ttft(path: &Path, records: &[Record]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let ran: Vec<&Record> = records.iter().filter(|r| r.ttft_s.is_some()).collect();
    if ran.is_empty() {
        return Err(anyhow!("plot: no method ran"));
    }
    let ts: Vec<f64> = ran.iter().filter_map(|r| r.ttft_s).collect();
    let lo = ts.iter().copied().fold(f64::INFINITY, f64::min) * 0.7;
    let hi = ts.iter().copied().fold(0.0, f64::max) * 1.4;
    let xmax = ran.iter().map(|r| r.prefix_tokens).max().unwrap_or(1) as f64 * 1.08;
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "TTFT in vLLM (SmolLM2-135M, CPU), cross-replica; median per point",
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..xmax, (lo..hi).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("shared prefix (tokens)")
        .y_desc("TTFT at the client (s)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, m) in METHODS.iter().enumerate() {
        let pts: Vec<(f64, f64)> = ran
            .iter()
            .filter(|r| r.method == *m)
            .filter_map(|r| Some((r.prefix_tokens as f64, r.ttft_s?)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(*m)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 4, c.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
