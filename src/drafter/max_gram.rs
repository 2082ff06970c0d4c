//! Max-Gram (CS Drafting, section 3.3 and Appendix A): copy what followed the longest earlier
//! occurrence of the text's suffix, falling back to a bigram table; optionally also from
//! earlier outputs kept on disk ([`History`]).

use super::bigram::follow_table;
use super::history::SharedHistory;
use crate::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use crate::error::Result;
use crate::model::common_prefix;
use crate::ngram::BigramTable;
use crate::sampling::Dist;
use fxhash::FxHashMap;
use std::sync::Arc;

/// The longest earlier occurrence of a sequence's suffix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Match {
    /// Length of the matched suffix.
    pub len: usize,
    /// Where the occurrence ends: `tokens[end - len..end]` equals the suffix, and
    /// `tokens[end]` is the token that followed it.
    pub end: usize,
}

/// An incremental index of a token sequence (prompt, then generated text) that finds the
/// longest suffix match in time independent of the sequence's length.
///
/// Rules, for a sequence `s` of length `T` whose first `P` tokens are the prompt:
/// - a match is an earlier occurrence `s[e - n..e] == s[T - n..T]` with `e < T` (so at least
///   one token followed it), of length `n <= max_ngram`;
/// - the longest match wins, wherever it is;
/// - among occurrences of that length, one in the prompt (`e < P`) beats one in the generated
///   text; among prompt occurrences the earliest wins (as in the paper's listing), among
///   generated ones the most recent.
///
/// Proposals copy `s[e..]`; a copy that reaches the end of the sequence continues from the
/// tokens it has copied (so a repeating pattern keeps repeating).
///
/// Example, with `max_ngram = 4` and prompt `[5, 1, 2, 3, 9]`, generated `[1, 2]`:
/// the suffix `[1, 2]` occurs at `e = 3` (followed by `3`), `[9, 1, 2]` nowhere earlier, so
/// the match is `{ len: 2, end: 3 }` and the proposal for k = 3 is `[3, 9, 1]`.
///
/// Index: for every position `e` and every `n <= max_ngram`, the hash of `s[e - n..e]` maps to
/// the (ascending) list of such `e`. Appending a token adds `max_ngram` entries, truncating
/// removes them in reverse, and a query hashes at most `max_ngram` suffixes; a hash hit is
/// confirmed by comparing tokens.
pub struct MaxGram {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_ngram: usize,
    index: FxHashMap<u64, Vec<u32>>,
}

impl MaxGram {
    /// An empty index matching suffixes of up to `max_ngram` tokens.
    pub fn new(max_ngram: usize) -> Self {
        Self {
            tokens: Vec::new(),
            prompt_len: 0,
            max_ngram: max_ngram.max(1),
            index: FxHashMap::default(),
        }
    }

    /// Starts over with `prompt`.
    pub fn start(&mut self, prompt: &[u32]) {
        self.tokens.clear();
        self.index.clear();
        prompt.iter().for_each(|&t| self.push(t));
        self.prompt_len = prompt.len();
    }

    /// The indexed sequence.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The `n`-gram keys of the grams ending at `end` (exclusive), for n = 1, 2, ...
    fn keys(&self, end: usize) -> impl Iterator<Item = u64> + '_ {
        let mut h = 0x51_7c_c1_b7_27_22_0a_95u64;
        (1..=self.max_ngram.min(end)).map(move |n| {
            h = (h.rotate_left(5) ^ self.tokens[end - n] as u64)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
            h ^ (n as u64).wrapping_mul(0xff51_afd7_ed55_8ccd)
        })
    }

    /// Appends a token: the grams ending just before it now have a continuation.
    pub fn push(&mut self, token: u32) {
        let end = self.tokens.len();
        let keys: Vec<u64> = self.keys(end).collect();
        for k in keys {
            self.index.entry(k).or_default().push(end as u32);
        }
        self.tokens.push(token);
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        while self.tokens.len() > len {
            let end = self.tokens.len() - 1;
            let keys: Vec<u64> = self.keys(end).collect();
            for k in keys {
                if let Some(v) = self.index.get_mut(&k) {
                    debug_assert_eq!(v.last(), Some(&(end as u32)));
                    v.pop();
                    if v.is_empty() {
                        self.index.remove(&k);
                    }
                }
            }
            self.tokens.pop();
        }
        self.prompt_len = self.prompt_len.min(len);
    }

    /// The longest earlier occurrence of the sequence's suffix, by the rules above.
    pub fn longest_match(&self) -> Option<Match> {
        let t = self.tokens.len();
        let mut best = None;
        for (i, key) in self.keys(t).enumerate() {
            let n = i + 1;
            let Some(ends) = self.index.get(&key) else {
                break;
            };
            let end = match ends[0] as usize {
                first if first < self.prompt_len => first,
                _ => *ends.last().unwrap() as usize,
            };
            if end < n || self.tokens[end - n..end] != self.tokens[t - n..t] {
                break; // a hash collision: treat as no longer match
            }
            best = Some(Match { len: n, end });
        }
        best
    }

    /// The longest match whose continuation is the one seen most often after the matched
    /// suffix, and that continuation's share of the occurrences (the most recent
    /// 255 occurrences and the first are counted). Among occurrences followed by that
    /// token the rules of [`MaxGram::longest_match`] pick one.
    pub fn best_continuation(&self) -> Option<(Match, f32)> {
        let m = self.longest_match()?;
        let n = m.len;
        let t = self.tokens.len();
        let key = self.keys(t).nth(n - 1)?;
        let ends = self.index.get(&key)?;
        let suffix = &self.tokens[t - n..];
        let scanned = ends
            .iter()
            .take(1)
            .chain(ends.iter().skip(1).rev().take(SCANNED))
            .map(|&e| e as usize)
            .filter(|&e| e < t && e >= n && self.tokens[e - n..e] == *suffix);
        let mut counts: FxHashMap<u32, (u32, usize)> = FxHashMap::default();
        let mut total = 0u32;
        for e in scanned {
            total += 1;
            let entry = counts.entry(self.tokens[e]).or_insert((0, e));
            entry.0 += 1;
            // Keep the preferred occurrence: in the prompt the earliest, else the latest.
            let rank = |x: usize| match x < self.prompt_len {
                true => (1, usize::MAX - x),
                false => (0, x),
            };
            if rank(e) > rank(entry.1) {
                entry.1 = e;
            }
        }
        // Ties go to the longest match's own pick, then to the lower token id.
        let chosen = self.tokens[m.end];
        let (count, end) = counts
            .into_iter()
            .max_by_key(|&(tok, (c, _))| (c, tok == chosen, std::cmp::Reverse(tok)))
            .map(|(_, v)| v)?;
        Some((Match { len: n, end }, count as f32 / total.max(1) as f32))
    }

    /// Up to `k` tokens copied from the longest match; empty if there is none.
    pub fn propose(&self, k: usize) -> Vec<u32> {
        match self.longest_match() {
            Some(m) => self.copy(m, k),
            None => Vec::new(),
        }
    }

    /// Up to `k` tokens copied from match `m`.
    pub fn copy(&self, m: Match, k: usize) -> Vec<u32> {
        let t = self.tokens.len();
        let mut out: Vec<u32> = Vec::with_capacity(k.min(crate::config::MAX_DRAFT));
        for i in 0..k {
            let at = m.end + i;
            out.push(if at < t { self.tokens[at] } else { out[at - t] });
        }
        out
    }
}

/// Occurrences of a match scanned for the most frequent continuation, most recent first.
const SCANNED: usize = 255;

/// How much the Max-Gram drafter proposes. A rejected draft token is not free (a verify
/// forward over k tokens costs more than over one), so weak evidence drafts little: a match
/// shorter than `min_match` is ignored, a match of length n proposes at most
/// `n * length_per_match` tokens, and without a match the bigram table proposes at most
/// `bigram_tokens`. The default is 0: on
/// the bench suite, one bigram token per miss was accepted about 20% of the time and made
/// Max-Gram slower (0.98x vs 1.13x autoregressive speed; see the README).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaxGramPolicy {
    /// Longest suffix searched for.
    pub max_ngram: usize,
    /// Shortest match worth drafting from.
    pub min_match: usize,
    /// Tokens drafted from the bigram table when nothing matches.
    pub bigram_tokens: usize,
    /// A match of length n copies at most `n * length_per_match` tokens (rounded up); 0 leaves
    /// the length to the gate (an adaptive one weighs each copied token by its confidence,
    /// which grows with the match).
    pub length_per_match: f32,
}

impl Default for MaxGramPolicy {
    fn default() -> Self {
        Self {
            max_ngram: 16,
            min_match: 2,
            bigram_tokens: 0,
            length_per_match: 1.0,
        }
    }
}

/// The Max-Gram drafter: [`MaxGram`] proposals (or, with a [`History`](super::History), a longer match in
/// earlier outputs), else the bigram table's most likely chain, as much as its
/// [`MaxGramPolicy`] allows. Deterministic, so every token is reported with a point-mass
/// distribution.
pub struct MaxGramDrafter {
    name: String,
    policy: MaxGramPolicy,
    index: MaxGram,
    table: Option<Arc<BigramTable>>,
    history: Option<SharedHistory>,
    /// Leading tokens of the index known to be committed.
    committed: usize,
}

impl MaxGramDrafter {
    /// A Max-Gram drafter with `policy`, falling back to `table`.
    pub fn new(
        name: impl Into<String>,
        policy: MaxGramPolicy,
        table: Option<Arc<BigramTable>>,
    ) -> Self {
        Self {
            name: name.into(),
            policy,
            index: MaxGram::new(policy.max_ngram),
            table,
            history: None,
            committed: 0,
        }
    }

    /// Also copies from the earlier outputs of `history` (where a longer suffix matches there
    /// than in the text itself), and records each finished output in it (a
    /// [`History`](super::History), or a [`SharedHistory`] that another node records).
    pub fn with_history(mut self, history: impl Into<SharedHistory>) -> Self {
        self.history = Some(history.into());
        self
    }

    /// Brings the index to `context`, comparing only past the committed prefix (so the cost
    /// stays independent of the context length).
    fn sync(&mut self, context: &[u32]) {
        let keep = common_prefix(self.index.tokens(), context, self.committed);
        self.index.truncate(keep);
        context[keep..].iter().for_each(|&t| self.index.push(t));
    }
}

impl Drafter for MaxGramDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> Result<Draft> {
        self.sync(context);
        let mut draft = Draft::new();
        let own = self.index.best_continuation();
        let history = self.history.as_ref().map(SharedHistory::lock);
        let earlier = history.as_ref().and_then(|h| h.best_continuation(context));
        // The longer match wins; the text itself on a tie.
        let (len, share) = match (own, earlier) {
            (_, Some(e)) if own.is_none_or(|(m, _)| e.len > m.len) => (e.len, e.share),
            (Some((m, share)), _) => (m.len, share),
            (None, _) => (0, 0.0),
        };
        if len >= self.policy.min_match.max(1) {
            let cap = match self.policy.length_per_match {
                l if l > 0.0 => (len as f32 * l).ceil() as usize,
                _ => usize::MAX,
            };
            let cap = cap.min(request.remaining());
            let copied = match (own, earlier) {
                (Some((m, _)), _) if m.len == len => self.index.copy(m, cap),
                (_, Some(e)) => history.as_ref().map_or(Vec::new(), |h| h.copy(e.at, cap)),
                _ => Vec::new(),
            };
            for (i, t) in copied.into_iter().enumerate() {
                // Confidence grows with the match (each copied token extends it by one if the
                // ones before it hold) and with the continuation's share.
                let matched = (len + i) as f32;
                if !request.fits(t) || !request.admit(Some(share * matched / (matched + 1.0))) {
                    break;
                }
                draft.push(t, Dist::Point(t));
                if request.ends(t) {
                    break;
                }
            }
        }
        // A copy the gate declined is not replaced by the table's guesses: they would be
        // learned under this drafter's name, among its copies' confidences.
        if draft.is_empty() && !request.declined() {
            if let (Some(table), Some(&last)) = (&self.table, context.last()) {
                follow_table(table, last, self.policy.bigram_tokens, request, &mut draft);
            }
        }
        Ok(draft)
    }

    fn commit(&mut self, context: &[u32]) {
        self.sync(context);
        self.committed = context.len();
    }

    fn start(&mut self, prompt: &[u32]) -> Result<()> {
        self.index.start(prompt);
        self.committed = prompt.len();
        Ok(())
    }

    fn finish(&mut self, output: &[u32]) -> Result<()> {
        match &self.history {
            Some(h) => h.record(output),
            None => Ok(()),
        }
    }

    fn stats(&self) -> NodeStats {
        NodeStats::new(&self.name, NodeKind::MaxGram)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::draft::{propose, propose_ending};
    use crate::drafter::Drafter;

    fn index(prompt: &[u32], generated: &[u32], max_ngram: usize) -> MaxGram {
        let mut m = MaxGram::new(max_ngram);
        m.start(prompt);
        generated.iter().for_each(|&t| m.push(t));
        m
    }

    #[test]
    fn the_documented_example() {
        let m = index(&[5, 1, 2, 3, 9], &[1, 2], 4);
        assert_eq!(m.longest_match(), Some(Match { len: 2, end: 3 }));
        assert_eq!(m.propose(3), vec![3, 9, 1]);
    }

    #[test]
    fn the_longest_match_wins() {
        // Suffix [7, 8]: [8] alone occurs at e=1 (followed by 4); [7, 8] at e=5 (followed by 6).
        let m = index(&[8, 4, 0, 7, 8, 6, 2], &[7, 8], 8);
        assert_eq!(m.longest_match(), Some(Match { len: 2, end: 5 }));
        assert_eq!(m.propose(2), vec![6, 2]);
    }

    #[test]
    fn the_prompt_beats_the_generated_text_then_earliest_or_latest() {
        // [3] occurs in the prompt at e=1 and e=4, and in the generated text at e=7 and e=9.
        let m = index(&[3, 10, 0, 3, 11], &[0, 3, 12, 3, 13, 3], 1);
        assert_eq!(m.longest_match(), Some(Match { len: 1, end: 1 }));
        assert_eq!(m.propose(1), vec![10]);
        // With no prompt occurrence, the most recent generated one.
        let m = index(&[1, 2], &[3, 12, 3, 13, 3], 1);
        assert_eq!(m.longest_match(), Some(Match { len: 1, end: 5 }));
        assert_eq!(m.propose(1), vec![13]);
    }

    #[test]
    fn the_most_frequent_continuation_wins_with_its_share() {
        // [1, 2] is followed by 7 once (in the prompt) and by 9 twice (generated).
        let m = index(&[1, 2, 7, 0, 1, 2, 9], &[5, 1, 2, 9, 4, 1, 2], 2);
        let (best, share) = m.best_continuation().unwrap();
        assert_eq!(best.len, 2);
        assert_eq!(m.tokens()[best.end], 9);
        assert!((share - 2.0 / 3.0).abs() < 1e-6, "{share}");
        // Of the occurrences followed by 9, the prompt's is copied.
        assert_eq!(best.end, 6);
        assert_eq!(m.copy(best, 2), vec![9, 5]);
        // A single occurrence: its continuation, all of the share.
        let m = index(&[1, 2, 7], &[1, 2], 2);
        assert_eq!(m.best_continuation(), Some((Match { len: 2, end: 2 }, 1.0)));
    }

    #[test]
    fn a_match_reaching_the_end_keeps_copying_its_own_proposal() {
        let m = index(&[1, 2, 1, 2], &[], 8);
        assert_eq!(m.longest_match(), Some(Match { len: 2, end: 2 }));
        assert_eq!(m.propose(5), vec![1, 2, 1, 2, 1]);
    }

    /// A copy stops after a token that ends the generation (a user message's end, copied
    /// into an answer that quotes it): nothing after it could be kept.
    #[test]
    fn a_copy_stops_after_a_token_that_ends_the_generation() {
        let (end, ctx) = (9, [1, 2, 3, 9, 4, 5, 1, 2]);
        let policy = MaxGramPolicy {
            length_per_match: 0.0,
            ..MaxGramPolicy::default()
        };
        let mut d = MaxGramDrafter::new("mag", policy, None);
        d.start(&ctx).unwrap();
        assert_eq!(propose(&mut d, &ctx, 8).tokens(), [3, 9, 4, 5, 1, 2, 3, 9]);
        assert_eq!(propose_ending(&mut d, &ctx, 8, &[end]).tokens(), [3, 9]);
    }

    /// A copy stops before an id the reviewer's vocabulary lacks (a narrower reviewer inside
    /// a cascade, under a target whose vocabulary extends it).
    #[test]
    fn a_copy_stops_before_an_id_beyond_the_reviewers_vocabulary() {
        use crate::sampling::{Rng, Sampling};
        use rand::SeedableRng;
        let ctx = [1, 2, 3, 9, 4, 5, 1, 2];
        let policy = MaxGramPolicy {
            length_per_match: 0.0,
            ..MaxGramPolicy::default()
        };
        let mut d = MaxGramDrafter::new("mag", policy, None);
        d.start(&ctx).unwrap();
        let mut rng = Rng::seed_from_u64(0);
        let draft = crate::draft::try_propose(&mut d, &ctx, 8, 9, &Sampling::greedy(), &mut rng);
        assert_eq!(draft.unwrap().tokens(), [3]);
    }

    #[test]
    fn the_policy_limits_proposals_by_match_length() {
        let mut d = MaxGramDrafter::new("mag", MaxGramPolicy::default(), None);
        // [.., 4, 5] matches at e=2 with length 2: at most 2 tokens.
        let ctx = [4, 5, 6, 7, 8, 9, 4, 5];
        d.start(&ctx).unwrap();
        assert_eq!(propose(&mut d, &ctx, 8).tokens(), [6, 7]);
        // A match of length 1 is ignored (min_match = 2), and there is no table.
        let ctx = [4, 5, 6, 7, 8, 9, 5];
        d.start(&ctx).unwrap();
        assert!(propose(&mut d, &ctx, 8).is_empty());
    }

    /// A table sure of 4 after 9 (and of 6 after 4), and a policy that drafts up to 4 of its
    /// guesses where nothing matches.
    fn table_and_policy() -> (Arc<BigramTable>, MaxGramPolicy) {
        let mut counts = FxHashMap::default();
        counts.insert((9, 4), 3);
        counts.insert((4, 6), 1);
        let policy = MaxGramPolicy {
            max_ngram: 8,
            min_match: 1,
            bigram_tokens: 4,
            ..Default::default()
        };
        (
            Arc::new(BigramTable::from_counts(&counts, &[], 16, 2, 0)),
            policy,
        )
    }

    #[test]
    fn no_match_falls_back_to_the_bigram_table() {
        let (table, policy) = table_and_policy();
        let mut d = MaxGramDrafter::new("mag", policy, Some(table));
        d.start(&[1, 2, 9]).unwrap();
        let draft = propose(&mut d, &[1, 2, 9], 5);
        assert_eq!(draft.tokens(), [4, 6]); // the table has nothing after 6
        assert_eq!(draft.dists(), [Dist::Point(4), Dist::Point(6)]);
        let mut d = MaxGramDrafter::new("mag", policy, None);
        d.start(&[1, 2, 9]).unwrap();
        assert!(propose(&mut d, &[1, 2, 9], 4).is_empty());
    }

    /// A copy the adaptive gate declines is not replaced by the table's guess, which would be
    /// learned under Max-Gram's name among its copies' confidences.
    #[test]
    fn a_declined_copy_does_not_fall_back_to_the_table() {
        use crate::costs::ForwardCost;
        use crate::draft::Request;
        use crate::gate::{Adaptive, Gate};
        use crate::sampling::{Rng, Sampling};
        use rand::SeedableRng;
        let (table, policy) = table_and_policy();
        // 9 was followed by 1, 2 and 3: a one-token match with a third's share, confidence
        // 1/6, which the gate's fresh estimate does not find worth a verified row at half a
        // decode step.
        let context = [9, 1, 9, 2, 9, 3, 9];
        let verify = ForwardCost {
            decode_seconds: 0.01,
            ratios: (1..=16).map(|k| (k, 1.0 + 0.5 * (k - 1) as f64)).collect(),
            per_context: Vec::new(),
        };
        let mut gate = Gate::adaptive(Adaptive::new(verify));
        let (sampling, mut rng) = (Sampling::default(), Rng::seed_from_u64(1));
        let mut request = Request::new(&sampling, &mut rng, &mut gate, "mag".into(), 8, 16);
        let mut d = MaxGramDrafter::new("mag", policy, Some(table));
        d.start(&context).unwrap();
        let draft = d.draft(&context, &mut request).unwrap();
        assert!(request.declined());
        assert!(draft.is_empty(), "{:?}", draft.tokens());
    }

    #[test]
    fn a_history_lends_earlier_outputs_where_they_match_longer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("h.hist");
        let history = || crate::drafter::History::open(&path, 1, 50, 1000, 8).unwrap();
        let policy = MaxGramPolicy {
            length_per_match: 0.0,
            ..Default::default()
        };
        let mut d = MaxGramDrafter::new("mag", policy, None).with_history(history());
        d.start(&[1, 2]).unwrap();
        d.finish(&[10, 11, 12, 13, 14]).unwrap();
        // A later run (another process: the file) whose text ends like the earlier output.
        let mut d = MaxGramDrafter::new("mag", policy, None).with_history(history());
        let ctx = [3, 11, 12];
        d.start(&ctx).unwrap();
        assert_eq!(propose(&mut d, &ctx, 8).tokens(), [13, 14]);
        // The text's own match wins a tie, and when it is longer.
        let ctx = [11, 12, 40, 11, 12];
        d.start(&ctx).unwrap();
        assert_eq!(propose(&mut d, &ctx, 1).tokens(), [40]);
        let ctx = [5, 11, 12, 40, 5, 11, 12];
        d.start(&ctx).unwrap();
        assert_eq!(propose(&mut d, &ctx, 1).tokens(), [40]);
        // Without the history, the earlier output is unknown.
        let mut d = MaxGramDrafter::new("mag", policy, None);
        d.start(&[3, 11, 12]).unwrap();
        assert!(propose(&mut d, &[3, 11, 12], 8).is_empty());
    }

    /// The quadratic definition the index must agree with.
    fn naive(tokens: &[u32], prompt_len: usize, max_ngram: usize) -> Option<Match> {
        let t = tokens.len();
        for n in (1..=max_ngram.min(t.saturating_sub(1))).rev() {
            let ends: Vec<usize> = (n..t)
                .filter(|&e| tokens[e - n..e] == tokens[t - n..t])
                .collect();
            if let Some(&first) = ends.first() {
                let end = if first < prompt_len {
                    first
                } else {
                    *ends.last().unwrap()
                };
                return Some(Match { len: n, end });
            }
        }
        None
    }

    #[test]
    fn the_index_agrees_with_a_naive_search_through_pushes_and_rollbacks() {
        let mut state = 12345u64;
        let mut rand = |n: u64| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) % n
        };
        for trial in 0..200 {
            let vocab = 2 + rand(5) as u32;
            let max_ngram = 1 + rand(6) as usize;
            let prompt: Vec<u32> = (0..rand(12)).map(|_| rand(vocab as u64) as u32).collect();
            let mut m = MaxGram::new(max_ngram);
            m.start(&prompt);
            let mut reference = prompt.clone();
            let mut prompt_len = prompt.len();
            for _ in 0..60 {
                if rand(4) == 0 && !reference.is_empty() {
                    let len = rand(reference.len() as u64 + 1) as usize;
                    m.truncate(len);
                    reference.truncate(len);
                    prompt_len = prompt_len.min(len);
                } else {
                    let t = rand(vocab as u64) as u32;
                    m.push(t);
                    reference.push(t);
                }
                assert_eq!(
                    m.longest_match(),
                    naive(&reference, prompt_len, max_ngram),
                    "trial {trial}: {reference:?}"
                );
            }
        }
    }
}
