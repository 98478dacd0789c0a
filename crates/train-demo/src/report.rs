//! What the user sees and keeps: metrics.csv, PNG curves and attention heatmaps.

use std::io::Write;
use std::path::Path;

use burn::tensor::Tensor;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

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

/// The radius of an evaluation's exact-match point on the held-out accuracy curves; its token
/// accuracy point is one pixel larger, so that it rings the other where the two are equal.
const EVALUATION_POINT: u32 = 3;

/// The size of `curves.png`: the loss on the left half, the held-out accuracy on the right.
const CURVES_SIZE: (u32, u32) = (1000, 420);

/// Training loss (log scale) and held-out accuracy against steps.
pub fn plot_curves(path: &Path, rows: &[MetricsRow], title: &str) -> Result<(), String> {
    let root = BitMapBackend::new(path, CURVES_SIZE).into_drawing_area();
    draw_curves(&root, rows, title)?;
    root.present().map_err(plot_error)
}

/// Draws the curves onto `root`, which is `CURVES_SIZE` large. Returns the pixel of each
/// held-out evaluation's exact-match point.
fn draw_curves<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    rows: &[MetricsRow],
    title: &str,
) -> Result<Vec<(i32, i32)>, String> {
    register_font();
    root.fill(&WHITE).map_err(plot_error)?;
    let (left, right) = root.split_horizontally(CURVES_SIZE.0 / 2);
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
    draw_accuracy(&right, rows, last_step)
}

/// The held-out accuracy panel; returns the pixel of each evaluation's exact-match point.
fn draw_accuracy<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    rows: &[MetricsRow],
    last_step: f64,
) -> Result<Vec<(i32, i32)>, String> {
    let mut chart = ChartBuilder::on(area)
        .caption("held-out accuracy", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        // A little room past the last step: its evaluation's point is not cut by the frame.
        .build_cartesian_2d(0f64..last_step * 1.04, 0f64..1.04)
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
    // One evaluation per epoch, each drawn as a point on its line: a run of one epoch (the
    // default run stops there) has a single point and no line.
    chart
        .draw_series(
            LineSeries::new(series(|r| r.token_accuracy), GREEN.filled())
                .point_size(EVALUATION_POINT + 1),
        )
        .map_err(plot_error)?
        .label("token")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], GREEN));
    let exact = series(|r| r.exact_accuracy);
    let exact_points: Vec<(i32, i32)> = exact
        .iter()
        .map(|point| chart.backend_coord(point))
        .collect();
    chart
        .draw_series(LineSeries::new(exact, RED.filled()).point_size(EVALUATION_POINT))
        .map_err(plot_error)?
        .label("exact match")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], RED));
    // Upper left: evaluations start at the end of the first epoch, and rise to the right.
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    Ok(exact_points)
}

/// The colour of an attention weight: white ("cold", 0) to blue ("hot", 1).
pub fn heat_colour(weight: f32) -> RGBColor {
    let w = weight.clamp(0.0, 1.0) as f64;
    let shade = (255.0 * (1.0 - w)) as u8;
    RGBColor(shade, shade, 255)
}

/// What the heatmaps say about their axes, under each panel's caption.
const AXES: &str = "query \u{2193} (0 at top), key \u{2192} (0 at left)";
/// Above each grid: the caption and the axes line.
const CAPTION_HEIGHT: u32 = 44;
/// Left of each grid: the query labels.
const QUERY_LABEL_WIDTH: u32 = 34;
/// Under each grid: the key labels and "key →".
const KEY_LABEL_HEIGHT: u32 = 42;
/// Right of each grid.
const RIGHT_MARGIN: u32 = 12;
/// The narrowest panel: its caption and axes line fit.
const MIN_PANEL_WIDTH: u32 = 300;
/// The spacing, in pixels, that a label of two or three digits needs.
const LABEL_SPACING: u32 = 18;

/// Where one attention layer's heatmaps lie in their image, in pixels: one panel per head, side
/// by side; in each, a grid of square cells, query `q` in row `q` from the top (as a matrix is
/// printed) and key `k` in column `k` from the left, labelled so. The renderer draws from these
/// numbers, and the tests find a cell's pixels with them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeatmapLayout {
    pub heads: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    /// The side of a cell.
    pub cell: u32,
    /// The size of one head's panel; head `h`'s starts at x = `h * panel.0`.
    pub panel: (u32, u32),
    /// The top-left corner of the grid inside its panel.
    pub grid: (u32, u32),
    /// Every how many queries and keys a label is written (1: all of them).
    pub label_every: usize,
}

impl HeatmapLayout {
    pub fn new(heads: usize, seq_q: usize, seq_k: usize) -> Self {
        let cell = (360 / seq_q.max(seq_k).max(1)).clamp(8, 40) as u32;
        let grid_width = cell * seq_k as u32;
        let grid_height = cell * seq_q as u32;
        Self {
            heads,
            seq_q,
            seq_k,
            cell,
            panel: (
                (QUERY_LABEL_WIDTH + grid_width + RIGHT_MARGIN).max(MIN_PANEL_WIDTH),
                CAPTION_HEIGHT + grid_height + KEY_LABEL_HEIGHT,
            ),
            grid: (QUERY_LABEL_WIDTH, CAPTION_HEIGHT),
            label_every: LABEL_SPACING.div_ceil(cell).max(1) as usize,
        }
    }

    /// The size of the whole image.
    pub fn image_size(&self) -> (u32, u32) {
        (self.panel.0 * self.heads as u32, self.panel.1)
    }

    /// The top-left pixel, in the whole image, of the cell of query `q` and key `k` in head
    /// `head`'s panel.
    pub fn cell_origin(&self, head: usize, q: usize, k: usize) -> (i32, i32) {
        (
            (head as u32 * self.panel.0 + self.grid.0 + k as u32 * self.cell) as i32,
            (self.grid.1 + q as u32 * self.cell) as i32,
        )
    }

    /// The pixel at the centre of that cell.
    pub fn cell_centre(&self, head: usize, q: usize, k: usize) -> (i32, i32) {
        let (x, y) = self.cell_origin(head, q, k);
        let half = (self.cell / 2) as i32;
        (x + half, y + half)
    }
}

/// One heatmap per head: rows are queries (query 0 at the top), columns keys (key 0 at the
/// left), white 0 to dark blue 1.
pub fn plot_attention(path: &Path, label: &str, weights: Tensor<4>) -> Result<(), String> {
    let [_, heads, seq_q, seq_k] = weights.dims();
    let values = weights
        .into_data()
        .try_into_vec_as::<f32>()
        .map_err(|e| format!("attention weights: {e:?}"))?;
    let layout = HeatmapLayout::new(heads, seq_q, seq_k);
    let root = BitMapBackend::new(path, layout.image_size()).into_drawing_area();
    draw_attention(&root, &layout, label, &values)?;
    root.present().map_err(plot_error)
}

/// Draws the heatmaps of `values` (`[heads, seq_q, seq_k]` row-major, the first example's)
/// onto `root`, which is `layout.image_size()` large, as `layout` places them.
fn draw_attention<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    layout: &HeatmapLayout,
    label: &str,
    values: &[f32],
) -> Result<(), String> {
    register_font();
    let HeatmapLayout {
        heads,
        seq_q,
        seq_k,
        cell,
        panel,
        label_every,
        ..
    } = *layout;
    if values.len() < heads * seq_q * seq_k {
        return Err(format!(
            "attention weights: {} values for {heads} heads of {seq_q} x {seq_k}",
            values.len()
        ));
    }
    root.fill(&WHITE).map_err(plot_error)?;
    let caption =
        TextStyle::from(("sans-serif", 14).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    let small = TextStyle::from(("sans-serif", 12).into_font());
    let below = small.pos(Pos::new(HPos::Center, VPos::Top));
    let left_of = small.pos(Pos::new(HPos::Right, VPos::Center));
    let cell = cell as i32;
    let (grid_width, grid_height) = (cell * seq_k as i32, cell * seq_q as i32);
    for head in 0..heads {
        let middle = (head as u32 * panel.0 + panel.0 / 2) as i32;
        root.draw_text(&format!("{label}, head {head}"), &caption, (middle, 4))
            .map_err(plot_error)?;
        root.draw_text(AXES, &below, (middle, 24))
            .map_err(plot_error)?;
        for q in 0..seq_q {
            for k in 0..seq_k {
                let (x, y) = layout.cell_origin(head, q, k);
                let colour = heat_colour(values[(head * seq_q + q) * seq_k + k]);
                root.draw(&Rectangle::new(
                    [(x, y), (x + cell, y + cell)],
                    colour.filled(),
                ))
                .map_err(plot_error)?;
            }
        }
        let (left, top) = layout.cell_origin(head, 0, 0);
        let (right, bottom) = (left + grid_width, top + grid_height);
        root.draw(&Rectangle::new(
            [(left - 1, top - 1), (right, bottom)],
            BLACK.stroke_width(1),
        ))
        .map_err(plot_error)?;
        for q in (0..seq_q).step_by(label_every) {
            let (_, y) = layout.cell_centre(head, q, 0);
            root.draw_text(&q.to_string(), &left_of, (left - 5, y))
                .map_err(plot_error)?;
        }
        for k in (0..seq_k).step_by(label_every) {
            let (x, _) = layout.cell_centre(head, 0, k);
            root.draw_text(&k.to_string(), &below, (x, bottom + 4))
                .map_err(plot_error)?;
        }
        root.draw_text("key \u{2192}", &below, ((left + right) / 2, bottom + 22))
            .map_err(plot_error)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{Device, TensorData};

    /// The colour of pixel `(x, y)` of an RGB buffer `width` pixels wide.
    fn pixel(buffer: &[u8], width: u32, (x, y): (i32, i32)) -> (u8, u8, u8) {
        let at = 3 * (y as usize * width as usize + x as usize);
        (buffer[at], buffer[at + 1], buffer[at + 2])
    }

    /// Two heads of 4 queries x 4 keys: head 0 has a single 1.0 at query 0, key 2; head 1 a
    /// 1.0 at query 3, key 1 and a 0.5 at query 1, key 0; zeros elsewhere.
    fn weights() -> (HeatmapLayout, Vec<f32>, [(usize, usize); 2]) {
        let (heads, seq) = (2, 4);
        let hot = [(0, 2), (3, 1)];
        let mut values = vec![0.0f32; heads * seq * seq];
        for (head, &(q, k)) in hot.iter().enumerate() {
            values[(head * seq + q) * seq + k] = 1.0;
        }
        values[(seq + 1) * seq] = 0.5;
        (HeatmapLayout::new(heads, seq, seq), values, hot)
    }

    #[test]
    fn heatmap_cells_sit_where_their_labels_say() {
        let (layout, values, hot) = weights();
        let (width, height) = layout.image_size();
        let mut buffer = vec![0u8; 3 * (width * height) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buffer, (width, height)).into_drawing_area();
            draw_attention(&root, &layout, "encoder 0 self", &values).unwrap();
            root.present().unwrap();
        }
        let (seq_q, seq_k) = (layout.seq_q, layout.seq_k);
        for (head, &(q, k)) in hot.iter().enumerate() {
            assert_eq!(
                pixel(&buffer, width, layout.cell_centre(head, q, k)),
                heat_colour(1.0).rgb(),
                "head {head}: query {q} (row {q} from the top), key {k} is hot"
            );
            // The row that labels running from 0 at the bottom would call query `q`.
            let mirrored = seq_q - 1 - q;
            assert_eq!(
                pixel(&buffer, width, layout.cell_centre(head, mirrored, k)),
                heat_colour(0.0).rgb(),
                "head {head}: query {mirrored}, key {k} is cold"
            );
            for query in 0..seq_q {
                for key in 0..seq_k {
                    let weight = values[(head * seq_q + query) * seq_k + key];
                    assert_eq!(
                        pixel(&buffer, width, layout.cell_centre(head, query, key)),
                        heat_colour(weight).rgb(),
                        "head {head}: query {query}, key {key}, weight {weight}"
                    );
                }
            }
        }
        assert_ne!(heat_colour(0.5).rgb(), heat_colour(0.0).rgb());
    }

    #[test]
    fn plot_attention_writes_a_png_of_the_layout_size() {
        let (layout, values, _) = weights();
        let path =
            std::env::temp_dir().join(format!("train-demo-heatmap-{}.png", std::process::id()));
        let tensor = Tensor::<4>::from_data(
            TensorData::new(values, [1, layout.heads, layout.seq_q, layout.seq_k]),
            &Device::flex(),
        );
        plot_attention(&path, "encoder 0 self", tensor).unwrap();
        let png = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // The IHDR chunk comes first: width and height, big-endian, at bytes 16 and 20.
        let size = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
        assert_eq!((size(16), size(20)), layout.image_size());
    }

    #[test]
    fn a_single_evaluation_shows_as_a_point() {
        // One epoch of 100 steps: the held-out metrics on its last row only.
        let mut rows: Vec<MetricsRow> = (1..=100)
            .map(|step| MetricsRow {
                step,
                loss: 2.0 / step as f64,
                lr: 1e-3,
                eval_loss: None,
                token_accuracy: None,
                exact_accuracy: None,
            })
            .collect();
        let last = rows.last_mut().unwrap();
        last.eval_loss = Some(0.9);
        last.token_accuracy = Some(0.6);
        last.exact_accuracy = Some(0.4);
        let (width, height) = CURVES_SIZE;
        let mut buffer = vec![0u8; 3 * (width * height) as usize];
        let points = {
            let root = BitMapBackend::with_buffer(&mut buffer, (width, height)).into_drawing_area();
            let points = draw_curves(&root, &rows, "count").unwrap();
            root.present().unwrap();
            points
        };
        assert_eq!(points.len(), 1, "one evaluation");
        assert_eq!(
            pixel(&buffer, width, points[0]),
            RED.rgb(),
            "drawn at {:?}",
            points[0]
        );
    }
}
