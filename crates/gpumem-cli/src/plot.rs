//! Plots with plotters and an embedded font: actual-vs-predicted scatters and simulation
//! timelines (SVG and PNG).

use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

/// Why a plot could not be written: the file, and plotters' error drawing it.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{}: {source}", file.display())]
    Svg {
        file: PathBuf,
        source: DrawingAreaErrorKind<std::io::Error>,
    },
    #[error("{}: {source}", file.display())]
    Png {
        file: PathBuf,
        source: DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>,
    },
}

static FONT: Once = Once::new();

fn register() {
    FONT.call_once(|| {
        let _ = register_font(
            "sans-serif",
            FontStyle::Normal,
            include_bytes!("../assets/DejaVuSans.ttf"),
        );
    });
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// One scatter of (measured, predicted) MiB per estimator, with the y = x line.
pub fn scatter(
    svg: &Path,
    png: &Path,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), PlotError> {
    register();
    draw(SVGBackend::new(svg, (900, 700)).into_drawing_area(), series).map_err(|source| {
        PlotError::Svg {
            file: svg.to_path_buf(),
            source,
        }
    })?;
    draw(
        BitMapBackend::new(png, (900, 700)).into_drawing_area(),
        series,
    )
    .map_err(|source| PlotError::Png {
        file: png.to_path_buf(),
        source,
    })
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    // Log axes: baselines can be off by orders of magnitude.
    let values = || {
        series
            .iter()
            .flat_map(|(_, p)| p.iter().flat_map(|&(m, e)| [m, e]))
            .filter(|v| *v > 0.0)
    };
    let max = values().fold(1.0f64, f64::max) * 1.2;
    // Below 10 MiB nothing is interesting (only context-free baselines go there).
    let min = (values().fold(max, f64::min) / 1.2).max(10.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "gpumem: measured vs predicted peak (MiB)",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d((min..max).log_scale(), (min..max).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("measured MiB (log)")
        .y_desc("predicted MiB (log)")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    chart
        .draw_series(LineSeries::new(
            [(min, min), (max, max)],
            BLACK.stroke_width(1),
        ))?
        .label("y = x")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
    for (k, (name, points)) in series.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        chart
            .draw_series(
                points
                    .iter()
                    .filter(|&&(m, p)| m >= min && p >= min)
                    .map(|&(m, p)| Circle::new((m, p), 2, color.filled())),
            )?
            .label(name.as_str())
            .legend(move |(x, y)| Circle::new((x + 10, y), 4, color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    root.present()
}

/// Per-GPU timeline of a simulation: one band per GPU, concurrent jobs stacked in lanes,
/// crashed runs in red.
pub fn timeline(
    svg: &Path,
    png: &Path,
    title: &str,
    gpus: usize,
    runs: &[gpumem_sim::Run],
    labels: &[String],
) -> Result<(), PlotError> {
    register();
    let height = (160 + 90 * gpus as u32).min(4000);
    draw_timeline(
        SVGBackend::new(svg, (1400, height)).into_drawing_area(),
        title,
        gpus,
        runs,
        labels,
    )
    .map_err(|source| PlotError::Svg {
        file: svg.to_path_buf(),
        source,
    })?;
    draw_timeline(
        BitMapBackend::new(png, (1400, height)).into_drawing_area(),
        title,
        gpus,
        runs,
        labels,
    )
    .map_err(|source| PlotError::Png {
        file: png.to_path_buf(),
        source,
    })
}

/// Lane of each run within its GPU band (greedy interval colouring), and lanes per GPU.
fn lanes(gpus: usize, runs: &[gpumem_sim::Run]) -> (Vec<Vec<(usize, usize)>>, Vec<usize>) {
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| runs[a].start_s.total_cmp(&runs[b].start_s));
    let mut ends: Vec<Vec<f64>> = vec![Vec::new(); gpus];
    let mut placed: Vec<Vec<(usize, usize)>> = vec![Vec::new(); gpus];
    for r in order {
        for &g in &runs[r].gpus {
            let lane = match ends[g].iter().position(|&e| e <= runs[r].start_s) {
                Some(l) => l,
                None => {
                    ends[g].push(0.0);
                    ends[g].len() - 1
                }
            };
            ends[g][lane] = runs[r].end_s;
            placed[g].push((r, lane));
        }
    }
    let counts = ends.iter().map(|e| e.len().max(1)).collect();
    (placed, counts)
}

fn draw_timeline<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    gpus: usize,
    runs: &[gpumem_sim::Run],
    labels: &[String],
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let end_h = runs.iter().map(|r| r.end_s).fold(0.0f64, f64::max) / 3600.0;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..end_h.max(0.01) * 1.02, 0.0..gpus as f64)?;
    chart
        .configure_mesh()
        .x_desc("hours")
        .y_desc("GPU")
        .y_labels((gpus + 1).min(41))
        .y_label_formatter(&|v| format!("{}", v.floor() as usize))
        .disable_y_mesh()
        .draw()?;
    let (placed, counts) = lanes(gpus, runs);
    for (g, on) in placed.iter().enumerate() {
        let lane_h = 0.9 / counts[g] as f64;
        chart.draw_series(on.iter().map(|&(r, lane)| {
            let run = &runs[r];
            let y0 = g as f64 + 0.05 + lane as f64 * lane_h;
            let color = if run.outcome == gpumem_sim::Outcome::Finished {
                COLORS[run.job % COLORS.len()].mix(0.8)
            } else {
                RED.mix(1.0)
            };
            Rectangle::new(
                [
                    (run.start_s / 3600.0, y0),
                    (run.end_s / 3600.0, y0 + lane_h * 0.9),
                ],
                color.filled(),
            )
        }))?;
        if gpus <= 16 {
            let font = ("sans-serif", 10).into_font().color(&BLACK);
            chart.draw_series(
                on.iter()
                    .filter(|&&(r, _)| runs[r].end_s - runs[r].start_s > end_h * 3600.0 / 40.0)
                    .map(|&(r, lane)| {
                        let y = g as f64 + 0.05 + (lane as f64 + 0.6) * lane_h;
                        Text::new(
                            labels.get(runs[r].job).cloned().unwrap_or_default(),
                            (runs[r].start_s / 3600.0, y),
                            font.clone(),
                        )
                    }),
            )?;
        }
    }
    root.present()
}

/// The replay's memory over one trace: live bytes per category stacked (allocated memory),
/// reserved memory as a line, the allocated peak marked. x is the event index.
pub fn memory_timeline(
    svg: &Path,
    title: &str,
    points: &[gpumem_core::estimate::TimelinePoint],
    peak_event: Option<u32>,
) -> Result<(), PlotError> {
    register();
    draw_memory(
        SVGBackend::new(svg, (1400, 700)).into_drawing_area(),
        title,
        points,
        peak_event,
    )
    .map_err(|source| PlotError::Svg {
        file: svg.to_path_buf(),
        source,
    })
}

/// At most this many x positions are drawn: each keeps the largest point of its stretch of
/// events, so no peak is lost.
const TIMELINE_COLUMNS: usize = 2000;

fn draw_memory<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    points: &[gpumem_core::estimate::TimelinePoint],
    peak_event: Option<u32>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>>
where
    DB::ErrorType: 'static,
{
    use gpumem_core::trace::Category;
    root.fill(&WHITE)?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let last = points.last().map_or(1, |p| p.event.max(1));
    let per = (last as usize).div_ceil(TIMELINE_COLUMNS).max(1) as u32;
    let mut columns: Vec<gpumem_core::estimate::TimelinePoint> = Vec::new();
    for p in points {
        match columns.last_mut() {
            Some(c) if c.event / per == p.event / per => {
                if p.reserved > c.reserved || p.allocated > c.allocated {
                    *c = gpumem_core::estimate::TimelinePoint {
                        event: c.event,
                        ..*p
                    };
                }
            }
            _ => columns.push(*p),
        }
    }
    // Headroom above the highest point for the legend.
    let top = columns
        .iter()
        .map(|p| mib(p.reserved.max(p.live.iter().sum())))
        .fold(1.0, f64::max)
        * 1.3;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..last as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("trace event (setup, then each iteration's forward, backward, optimizer)")
        .y_desc("MiB")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()?;
    // Stacked areas, drawn from the top of the stack down so each covers the ones below it.
    let colors = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(255, 127, 14),
        RGBColor(188, 189, 34),
        RGBColor(23, 190, 207),
        RGBColor(140, 86, 75),
    ];
    // The allocator's categories (host-backed memory, outside it, is never in the timeline).
    for k in (0..Category::ALL.len())
        .rev()
        .filter(|&k| Category::ALL[k] != Category::HostBacked)
    {
        let color = colors[k];
        let stacked = columns
            .iter()
            .map(|p| (p.event as f64, mib(p.live[..=k].iter().sum())));
        chart
            .draw_series(AreaSeries::new(stacked, 0.0, color.mix(0.85)).border_style(color))?
            .label(Category::ALL[k].name())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], color.filled()));
    }
    chart
        .draw_series(LineSeries::new(
            columns.iter().map(|p| (p.event as f64, mib(p.reserved))),
            BLACK.stroke_width(2),
        ))?
        .label("reserved (allocator)")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], BLACK.stroke_width(2)));
    if let Some(e) = peak_event {
        chart
            .draw_series(LineSeries::new(
                [(e as f64, 0.0), (e as f64, top)],
                RED.stroke_width(1),
            ))?
            .label("peak of allocated memory")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 15, y)], RED));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE)
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()
}
