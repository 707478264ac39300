//! Checks shared by the scenario-file tests.

#![allow(dead_code)]

use std::path::Path;

use deepinfer::scenario::Scenario;

/// Each case `(from, to, key, needle)` edits `good` (its first `from`
/// becomes `to`); the result must be refused with an error that names
/// `file`, the line of `to`'s last line and `key`, and says `needle`.
pub fn assert_refused_with_place(file: &str, good: &str, cases: &[(&str, &str, &str, &str)]) {
    for &(from, to, key, needle) in cases {
        let text = good.replacen(from, to, 1);
        let last = to.lines().last().expect("a replacement");
        let line = text.lines().position(|l| l == last).expect("the edited line") + 1;
        let e = Scenario::parse(file, &text, Path::new(".")).unwrap_err();
        assert_eq!(e.key.as_deref(), Some(key), "{e}");
        assert_eq!(e.line, line, "{e}");
        assert!(e.to_string().starts_with(&format!("{file}:{line}:")) && e.to_string().contains(needle), "{e}");
    }
}
