//! Plots of a simulation report as standalone SVG: throughput over time
//! with faults marked, latency CDFs, and the expert-load heatmap.

use std::fmt::Write;
use std::path::Path;

use super::Report;

/// A line of a chart: name, colour, points.
pub type Line<'a> = (&'a str, &'a str, Vec<(f64, f64)>);

const W: f64 = 760.0;
const H: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 50.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// A tick step near `span / 5` of the form 1, 2 or 5 × 10^k.
fn tick(span: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|&s| s >= raw).unwrap_or(10.0 * mag)
}

fn number(v: f64) -> String {
    if v.abs() >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v.abs() >= 10.0 || v == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// Lines `(name, colour, points)` on shared axes, with vertical marks `(x, label)`.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, lines: &[Line<'_>], marks: &[(f64, String)]) -> String {
    let points = lines.iter().flat_map(|l| l.2.iter());
    let (mut x_max, mut y_max) = (0.0f64, 0.0f64);
    for &(x, y) in points {
        x_max = x_max.max(x);
        y_max = y_max.max(y);
    }
    for (x, _) in marks {
        x_max = x_max.max(*x);
    }
    let (x_max, y_max) = (if x_max > 0.0 { x_max } else { 1.0 }, if y_max > 0.0 { y_max * 1.05 } else { 1.0 });
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let sx = |x: f64| LEFT + x / x_max * pw;
    let sy = |y: f64| TOP + ph - y / y_max * ph;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"14\" text-anchor=\"middle\">{}</text>\n",
        W / 2.0,
        escape(title)
    );
    let (xt, yt) = (tick(x_max), tick(y_max));
    let mut v = 0.0;
    while v <= y_max + 1e-9 {
        let y = sy(v);
        let _ =
            writeln!(svg, "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#e5e5e5\"/>", W - RIGHT);
        let _ =
            writeln!(svg, "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>", LEFT - 6.0, y + 4.0, number(v));
        v += yt;
    }
    let mut v = 0.0;
    while v <= x_max + 1e-9 {
        let x = sx(v);
        let _ =
            writeln!(svg, "<text x=\"{x:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>", TOP + ph + 16.0, number(v));
        v += xt;
    }
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n\
         <text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{}</text>",
        LEFT + pw / 2.0,
        H - 12.0,
        escape(x_label),
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        escape(y_label)
    );
    for (i, (x, label)) in marks.iter().enumerate() {
        let px = sx(*x);
        let _ = writeln!(
            svg,
            "<line x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{TOP}\" y2=\"{}\" stroke=\"#d62728\" stroke-dasharray=\"4 3\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#d62728\">{}</text>",
            TOP + ph,
            px + 3.0,
            TOP + 12.0 + 12.0 * (i % 4) as f64,
            escape(label)
        );
    }
    for (i, (name, colour, pts)) in lines.iter().enumerate() {
        let path: Vec<String> = pts.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"1.5\" points=\"{}\"/>\n\
             <rect x=\"{}\" y=\"{}\" width=\"12\" height=\"3\" fill=\"{colour}\"/>\n\
             <text x=\"{}\" y=\"{}\">{}</text>",
            path.join(" "),
            W - RIGHT - 150.0,
            TOP + 10.0 + 14.0 * i as f64,
            W - RIGHT - 134.0,
            TOP + 14.0 + 14.0 * i as f64,
            escape(name)
        );
    }
    svg + "</svg>\n"
}

/// Labelled points `(x, y, label)` on axes from 0, with `line` (sorted by x) drawn through its points.
pub fn scatter_chart(
    title: &str,
    x_label: &str,
    y_label: &str,
    points: &[(f64, f64, String)],
    line: &[(f64, f64)],
) -> String {
    // The axes of a line chart over the same points (their line drawn in no colour).
    let all: Vec<(f64, f64)> = points.iter().map(|p| (p.0, p.1)).collect();
    let axes = line_chart(title, x_label, y_label, &[("", "none", all), ("frontier", "#2b7bba", line.to_vec())], &[]);
    let x_max = points.iter().map(|p| p.0).fold(0.0f64, f64::max);
    let y_max = points.iter().map(|p| p.1).fold(0.0f64, f64::max);
    let (x_max, y_max) = (if x_max > 0.0 { x_max } else { 1.0 }, if y_max > 0.0 { y_max * 1.05 } else { 1.0 });
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let mut dots = String::new();
    for (x, y, label) in points {
        let (px, py) = (LEFT + x / x_max * pw, TOP + ph - y / y_max * ph);
        let _ = writeln!(
            dots,
            "<circle cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"4\" fill=\"#d7301f\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\" font-size=\"9\" text-anchor=\"end\">{}</text>",
            px - 6.0,
            py - 6.0,
            escape(label)
        );
    }
    axes.replacen("</svg>\n", &(dots + "</svg>\n"), 1)
}

/// A `[row][column]` matrix of non-negative values as shades of blue.
pub fn heatmap(title: &str, x_label: &str, y_label: &str, m: &[Vec<f64>]) -> String {
    let rows = m.len().max(1);
    let cols = m.first().map_or(1, Vec::len).max(1);
    let max = m.iter().flatten().cloned().fold(0.0f64, f64::max).max(1e-12);
    let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
    let (cw, ch) = (pw / cols as f64, ph / rows as f64);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" font-size=\"14\" text-anchor=\"middle\">{} (darkest = {:.2}% of a layer's pairs)</text>\n",
        W / 2.0,
        escape(title),
        max * 100.0
    );
    for (r, row) in m.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            let shade = (255.0 * (1.0 - v / max)).round().clamp(0.0, 255.0) as u8;
            let _ = writeln!(
                svg,
                "<rect x=\"{:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"{:.2}\" fill=\"rgb({shade},{shade},255)\"/>",
                LEFT + c as f64 * cw,
                TOP + r as f64 * ch,
                cw + 0.05,
                ch + 0.05
            );
        }
    }
    let _ = writeln!(
        svg,
        "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#444\"/>\n\
         <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{} (0–{})</text>\n\
         <text x=\"16\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {})\">{} (0–{})</text>",
        LEFT + pw / 2.0,
        H - 12.0,
        escape(x_label),
        cols - 1,
        TOP + ph / 2.0,
        TOP + ph / 2.0,
        escape(y_label),
        rows - 1
    );
    svg + "</svg>\n"
}

fn cdf(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    // At most 400 points: enough for the eye, small files.
    let stride = n.div_ceil(400).max(1);
    let mut pts: Vec<(f64, f64)> = (0..n).step_by(stride).map(|i| (sorted[i], (i + 1) as f64 / n as f64)).collect();
    if let Some(&last) = sorted.last() {
        pts.push((last, 1.0));
    }
    pts
}

/// Write `throughput.svg`, `latency_cdf.svg` (TTFT) , `tpot_cdf.svg`, `expert_load.svg` and,
/// with cache tiers, `cache_tiers.svg` into `dir`.
pub fn write_all(report: &Report, dir: &Path) -> std::io::Result<()> {
    let input: Vec<(f64, f64)> = report.series.iter().map(|p| (p.t_s, p.input_tok_s)).collect();
    let output: Vec<(f64, f64)> = report.series.iter().map(|p| (p.t_s, p.output_tok_s)).collect();
    let through = line_chart(
        &format!("{}: throughput over time", report.scenario),
        "simulated time (s)",
        "tokens/s",
        &[("input (prefilled)", "#1f77b4", input), ("output", "#2ca02c", output)],
        &report.faults,
    );
    std::fs::write(dir.join("throughput.svg"), through)?;
    let ttft = line_chart(
        &format!("{}: TTFT CDF (p99 {:.0} ms)", report.scenario, report.ttft_ms.p99),
        "time to first token (ms)",
        "fraction of requests",
        &[("TTFT", "#9467bd", cdf(&report.ttft_sorted_ms))],
        &[],
    );
    std::fs::write(dir.join("latency_cdf.svg"), ttft)?;
    let tpot = line_chart(
        &format!("{}: TPOT CDF (p99 {:.1} ms)", report.scenario, report.tpot_ms.p99),
        "time per output token (ms)",
        "fraction of requests",
        &[("TPOT", "#ff7f0e", cdf(&report.tpot_sorted_ms))],
        &[],
    );
    std::fs::write(dir.join("tpot_cdf.svg"), tpot)?;
    let heat = heatmap(
        &format!("{}: expert load per device", report.scenario),
        "device of the first decoding instance",
        "MoE layer",
        &report.expert_heatmap,
    );
    std::fs::write(dir.join("expert_load.svg"), heat)?;
    if let Some(c) = &report.cache {
        let chart = line_chart(
            &format!("{}: prompt tokens served per cache tier (all: {:.1}%)", report.scenario, c.hit_rate * 100.0),
            "simulated time (s)",
            "hit rate (% of prompt tokens admitted)",
            &c.lines(),
            &report.faults,
        );
        std::fs::write(dir.join("cache_tiers.svg"), chart)?;
    }
    Ok(())
}
