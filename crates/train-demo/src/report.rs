//! What the user sees and keeps: metrics.csv, PNG curves and attention heatmaps.

use std::io::Write;
use std::path::Path;

use burn::tensor::Tensor;
use plotters::prelude::*;

/// One row of `metrics.csv`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MetricsRow {
    pub step: usize,
    pub loss: f64,
    pub lr: f64,
    /// Held-out loss and accuracy, on the last step of each epoch.
    pub eval_loss: Option<f64>,
    pub token_accuracy: Option<f64>,
    pub exact_accuracy: Option<f64>,
}

const HEADER: &str = "step,loss,lr,eval_token_accuracy,eval_exact_accuracy,eval_loss";

/// Reads the rows of a previous run's `metrics.csv` (to continue it on resume).
pub fn read_metrics(path: &Path) -> Vec<MetricsRow> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            let optional = |text: &str| text.parse::<f64>().ok();
            Some(MetricsRow {
                step: fields.first()?.parse().ok()?,
                loss: fields.get(1)?.parse().ok()?,
                lr: fields.get(2)?.parse().ok()?,
                token_accuracy: fields.get(3).and_then(|t| optional(t)),
                exact_accuracy: fields.get(4).and_then(|t| optional(t)),
                eval_loss: fields.get(5).and_then(|t| optional(t)),
            })
        })
        .collect()
}

/// Writes the metrics beside `path` and renames them over it, so that a crash leaves either the
/// old file or the new one.
pub fn write_metrics(path: &Path, rows: &[MetricsRow]) -> std::io::Result<()> {
    let partial = path.with_extension("csv.partial");
    write_rows(&partial, rows)?;
    std::fs::rename(&partial, path)
}

fn write_rows(path: &Path, rows: &[MetricsRow]) -> std::io::Result<()> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(file, "{HEADER}")?;
    let optional = |value: Option<f64>| value.map(|v| format!("{v:.6}")).unwrap_or_default();
    for row in rows {
        writeln!(
            file,
            "{},{:.8},{:.8},{},{},{}",
            row.step,
            row.loss,
            row.lr,
            optional(row.token_accuracy),
            optional(row.exact_accuracy),
            optional(row.eval_loss)
        )?;
    }
    file.into_inner()?.sync_all()
}

const FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
            .unwrap_or_else(|_| panic!("the bundled font is a valid TTF"));
    });
}

fn plot_error(error: impl std::fmt::Display) -> String {
    format!("plotting: {error}")
}

/// Training loss (log scale) and held-out accuracy against steps.
pub fn plot_curves(path: &Path, rows: &[MetricsRow], title: &str) -> Result<(), String> {
    register_font();
    let root = BitMapBackend::new(path, (1000, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let (left, right) = root.split_horizontally(500);
    let last_step = rows.last().map_or(1, |r| r.step.max(1)) as f64;
    let losses: Vec<(f64, f64)> = rows
        .iter()
        .map(|r| (r.step as f64, r.loss.max(1e-6)))
        .collect();
    let (min_loss, max_loss) = losses
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), (_, l)| {
            (lo.min(*l), hi.max(*l))
        });
    let mut chart = ChartBuilder::on(&left)
        .caption(format!("{title}: training loss"), ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(
            0f64..last_step,
            (min_loss * 0.8..max_loss * 1.2).log_scale(),
        )
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("cross-entropy")
        .draw()
        .map_err(plot_error)?;
    chart
        .draw_series(LineSeries::new(losses, &BLUE))
        .map_err(plot_error)?;

    let mut chart = ChartBuilder::on(&right)
        .caption("held-out accuracy", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0f64..last_step, 0f64..1.02)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .draw()
        .map_err(plot_error)?;
    let series = |pick: fn(&MetricsRow) -> Option<f64>| -> Vec<(f64, f64)> {
        rows.iter()
            .filter_map(|r| pick(r).map(|a| (r.step as f64, a)))
            .collect()
    };
    chart
        .draw_series(LineSeries::new(series(|r| r.token_accuracy), &GREEN))
        .map_err(plot_error)?
        .label("token")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], GREEN));
    chart
        .draw_series(LineSeries::new(series(|r| r.exact_accuracy), &RED))
        .map_err(plot_error)?
        .label("exact match")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], RED));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    root.present().map_err(plot_error)
}

/// One heatmap per head: rows are queries, columns keys, white 0 to dark blue 1.
pub fn plot_attention(path: &Path, label: &str, weights: Tensor<4>) -> Result<(), String> {
    register_font();
    let [_, heads, seq_q, seq_k] = weights.dims();
    let values = weights
        .into_data()
        .try_into_vec_as::<f32>()
        .map_err(|e| format!("attention weights: {e:?}"))?;
    let cell = (360 / seq_q.max(seq_k)).clamp(8, 40) as u32;
    let panel = (cell * seq_k as u32 + 70, cell * seq_q as u32 + 80);
    let root = BitMapBackend::new(path, (panel.0 * heads as u32, panel.1)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    for (head, area) in root.split_evenly((1, heads)).iter().enumerate() {
        let mut chart = ChartBuilder::on(area)
            .caption(format!("{label}, head {head}"), ("sans-serif", 14))
            .margin(6)
            .x_label_area_size(30)
            .y_label_area_size(30)
            .build_cartesian_2d(0..seq_k, 0..seq_q)
            .map_err(plot_error)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_desc("key")
            .y_desc("query")
            .draw()
            .map_err(plot_error)?;
        let offset = head * seq_q * seq_k;
        let values = &values;
        chart
            .draw_series((0..seq_q).flat_map(|q| {
                (0..seq_k).map(move |k| {
                    let w = values[offset + q * seq_k + k].clamp(0.0, 1.0) as f64;
                    let shade = (255.0 * (1.0 - w)) as u8;
                    // Query 0 at the top, as a matrix is printed.
                    let row = seq_q - 1 - q;
                    Rectangle::new(
                        [(k, row), (k + 1, row + 1)],
                        RGBColor(shade, shade, 255).filled(),
                    )
                })
            }))
            .map_err(plot_error)?;
    }
    root.present().map_err(plot_error)
}
