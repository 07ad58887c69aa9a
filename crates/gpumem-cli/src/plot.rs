//! Actual-vs-predicted scatter plots (SVG and PNG) with plotters and an embedded font.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

static FONT: Once = Once::new();

fn register() {
    FONT.call_once(|| {
        let _ = register_font("sans-serif", FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"));
    });
}

const COLORS: [RGBColor; 6] = [RGBColor(31, 119, 180), RGBColor(255, 127, 14), RGBColor(44, 160, 44), RGBColor(214, 39, 40), RGBColor(148, 103, 189), RGBColor(140, 86, 75)];

/// One scatter of (measured, predicted) MiB per estimator, with the y = x line.
pub fn scatter(svg: &Path, png: &Path, series: &[(String, Vec<(f64, f64)>)]) -> Result<(), String> {
    register();
    draw(SVGBackend::new(svg, (900, 700)).into_drawing_area(), series).map_err(|e| format!("{}: {e}", svg.display()))?;
    draw(BitMapBackend::new(png, (900, 700)).into_drawing_area(), series).map_err(|e| format!("{}: {e}", png.display()))
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, plotters::coord::Shift>, series: &[(String, Vec<(f64, f64)>)]) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    // Log axes: baselines can be off by orders of magnitude.
    let values = || series.iter().flat_map(|(_, p)| p.iter().flat_map(|&(m, e)| [m, e])).filter(|v| *v > 0.0);
    let max = values().fold(1.0f64, f64::max) * 1.2;
    // Below 10 MiB nothing is interesting (only context-free baselines go there).
    let min = (values().fold(max, f64::min) / 1.2).max(10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption("gpumem: measured vs predicted peak (MiB)", ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((min..max).log_scale(), (min..max).log_scale())
        .map_err(err)?;
    chart.configure_mesh().x_desc("measured MiB (log)").y_desc("predicted MiB (log)").x_label_formatter(&|v| format!("{v:.0}")).y_label_formatter(&|v| format!("{v:.0}")).draw().map_err(err)?;
    chart.draw_series(LineSeries::new([(min, min), (max, max)], BLACK.stroke_width(1))).map_err(err)?.label("y = x").legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (k, (name, points)) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        chart
            .draw_series(points.iter().filter(|&&(m, p)| m >= min && p >= min).map(|&(m, p)| Circle::new((m, p), 2, color.filled())))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::UpperLeft).draw().map_err(err)?;
    root.present().map_err(err)
}
