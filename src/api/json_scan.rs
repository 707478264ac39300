//! What a JSON grammar's output has open so far, read byte by byte: the
//! wrap-up of [`super::constraint`] closes the document within the token budget
//! from it, and it keeps exponents out of numbers.

/// Open strings, objects and arrays of the JSON written so far.
#[derive(Clone, Debug, Default)]
pub struct JsonScan {
    stack: Vec<u8>,
    in_string: bool,
    escaped: bool,
    in_number: bool,
}

impl JsonScan {
    /// Append `bytes`; false if they put an exponent into a number.
    pub fn push(&mut self, bytes: &[u8]) -> bool {
        for &b in bytes {
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'e' | b'E' if self.in_number => return false,
                b'0'..=b'9' | b'-' | b'+' | b'.' => self.in_number = true,
                _ => self.in_number = false,
            }
            match b {
                b'"' => self.in_string = true,
                b'{' | b'[' => self.stack.push(b),
                b'}' | b']' => {
                    self.stack.pop();
                }
                _ => {}
            }
        }
        true
    }

    /// Whether `bytes` may follow: no exponent in a number.
    pub fn admits(&self, bytes: &[u8]) -> bool {
        // Only bytes outside strings can matter; most tokens inside a string stay there.
        (self.in_string && !bytes.contains(&b'"')) || self.clone().push(bytes)
    }

    /// How much is open: lower is closer to a complete document.
    fn depth(&self) -> usize {
        self.stack.len() + usize::from(self.in_string)
    }

    /// Rank of appending `bytes` when wrapping up: fewest open, then tokens
    /// that reach a separator or closer (they end numbers and literals).
    pub fn rank_after(&self, bytes: &[u8]) -> (usize, bool) {
        let mut next = self.clone();
        let mut structural = false;
        for &b in bytes {
            if !next.in_string && matches!(b, b',' | b':' | b'}' | b']') {
                structural = true;
            }
            next.push(std::slice::from_ref(&b));
        }
        (next.depth(), !structural)
    }
}
