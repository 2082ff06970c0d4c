//! Turning committed tokens into streamed text, with stop strings.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use aho_corasick::{AhoCorasick, MatchKind};

/// The most tokens held back undecoded ([`TextStream::push`]).
const MAX_PENDING: usize = 8;

/// Decodes generated tokens as they are committed, finds stop strings, and releases text
/// that is final: not a possible start of a stop string, not half of a UTF-8 character.
///
/// Decoding is incremental (only the last few tokens are decoded per step, as in
/// `tokenizers`' streaming decoders), so a long generation costs linear time.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    stop: &'a [String],
    /// Finds the leftmost of all stop strings in one pass over the new text.
    matcher: Option<AhoCorasick>,
    longest: usize,
    ids: Vec<u32>,
    /// `ids[prefix..read]` were decoded into `text` already; `ids[read..]` are pending (an
    /// incomplete UTF-8 character).
    prefix: usize,
    read: usize,
    text: String,
    released: usize,
    /// A stop string was found (the text ends before it).
    stopped: bool,
}

impl<'a> TextStream<'a> {
    /// A stream for `tokenizer`'s tokens that ends at the first of the `stop` strings; an
    /// empty stop string is an error (it would stop before any text).
    pub fn new(tokenizer: &'a Tokenizer, stop: &'a [String]) -> Result<Self> {
        if stop.iter().any(String::is_empty) {
            return Err(Error::config(
                "stop",
                "a stop string is empty (it would stop before any text)",
            ));
        }
        let matcher = (!stop.is_empty()).then(|| {
            AhoCorasick::builder()
                .match_kind(MatchKind::LeftmostFirst)
                .build(stop)
                .expect("plain strings always build an automaton")
        });
        Ok(Self {
            tokenizer,
            stop,
            matcher,
            longest: stop.iter().map(String::len).max().unwrap_or(0),
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            released: 0,
            stopped: false,
        })
    }

    /// Adds one token. Returns true if the text now contains a stop string; the text is then
    /// cut just before it.
    pub fn push(&mut self, id: u32) -> Result<bool> {
        self.ids.push(id);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read])?;
        let now = self.tokenizer.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len()
            && !now.ends_with('\u{FFFD}')
            && now.is_char_boundary(before.len())
        {
            self.release(&before, &now, self.ids.len());
        } else if self.ids.len() - self.read > MAX_PENDING {
            // Tokens wait while they decode to nothing new (control tokens) or to half a
            // character, but not beyond MAX_PENDING: release up to the last token that ends
            // a whole character. If none does, the bytes are invalid (a character spans at
            // most 4 byte tokens): all but the last 3 tokens, which may still begin one, go
            // out as replacement characters.
            let whole = (self.read + 1..=self.ids.len()).rev().find_map(|r| {
                let text = self.tokenizer.decode(&self.ids[self.prefix..r]).ok()?;
                let fits = text.len() >= before.len() && text.is_char_boundary(before.len());
                (fits && !text.ends_with('\u{FFFD}')).then_some((r, text))
            });
            let (r, text) = match whole {
                Some(found) => found,
                None => {
                    let r = self.ids.len() - 3;
                    (r, self.tokenizer.decode(&self.ids[self.prefix..r])?)
                }
            };
            self.release(&before, &text, r);
        }
        Ok(self.cut_at_stop())
    }

    /// Cuts the text before the first stop string in it, if there is one (then true).
    fn cut_at_stop(&mut self) -> bool {
        let Some(matcher) = &self.matcher else {
            return false;
        };
        // Only the tail can hold a new match: earlier text was checked before.
        let mut from = self.released.saturating_sub(self.longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        match matcher.find(&self.text[from..]) {
            Some(m) => {
                self.text.truncate(from + m.start());
                // Tokens still pending come after the stop string: none of them is text.
                self.read = self.ids.len();
                self.stopped = true;
                true
            }
            None => false,
        }
    }

    /// Appends what `now` (the decode of `ids[prefix..read]`) adds to `before` (that of
    /// `ids[prefix..self.read]`), and moves the window on.
    fn release(&mut self, before: &str, now: &str, read: usize) {
        let mut from = before.len().min(now.len());
        while !now.is_char_boundary(from) {
            from += 1;
        }
        self.text.push_str(&now[from..]);
        self.prefix = self.read;
        self.read = read;
    }

    /// Text that became final since the last call. With `finished`, everything left but a
    /// character the generation cut off in the middle, cut before a stop string: a token held
    /// back as half a character may hold a whole one before it.
    pub fn take_final(&mut self, finished: bool) -> &str {
        if finished && self.read < self.ids.len() {
            let before = self
                .tokenizer
                .decode(&self.ids[self.prefix..self.read])
                .unwrap_or_default();
            let now = self
                .tokenizer
                .decode(&self.ids[self.prefix..])
                .unwrap_or_default();
            // Half a character is no text: its bytes, decoded as replacement characters (one
            // or one per byte, by tokenizer), stay in the tokens only.
            let now = now.trim_end_matches('\u{FFFD}');
            self.release(&before, now, self.ids.len());
            self.cut_at_stop();
        }
        let mut end = self.text.len();
        if !finished {
            // Hold back any suffix that could begin a stop string.
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

    /// All text so far, cut before a stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn partial_suffix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
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
