//! Drafters are held to their contract at every review level: a plug-in that proposes an
//! out-of-vocabulary token, tokens it was not admitted or more than asked, or a token its reported distribution
//! could not have drawn (or one that does not fit the vocabulary, does not sum to 1 or lists a
//! token twice), is a clear error wherever it sits
//! in the tree (the target's review, a vertical cascade's, a horizontal cascade's part), never
//! an index out of bounds; an empty context is an error, not a panic; a drafter that cannot
//! record a finished output costs a warning, never the output; and what a drafter proposes
//! after a token that ends the generation is never verified.

mod common;

use cascade::draft::{try_propose, Draft, Drafter, Request};
use cascade::drafter::{AdaptiveCascade, HorizontalCascade, NeuralDrafter, VerticalCascade};
use cascade::engine::{Engine, FinishReason, GenerateOptions};
use cascade::model::Logits;
use cascade::review::{review, Verdict};
use cascade::sampling::{Dist, Rng, Sampling};
use cascade::Error;
use common::{toy_tokenizer, toy_tokenizer_ending, ToyModel};
use rand::SeedableRng;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

const VOCAB: usize = 6;

/// A plug-in that proposes `token`, asking admission first or not, with `dist` as its
/// distribution (a point mass on it if `None`).
struct Broken {
    token: u32,
    ask: bool,
    dist: Option<Dist>,
}

impl Drafter for Broken {
    fn name(&self) -> &str {
        "broken"
    }

    fn draft(&mut self, _: &[u32], request: &mut Request) -> cascade::Result<Draft> {
        let mut d = Draft::new();
        if !self.ask || request.admit(None) {
            let dist = self.dist.clone().unwrap_or(Dist::Point(self.token));
            d.push(self.token, dist);
        }
        Ok(d)
    }
}

fn toy() -> Box<ToyModel> {
    Box::new(ToyModel::new(5, VOCAB, 3.0))
}

fn generate(drafter: Box<dyn Drafter>) -> Result<(), Error> {
    let mut e = Engine::new(toy(), Some(drafter), toy_tokenizer(VOCAB));
    e.generate(&[1, 2], &GenerateOptions::default(), &mut |_| {})
        .map(drop)
}

fn vertical(inner: Box<dyn Drafter>) -> Box<dyn Drafter> {
    Box::new(VerticalCascade::new("v", toy(), inner, 3, 1.0))
}

fn horizontal(part: Box<dyn Drafter>) -> Box<dyn Drafter> {
    let neural = Box::new(NeuralDrafter::new("n", toy()));
    Box::new(HorizontalCascade::new("h", vec![(neural, 1), (part, 2)]))
}

#[test]
fn an_out_of_vocabulary_token_is_an_error_at_every_level() {
    let want = "drafter broke its contract: `broken` proposed token id 99, outside the vocabulary (6 tokens)";
    let bad = || {
        Box::new(Broken {
            token: 99,
            ask: true,
            dist: None,
        })
    };
    for (level, drafter) in [
        ("target", bad() as Box<dyn Drafter>),
        ("vertical cascade", vertical(bad())),
        ("horizontal cascade", horizontal(bad())),
        (
            "vertical cascade over a horizontal one",
            vertical(horizontal(bad())),
        ),
    ] {
        let e = generate(drafter).unwrap_err();
        assert_eq!(e.to_string(), want, "{level}");
    }
}

#[test]
fn tokens_not_admitted_are_an_error_at_every_level() {
    let want = "drafter broke its contract: `broken` returned 1 tokens but 0 were admitted \
                (call `Request::admit` once before each token)";
    let rude = || {
        Box::new(Broken {
            token: 1,
            ask: false,
            dist: None,
        })
    };
    for (level, drafter) in [
        ("target", rude() as Box<dyn Drafter>),
        ("vertical cascade", vertical(rude())),
        ("horizontal cascade", horizontal(rude())),
    ] {
        let e = generate(drafter).unwrap_err();
        assert_eq!(e.to_string(), want, "{level}");
    }
}

/// A drafter that counts tokens it was never admitted (`Request::count_part`, meant for a
/// cascade's parts) to return more than asked is refused, not verified past the room the
/// engine left for it.
#[test]
fn a_draft_longer_than_asked_is_an_error_at_every_level() {
    struct Greedy;
    impl Drafter for Greedy {
        fn name(&self) -> &str {
            "greedy"
        }
        fn draft(&mut self, _: &[u32], request: &mut Request) -> cascade::Result<Draft> {
            let n = request.remaining() + 1;
            request.count_part(n);
            let mut d = Draft::new();
            (0..n).for_each(|_| d.push(1, Dist::Point(1)));
            Ok(d)
        }
    }
    for (level, drafter, asked) in [
        ("target", Box::new(Greedy) as Box<dyn Drafter>, 4),
        ("vertical cascade", vertical(Box::new(Greedy)), 3),
        ("horizontal cascade", horizontal(Box::new(Greedy)), 2),
    ] {
        let e = generate(drafter).unwrap_err().to_string();
        let want = format!(
            "drafter broke its contract: `greedy` returned {} tokens, more than the {asked} asked",
            asked + 1
        );
        assert_eq!(e, want, "{level}");
    }
}

#[test]
fn a_token_its_reported_distribution_cannot_draw_is_an_error_at_every_level() {
    // The review would accept the token with the wrong probability, or index out of bounds.
    let cases = [
        (
            Dist::Point(2),
            "`broken` proposed token 1 at position 0, to which the distribution reported with it \
             gives probability 0 (report the distribution the token was drawn from)",
        ),
        (
            Dist::Sparse(vec![(1, 0.5), (40, 0.5)]),
            "`broken` reported a distribution at position 0 that does not fit the vocabulary \
             (6 tokens; a dense one has at most one probability per token)",
        ),
        (
            Dist::Dense(vec![0.125; 8]),
            "`broken` reported a distribution at position 0 that does not fit the vocabulary \
             (6 tokens; a dense one has at most one probability per token)",
        ),
        // Sampling normalizes weights, the review reads them as given.
        (
            Dist::Dense(vec![0.0, 1.0, 1.0, 0.0, 0.0, 0.0]),
            "`broken` reported a distribution at position 0 whose probabilities sum to 2, not 1",
        ),
        (
            Dist::Sparse(vec![(1, 0.5), (3, 0.5), (1, 0.5)]),
            "`broken` reported a sparse distribution at position 0 that lists token 1 twice",
        ),
        (
            Dist::Sparse(vec![(1, 1.5), (2, -0.5)]),
            "`broken` reported a distribution at position 0 with a negative or NaN probability",
        ),
    ];
    for (dist, want) in cases {
        let bad = || {
            Box::new(Broken {
                token: 1,
                ask: true,
                dist: Some(dist.clone()),
            })
        };
        for (level, drafter) in [
            ("target", bad() as Box<dyn Drafter>),
            ("vertical cascade", vertical(bad())),
            ("horizontal cascade", horizontal(bad())),
        ] {
            let e = generate(drafter).unwrap_err().to_string();
            assert_eq!(e, format!("drafter broke its contract: {want}"), "{level}");
        }
        // The same check for a drafter tried on its own.
        let mut rng = Rng::seed_from_u64(0);
        let e = try_propose(&mut *bad(), &[1], 1, VOCAB, &Sampling::greedy(), &mut rng);
        assert_eq!(
            e.unwrap_err().to_string(),
            format!("drafter broke its contract: {want}")
        );
    }
}

#[test]
fn a_distribution_off_by_less_than_the_bound_is_reviewed_as_the_one_sampling_draws_from() {
    // Sampling normalizes: weights summing to 0.9995 draw token 1 with 0.4998 / 0.9995, which
    // is the q the review must read. A normalized distribution is left bit for bit as it was.
    let off = Dist::Dense(vec![0.0, 0.4998, 0.4997, 0.0, 0.0, 0.0]);
    let exact = Dist::Sparse(vec![(1, 0.25), (2, 0.75)]);
    for (dist, want) in [(off, 0.4998 / 0.9995), (exact, 0.25)] {
        let mut plug_in = Broken {
            token: 1,
            ask: true,
            dist: Some(dist),
        };
        let mut rng = Rng::seed_from_u64(0);
        let draft = try_propose(&mut plug_in, &[1], 1, VOCAB, &Sampling::greedy(), &mut rng)
            .expect("within the bound");
        let q = &draft.dists()[0];
        assert_eq!(q.prob(1), want as f32);
        let total: f64 = (0..VOCAB as u32).map(|t| f64::from(q.prob(t))).sum();
        assert!((total - 1.0).abs() < 1e-7, "sums to {total}");
    }
}

#[test]
fn a_draft_longer_than_a_config_allows_is_refused_before_the_drafter_is_asked() {
    // A Max-Gram copy with no cap per match made room for all k tokens: usize::MAX aborted.
    let policy = cascade::drafter::MaxGramPolicy {
        length_per_match: 0.0,
        ..Default::default()
    };
    let mut mag = cascade::drafter::MaxGramDrafter::new("mag", policy, None);
    let mut rng = Rng::seed_from_u64(0);
    for k in [65, usize::MAX] {
        let e = try_propose(
            &mut mag,
            &[1, 2, 1],
            k,
            VOCAB,
            &Sampling::greedy(),
            &mut rng,
        );
        assert_eq!(
            e.unwrap_err().to_string(),
            format!("k: must be at most 64 (tokens drafted per target call), got {k}")
        );
    }
    assert!(try_propose(
        &mut mag,
        &[1, 2, 1],
        64,
        VOCAB,
        &Sampling::greedy(),
        &mut rng
    )
    .is_ok());
}

#[test]
fn a_cascade_asked_to_continue_nothing_is_an_error() {
    let mut v = VerticalCascade::new("v", toy(), Box::new(NeuralDrafter::new("n", toy())), 3, 1.0);
    let mut rng = Rng::seed_from_u64(0);
    let e = try_propose(&mut v, &[], 2, VOCAB, &Sampling::greedy(), &mut rng).unwrap_err();
    assert_eq!(
        e.to_string(),
        "empty prompt: at least one token is needed to start generation"
    );
}

/// A plug-in that drafts nothing and counts the outputs it is asked to record; with `fails`,
/// recording fails as a full disk would.
struct Recorder {
    finished: Arc<AtomicUsize>,
    fails: bool,
}

impl Drafter for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }

    fn draft(&mut self, _: &[u32], _: &mut Request) -> cascade::Result<Draft> {
        Ok(Draft::new())
    }

    fn finish(&mut self, _: &[u32]) -> cascade::Result<()> {
        self.finished.fetch_add(1, Ordering::Relaxed);
        match self.fails {
            true => Err(Error::History {
                path: "h.hist".into(),
                reason: "cannot write: No space left on device".into(),
            }),
            false => Ok(()),
        }
    }
}

#[test]
fn a_drafter_that_cannot_record_the_output_costs_a_warning_not_the_output() {
    let opts = GenerateOptions {
        max_new_tokens: 6,
        ..Default::default()
    };
    let plain = Engine::new(toy(), None, toy_tokenizer(VOCAB))
        .generate(&[1, 2], &opts, &mut |_| {})
        .unwrap();
    let finished = Arc::new(AtomicUsize::new(0));
    let part = |fails| {
        Box::new(Recorder {
            finished: finished.clone(),
            fails,
        }) as Box<dyn Drafter>
    };
    // The failing part comes first: the parts after it still record.
    let drafters: [Box<dyn Drafter>; 3] = [
        part(true),
        Box::new(HorizontalCascade::new(
            "h",
            vec![(part(true), 1), (part(false), 1)],
        )),
        Box::new(AdaptiveCascade::new("a", vec![part(true), part(false)])),
    ];
    for (i, drafter) in drafters.into_iter().enumerate() {
        let mut e = Engine::new(toy(), Some(drafter), toy_tokenizer(VOCAB));
        let mut streamed = String::new();
        let got = e.generate(&[1, 2], &opts, &mut |t| streamed += t).unwrap();
        assert_eq!(got.tokens, plain.tokens, "drafter {i}");
        assert_eq!(streamed, got.text);
        assert_eq!(
            got.warnings,
            ["Max-Gram history h.hist: cannot write: No space left on device"]
        );
    }
    assert_eq!(finished.load(Ordering::Relaxed), 5);
}

/// A review rule set for an experiment is held to its contract: keeping more tokens than
/// were drafted, or emitting tokens without their distributions inside a cascade, is an
/// error, not a panic or a cascade that never ends.
#[test]
fn a_review_rule_that_breaks_its_contract_is_an_error() {
    fn keeps_too_many(
        draft: &[u32],
        _: &[Dist],
        _: &Logits,
        _: &Sampling,
        _: f32,
        _: &mut Rng,
        _: Option<&mut Vec<Dist>>,
    ) -> Verdict {
        Verdict {
            accepted: draft.len() + 1,
            next: 0,
        }
    }
    fn emits_no_distribution(
        draft: &[u32],
        q: &[Dist],
        logits: &Logits,
        s: &Sampling,
        lenience: f32,
        rng: &mut Rng,
        _: Option<&mut Vec<Dist>>,
    ) -> Verdict {
        review(draft, q, logits, s, lenience, rng, None)
    }
    let plain = || Box::new(NeuralDrafter::new("n", toy()));
    let mut e =
        Engine::new(toy(), Some(plain()), toy_tokenizer(VOCAB)).with_review_rule(keeps_too_many);
    let got = e.generate(&[1, 2], &GenerateOptions::default(), &mut |_| {});
    let got = got.err().unwrap().to_string();
    assert_eq!(
        got,
        "model computation failed: the review rule kept 5 of 4 drafted tokens"
    );
    let cascade =
        VerticalCascade::new("v", toy(), plain(), 3, 1.0).with_review_rule(emits_no_distribution);
    let got = generate(Box::new(cascade)).err().unwrap().to_string();
    let emitted = got
        .strip_prefix("model computation failed: the review rule gave 0 distributions for the ")
        .and_then(|rest| rest.strip_suffix(" tokens it emitted"))
        .and_then(|n| n.parse::<usize>().ok());
    assert!(emitted.is_some_and(|n| n >= 1), "{got}");
}

/// A cancelled generation (its client left) is no answer to learn from: the drafters do not
/// record it. The same generation run to its end is recorded.
#[test]
fn a_cancelled_generation_is_not_recorded() {
    let finished = Arc::new(AtomicUsize::new(0));
    let recorder = Box::new(Recorder {
        finished: finished.clone(),
        fails: false,
    });
    let mut e = Engine::new(toy(), Some(recorder), toy_tokenizer(VOCAB));
    for cancelled in [true, false] {
        let cancel = Arc::new(AtomicBool::new(false));
        let opts = GenerateOptions {
            max_new_tokens: 6,
            cancel: Some(cancel.clone()),
            ..Default::default()
        };
        let got = e
            .generate(&[1, 2], &opts, &mut |_| {
                cancel.store(cancelled, Ordering::Relaxed)
            })
            .unwrap();
        let want = match cancelled {
            true => FinishReason::Cancelled,
            false => FinishReason::Length,
        };
        assert_eq!(got.finish_reason, want);
        assert_eq!(finished.load(Ordering::Relaxed), usize::from(!cancelled));
    }
}

/// A draft model that cancels the generation once it has read `after` tokens of the prompt
/// (as a client leaving meanwhile would), counting what it read.
struct LeavingClient {
    model: ToyModel,
    after: usize,
    read: Arc<AtomicUsize>,
    cancel: Arc<AtomicBool>,
}

impl cascade::model::Model for LeavingClient {
    fn name(&self) -> &str {
        "leaving"
    }
    fn forward(&mut self, tokens: &[u32]) -> cascade::Result<Logits> {
        if tokens.len() > 1 {
            let read = self.read.fetch_add(tokens.len(), Ordering::Relaxed) + tokens.len();
            self.cancel.store(read >= self.after, Ordering::Relaxed);
        }
        self.model.forward(tokens)
    }
    fn len(&self) -> usize {
        self.model.len()
    }
    fn truncate(&mut self, len: usize) {
        self.model.truncate(len)
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn max_len(&self) -> usize {
        self.model.max_len
    }
}

/// A cancelled generation stops a draft model's or a reviewer's reading of a long prompt at
/// the next chunk, as it stops the target's: a client that left does not keep the engine busy.
#[test]
fn a_cancelled_generation_stops_a_drafters_reading_of_the_prompt() {
    let prompt: Vec<u32> = (0..2000).map(|i| (i % VOCAB) as u32).collect();
    for vertical in [false, true] {
        let (read, cancel) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let leaving = Box::new(LeavingClient {
            model: *toy(),
            after: 1,
            read: read.clone(),
            cancel: cancel.clone(),
        });
        let drafter: Box<dyn Drafter> = match vertical {
            false => Box::new(NeuralDrafter::new("draft", leaving)),
            true => Box::new(VerticalCascade::new(
                "reviewer",
                leaving,
                Box::new(NeuralDrafter::new("draft", toy())),
                3,
                1.0,
            )),
        };
        let mut e = Engine::new(toy(), Some(drafter), toy_tokenizer(VOCAB));
        let opts = GenerateOptions {
            max_new_tokens: 6,
            cancel: Some(cancel),
            ..Default::default()
        };
        let got = e.generate(&prompt, &opts, &mut |_| {}).unwrap();
        assert_eq!(got.finish_reason, FinishReason::Cancelled);
        let read = read.load(Ordering::Relaxed);
        assert_eq!(read, cascade::model::PREFILL_CHUNK, "vertical: {vertical}");
    }
}

/// A draft model or reviewer whose context is shorter than the target's stops drafting where
/// the text outgrows it (or does not start, if the prompt does not fit); the generation goes on
/// with the target's own tokens.
#[test]
fn a_drafter_with_a_shorter_context_stops_drafting_where_the_text_outgrows_it() {
    let short = |max_len: usize| {
        let mut m = toy();
        m.max_len = max_len;
        m
    };
    let opts = GenerateOptions {
        max_new_tokens: 8,
        ..Default::default()
    };
    let prompt = [1, 2, 3, 4, 5, 1, 2, 3];
    let run = |drafter: Option<Box<dyn Drafter>>| {
        let mut e = Engine::new(toy(), drafter, toy_tokenizer(VOCAB));
        e.generate(&prompt, &opts, &mut |_| {}).unwrap()
    };
    let plain = run(None);
    // Room for a few draft tokens, then none.
    let neural = run(Some(Box::new(NeuralDrafter::new("n", short(11)))));
    assert_eq!(neural.tokens, plain.tokens);
    assert!(neural.stats.drafted > 0);
    // The prompt itself does not fit.
    let neural = run(Some(Box::new(NeuralDrafter::new("n", short(6)))));
    assert_eq!(neural.tokens, plain.tokens);
    assert_eq!(neural.stats.drafted, 0);
    let inner = Box::new(NeuralDrafter::new("n", toy()));
    let vertical = run(Some(Box::new(VerticalCascade::new(
        "v",
        short(6),
        inner,
        3,
        1.0,
    ))));
    assert_eq!(vertical.tokens, plain.tokens);
    assert_eq!(vertical.stats.drafted, 0);
}

/// A plug-in that proposes its tokens, as many as it is admitted, and stops at nothing.
struct Fixed(Vec<u32>);

impl Drafter for Fixed {
    fn name(&self) -> &str {
        "fixed"
    }

    fn draft(&mut self, _: &[u32], request: &mut Request) -> cascade::Result<Draft> {
        let mut d = Draft::new();
        for &t in &self.0 {
            if !request.admit(None) {
                break;
            }
            d.push(t, Dist::Point(t));
        }
        Ok(d)
    }
}

/// Nothing drafted after a token that ends the generation could be kept, so a draft is cut
/// after it before it is scored, at every level (the target's review, a vertical cascade's, a
/// horizontal cascade's part), whatever the drafter proposes beyond it. A generation that goes
/// on past end tokens (`ignore_eos`) scores the whole draft. The output is the target's either
/// way.
#[test]
fn a_draft_is_cut_after_a_token_that_ends_the_generation() {
    const END: u32 = 5;
    type Make = fn() -> Box<dyn Drafter>;
    fn fixed() -> Box<dyn Drafter> {
        Box::new(Fixed(vec![END, 1, 2, 3]))
    }
    // The positions the level's reviews score at most, when END ends the generation and when
    // it does not: the plug-in alone drafts 4 (k), in a vertical cascade 3 (its inner k), as
    // a horizontal cascade's part 2 after the draft model's 1.
    let levels: [(&str, Make, [usize; 2]); 3] = [
        ("the target's review", fixed, [1, 4]),
        ("a vertical cascade's review", || vertical(fixed()), [1, 3]),
        (
            "a horizontal cascade's part",
            || horizontal(fixed()),
            [2, 3],
        ),
    ];
    let run = |drafter: Option<Box<dyn Drafter>>, ignore_eos: bool| {
        let tokenizer = toy_tokenizer_ending(VOCAB, vec![END]);
        let mut e = Engine::new(toy(), drafter, tokenizer);
        let opts = GenerateOptions {
            max_new_tokens: 12,
            k: 4,
            ignore_eos,
            ..Default::default()
        };
        e.generate(&[1, 2], &opts, &mut |_| {}).unwrap()
    };
    for (level, make, scored) in levels {
        for (ignore_eos, scored) in [(false, scored[0]), (true, scored[1])] {
            let what = format!("{level}, ignore_eos {ignore_eos}");
            let g = run(Some(make()), ignore_eos);
            assert_eq!(g.tokens, run(None, ignore_eos).tokens, "{what}");
            let node = g.drafter.as_ref().unwrap();
            let reviews = match node.kind {
                cascade::draft::NodeKind::Vertical => &node.reviews,
                _ => &g.stats.reviews,
            };
            assert_eq!(reviews.drafted_at.len(), scored, "{what}: {reviews:?}");
        }
    }
}

/// What a config would refuse, the engine refuses too, for a program that builds its options
/// or its cascades in code: a draft length above the bound, and a lenience other than a finite
/// number of at least 1 at any review (NaN rejected every token while the cascade reported its
/// drafter's distribution: the level above reviewed against the wrong one, without an error).
#[test]
fn settings_out_of_range_are_refused_without_a_config() {
    let neural = || Box::new(NeuralDrafter::new("n", toy()));
    let mut e = Engine::new(toy(), Some(neural()), toy_tokenizer(VOCAB));
    let opts = GenerateOptions {
        k: 65,
        ..Default::default()
    };
    assert_eq!(
        e.generate(&[1, 2], &opts, &mut |_| {})
            .unwrap_err()
            .to_string(),
        "k: must be at most 64 (tokens drafted per target call), got 65"
    );
    let sampled = GenerateOptions {
        sampling: Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        },
        ..Default::default()
    };
    for l in [f32::NAN, f32::INFINITY, 0.5] {
        let cascade = VerticalCascade::new("v", toy(), neural(), 3, l);
        let mut e = Engine::new(toy(), Some(Box::new(cascade)), toy_tokenizer(VOCAB));
        assert_eq!(
            e.generate(&[1, 2], &sampled, &mut |_| {})
                .unwrap_err()
                .to_string(),
            format!("lenience of the review by `toy`: must be a finite number >= 1, got {l}")
        );
    }
}
