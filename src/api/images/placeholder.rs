//! The image token typed as text. The chat template and the tokenizer would
//! turn it into the token every image position carries, so a client could
//! forge an image span; it is refused wherever it appears in the body.

use serde_json::{Map, Value};

/// The spellings refused: the chat template's image placeholder (the recipe's
/// `SpecialToken::Image`) and the tokenizer's own text of the image token id,
/// when the tokenizer holds it as an added token.
pub fn spellings(tokenizer: &tokenizers::Tokenizer, image_token_id: u32) -> Vec<String> {
    let template = deepseek_recipe_core::special_tokens::SpecialToken::Image.default_str().to_string();
    let mut out = vec![template];
    if let Some(added) = tokenizer.get_added_tokens_decoder().get(&image_token_id) {
        if !out.contains(&added.content) {
            out.push(added.content.clone());
        }
    }
    out
}

/// A 400 naming the first string (or object key) of `body` that holds a spelling.
pub fn refuse(body: &Map<String, Value>, spellings: &[String]) -> Result<(), String> {
    fn find(value: &Value, path: &mut String, spellings: &[String], depth: usize) -> Option<String> {
        if depth > 64 {
            return None;
        }
        let hit = |s: &str| spellings.iter().find(|p| s.contains(p.as_str())).cloned();
        let child = |path: &mut String, suffix: String, v: &Value| {
            let len = path.len();
            path.push_str(&suffix);
            let found = find(v, path, spellings, depth + 1);
            path.truncate(len);
            found
        };
        match value {
            Value::String(s) => hit(s).map(|p| format!("`{path}` holds `{p}`")),
            Value::Object(map) => map.iter().find_map(|(k, v)| match hit(k) {
                Some(p) => Some(format!("a key of `{path}` holds `{p}`")),
                None => child(path, format!(".{k}"), v),
            }),
            Value::Array(items) => items.iter().enumerate().find_map(|(i, v)| child(path, format!("[{i}]"), v)),
            _ => None,
        }
    }
    for (key, value) in body {
        if let Some(found) = find(value, &mut key.clone(), spellings, 0) {
            return Err(format!(
                "{found}, the image token: images are sent as image parts, and their token cannot be typed"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_image_token_is_refused_by_its_place() {
        let spellings = vec!["<｜image｜>".to_string()];
        let body = json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "a <｜image｜> b"}]}]});
        let err = refuse(body.as_object().unwrap(), &spellings).unwrap_err();
        assert!(err.starts_with("`messages[0].content[0].text` holds `<｜image｜>`"), "{err}");
        let body = json!({"messages": [{"role": "user", "content": "a <｜image2｜> b"}]});
        refuse(body.as_object().unwrap(), &spellings).unwrap();
    }
}
