//! SVG plots of the `objectcache sim` records (plotters).

use objectcache_core::Error;

/// An SVG of side-by-side panels ([`Panels::draw`]).
pub(super) struct Panels<'a> {
    /// Pixels of one panel (width, height).
    pub(super) size: (u32, u32),
    /// One title per panel.
    pub(super) titles: &'a [String],
    /// The x axis's categories, evenly spaced and labelled by value.
    pub(super) xs: &'a [usize],
    /// The x axis's title.
    pub(super) x_desc: &'a str,
    /// The y axis's title.
    pub(super) y_desc: &'a str,
    /// Every y value of the plot, seconds: the y axis ends at twice the largest.
    pub(super) ys: &'a [f64],
}

impl Panels<'_> {
    /// Draws the panels to `path`, panel `p` holding the lines `lines(p)` (a legend label
    /// and points: index into `xs`, y in seconds), on a log y axis from 0.1 ms.
    pub(super) fn draw(
        &self,
        path: &std::path::Path,
        lines: impl Fn(usize) -> Vec<(String, Vec<(f64, f64)>)>,
    ) -> objectcache_core::Result<()> {
        use plotters::prelude::*;
        let err = |e: &dyn std::fmt::Display| {
            Error::InvalidArgument(format!("cannot draw {}: {e}", path.display()))
        };
        let floor = 1e-4;
        let ymax = self.ys.iter().copied().fold(floor, f64::max) * 2.0;
        let n = self.titles.len().max(1);
        let root = SVGBackend::new(path, (self.size.0 * n as u32, self.size.1)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let panels = root.split_evenly((1, n));
        for (p, (panel, title)) in panels.iter().zip(self.titles).enumerate() {
            let xmax = (self.xs.len().max(2) - 1) as f64;
            let mut chart = ChartBuilder::on(panel)
                .caption(title, ("sans-serif", 18))
                .margin(12)
                .x_label_area_size(36)
                .y_label_area_size(56)
                .build_cartesian_2d(0f64..xmax, (floor..ymax).log_scale())
                .map_err(|e| err(&e))?;
            chart
                .configure_mesh()
                .x_desc(self.x_desc)
                .y_desc(self.y_desc)
                .x_labels(self.xs.len().max(2))
                .x_label_formatter(&|x| {
                    let i = x.round() as usize;
                    if (x - x.round()).abs() < 1e-6 && i < self.xs.len() {
                        self.xs[i].to_string()
                    } else {
                        String::new()
                    }
                })
                .draw()
                .map_err(|e| err(&e))?;
            for (li, (label, pts)) in lines(p).into_iter().enumerate() {
                let color = Palette99::pick(li).to_rgba();
                let pts = pts.into_iter().map(|(x, y)| (x, y.max(floor)));
                chart
                    .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                    .map_err(|e| err(&e))?
                    .label(label)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                    });
            }
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font(("sans-serif", 11))
                .draw()
                .map_err(|e| err(&e))?;
        }
        root.present().map_err(|e| err(&e))?;
        Ok(())
    }
}
