//! Image parts of the three protocols, found in the raw body with their field
//! paths: Chat Completions `{"type": "image_url", "image_url": {"url", "detail"}}`,
//! Messages `{"type": "image", "source": {"type": "base64"|"url", …}}` and
//! Responses `{"type": "input_image", "image_url", "detail"}`. Images are read
//! in user messages only; anywhere else (system, assistant, tool results) they
//! are refused by their place. `detail` is honoured as `auto` or `high` (the
//! model's one resolution plan) and `low` is refused.

use serde_json::{Map, Value};

use super::ImageConfig;

/// The part types that carry an image.
pub const IMAGE_PARTS: &[&str] = &["image_url", "image", "input_image"];

/// Where an image's bytes are.
#[derive(Debug, PartialEq, Eq)]
pub enum Source<'a> {
    /// A base64 payload (a data URL's, or a Messages `base64` source's) of an image media type.
    Data { media: &'a str, base64: &'a str },
    /// An `http(s)` URL.
    Url(&'a str),
}

/// One image part: the path of the field holding its bytes or URL, and its source.
#[derive(Debug, PartialEq, Eq)]
pub struct ImagePart<'a> {
    pub path: String,
    pub source: Source<'a>,
}

/// Media types DeepSeek's API takes (`image/jpg` is an alias of JPEG).
const MEDIA: &[&str] = &["image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"];

/// Every image part of a request in prompt order, each checked without its
/// bytes: its place, fields, `detail`, media type, URL scheme and length, and
/// the count limit.
pub fn find<'a>(body: &'a Map<String, Value>, config: &ImageConfig) -> Result<Vec<ImagePart<'a>>, String> {
    let mut out = Vec::new();
    for key in ["messages", "input", "system", "instructions", "tools"] {
        let Some(value) = body.get(key) else { continue };
        walk(value, &mut key.to_string(), 0, &mut |path, part| {
            if !in_user_message(body, path) {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                return Err(format!(
                    "`{path}` is an `{kind}` part, but images are read only in the content of user messages"
                ));
            }
            if out.len() == config.limits.max_images {
                return Err(format!(
                    "`{path}`: more than {} images in one request (the limit per request)",
                    config.limits.max_images
                ));
            }
            out.push(read_part(path, part, config)?);
            Ok(())
        })?;
    }
    Ok(out)
}

/// What `walk` calls with each image part's path and object.
type PartVisitor<'v, 'a> = dyn FnMut(&str, &'a Map<String, Value>) -> Result<(), String> + 'v;

/// Call `found` with the path and object of every image-typed part under
/// `value`, refusing one that is not in a user message's content.
fn walk<'a>(value: &'a Value, path: &mut String, depth: usize, found: &mut PartVisitor<'_, 'a>) -> Result<(), String> {
    // Content nests a few levels (message → content → block → tool result); bound the walk.
    if depth > 8 {
        return Ok(());
    }
    let mut child = |path: &mut String, suffix: String, v: &'a Value| {
        let len = path.len();
        path.push_str(&suffix);
        let r = walk(v, path, depth + 1, found);
        path.truncate(len);
        r
    };
    match value {
        Value::Object(map) => {
            if map.get("type").and_then(Value::as_str).is_some_and(|t| IMAGE_PARTS.contains(&t)) {
                return found(path, map);
            }
            for (k, v) in map {
                child(path, format!(".{k}"), v)?;
            }
            Ok(())
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                child(path, format!("[{i}]"), v)?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether `path` is `messages[i].content[j]` or `input[i].content[j]` of a
/// message whose role is `user`.
fn in_user_message(body: &Map<String, Value>, path: &str) -> bool {
    let Some((key, rest)) = path.split_once('[') else { return false };
    let Some((i, rest)) = rest.split_once("].content[") else { return false };
    let is_index = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !matches!(key, "messages" | "input") || !is_index(i) || !rest.strip_suffix(']').is_some_and(is_index) {
        return false;
    }
    let message = i.parse::<usize>().ok().and_then(|i| body.get(key)?.get(i));
    message.and_then(|m| m.get("role")).and_then(Value::as_str) == Some("user")
}

fn str_field<'a>(map: &'a Map<String, Value>, key: &str, path: &str) -> Result<Option<&'a str>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("`{path}.{key}` must be a string, got {v}")),
    }
}

fn only_keys(map: &Map<String, Value>, keys: &[&str], path: &str) -> Result<(), String> {
    match map.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(format!("unknown field `{path}.{k}`")),
        None => Ok(()),
    }
}

/// `detail`: `auto` and `high` (and absent) are the model's one resolution plan.
fn detail(value: Option<&str>, path: &str) -> Result<(), String> {
    match value {
        None | Some("auto" | "high") => Ok(()),
        Some("low") => Err(format!(
            "`{path}` = \"low\" is not supported: the model reads every image at its own resolution plan \
             (send \"auto\" or \"high\", or leave it out)"
        )),
        Some(v) => Err(format!("`{path}` must be \"auto\" or \"high\", got \"{v}\"")),
    }
}

fn read_part<'a>(path: &str, part: &'a Map<String, Value>, config: &ImageConfig) -> Result<ImagePart<'a>, String> {
    match part.get("type").and_then(Value::as_str) {
        Some("image_url") => {
            only_keys(part, &["type", "image_url"], path)?;
            let path = format!("{path}.image_url");
            match part.get("image_url") {
                Some(Value::String(url)) => url_source(url, &path, config),
                Some(Value::Object(inner)) => {
                    only_keys(inner, &["url", "detail"], &path)?;
                    detail(str_field(inner, "detail", &path)?, &format!("{path}.detail"))?;
                    let url = str_field(inner, "url", &path)?.ok_or_else(|| format!("`{path}.url` is required"))?;
                    url_source(url, &format!("{path}.url"), config)
                }
                _ => Err(format!("`{path}` must be an object with `url`")),
            }
        }
        Some("input_image") => {
            only_keys(part, &["type", "image_url", "file_id", "detail"], path)?;
            detail(str_field(part, "detail", path)?, &format!("{path}.detail"))?;
            if str_field(part, "file_id", path)?.is_some() {
                return Err(format!(
                    "`{path}.file_id`: uploaded files are not supported by this server; send `image_url` \
                     (a base64 data URL, or an http(s) URL)"
                ));
            }
            let url = str_field(part, "image_url", path)?.ok_or_else(|| format!("`{path}.image_url` is required"))?;
            url_source(url, &format!("{path}.image_url"), config)
        }
        _ => {
            only_keys(part, &["type", "source", "cache_control"], path)?;
            let path = format!("{path}.source");
            let source =
                part.get("source").and_then(Value::as_object).ok_or_else(|| format!("`{path}` is required"))?;
            match str_field(source, "type", &path)? {
                Some("base64") => {
                    only_keys(source, &["type", "media_type", "data"], &path)?;
                    let media = str_field(source, "media_type", &path)?.unwrap_or("");
                    if !MEDIA.contains(&media.to_ascii_lowercase().as_str()) {
                        return Err(format!(
                            "`{path}.media_type` must be image/png, image/jpeg, image/webp or image/gif, got \"{media}\""
                        ));
                    }
                    let data = str_field(source, "data", &path)?.ok_or_else(|| format!("`{path}.data` is required"))?;
                    Ok(ImagePart { path: format!("{path}.data"), source: Source::Data { media, base64: data } })
                }
                Some("url") => {
                    only_keys(source, &["type", "url"], &path)?;
                    let url = str_field(source, "url", &path)?.ok_or_else(|| format!("`{path}.url` is required"))?;
                    match url.get(..5).is_some_and(|s| s.eq_ignore_ascii_case("data:")) {
                        true => Err(format!("`{path}.url` must be an http(s) URL; send data as a `base64` source")),
                        false => url_source(url, &format!("{path}.url"), config),
                    }
                }
                Some("file") => Err(format!(
                    "`{path}`: files uploaded with the Files API are not supported by this server; send a \
                     `base64` or `url` source"
                )),
                other => Err(format!("`{path}.type` must be \"base64\" or \"url\", got {other:?}")),
            }
        }
    }
}

/// A data URL (`data:<image type>;base64,<payload>`) or an `http(s)` URL.
fn url_source<'a>(url: &'a str, path: &str, config: &ImageConfig) -> Result<ImagePart<'a>, String> {
    let part = |source| Ok(ImagePart { path: path.to_string(), source });
    let lower = |n: usize| url.get(..n).map(str::to_ascii_lowercase);
    if lower(5).as_deref() == Some("data:") {
        let (head, payload) =
            url[5..].split_once(',').ok_or_else(|| format!("`{path}` is a data URL without a `,` before its data"))?;
        let mut params = head.split(';');
        let media = params.next().unwrap_or("").trim();
        if !params.any(|p| p.trim().eq_ignore_ascii_case("base64")) {
            return Err(format!("`{path}` must be a base64 data URL (`data:image/png;base64,...`)"));
        }
        if !MEDIA.contains(&media.to_ascii_lowercase().as_str()) {
            return Err(format!(
                "`{path}`: a data URL of type \"{media}\"; images must be image/png, image/jpeg, image/webp or image/gif"
            ));
        }
        return part(Source::Data { media, base64: payload });
    }
    if lower(7).as_deref() == Some("http://") || lower(8).as_deref() == Some("https://") {
        let chars = url.chars().count();
        let max = config.limits.max_url_chars;
        if chars > max {
            return Err(format!("`{path}`: an image URL of {chars} characters; the limit is {max}"));
        }
        return part(Source::Url(url));
    }
    let shown: String = url.chars().take(32).collect();
    Err(format!("`{path}` must be a base64 data URL or an http(s) URL, got \"{shown}\""))
}
