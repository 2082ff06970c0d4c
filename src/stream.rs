//! Turning committed tokens into streamed text, with stop strings.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Decodes generated tokens as they are committed, finds stop strings, and releases text
/// that is final: not a possible start of a stop string, not half of a UTF-8 character.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    stop: &'a [String],
    ids: Vec<u32>,
    text: String,
    released: usize,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer, stop: &'a [String]) -> Self {
        Self {
            tokenizer,
            stop,
            ids: Vec::new(),
            text: String::new(),
            released: 0,
        }
    }

    /// Adds one token. Returns true if the text now contains a stop string; the text is then
    /// cut just before it.
    pub fn push(&mut self, id: u32) -> Result<bool> {
        self.ids.push(id);
        self.text = self.tokenizer.decode(&self.ids)?;
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        // Only the tail can hold a new match: earlier text was checked before.
        let mut from = self.released.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stop
            .iter()
            .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i))
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            return Ok(true);
        }
        Ok(false)
    }

    /// Text that became final since the last call. With `finished`, everything left.
    pub fn take_final(&mut self, finished: bool) -> &str {
        let mut end = self.text.len();
        if !finished {
            // Hold back a trailing replacement character (a UTF-8 sequence split across
            // tokens) and any suffix that could begin a stop string.
            if self.text.ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            let held = self
                .stop
                .iter()
                .map(|s| partial_suffix(&self.text[..end], s))
                .max()
                .unwrap_or(0);
            end -= held;
        }
        let start = self.released.min(end);
        self.released = end.max(self.released);
        &self.text[start..end]
    }

    pub fn text(&self) -> &str {
        &self.text
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_suffix;

    #[test]
    fn partial_suffix_finds_a_started_stop_string() {
        assert_eq!(partial_suffix("abc\n", "\n\n"), 1);
        assert_eq!(partial_suffix("abc", "\n\n"), 0);
        assert_eq!(partial_suffix("x</s", "</stop>"), 3);
    }
}
