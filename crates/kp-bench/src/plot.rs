//! PNG plots of the results with plotters: sync time against N and connect latency against N,
//! one line per mode, on log-log axes.
//!
//! Text is drawn with ab_glyph from DejaVu Sans, read at run time from Debian's
//! `fonts-dejavu-core` (or the file named by `KP_BENCH_FONT`), so nothing depends on
//! fontconfig or a system font lookup.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::results::Results;

/// Where the font is looked for, after `KP_BENCH_FONT`.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// The plots, relative to the repository root.
pub const SYNC_TIME: &str = "bench/sync_time.png";
/// The real-API-server plot: our binary and upstream's on the same API server.
pub const REAL_APISERVER: &str = "bench/real_apiserver.png";
/// The connect-latency plot.
pub const CONNECT_LATENCY: &str = "bench/connect_latency.png";
/// The churn soak's plot (`bench churn`).
pub const CHURN: &str = "bench/churn.png";

const FAMILY: &str = "sans-serif";

/// Registers the font once; the error says how to get one.
fn font() -> Result<(), String> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os("KP_BENCH_FONT")
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        for path in &candidates {
            if let Ok(bytes) = std::fs::read(path) {
                // plotters keeps fonts for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                return plotters::style::register_font(FAMILY, FontStyle::Normal, bytes)
                    .map_err(|_| format!("{} is not a font plotters can read", path.display()));
            }
        }
        Err(format!(
            "no font for the plots: install Debian's fonts-dejavu-core (apt-get install fonts-dejavu-core) or set KP_BENCH_FONT to a .ttf file (looked in {})",
            FONT_PATHS.join(", ")
        ))
    })
    .clone()
}

/// Colours per mode, in run order.
const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];
const GREY: RGBColor = RGBColor(120, 120, 120);
const LIGHT_GREY: RGBColor = RGBColor(185, 185, 185);

/// One line of a panel.
struct Line {
    label: String,
    color: RGBColor,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// One panel: title, y-axis label, lines.
struct Panel {
    title: String,
    y_label: String,
    lines: Vec<Line>,
}

/// The positive finite values' span, widened by `pad` on both sides (a fixed span if none).
fn span(values: impl Iterator<Item = f64> + Clone, pad: f64) -> (f64, f64) {
    let positive = values.filter(|v| *v > 0.0 && v.is_finite());
    let lo = positive.clone().fold(f64::INFINITY, f64::min);
    let hi = positive.fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return (0.1, 10.0);
    }
    (lo / pad, hi * pad)
}

/// Label values for a log axis over `lo..hi`: 1-2-5 steps, or every whole step of the decade
/// when that would give fewer than four labels (a narrow range).
fn one_two_five(lo: f64, hi: f64) -> Vec<f64> {
    let steps = |multiples: &[f64]| {
        let mut out = Vec::new();
        let mut decade = 10f64.powf(lo.log10().floor());
        while decade <= hi {
            for m in multiples {
                let v = decade * m;
                if v >= lo && v <= hi {
                    out.push(v);
                }
            }
            decade *= 10.0;
        }
        out
    };
    let coarse = steps(&[1.0, 2.0, 5.0]);
    if coarse.len() >= 4 {
        coarse
    } else {
        steps(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
    }
}

fn draw(path: &Path, panels: &[Panel]) -> Result<(), String> {
    font()?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
    }
    let width = 640 * panels.len() as u32;
    let root = BitMapBackend::new(path, (width, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let areas = root.split_evenly((1, panels.len()));
    for (area, panel) in areas.iter().zip(panels) {
        let xs = panel
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.0));
        let (x0, x1) = span(xs.clone(), 1.4);
        let mut x_keys: Vec<f64> = xs.collect();
        x_keys.sort_by(f64::total_cmp);
        x_keys.dedup();
        let (y0, y1) = span(
            panel
                .lines
                .iter()
                .flat_map(|l| l.points.iter().map(|p| p.1)),
            2.0,
        );
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, (FAMILY, 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(
                (x0..x1).log_scale().with_key_points(x_keys),
                (y0..y1).log_scale().with_key_points(one_two_five(y0, y1)),
            )
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc("Services (N)")
            .y_desc(panel.y_label.as_str())
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format_number(*v))
            .label_style((FAMILY, 13))
            .axis_desc_style((FAMILY, 15))
            .draw()
            .map_err(|e| err(&e))?;
        for line in &panel.lines {
            let style = ShapeStyle::from(&line.color).stroke_width(2);
            if line.dashed {
                chart
                    .draw_series(DashedLineSeries::new(line.points.clone(), 8, 5, style))
                    .map_err(|e| err(&e))?
                    .label(line.label.as_str())
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (7, 0)], style)
                            + PathElement::new(vec![(11, 0), (18, 0)], style)
                    });
            } else {
                chart
                    .draw_series(LineSeries::new(line.points.clone(), style))
                    .map_err(|e| err(&e))?
                    .label(line.label.as_str())
                    .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
            }
            chart
                .draw_series(
                    line.points
                        .iter()
                        .map(|p| Circle::new(*p, 3, ShapeStyle::from(&line.color).filled())),
                )
                .map_err(|e| err(&e))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font((FAMILY, 13))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

fn format_number(v: f64) -> String {
    if v >= 10.0 || (v >= 1.0 && (v - v.round()).abs() < 1e-9) {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else if v >= 0.001 {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    } else {
        format!("{v:.1e}")
    }
}

fn points(
    results: &Results,
    mode: &str,
    f: impl Fn(&crate::results::Run) -> Option<f64>,
) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = results
        .runs
        .iter()
        .filter(|r| r.mode == mode)
        .filter_map(|r| f(r).filter(|y| *y > 0.0).map(|y| (r.services as f64, y)))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

/// The sync-time plot: full sync (with the bare load dashed) and the one-endpoint change p99.
pub fn sync_time(results: &Results, path: &Path) -> Result<(), String> {
    // Upstream's rows have no in-process phases: they are in the real-API-server plot.
    let mut modes = results.modes();
    modes.retain(|m| !crate::upstream::is_upstream(m));
    let mut full = Vec::new();
    let mut partial = Vec::new();
    for (i, mode) in modes.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        full.push(Line {
            label: format!("{mode}: full sync"),
            color,
            dashed: false,
            points: points(results, mode, |r| r.full_sync.as_ref().map(|f| f.total_s)),
        });
        full.push(Line {
            label: format!("{mode}: bare kernel load"),
            color,
            dashed: true,
            points: points(results, mode, |r| r.bare.as_ref().map(|b| b.seconds)),
        });
        partial.push(Line {
            label: mode.clone(),
            color,
            dashed: false,
            points: points(results, mode, |r| r.incremental_ms.map(|s| s.p99)),
        });
    }
    draw(
        path,
        &[
            Panel {
                title: "First full sync".into(),
                y_label: "seconds".into(),
                lines: full,
            },
            Panel {
                title: "One-endpoint change, p99".into(),
                y_label: "milliseconds".into(),
                lines: partial,
            },
        ],
    )
}

/// The real-API-server plot: startup (first full sync after start, list included) and the
/// programming latency p99 of our binary and upstream's against N, both fed by the same real
/// API server (the `kube-apiserver` source).
pub fn real_apiserver(results: &Results, path: &Path) -> Result<(), String> {
    let source = crate::proxy::Source::KubeApiServer.name();
    let mut startup = Vec::new();
    let mut p99 = Vec::new();
    for (i, mode) in results.modes().iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let pick = |f: fn(&crate::results::ProxyRun) -> f64| {
            points(results, mode, move |r| {
                r.proxy.iter().find(|p| p.source == source).map(f)
            })
        };
        let start = pick(|p| p.startup_s);
        if start.is_empty() {
            continue;
        }
        startup.push(Line {
            label: mode.clone(),
            color,
            dashed: crate::upstream::is_upstream(mode),
            points: start,
        });
        p99.push(Line {
            label: mode.clone(),
            color,
            dashed: crate::upstream::is_upstream(mode),
            points: pick(|p| p.latency_ms.p99),
        });
    }
    if startup.is_empty() {
        return Err("no run with the kube-apiserver source".into());
    }
    draw(
        path,
        &[
            Panel {
                title: "Real API server: start to cluster live".into(),
                y_label: "seconds".into(),
                lines: startup,
            },
            Panel {
                title: "Real API server: programming latency p99".into(),
                y_label: "milliseconds".into(),
                lines: p99,
            },
        ],
    )
}

/// The connect-latency plot: p50 and p99 through the ClusterIP per mode, straight to the pod,
/// and straight to the pod before any rule was loaded (the physical limit); the last two
/// averaged over the modes' runs.
pub fn connect_latency(results: &Results, path: &Path) -> Result<(), String> {
    let modes = results.modes();
    let mut panels = Vec::new();
    for (title, pick) in [
        ("New TCP connection, p50", 0usize),
        ("New TCP connection, p99", 1usize),
    ] {
        let q = move |s: &crate::stats::Summary| if pick == 0 { s.p50 } else { s.p99 };
        let mut lines: Vec<Line> = modes
            .iter()
            .enumerate()
            .map(|(i, mode)| Line {
                label: format!("{mode}: via ClusterIP"),
                color: PALETTE[i % PALETTE.len()],
                dashed: false,
                points: points(results, mode, |r| {
                    r.datapath.as_ref().map(|d| q(&d.vip.latency_us))
                }),
            })
            .collect();
        let mut sizes: Vec<usize> = results.runs.iter().map(|r| r.services).collect();
        sizes.sort_unstable();
        sizes.dedup();
        // Averaged over the modes' runs at each size: neither depends on the mode much.
        let average = |pick_connect: &dyn Fn(&crate::results::Datapath) -> Option<f64>| {
            let mut points = Vec::new();
            for &n in &sizes {
                let d: Vec<f64> = results
                    .runs
                    .iter()
                    .filter(|r| r.services == n)
                    .filter_map(|r| r.datapath.as_ref().and_then(pick_connect))
                    .filter(|v| *v > 0.0)
                    .collect();
                if !d.is_empty() {
                    points.push((n as f64, d.iter().sum::<f64>() / d.len() as f64));
                }
            }
            points
        };
        lines.push(Line {
            label: "direct to the pod IP".into(),
            color: GREY,
            dashed: true,
            points: average(&|d| Some(q(&d.direct.latency_us))),
        });
        lines.push(Line {
            label: "to the pod IP, no rules loaded".into(),
            color: LIGHT_GREY,
            dashed: true,
            points: average(&|d| d.unloaded.as_ref().map(|u| q(&u.latency_us))),
        });
        panels.push(Panel {
            title: title.into(),
            y_label: "microseconds".into(),
            lines,
        });
    }
    draw(path, &panels)
}

/// The churn soak's plot: the proxy's VmRSS and VmHWM every second (left), and each timed
/// change's programming latency against when it was made, on a log scale (right); the end of
/// the churn is a dashed vertical line in both.
pub fn churn(r: &crate::churn::ChurnResults, path: &Path) -> Result<(), String> {
    font()?;
    let err = |e: &dyn std::fmt::Display| format!("drawing {}: {e}", path.display());
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err(&e))?;
    }
    let s = &r.settings;
    let end = s.seconds as f64;
    let samples = &r.memory.samples;
    let t_max = samples
        .iter()
        .map(|m| m.t_s)
        .chain(r.latency_samples.iter().map(|l| l.at_s))
        .fold(end, f64::max)
        * 1.02;
    let root = BitMapBackend::new(path, (1280, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (title, body) = root.split_vertically(40);
    title
        .titled(
            &format!(
                "{}: {} Services × {}, {} endpoint changes/s for {} s (achieved {:.1}/s), API source",
                s.mode, s.services, s.endpoints, s.target_rate, s.seconds, r.pace.achieved_rate
            ),
            (FAMILY, 20),
        )
        .map_err(|e| err(&e))?;
    let areas = body.split_evenly((1, 2));

    let y_max = samples
        .iter()
        .map(|m| m.hwm_mib.max(m.rss_mib))
        .fold(1.0, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&areas[0])
        .caption("kube-proxy memory", (FAMILY, 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..t_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the churn started")
        .y_desc("MiB")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FAMILY, 13))
        .axis_desc_style((FAMILY, 15))
        .draw()
        .map_err(|e| err(&e))?;
    // VmRSS solid, then VmHWM dashed over it: where the peak is the current size, both show.
    let rss = ShapeStyle::from(&PALETTE[0]).stroke_width(2);
    chart
        .draw_series(LineSeries::new(
            samples.iter().map(|m| (m.t_s, m.rss_mib)),
            rss,
        ))
        .map_err(|e| err(&e))?
        .label("VmRSS")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], rss));
    let hwm = ShapeStyle::from(&PALETTE[1]).stroke_width(2);
    chart
        .draw_series(DashedLineSeries::new(
            samples.iter().map(|m| (m.t_s, m.hwm_mib)),
            8,
            5,
            hwm,
        ))
        .map_err(|e| err(&e))?
        .label("VmHWM (peak)")
        .legend(move |(x, y)| {
            EmptyElement::at((x, y))
                + PathElement::new(vec![(0, 0), (7, 0)], hwm)
                + PathElement::new(vec![(11, 0), (18, 0)], hwm)
        });
    let grey = ShapeStyle::from(&GREY).stroke_width(1);
    chart
        .draw_series(DashedLineSeries::new(
            vec![(end, 0.0), (end, y_max)],
            6,
            4,
            grey,
        ))
        .map_err(|e| err(&e))?
        .label("end of the churn")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], grey));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FAMILY, 13))
        .draw()
        .map_err(|e| err(&e))?;

    let (y0, y1) = span(r.latency_samples.iter().map(|l| l.ms), 2.0);
    // Lower bounds below the first-seen range are left out rather than squeezing the axis.
    let mut chart = ChartBuilder::on(&areas[1])
        .caption(
            format!(
                "Programming latency of {} timed changes (p50 {:.1} ms, p99 {:.1} ms)",
                r.latency_ms.n, r.latency_ms.p50, r.latency_ms.p99
            ),
            (FAMILY, 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(
            0.0..t_max,
            (y0..y1).log_scale().with_key_points(one_two_five(y0, y1)),
        )
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("seconds since the churn started (when the change was made)")
        .y_desc("milliseconds")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format_number(*v))
        .label_style((FAMILY, 13))
        .axis_desc_style((FAMILY, 15))
        .draw()
        .map_err(|e| err(&e))?;
    // Lower bounds first, so the first-seen points stay on top.
    chart
        .draw_series(
            r.latency_samples
                .iter()
                .filter(|l| l.absent_ms >= y0)
                .map(|l| {
                    Circle::new(
                        (l.at_s, l.absent_ms),
                        2,
                        ShapeStyle::from(&LIGHT_GREY).filled(),
                    )
                }),
        )
        .map_err(|e| err(&e))?
        .label("last seen absent (lower bound)")
        .legend(|(x, y)| Circle::new((x + 9, y), 3, ShapeStyle::from(&LIGHT_GREY).filled()));
    chart
        .draw_series(
            r.latency_samples
                .iter()
                .filter(|l| l.ms > 0.0)
                .map(|l| Circle::new((l.at_s, l.ms), 2, ShapeStyle::from(&PALETTE[0]).filled())),
        )
        .map_err(|e| err(&e))?
        .label("first seen in the kernel")
        .legend(|(x, y)| Circle::new((x + 9, y), 3, ShapeStyle::from(&PALETTE[0]).filled()));
    let p99 = r.latency_ms.p99;
    if p99 > 0.0 {
        let style = ShapeStyle::from(&PALETTE[1]).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, p99), (t_max, p99)],
                6,
                4,
                style,
            ))
            .map_err(|e| err(&e))?
            .label("p99")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart
        .draw_series(DashedLineSeries::new(
            vec![(end, y0), (end, y1)],
            6,
            4,
            grey,
        ))
        .map_err(|e| err(&e))?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FAMILY, 13))
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_axis_labels_are_one_two_five_or_finer_on_a_narrow_range() {
        assert_eq!(
            one_two_five(0.15, 12.0),
            vec![0.2, 0.5, 1.0, 2.0, 5.0, 10.0]
        );
        assert_eq!(one_two_five(19.0, 60.0), vec![20.0, 30.0, 40.0, 50.0, 60.0]);
    }
}
