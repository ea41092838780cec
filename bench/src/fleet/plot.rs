//! The fleet benchmark's plot: TTFT of every request over the time it was sent, one series
//! per method and routing (log-scale TTFT), drawn with plotters.

use super::Record;
use crate::vllm::plot::COLORS;
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

/// Writes the plot of trace `trace`'s records that ran to `path`.
///
/// # Errors
/// The file cannot be written, or no record of the trace ran.
pub fn ttft_over_time(path: &Path, trace: &str, records: &[Record]) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("plot {}: {e}", path.display());
    let ran: Vec<&Record> = records
        .iter()
        .filter(|r| r.trace == trace && !r.outcomes.is_empty())
        .collect();
    if ran.is_empty() {
        return Err(anyhow!("plot: no method ran on trace {trace}"));
    }
    let all = || ran.iter().flat_map(|r| r.outcomes.iter());
    let lo = all().map(|o| o.ttft_s).fold(f64::INFINITY, f64::min) * 0.7;
    let hi = all().map(|o| o.ttft_s).fold(0.0, f64::max) * 1.4;
    let xmax = all().map(|o| o.sent_s).fold(0.0, f64::max) * 1.05 + 1.0;
    let root = SVGBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "TTFT over the `{trace}` trace, {} vLLM replicas (CPU)",
                ran[0].replicas
            ),
            ("sans-serif", 18),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0f64..xmax, (lo..hi).log_scale())
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("request sent (s from the trace's start)")
        .y_desc("TTFT at the client (s)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in ran.iter().enumerate() {
        let mut pts: Vec<(f64, f64)> = r.outcomes.iter().map(|o| (o.sent_s, o.ttft_s)).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let c = COLORS[i % COLORS.len()];
        let style = if r.routing == "prefix" {
            c.stroke_width(1)
        } else {
            c.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(pts.clone(), style))
            .map_err(|e| err(&e))?
            .label(format!("{} / {}", r.method, r.routing))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, c.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
