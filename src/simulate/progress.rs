//! How a run shows its progress on stderr: nothing, a bar (stderr is a
//! terminal), or a plain line every few seconds of wall time, for a run
//! whose stderr goes to a log (`deepinfer simulate --progress`).

use std::cell::Cell;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};

/// Wall time between two progress lines unless told otherwise.
pub const EVERY_DEFAULT_S: f64 = 5.0;

/// What a run shows while it runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Progress {
    #[default]
    Off,
    /// A bar on the terminal.
    Bar,
    /// A line on stderr at the first of the time series' samples, then at
    /// the first sample at least `every` of wall time after the previous
    /// line, and one at the end; each starts with `label` (`progress`, or a
    /// capacity probe's load).
    Lines { every: Duration, label: String },
}

impl From<bool> for Progress {
    /// `true`: a bar.
    fn from(bar: bool) -> Self {
        if bar {
            Progress::Bar
        } else {
            Progress::Off
        }
    }
}

impl Progress {
    /// Lines every `every_s` seconds of wall time, labelled `label`.
    pub fn lines(every_s: f64, label: impl Into<String>) -> Self {
        Progress::Lines { every: Duration::from_secs_f64(every_s.max(0.0)), label: label.into() }
    }

    /// The same with the label `relabel` makes of it (lines only).
    pub fn relabelled(&self, relabel: impl FnOnce(&str) -> String) -> Self {
        match self {
            Progress::Lines { every, label } => Progress::Lines { every: *every, label: relabel(label) },
            other => other.clone(),
        }
    }
}

/// The running side of a [`Progress`], for one run of `total_s` simulated seconds.
pub struct Reporter {
    bar: ProgressBar,
    lines: Option<(Duration, String)>,
    total_s: f64,
    started: Instant,
    last: Cell<Option<Instant>>,
}

impl Reporter {
    pub fn new(progress: &Progress, total_s: f64) -> Self {
        let bar =
            if *progress == Progress::Bar { ProgressBar::new(total_s.ceil() as u64) } else { ProgressBar::hidden() };
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} simulated s, {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        let lines = match progress {
            Progress::Lines { every, label } => Some((*every, label.clone())),
            _ => None,
        };
        Self { bar, lines, total_s, started: Instant::now(), last: Cell::new(None) }
    }

    /// Whether a line is due.
    fn due(&self) -> bool {
        match &self.lines {
            Some((every, _)) => self.last.get().is_none_or(|t| t.elapsed() >= *every),
            None => false,
        }
    }

    /// At a sample: `simulated_s` of the run done, `submitted` requests so
    /// far, `running` of them still running.
    pub fn show(&self, simulated_s: f64, submitted: usize, running: usize) {
        self.bar.set_position(simulated_s as u64);
        self.bar.set_message(format!("{submitted} requests, {running} running"));
        if self.due() {
            self.last.set(Some(Instant::now()));
            self.line(simulated_s, submitted, running);
        }
    }

    fn line(&self, simulated_s: f64, submitted: usize, running: usize) {
        if let Some((_, label)) = &self.lines {
            eprintln!(
                "{label}: {simulated_s:.0}/{:.0} simulated s, {submitted} requests submitted, {running} running, \
                 {:.1} s of wall time",
                self.total_s,
                self.started.elapsed().as_secs_f64()
            );
        }
    }

    /// The run ended at `simulated_s`: clear the bar, print the last line.
    pub fn finish(&self, simulated_s: f64, submitted: usize, running: usize) {
        self.bar.finish_and_clear();
        self.line(simulated_s, submitted, running);
    }
}
