//! A run's loss curves, drawn from its `metrics.jsonl` to a PNG.
//!
//! Training bits per byte per step (faint) with its moving average, the
//! periodic validation points and the final full validation, against the
//! optimizer step. The trainer draws `loss.png` into the run directory at the
//! end of a run; `tvq plot` draws it on demand (also mid-run), or the curves
//! of several runs on one chart to compare them ([`plot_runs`]).

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};
use serde::Deserialize;

use crate::error::TrainError;
use crate::inference::evaluate::PositionBucket;

/// DejaVu Sans (see `assets/DejaVuSans-LICENSE.txt`), so text renders the
/// same on every machine, with no system fonts involved.
static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Steps in the moving average of the training curve.
pub const SMOOTHING: usize = 25;

/// The points of one run's curves, in bits per byte.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Curves {
    /// `(step, bits per byte)` of every training step.
    pub train: Vec<(u64, f64)>,
    /// `(step, bits per byte)` of every periodic validation.
    pub validation: Vec<(u64, f64)>,
    /// `(step, bits per byte)` of the final full validation, once there is one.
    pub final_validation: Option<(u64, f64)>,
}

#[derive(Deserialize)]
struct Line {
    kind: String,
    step: u64,
    bits_per_byte: f64,
}

impl Curves {
    /// Reads `metrics.jsonl`; lines of other kinds are skipped, a line that
    /// does not parse is an error naming it, unless it is the last and has
    /// no newline yet (being written, or torn by a killed run, which
    /// writes it again when resumed).
    pub fn read(path: &Path) -> Result<Self, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::io(path, e))?;
        let complete = text.ends_with('\n');
        let count = text.lines().count();
        let mut curves = Self::default();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let line: Line = match serde_json::from_str(line) {
                Ok(line) => line,
                Err(_) if !complete && i + 1 == count => continue,
                Err(e) => {
                    return Err(TrainError::Plot {
                        path: path.to_path_buf(),
                        reason: format!("line {}: {e}", i + 1),
                    });
                }
            };
            let point = (line.step, line.bits_per_byte);
            match line.kind.as_str() {
                "train" => curves.train.push(point),
                "eval" => curves.validation.push(point),
                "final_eval" => curves.final_validation = Some(point),
                _ => {}
            }
        }
        Ok(curves)
    }

    /// The periodic validations, then the final one.
    fn evals(&self) -> Vec<(u64, f64)> {
        self.validation
            .iter()
            .chain(self.final_validation.iter())
            .copied()
            .collect()
    }

    /// The mean of the last [`SMOOTHING`] training points at each step.
    pub fn smoothed_train(&self) -> Vec<(u64, f64)> {
        let mut sum = 0.0;
        self.train
            .iter()
            .enumerate()
            .map(|(i, &(step, y))| {
                sum += y;
                if i >= SMOOTHING {
                    sum -= self.train[i - SMOOTHING].1;
                }
                (step, sum / (i + 1).min(SMOOTHING) as f64)
            })
            .collect()
    }
}

/// A run directory's name, for titles and legends.
fn run_name(run_dir: &Path) -> String {
    run_dir
        .canonicalize()
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "tvq".into())
}

/// Draws the curves of the run in `run_dir` (its `metrics.jsonl`) to the PNG
/// `out`, titled with the run directory's name.
pub fn plot_run(run_dir: &Path, out: &Path) -> Result<(), TrainError> {
    plot_metrics(&run_dir.join("metrics.jsonl"), out, &run_name(run_dir))
}

/// The curves of `metrics`, which must hold at least one training step.
fn read_nonempty(metrics: &Path) -> Result<Curves, TrainError> {
    let curves = Curves::read(metrics)?;
    if curves.train.is_empty() {
        return Err(TrainError::Plot {
            path: metrics.to_path_buf(),
            reason: "no training steps recorded yet".into(),
        });
    }
    Ok(curves)
}

/// Draws the curves of `metrics` (a `metrics.jsonl`) to the PNG `out`, titled `title`.
pub fn plot_metrics(metrics: &Path, out: &Path, title: &str) -> Result<(), TrainError> {
    let curves = read_nonempty(metrics)?;
    write_png(out, |root| draw(&curves, root, title))
}

/// Draws the runs in `run_dirs` on one chart in the PNG `out`, one colour
/// each, named by their directories: the moving average of the training
/// loss as a line, the validations as dots joined by a thin line.
pub fn plot_runs(run_dirs: &[&Path], out: &Path) -> Result<(), TrainError> {
    let runs = run_dirs
        .iter()
        .map(|dir| Ok((run_name(dir), read_nonempty(&dir.join("metrics.jsonl"))?)))
        .collect::<Result<Vec<_>, TrainError>>()?;
    write_png(out, |root| draw_comparison(&runs, root))
}

fn write_png(
    out: &Path,
    draw: impl FnOnce(&DrawingArea<BitMapBackend, plotters::coord::Shift>) -> Result<(), String>,
) -> Result<(), TrainError> {
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    draw(&root)
        .and_then(|()| root.present().map_err(|e| e.to_string()))
        .map_err(|reason| TrainError::Plot {
            path: out.to_path_buf(),
            reason,
        })
}

/// Where a bucket's point goes on the log position axis.
fn middle(b: &PositionBucket) -> f64 {
    (b.first as f64 * b.last as f64).sqrt()
}

fn register_the_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The font is compiled in and known to parse; a failure would show as missing text.
        let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Draws the loss by position in the document (bits per token against the
/// position, log scale, one point per bucket at the geometric middle of
/// its positions) to the PNG `out`; where the buckets carry attention figures, also the share of
/// attention on the compressed cache (mean over sublayers, right axis).
pub fn plot_by_position(
    buckets: &[PositionBucket],
    out: &Path,
    title: &str,
) -> Result<(), TrainError> {
    let fail = |reason: String| TrainError::Plot {
        path: out.to_path_buf(),
        reason,
    };
    if buckets.is_empty() {
        return Err(fail("no tokens were scored".into()));
    }
    register_the_font();
    let points: Vec<(f64, f64)> = buckets
        .iter()
        .map(|b| (middle(b), b.bits_per_token))
        .collect();
    let x_max = points.iter().map(|p| p.0).fold(1.0, f64::max) * 2.0;
    let (lo, hi) = points.iter().fold((f64::INFINITY, 0f64), |(lo, hi), p| {
        (lo.min(p.1), hi.max(p.1))
    });
    let pad = ((hi - lo) * 0.05).max(0.01);
    let root = BitMapBackend::new(out, SIZE).into_drawing_area();
    let err = |e: &dyn std::fmt::Display| fail(e.to_string());
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let cache_share: Vec<(f64, f64)> = buckets
        .iter()
        .filter(|b| !b.attention.is_empty())
        .map(|b| {
            let shares = b.attention.iter().map(|a| a.share[2]);
            (middle(b), shares.sum::<f64>() / b.attention.len() as f64)
        })
        .collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .right_y_label_area_size(if cache_share.is_empty() { 0 } else { 56 })
        .build_cartesian_2d((1f64..x_max).log_scale(), (lo - pad).max(0.0)..hi + pad)
        .map_err(|e| err(&e))?
        .set_secondary_coord((1f64..x_max).log_scale(), 0f64..1.0);
    chart
        .configure_mesh()
        .x_desc("position in the document (tokens read)")
        .y_desc("bits per token")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(&e))?;
    chart
        .draw_series(LineSeries::new(points.clone(), RED.stroke_width(2)))
        .map_err(|e| err(&e))?;
    chart
        .draw_series(points.iter().map(|&p| Circle::new(p, 4, RED.filled())))
        .map_err(|e| err(&e))?;
    if !cache_share.is_empty() {
        chart
            .configure_secondary_axes()
            .y_desc("share of attention on the compressed cache (blue)")
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_secondary_series(LineSeries::new(cache_share, BLUE.stroke_width(2)))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

/// Width and height of the PNG in pixels.
pub const SIZE: (u32, u32) = (960, 540);

/// The x and y ranges that show `curves`: every step, and the smoothed
/// training curves and validations (not the raw first steps, ~8 bits per
/// byte, which would flatten everything after them), padded by 5%.
fn ranges<'a>(curves: impl Iterator<Item = &'a Curves> + Clone) -> (u64, f64, f64) {
    let last_step = curves
        .clone()
        .flat_map(|c| c.train.iter().chain(&c.validation).map(|p| p.0))
        .max()
        .unwrap_or(1)
        .max(1);
    let ys = curves.flat_map(|c| {
        let mut ys: Vec<f64> = c.smoothed_train().iter().map(|p| p.1).collect();
        ys.extend(c.evals().iter().map(|p| p.1));
        ys
    });
    let (lo, hi) = ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), y| {
        (lo.min(y), hi.max(y))
    });
    let pad = ((hi - lo) * 0.05).max(0.01);
    (last_step, (lo - pad).max(0.0), hi + pad)
}

type Chart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordu64, plotters::coord::types::RangedCoordf64>,
>;

/// A white chart titled `title` with labelled axes over the given ranges.
fn chart<'a, DB: DrawingBackend>(
    root: &'a DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    (last_step, lo, hi): (u64, f64, f64),
) -> Result<Chart<'a, DB>, String> {
    register_the_font();
    let err = |e: &dyn std::fmt::Display| e.to_string();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0u64..last_step, lo..hi)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc("bits per byte")
        .light_line_style(WHITE.mix(0.0))
        .draw()
        .map_err(|e| err(&e))?;
    Ok(chart)
}

fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut Chart<'a, DB>) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(|e| e.to_string())
}

/// Draws `curves` onto `root` (any plotters backend).
fn draw<DB: DrawingBackend>(
    curves: &Curves,
    root: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
) -> Result<(), String> {
    let (last_step, lo, hi) = ranges(std::iter::once(curves));
    let mut chart = chart(root, title, (last_step, lo, hi))?;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let faint = BLUE.mix(0.25);
    chart
        .draw_series(LineSeries::new(
            curves.train.iter().map(|&(x, y)| (x, y.min(hi))),
            faint,
        ))
        .map_err(|e| err(&e))?
        .label("train, per step")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], faint));
    chart
        .draw_series(LineSeries::new(
            curves.smoothed_train(),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| err(&e))?
        .label(format!("train, {SMOOTHING}-step mean"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    let evals = curves.evals();
    if !evals.is_empty() {
        chart
            .draw_series(LineSeries::new(evals.clone(), RED.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        chart
            .draw_series(evals.iter().map(|&p| Circle::new(p, 4, RED.filled())))
            .map_err(|e| err(&e))?;
    }
    legend(&mut chart)
}

/// Colours of the runs of a comparison, in order (then again).
const RUN_COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Draws several named runs onto `root`: per run, the smoothed training
/// curve (thick) and the validations (dots on a thin line), in its colour.
fn draw_comparison<DB: DrawingBackend>(
    runs: &[(String, Curves)],
    root: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), String> {
    let title = format!("training ({SMOOTHING}-step mean) and validation (dots)");
    let mut chart = chart(root, &title, ranges(runs.iter().map(|(_, c)| c)))?;
    let err = |e: &dyn std::fmt::Display| e.to_string();
    for (i, (name, curves)) in runs.iter().enumerate() {
        let colour = RUN_COLOURS[i % RUN_COLOURS.len()];
        chart
            .draw_series(LineSeries::new(
                curves.smoothed_train(),
                colour.stroke_width(2),
            ))
            .map_err(|e| err(&e))?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        let evals = curves.evals();
        chart
            .draw_series(LineSeries::new(evals.clone(), colour.stroke_width(1)))
            .map_err(|e| err(&e))?;
        chart
            .draw_series(evals.iter().map(|&p| Circle::new(p, 4, colour.filled())))
            .map_err(|e| err(&e))?;
    }
    legend(&mut chart)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(lines: &[&str]) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        std::fs::write(&path, lines.join("\n")).unwrap();
        (dir, path)
    }

    fn train_line(step: u64, bpb: f64) -> String {
        format!(r#"{{"kind":"train","step":{step},"lr":0.001,"bits_per_byte":{bpb}}}"#)
    }

    #[test]
    fn reads_each_kind_names_a_bad_line_and_skips_a_torn_last_one() {
        let lines = [
            train_line(1, 8.0),
            train_line(2, 6.0),
            r#"{"kind":"eval","step":2,"bits_per_byte":5.5,"tokens":10}"#.into(),
            r#"{"kind":"final_eval","step":2,"bits_per_byte":5.25}"#.into(),
            r#"{"kind":"something_else","step":2,"bits_per_byte":1.0}"#.into(),
        ];
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (_dir, path) = metrics(&refs);
        let curves = Curves::read(&path).unwrap();
        assert_eq!(curves.train, vec![(1, 8.0), (2, 6.0)]);
        assert_eq!(curves.validation, vec![(2, 5.5)]);
        assert_eq!(curves.final_validation, Some((2, 5.25)));

        let (_dir, path) = metrics(&[&train_line(1, 8.0), "{not json", &train_line(2, 6.0)]);
        let err = Curves::read(&path).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        // A last line without its newline is being written (or was torn).
        let (_dir, path) = metrics(&[&train_line(1, 8.0), r#"{"kind":"tr"#]);
        assert_eq!(Curves::read(&path).unwrap().train, vec![(1, 8.0)]);
    }

    #[test]
    fn smoothing_is_a_trailing_mean() {
        let curves = Curves {
            train: (0..60).map(|i| (i, i as f64)).collect(),
            ..Curves::default()
        };
        let s = curves.smoothed_train();
        assert_eq!(s[0], (0, 0.0));
        assert_eq!(s[3], (3, 1.5)); // mean of 0..=3
        // Step 59: mean of 35..=59.
        assert!((s[59].1 - 47.0).abs() < 1e-12);
    }

    /// Pixels that are clearly red (validation) and clearly blue (training mean).
    fn render(curves: &Curves) -> (usize, usize) {
        let (w, h) = SIZE;
        let mut buf = vec![0u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area();
            draw(curves, &root, "test").unwrap();
            root.present().unwrap();
        }
        let px = buf.chunks(3);
        let red = px
            .clone()
            .filter(|p| p[0] > 200 && p[1] < 60 && p[2] < 60)
            .count();
        let blue = px.filter(|p| p[2] > 200 && p[0] < 60 && p[1] < 60).count();
        (red, blue)
    }

    #[test]
    fn draws_the_training_and_validation_curves() {
        let train: Vec<(u64, f64)> = (1..=200).map(|i| (i, 8.0 / (i as f64).sqrt())).collect();
        let with_eval = Curves {
            train: train.clone(),
            validation: vec![(100, 1.0), (200, 0.7)],
            final_validation: Some((200, 0.68)),
        };
        let (red, blue) = render(&with_eval);
        assert!(red > 100, "validation curve drawn: {red} red pixels");
        assert!(blue > 300, "training curve drawn: {blue} blue pixels");
        let (red, _) = render(&Curves {
            train,
            ..Curves::default()
        });
        assert_eq!(red, 0, "no validation, nothing red");
    }

    #[test]
    fn a_comparison_draws_every_run_in_its_colour() {
        // Pixels of exactly `colour` in a comparison of `runs`.
        let count = |runs: &[(String, Curves)], colour: RGBColor| {
            let (w, h) = SIZE;
            let mut buf = vec![0u8; (w * h * 3) as usize];
            {
                let root = BitMapBackend::with_buffer(&mut buf, SIZE).into_drawing_area();
                draw_comparison(runs, &root).unwrap();
                root.present().unwrap();
            }
            buf.chunks(3)
                .filter(|p| (p[0], p[1], p[2]) == (colour.0, colour.1, colour.2))
                .count()
        };
        let run = |scale: f64| Curves {
            train: (1..=200).map(|i| (i, scale / (i as f64).sqrt())).collect(),
            validation: vec![(100, scale * 0.1), (200, scale * 0.07)],
            final_validation: None,
        };
        let one = vec![("a".to_string(), run(8.0))];
        let two = vec![("a".to_string(), run(8.0)), ("b".to_string(), run(4.0))];
        let [first, second] = [RUN_COLOURS[0], RUN_COLOURS[1]];
        assert!(count(&one, first) > 300);
        assert_eq!(count(&one, second), 0, "one run, one colour");
        assert!(count(&two, first) > 300);
        assert!(
            count(&two, second) > 300,
            "the second run is drawn in the second colour"
        );
    }

    #[test]
    fn writes_a_png_and_refuses_an_empty_run() {
        let lines = [train_line(1, 8.0), train_line(2, 7.0), train_line(3, 6.5)];
        let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
        let (dir, path) = metrics(&refs);
        let out = dir.path().join("loss.png");
        plot_metrics(&path, &out, "run").unwrap();
        let png = std::fs::read(&out).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        // IHDR: width and height, big-endian, at bytes 16..24.
        assert_eq!(u32::from_be_bytes(png[16..20].try_into().unwrap()), SIZE.0);
        assert_eq!(u32::from_be_bytes(png[20..24].try_into().unwrap()), SIZE.1);

        let (_dir, empty) = metrics(&[]);
        let err = plot_metrics(&empty, &out, "run").unwrap_err().to_string();
        assert!(err.contains("no training steps"), "{err}");
    }
}
