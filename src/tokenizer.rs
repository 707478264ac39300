//! Tokenizers: the built-in byte-level BPE used by `builtin:` models, and
//! loading of real `tokenizer.json` files.
//!
//! The built-in tokenizer exists so that a machine with no model files can
//! still run end to end. It is a GPT-2 style byte-level BPE whose merges are
//! learned from a small corpus embedded below, so every byte sequence
//! encodes and decodes losslessly. Its special tokens are copied from the
//! DeepSeek-V4 tokenizer (same strings, same `special` flags) so chat
//! templates and tool-call parsing behave the same on both.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::OnceLock;

use anyhow::{anyhow, Context};
use serde_json::{json, Value};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer};

/// Number of ids in the built-in vocabulary (`0..BUILTIN_VOCAB_SIZE`, no gaps).
pub const BUILTIN_VOCAB_SIZE: usize = 1024;
/// Beginning-of-sequence token, shared with DeepSeek-V4.
pub const BOS_TOKEN: &str = "<｜begin▁of▁sentence｜>";
/// End-of-sequence token, shared with DeepSeek-V4.
pub const EOS_TOKEN: &str = "<｜end▁of▁sentence｜>";
/// Id of [`BOS_TOKEN`] in the built-in vocabulary.
pub const BUILTIN_BOS_ID: u32 = 0;
/// Id of [`EOS_TOKEN`] in the built-in vocabulary.
pub const BUILTIN_EOS_ID: u32 = 1;

/// Chat, reasoning and tool-call tokens of DeepSeek-V4 with their `special`
/// flag, in the order of their ids there. They occupy the last ids of the
/// built-in vocabulary, in this order. `<think>` and the tool-call markers
/// are not special in DeepSeek-V4, so decoding with `skip_special_tokens`
/// keeps them; mirroring that keeps output parsers identical.
pub const BUILTIN_RESERVED_TOKENS: &[(&str, bool)] = &[
    ("<｜▁pad▁｜>", true),
    ("<｜fim▁hole｜>", false),
    ("<｜fim▁begin｜>", false),
    ("<｜fim▁end｜>", false),
    ("<｜User｜>", false),
    ("<｜Assistant｜>", false),
    ("<|EOT|>", false),
    ("<｜tool▁calls▁begin｜>", false),
    ("<｜tool▁calls▁end｜>", false),
    ("<｜tool▁call▁begin｜>", false),
    ("<｜tool▁call▁end｜>", false),
    ("<｜tool▁outputs▁begin｜>", false),
    ("<｜tool▁outputs▁end｜>", false),
    ("<｜tool▁output▁begin｜>", false),
    ("<｜tool▁output▁end｜>", false),
    ("<｜tool▁sep｜>", false),
    ("<think>", false),
    ("</think>", false),
    ("｜DSML｜", false),
    ("<｜begin▁sys｜>", false),
    ("<｜end▁sys｜>", false),
    ("<｜latest_reminder｜>", false),
    ("<｜action｜>", false),
    ("<｜query｜>", false),
    ("<｜authority｜>", false),
    ("<｜domain｜>", false),
    ("<｜task｜>", false),
    ("<｜political｜>", false),
    ("<｜entity｜>", false),
    ("<｜title｜>", false),
    ("<｜safety｜>", false),
    ("<｜answer｜>", false),
    ("<｜search｜>", false),
    ("<dsml:", false),
    ("</dsml:", false),
    ("<｜search▁begin｜>", false),
    ("<｜search▁end｜>", false),
    ("<｜extracted_url｜>", false),
    ("<｜read_url｜>", false),
    ("<｜end_of_query｜>", true),
];

/// Ids before the byte symbols: bos and eos.
const LEADING_SPECIALS: usize = 2;
/// First id of the learned merges.
const FIRST_MERGE_ID: usize = LEADING_SPECIALS + 256;
/// First id of [`BUILTIN_RESERVED_TOKENS`].
const FIRST_RESERVED_ID: usize = BUILTIN_VOCAB_SIZE - BUILTIN_RESERVED_TOKENS.len();

/// Training text for the built-in merges: plain English and a little code,
/// enough that every merge slot is filled.
const CORPUS: &str = r#"The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
It was a bright cold day in April, and the clocks were striking thirteen. The weather report said that
the rain would stop before the evening, but the wind kept blowing from the north all through the night.
People often ask what makes a good story. Most writers agree that it starts with a character who wants
something, and then the story follows what that person is willing to do to get it. The best stories
are simple on the surface and surprising underneath.

Hello! How are you today? I am fine, thank you. Could you help me with a question about the history of
science? Of course. The scientific method is a process of observation, hypothesis, experiment and
analysis. Scientists collect data, test their ideas, and share the results so that other researchers
can check the work. Over time, the knowledge that survives many tests becomes accepted theory.

Water boils at one hundred degrees Celsius at sea level. The Earth orbits the Sun once every year, and
the Moon orbits the Earth roughly once every month. Light from the Sun takes about eight minutes to
reach us. There are seven continents and five oceans, and more than seven thousand languages are
spoken around the world today.

To make a cup of tea, first boil some water. Put a tea bag in the cup, pour the hot water over it, and
wait for three to five minutes. Remove the bag, and add milk or sugar if you like. Some people prefer
lemon instead of milk, and some prefer their tea without anything at all.

Learning to program is a little like learning a new language. You start with the basic words and
grammar, then you practise by writing small programs, reading other people's code, and fixing your
own mistakes. Good programmers write code that is easy to read, easy to test, and easy to change.

The model reads the input text, splits it into tokens, and predicts the next token one step at a time.
Each token is an integer id. The tokenizer turns text into ids and ids back into text, and the decoder
must return exactly the same bytes that went in. Questions, answers, summaries and translations are all
generated the same way: one token after another until the end of the sequence.

Dear team, thank you for your work this week. Please review the attached document before our meeting
on Monday morning. We will discuss the schedule, the budget, and the next steps for the project. Let me
know if you have any questions or comments. Best regards, and have a nice weekend.

fn main() {
    let numbers = vec![1, 2, 3, 4, 5];
    let total: i32 = numbers.iter().sum();
    println!("The total is {}", total);
    for (index, value) in numbers.iter().enumerate() {
        if value % 2 == 0 {
            println!("{index}: {value} is even");
        } else {
            println!("{index}: {value} is odd");
        }
    }
}

pub struct Config {
    pub name: String,
    pub size: usize,
    pub enabled: bool,
}

impl Config {
    pub fn new(name: &str) -> Self {
        Self { name: name.to_string(), size: 0, enabled: true }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() {
            return Err("name must not be empty".to_string());
        }
        Ok(())
    }
}

def fibonacci(n):
    """Return the first n Fibonacci numbers."""
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result

class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

if __name__ == "__main__":
    counter = Counter()
    for i in range(10):
        print(f"step {i}: {counter.increment()}")
    print(fibonacci(12))

import os
import sys
import json

def load_config(path):
    with open(path, "r", encoding="utf-8") as handle:
        return json.load(handle)

function greet(name) {
  const message = `Hello, ${name}!`;
  console.log(message);
  return message;
}

const items = [1, 2, 3].map((x) => x * 2).filter((x) => x > 2);
export default { greet, items };

SELECT id, name, email FROM users WHERE active = 1 ORDER BY name ASC LIMIT 10;

{"name": "example", "version": "1.0.0", "description": "A small example package", "license": "MIT",
 "dependencies": {"serde": "1", "anyhow": "1"}, "tags": ["text", "code", "data"], "count": 42,
 "enabled": true, "value": null}

<html>
  <head><title>Example page</title></head>
  <body>
    <div class="content"><p>This is a paragraph of text inside a div.</p></div>
  </body>
</html>

# Getting started

Install the package, then run the command below:

    cargo build --release
    ./target/release/app --input data.txt --output result.json

- Read the configuration file.
- Parse the command line arguments.
- Print a helpful error message when something goes wrong.

1. Open the file.
2. Read each line.
3. Count the words.
4. Close the file.

The function returns an error if the file does not exist, if the user does not have permission to read
it, or if the content is not valid UTF-8. In every case the error message includes the path of the file
so that the user knows what to fix. Tests check both the success path and each of the failure cases.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 2.718 -1 +1 50% $20 #1 @home a@b.com x=y a/b c\d
Punctuation: . , ; : ! ? ' " ( ) [ ] { } < > = + - * / % & | ^ ~ ` _ -> => :: != == <= >= && || ...
"#;

/// GPT-2's byte-to-character table: printable bytes map to themselves, the
/// rest to code points from U+0100 upward, in byte order.
fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let b = byte as u32;
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("byte-level code points are valid chars");
    }
    table
}

/// Learns merges on [`CORPUS`] until the vocabulary reaches
/// `FIRST_RESERVED_ID` entries. Returns the token strings (index = id,
/// starting at the first byte symbol) and the merges in rank order.
fn learn_bpe() -> (Vec<String>, Vec<(String, String)>) {
    // Split exactly as the runtime pre-tokenizer will, so learned merges
    // never cross a boundary that encoding respects.
    let mut pretokenized = PreTokenizedString::from(CORPUS);
    ByteLevel::new(false, false, true)
        .pre_tokenize(&mut pretokenized)
        .expect("byte-level pre-tokenization of the corpus");

    let mut symbols: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
    let mut symbol_ids: BTreeMap<String, u32> =
        symbols.iter().enumerate().map(|(id, s)| (s.clone(), id as u32)).collect();

    // Each distinct word with its frequency, as a sequence of symbol ids.
    let mut word_counts: BTreeMap<&str, u64> = BTreeMap::new();
    for (word, _, _) in pretokenized.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        *word_counts.entry(word).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, u64)> = word_counts
        .into_iter()
        .map(|(word, count)| {
            let ids = word.chars().map(|c| symbol_ids[&c.to_string()]).collect();
            (ids, count)
        })
        .collect();

    let target = FIRST_RESERVED_ID - LEADING_SPECIALS;
    let mut merges = Vec::new();
    while symbols.len() < target {
        let mut pair_counts: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        for (ids, count) in &words {
            for pair in ids.windows(2) {
                *pair_counts.entry((pair[0], pair[1])).or_default() += count;
            }
        }
        // Highest count wins, ties go to the lowest pair of ids, so the
        // merges are the same on every run.
        let Some((&(left, right), _)) = pair_counts.iter().max_by(|a, b| a.1.cmp(b.1).then_with(|| b.0.cmp(a.0)))
        else {
            panic!("built-in corpus exhausted after {} tokens; it needs more text", symbols.len());
        };
        let merged = format!("{}{}", symbols[left as usize], symbols[right as usize]);
        let merged_id = match symbol_ids.get(&merged) {
            Some(&id) => id,
            None => {
                let id = symbols.len() as u32;
                symbols.push(merged.clone());
                symbol_ids.insert(merged, id);
                id
            }
        };
        merges.push((symbols[left as usize].clone(), symbols[right as usize].clone()));
        for (ids, _) in &mut words {
            let mut out = Vec::with_capacity(ids.len());
            let mut i = 0;
            while i < ids.len() {
                if i + 1 < ids.len() && ids[i] == left && ids[i + 1] == right {
                    out.push(merged_id);
                    i += 2;
                } else {
                    out.push(ids[i]);
                    i += 1;
                }
            }
            *ids = out;
        }
    }
    (symbols, merges)
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({
        "id": id,
        "content": content,
        "single_word": false,
        "lstrip": false,
        "rstrip": false,
        // DeepSeek-V4 marks its non-special markers as normalized; with no
        // normalizer the flag changes nothing but keeps the files alike.
        "normalized": !special,
        "special": special,
    })
}

fn build_tokenizer_json() -> String {
    let (symbols, merges) = learn_bpe();

    let mut specials: Vec<(usize, &str, bool)> = vec![(0, BOS_TOKEN, true), (1, EOS_TOKEN, true)];
    specials.extend(
        BUILTIN_RESERVED_TOKENS
            .iter()
            .enumerate()
            .map(|(i, &(content, special))| (FIRST_RESERVED_ID + i, content, special)),
    );

    // Special tokens are also in the model vocabulary: that is what pins
    // their ids when the file is loaded (otherwise they would be appended
    // after the model's ids).
    let mut vocab = serde_json::Map::new();
    for &(id, content, _) in &specials {
        vocab.insert(content.to_string(), json!(id));
    }
    for (i, symbol) in symbols.iter().enumerate() {
        vocab.insert(symbol.clone(), json!(LEADING_SPECIALS + i));
    }
    debug_assert_eq!(vocab.len(), BUILTIN_VOCAB_SIZE);
    debug_assert_eq!(FIRST_MERGE_ID + (symbols.len() - 256), FIRST_RESERVED_ID);

    let added_tokens: Vec<Value> =
        specials.iter().map(|&(id, content, special)| added_token(id, content, special)).collect();
    let merges: Vec<Value> = merges.into_iter().map(|(a, b)| json!([a, b])).collect();

    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": false,
            "use_regex": true,
        },
        "post_processor": null,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": false,
            "use_regex": true,
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });
    serde_json::to_string(&tokenizer).expect("serializing a JSON value cannot fail")
}

/// The built-in tokenizer as `tokenizer.json` text. Learned once per process
/// and byte-identical on every call.
pub fn builtin_tokenizer_json() -> String {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(build_tokenizer_json).clone()
}

/// The built-in tokenizer: [`BUILTIN_VOCAB_SIZE`] ids, bos 0, eos 1.
pub fn builtin_tokenizer() -> Tokenizer {
    Tokenizer::from_str(&builtin_tokenizer_json()).expect("the built-in tokenizer.json is valid")
}

/// The built-in tokenizer for a model that reads images: the reserved id
/// `image_token_id` spells DeepSeek's image token (`<｜image｜>`) instead of
/// its usual marker, so a chat template's image part encodes to that id.
/// Every other id keeps its spelling. `None` when the id is not a reserved
/// one (a byte or a merge cannot be given up).
pub fn builtin_tokenizer_with_image_token(image_token_id: u32) -> Option<Tokenizer> {
    let id = image_token_id as usize;
    if !(FIRST_RESERVED_ID..BUILTIN_VOCAB_SIZE).contains(&id) {
        return None;
    }
    let image = deepseek_recipe_core::special_tokens::SpecialToken::Image.default_str();
    let (old, _) = BUILTIN_RESERVED_TOKENS[id - FIRST_RESERVED_ID];
    let mut json: Value =
        serde_json::from_str(&builtin_tokenizer_json()).expect("the built-in tokenizer.json is valid");
    for token in json["added_tokens"].as_array_mut().expect("added tokens") {
        if token["id"] == json!(id) {
            *token = added_token(id, image, true);
        }
    }
    let vocab = json["model"]["vocab"].as_object_mut().expect("a vocabulary");
    vocab.remove(old);
    vocab.insert(image.to_string(), json!(id));
    Some(Tokenizer::from_str(&json.to_string()).expect("the edited tokenizer.json is valid"))
}

/// Loads a Hugging Face `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read tokenizer file {}", path.display()))?;
    Tokenizer::from_str(&text).map_err(|e| anyhow!("cannot parse tokenizer file {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn roundtrip(tok: &Tokenizer, text: &str) -> Vec<u32> {
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "ids {ids:?}");
        ids
    }

    #[test]
    fn vocab_is_dense_and_sized() {
        let tok = builtin_tokenizer();
        assert_eq!(tok.get_vocab_size(true), BUILTIN_VOCAB_SIZE);
        let vocab = tok.get_vocab(true);
        assert_eq!(vocab.len(), BUILTIN_VOCAB_SIZE);
        let mut ids: Vec<u32> = vocab.values().copied().collect();
        ids.sort_unstable();
        assert!(ids.iter().copied().eq(0..BUILTIN_VOCAB_SIZE as u32));
        for id in 0..BUILTIN_VOCAB_SIZE as u32 {
            let token = tok.id_to_token(id).expect("every id has a token");
            assert_eq!(tok.token_to_id(&token), Some(id));
        }
    }

    #[test]
    fn bos_eos_ids() {
        let tok = builtin_tokenizer();
        assert_eq!(tok.token_to_id(BOS_TOKEN), Some(BUILTIN_BOS_ID));
        assert_eq!(tok.token_to_id(EOS_TOKEN), Some(BUILTIN_EOS_ID));
        let added = tok.get_added_tokens_decoder();
        assert!(added[&BUILTIN_BOS_ID].special);
        assert!(added[&BUILTIN_EOS_ID].special);
    }

    #[test]
    fn layout_bytes_then_merges_then_reserved() {
        let tok = builtin_tokenizer();
        for (byte, c) in byte_to_char().iter().enumerate() {
            assert_eq!(tok.token_to_id(&c.to_string()), Some((LEADING_SPECIALS + byte) as u32));
        }
        let alphabet = ByteLevel::alphabet();
        assert_eq!(alphabet.len(), 256);
        assert!(byte_to_char().iter().all(|c| alphabet.contains(c)));
        for (i, &(content, _)) in BUILTIN_RESERVED_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(content), Some((FIRST_RESERVED_ID + i) as u32));
        }
        assert_eq!(tok.id_to_token(BUILTIN_VOCAB_SIZE as u32 - 1).as_deref(), Some("<｜end_of_query｜>"));
        // Merges are real multi-byte tokens and actually used by encoding.
        let ids = roundtrip(&tok, "The total is the number of tokens.");
        assert!(ids.iter().any(|&id| id as usize >= FIRST_MERGE_ID));
        assert!(ids.len() < "The total is the number of tokens.".len() / 2);
    }

    #[test]
    fn roundtrips_arbitrary_utf8() {
        let tok = builtin_tokenizer();
        let samples = [
            "",
            "hello world",
            "  leading and trailing spaces  ",
            "tabs\tand\nnewlines\r\n\n\n",
            "Ünïcödé àccénts: café, naïve, Ångström, ß, œ",
            "中文字符和日本語のテキスト, 한국어",
            "emoji 🦀🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
            "fn main() { println!(\"{}\", 1 + 2); }",
            "control \u{0}\u{1}\u{7f} and nbsp\u{a0} and bidi \u{202e}",
            "mixed <｜User｜>hi<｜Assistant｜><think>x</think> done",
            "1234567890 3.14159 -42 1e-9",
        ];
        for text in samples {
            roundtrip(&tok, text);
        }
        // Every one- and two-byte UTF-8 code point in one long run.
        let all: String = (0u32..0x800).filter_map(char::from_u32).collect();
        roundtrip(&tok, &all);
    }

    #[test]
    fn special_tokens_encode_to_single_ids() {
        let tok = builtin_tokenizer();
        let mut all = vec![(BOS_TOKEN, true), (EOS_TOKEN, true)];
        all.extend_from_slice(BUILTIN_RESERVED_TOKENS);
        let added = tok.get_added_tokens_decoder();
        for (content, special) in all {
            let id = tok.token_to_id(content).unwrap();
            assert_eq!(added[&id].special, special, "{content}");
            let enc = tok.encode(content, false).unwrap();
            assert_eq!(enc.get_ids(), &[id], "{content}");
            let enc = tok.encode(format!("a{content}b"), false).unwrap();
            assert_eq!(enc.get_ids().len(), 3, "{content}");
            assert_eq!(enc.get_ids()[1], id, "{content}");
        }
        // Skipping special tokens keeps the non-special markers, as DeepSeek-V4 does.
        let ids = tok.encode(format!("{BOS_TOKEN}<think>hi</think>{EOS_TOKEN}"), false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, true).unwrap(), "<think>hi</think>");
    }

    #[test]
    fn json_is_deterministic() {
        let a = builtin_tokenizer_json();
        let b = builtin_tokenizer_json();
        assert_eq!(a, b);
        // A fresh build, not just the cached copy.
        assert_eq!(build_tokenizer_json(), a);
    }

    #[test]
    fn load_tokenizer_names_missing_file() {
        let path = Path::new("/nonexistent/dir/tokenizer.json");
        let err = load_tokenizer(path).unwrap_err();
        assert!(format!("{err:#}").contains("/nonexistent/dir/tokenizer.json"));

        let dir = std::env::temp_dir().join(format!("deepinfer-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("tokenizer.json");
        std::fs::write(&bad, "{not json").unwrap();
        let err = load_tokenizer(&bad).unwrap_err();
        assert!(format!("{err:#}").contains(&bad.display().to_string()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loads_real_deepseek_v4_tokenizer() {
        let path = PathBuf::from("../shared/assets/deepseek-v4/tokenizer.json");
        let tok = load_tokenizer(&path).unwrap();
        assert_eq!(tok.get_vocab_size(true), 129_280);
        assert_eq!(tok.token_to_id("<｜User｜>"), Some(128_803));
        assert_eq!(tok.token_to_id("<｜Assistant｜>"), Some(128_804));
        assert_eq!(tok.token_to_id("<think>"), Some(128_821));
        assert_eq!(tok.token_to_id("</think>"), Some(128_822));
        assert_eq!(tok.token_to_id(BOS_TOKEN), Some(0));
        assert_eq!(tok.token_to_id(EOS_TOKEN), Some(1));
        // The built-in reserved tokens mirror the real file's strings and flags.
        let added = tok.get_added_tokens_decoder();
        for &(content, special) in BUILTIN_RESERVED_TOKENS {
            let id = tok.token_to_id(content).unwrap_or_else(|| panic!("{content} missing"));
            assert_eq!(added[&id].special, special, "{content}");
        }
        let text = "Hello, world! <｜User｜>你好 🦀";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}
