//! Adaptive drafting's one-time decisions: a draft model (alone, or reviewing another drafter
//! in a vertical cascade) reads the prompt only when the rest of the generation can repay it.

mod common;

use cascade::costs::ForwardCost;
use cascade::draft::Drafter;
use cascade::drafter::{NeuralDrafter, VerticalCascade};
use cascade::engine::{Engine, GenerateOptions};
use common::{toy_tokenizer, ToyModel};

const VOCAB: usize = 8;

/// A 10 ms target step, each extra token scored 1.5 ms more.
fn verify_cost() -> ForwardCost {
    ForwardCost {
        decode_seconds: 0.01,
        ratios: (1..=16).map(|k| (k, 1.0 + 0.15 * (k - 1) as f64)).collect(),
        per_context: Vec::new(),
    }
}

/// A draft model step of 1 ms, and 0.5 ms per token of a longer forward (its prompt: 0.2 s).
fn draft_cost() -> ForwardCost {
    ForwardCost {
        decode_seconds: 0.001,
        ratios: vec![(1, 1.0), (2, 1.5)],
        per_context: Vec::new(),
    }
}

fn neural() -> NeuralDrafter {
    NeuralDrafter::new("d", Box::new(ToyModel::new(5, VOCAB, 6.0))).with_cost(&draft_cost())
}

/// Plain decoding takes 10 ms a token and a catch-up may cost a tenth of the time the rest of
/// the generation is expected to take. With `max_new_tokens` of 10 that is 10 ms, so reading
/// the 400-token prompt (0.2 s) is not worth it. With 300 it is not either: the rest is
/// expected to be as long as what is out, at least 128 tokens, at most what the limit leaves,
/// so the budget never passes 0.15 s (150 tokens out, 150 to go), while reading grows with the
/// text (0.275 s then). With 1,000 the generation earns it once about 400 tokens are out: the
/// draft model reads then and drafts the rest. Greedy output is the target's either way.
#[test]
fn a_draft_model_reads_a_long_prompt_only_if_the_generation_can_repay_it() {
    let prompt: Vec<u32> = (0..400).map(|i| (i * 5 % VOCAB) as u32).collect();
    type Make = fn() -> Box<dyn Drafter>;
    let drafters: [(&str, Make); 2] = [
        ("a draft model", || Box::new(neural())),
        ("a vertical cascade", || {
            let reviewer = Box::new(ToyModel::new(5, VOCAB, 6.0));
            Box::new(
                VerticalCascade::new("v", reviewer, Box::new(neural()), 2, 1.0)
                    .with_cost(draft_cost()),
            )
        }),
    ];
    let generate = |drafter: Option<Box<dyn Drafter>>, max_new_tokens: usize| {
        let mut e = Engine::new(
            Box::new(ToyModel::new(5, VOCAB, 6.0)),
            drafter,
            toy_tokenizer(VOCAB),
        )
        .with_adaptive(verify_cost(), &[]);
        let opts = GenerateOptions {
            max_new_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        e.generate(&prompt, &opts, &mut |_| {}).unwrap()
    };
    for (name, drafter) in drafters {
        for (max_new_tokens, reads) in [(10, false), (300, false), (1000, true)] {
            let what = format!("{name}, {max_new_tokens} tokens");
            let plain = generate(None, max_new_tokens);
            let g = generate(Some(drafter()), max_new_tokens);
            assert_eq!(g.tokens, plain.tokens, "{what}");
            let calls = g.drafter.as_ref().unwrap().forward_calls;
            assert_eq!(calls > 0, reads, "{what}: {calls} forward calls");
            assert_eq!(g.stats.drafted > 0, reads, "{what}");
            if reads {
                // Not at once: the first 400 tokens were decoded one target call each.
                assert!(g.stats.target_calls > 400, "{what}: {:?}", g.stats);
            }
        }
    }
}

/// Reading a 200-token prompt (0.1 s) is worth it for an answer expected to run 128 tokens
/// (1.28 s of decoding) but not when the target's context has room for only 30 more (0.3 s),
/// whatever `max_new_tokens` allows.
#[test]
fn a_nearly_full_context_does_not_pay_for_reading_the_prompt() {
    let prompt: Vec<u32> = (0..200).map(|i| (i * 3 % VOCAB) as u32).collect();
    let generate = |drafter: Option<Box<dyn Drafter>>, context: usize| {
        let mut target = ToyModel::new(5, VOCAB, 6.0);
        target.max_len = context;
        let mut e = Engine::new(Box::new(target), drafter, toy_tokenizer(VOCAB))
            .with_adaptive(verify_cost(), &[]);
        let opts = GenerateOptions {
            max_new_tokens: 1000,
            ignore_eos: true,
            ..Default::default()
        };
        e.generate(&prompt, &opts, &mut |_| {}).unwrap()
    };
    for (context, reads) in [(4096, true), (230, false)] {
        let plain = generate(None, context);
        let g = generate(Some(Box::new(neural())), context);
        assert_eq!(g.tokens, plain.tokens, "context {context}");
        let calls = g.drafter.as_ref().unwrap().forward_calls;
        assert_eq!(calls > 0, reads, "context {context}: {calls} forward calls");
    }
}

/// What the gate learns from greedy reviews does not size sampled drafts (a sampled token is
/// accepted less often, and a server mixes both): a sampled generation after a greedy one
/// learns what it learns alone.
#[test]
fn greedy_and_sampled_reviews_are_learned_apart() {
    let prompt: Vec<u32> = (0..24).map(|i| (i * 3 % VOCAB) as u32).collect();
    let engine = || {
        Engine::new(
            Box::new(ToyModel::new(5, VOCAB, 6.0)),
            Some(Box::new(neural())),
            toy_tokenizer(VOCAB),
        )
        .with_adaptive(verify_cost(), &[])
    };
    let opts = |temperature: f32| GenerateOptions {
        max_new_tokens: 80,
        ignore_eos: true,
        sampling: cascade::sampling::Sampling {
            temperature,
            ..Default::default()
        },
        seed: 7,
        ..Default::default()
    };
    let learned = |e: &Engine| {
        let c = e.adaptive().unwrap().calibration("d").unwrap();
        let estimates: Vec<f64> = (0..=20)
            .map(|i| c.estimate(Some(i as f32 / 20.0)))
            .collect();
        (estimates, e.adaptive().unwrap().report())
    };
    let mut alone = engine();
    let g = alone.generate(&prompt, &opts(1.0), &mut |_| {}).unwrap();
    assert!(g.stats.drafted > 0, "{:?}", g.stats);
    let mut after_greedy = engine();
    let greedy = after_greedy
        .generate(&prompt, &opts(0.0), &mut |_| {})
        .unwrap();
    assert!(greedy.stats.drafted > 0, "{:?}", greedy.stats);
    let greedy_learned = learned(&after_greedy);
    after_greedy.forget();
    after_greedy
        .generate(&prompt, &opts(1.0), &mut |_| {})
        .unwrap();
    assert_eq!(learned(&after_greedy), learned(&alone));
    assert_ne!(greedy_learned, learned(&alone));
}
