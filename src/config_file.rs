//! Reading the TOML files users write (topologies, scenarios): every error
//! names the file, the line and column, and the key.

use std::fmt;
use std::path::Path;

use deepinfer_engine::speculative::policy::{DraftPolicy, MAX_DRAFT_TOKENS};
use deepinfer_engine::speculative::{DraftMethod, SpeculativeConfig};
use serde::de::DeserializeOwned;

/// An error in a user's file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    /// Dotted path of the key, when it can be named (`node.devices`).
    pub key: Option<String>,
    pub message: String,
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}: ", self.file, self.line, self.column)?;
        if let Some(key) = &self.key {
            write!(f, "key `{key}`: ")?;
        }
        write!(f, "{}", self.message)
    }
}

impl std::error::Error for FileError {}

/// Read and parse a TOML file into `T`.
pub fn read_toml<T: DeserializeOwned>(path: &Path) -> Result<T, FileError> {
    let (file, text) = read_text(path)?;
    parse_toml(&file, &text)
}

/// The file's name as errors show it, and its text.
pub fn read_text(path: &Path) -> Result<(String, String), FileError> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((file, text)),
        Err(e) => Err(FileError { file, line: 0, column: 0, key: None, message: format!("cannot read: {e}") }),
    }
}

/// Parse TOML text into `T`; `file` names it in errors.
pub fn parse_toml<T: DeserializeOwned>(file: &str, text: &str) -> Result<T, FileError> {
    toml::from_str(text).map_err(|e| {
        let span = e.span().unwrap_or(0..0);
        let message = e.message().trim().to_string();
        let (line, column) = line_column(text, span.start);
        // A missing field's span is the enclosing table; its name is in the message.
        let key = quoted_field(&message)
            .filter(|_| message.starts_with("missing field"))
            .map(|field| join(table_at(text, span.start), &field))
            .or_else(|| key_at(text, span.start));
        FileError { file: file.to_string(), line, column, key, message }
    })
}

/// An error about a value that parsed but does not make sense, at `span`.
pub fn value_error(file: &str, text: &str, span: std::ops::Range<usize>, message: impl Into<String>) -> FileError {
    let (line, column) = line_column(text, span.start);
    FileError { file: file.to_string(), line, column, key: key_at(text, span.start), message: message.into() }
}

/// 1-based line and column of a byte offset.
pub fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text[..offset];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

fn line_start(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].rfind('\n').map_or(0, |i| i + 1)
}

/// The `[table]` or `[[array]]` header in force at `offset`.
fn table_at(text: &str, offset: usize) -> Option<String> {
    // Headers up to and including the line at `offset`.
    let end = text[offset.min(text.len())..].find('\n').map_or(text.len(), |i| offset + i);
    let upto = &text[..end];
    upto.lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_string())
}

/// The dotted key of the `key = value` line containing `offset`.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let start = line_start(text, offset);
    let line = text[start..].lines().next().unwrap_or("");
    if line.trim_start().starts_with('[') {
        return Some(line.trim().trim_matches(|c| c == '[' || c == ']').trim().to_string());
    }
    let (name, _) = line.split_once('=')?;
    let name = name.trim().trim_matches('"');
    (!name.is_empty()).then(|| join(table_at(text, offset), name))
}

fn join(table: Option<String>, key: &str) -> String {
    match table {
        Some(t) if !t.is_empty() => format!("{t}.{key}"),
        _ => key.to_string(),
    }
}

fn quoted_field(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let end = start + message[start..].find('`')?;
    Some(message[start..end].to_string())
}

/// The speculative decoding of a `[speculative]`-style table's three keys
/// (a topology's and a scenario's): `method` (`off`, `mtp`, `dspark`),
/// `num_draft_tokens` (1 to 16) and `draft_length` (`fixed`, `adaptive`);
/// an error gives the span of the key at fault.
pub fn speculative_config(
    method: &toml::Spanned<String>,
    num_draft_tokens: &toml::Spanned<usize>,
    draft_length: &toml::Spanned<String>,
) -> Result<SpeculativeConfig, (std::ops::Range<usize>, String)> {
    let parsed: DraftMethod = method.get_ref().parse().map_err(|e| (method.span(), e))?;
    let k = *num_draft_tokens.get_ref();
    if !(1..=MAX_DRAFT_TOKENS).contains(&k) {
        return Err((num_draft_tokens.span(), format!("must be 1 to {MAX_DRAFT_TOKENS}, not {k}")));
    }
    let policy = match (parsed, draft_length.get_ref().as_str()) {
        (DraftMethod::Off, _) => DraftPolicy::Off,
        (_, "fixed") => DraftPolicy::Fixed(k),
        (_, "adaptive") => DraftPolicy::Adaptive { max: k },
        (_, other) => return Err((draft_length.span(), format!("unknown `{other}` (fixed, adaptive)"))),
    };
    Ok(SpeculativeConfig { method: parsed, policy })
}
