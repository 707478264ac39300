//! A JSON schema tightened before it becomes a grammar, so that every string the
//! grammar allows is one the client's parser accepts, not only one the schema's
//! letter allows:
//!
//! - **Numbers.** An unbounded `number` or `integer` lets the grammar write
//!   `188188e124186` or a thousand digits, which overflows a double and fails
//!   to parse. Missing bounds become ±[`NUMBER_LIMIT`] (at most 16 digits before
//!   the point, and a bounded range has no exponent in the grammar).
//! - **Dates and times.** `format` `date-time`, `date` and `time` become
//!   patterns of RFC 3339 that also hold in the calendar: 29 February only in
//!   leap years, no year 0000, no leap second, at most 6 fractional digits,
//!   which is what date libraries (Python's `datetime`, pydantic) accept.
//!   The other formats (`email`, `uuid`, `uri`, `ipv4`, …) are the grammar
//!   engine's own, limited to [`FORMAT_CHARS_MAX`] characters without a
//!   `maxLength`: a string that must still reach its `@` or its host cannot be
//!   closed early when the token budget runs out.
//!
//! Tightening only removes strings: what it allows, the client's schema allows.

use serde_json::{Map, Value};

/// Largest magnitude a number gets when its schema sets no bound: exact as
/// an integer in a double, and with an integer part of at most 16 digits.
pub const NUMBER_LIMIT: i64 = 9_007_199_254_740_991;

/// Longest string under a `format` that sets no `maxLength`.
pub const FORMAT_CHARS_MAX: u64 = 64;

/// A year 0001 to 9999.
const YEAR: &str = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)";
/// A leap year 0004 to 9996: divisible by 4, centuries only when by 400.
const LEAP_YEAR: &str = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)";

fn date() -> String {
    format!(
        "(?:{YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))|{LEAP_YEAR}-02-29)"
    )
}

fn time() -> &'static str {
    "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,6})?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
}

/// The anchored pattern that replaces `format`, where this module has one.
pub fn format_pattern(format: &str) -> Option<String> {
    match format {
        "date-time" => Some(format!("^{}[tT]{}$", date(), time())),
        "date" => Some(format!("^{}$", date())),
        "time" => Some(format!("^{}$", time())),
        _ => None,
    }
}

/// Tighten `schema` and every schema inside it.
pub fn tighten(schema: &mut Value) {
    tighten_at(schema, 0);
}

fn tighten_at(schema: &mut Value, depth: usize) {
    // Schemas nest through `$defs` and references, never unboundedly in the text;
    // the bound only keeps a pathological document from exhausting the stack.
    if depth > 64 {
        return;
    }
    let Some(obj) = schema.as_object_mut() else { return };
    tighten_string(obj);
    tighten_number(obj);
    for key in ["properties", "$defs", "definitions", "patternProperties"] {
        if let Some(Value::Object(subs)) = obj.get_mut(key) {
            subs.values_mut().for_each(|s| tighten_at(s, depth + 1));
        }
    }
    for key in ["items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else"] {
        match obj.get_mut(key) {
            Some(Value::Array(subs)) => subs.iter_mut().for_each(|s| tighten_at(s, depth + 1)),
            Some(sub) => tighten_at(sub, depth + 1),
            None => {}
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(subs)) = obj.get_mut(key) {
            subs.iter_mut().for_each(|s| tighten_at(s, depth + 1));
        }
    }
}

fn tighten_string(obj: &mut Map<String, Value>) {
    if obj.contains_key("format") && !obj.contains_key("maxLength") {
        obj.insert("maxLength".into(), Value::from(FORMAT_CHARS_MAX));
    }
    // With a pattern of its own the schema keeps `format`: the engine intersects the two.
    if obj.contains_key("pattern") {
        return;
    }
    let Some(pattern) = obj.get("format").and_then(Value::as_str).and_then(format_pattern) else { return };
    obj.remove("format");
    obj.insert("pattern".into(), Value::String(pattern));
}

fn has_type(obj: &Map<String, Value>, name: &str) -> bool {
    match obj.get("type") {
        Some(Value::String(t)) => t == name,
        Some(Value::Array(ts)) => ts.iter().any(|t| t == name),
        _ => false,
    }
}

fn tighten_number(obj: &mut Map<String, Value>) {
    if !has_type(obj, "number") && !has_type(obj, "integer") {
        return;
    }
    // A draft-4 boolean `exclusiveMinimum` qualifies `minimum`; a number is a bound.
    let bounded = |obj: &Map<String, Value>, plain: &str, exclusive: &str| {
        obj.get(plain).is_some_and(Value::is_number) || obj.get(exclusive).is_some_and(Value::is_number)
    };
    if !bounded(obj, "minimum", "exclusiveMinimum") {
        obj.insert("minimum".into(), Value::from(-NUMBER_LIMIT));
    }
    if !bounded(obj, "maximum", "exclusiveMaximum") {
        obj.insert("maximum".into(), Value::from(NUMBER_LIMIT));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn matches(pattern: &str, text: &str) -> bool {
        let rx = regex_lite(pattern);
        rx(text)
    }

    /// A full-match check through llguidance's own regex engine.
    fn regex_lite(pattern: &str) -> impl Fn(&str) -> bool {
        let inner = pattern.trim_start_matches('^').trim_end_matches('$').to_string();
        move |text: &str| {
            let mut builder = llguidance::derivre::RegexBuilder::new();
            let id = builder.mk_regex(&inner).unwrap();
            let mut rx = builder.to_regex(id);
            rx.is_match(text)
        }
    }

    #[test]
    fn dates_hold_in_the_calendar() {
        let d = format_pattern("date").unwrap();
        for ok in ["2024-02-29", "2000-02-29", "0004-02-29", "1999-12-31", "0001-01-01", "2023-02-28"] {
            assert!(matches(&d, ok), "{ok}");
        }
        for bad in ["2023-02-29", "1900-02-29", "0000-01-01", "2024-13-01", "2024-04-31", "2024-1-01", "24-01-01"] {
            assert!(!matches(&d, bad), "{bad}");
        }
    }

    #[test]
    fn date_times_and_times_are_rfc_3339() {
        let dt = format_pattern("date-time").unwrap();
        for ok in ["2024-05-06T07:08:09Z", "2024-05-06t23:59:59.123456+05:30", "1970-01-01T00:00:00-00:00"] {
            assert!(matches(&dt, ok), "{ok}");
        }
        for bad in ["2024-05-06T07:08:60Z", "2024-05-06T24:00:00Z", "2024-05-06 07:08:09Z", "2024-05-06T07:08:09"] {
            assert!(!matches(&dt, bad), "{bad}");
        }
        let t = format_pattern("time").unwrap();
        assert!(matches(&t, "12:34:56Z") && !matches(&t, "12:34:56.1234567Z"));
        assert_eq!(format_pattern("email"), None, "the engine's own");
    }

    #[test]
    fn unbounded_numbers_get_bounds_and_bounded_ones_keep_theirs() {
        let mut s = json!({"type": "object", "properties": {
            "n": {"type": "number"},
            "i": {"type": ["integer", "null"], "minimum": 3},
            "x": {"type": "number", "exclusiveMaximum": 1.5},
            "when": {"type": "string", "format": "date"},
            "list": {"type": "array", "items": {"type": "integer"}},
        }, "$defs": {"d": {"anyOf": [{"type": "number"}]}}});
        tighten(&mut s);
        let p = &s["properties"];
        assert_eq!((p["n"]["minimum"].as_i64(), p["n"]["maximum"].as_i64()), (Some(-NUMBER_LIMIT), Some(NUMBER_LIMIT)));
        assert_eq!((p["i"]["minimum"].as_i64(), p["i"]["maximum"].as_i64()), (Some(3), Some(NUMBER_LIMIT)));
        assert_eq!((p["x"]["minimum"].as_i64(), p["x"].get("maximum")), (Some(-NUMBER_LIMIT), None));
        assert!(p["when"].get("format").is_none() && p["when"]["pattern"].is_string());
        assert_eq!(p["when"]["maxLength"].as_u64(), Some(FORMAT_CHARS_MAX));
        assert_eq!(p["list"]["items"]["maximum"].as_i64(), Some(NUMBER_LIMIT));
        assert_eq!(s["$defs"]["d"]["anyOf"][0]["minimum"].as_i64(), Some(-NUMBER_LIMIT));
    }
}
