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

/// A draft model step of 1 ms, and 1 ms per token of a longer forward (its prompt: 0.2 s).
fn draft_cost() -> ForwardCost {
    ForwardCost {
        decode_seconds: 0.001,
        ratios: vec![(1, 1.0)],
        per_context: Vec::new(),
    }
}

fn neural() -> NeuralDrafter {
    NeuralDrafter::new("d", Box::new(ToyModel::new(5, VOCAB, 6.0))).with_cost(&draft_cost())
}

/// Plain decoding takes 10 ms a token, so `max_new_tokens` of 10 leave a catch-up 10 ms (a
/// tenth of 0.1 s): reading the 200-token prompt (0.2 s) is not worth it, and the draft model
/// never runs. With 1,000 tokens to go (10 ms a token, 10 s) it is, and the model drafts.
/// Greedy output is the target's either way.
#[test]
fn a_draft_model_reads_a_long_prompt_only_if_the_generation_can_repay_it() {
    let prompt: Vec<u32> = (0..200).map(|i| (i * 5 % VOCAB) as u32).collect();
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
        for (max_new_tokens, reads) in [(10, false), (1000, true)] {
            let what = format!("{name}, {max_new_tokens} tokens");
            let plain = generate(None, max_new_tokens);
            let g = generate(Some(drafter()), max_new_tokens);
            assert_eq!(g.tokens, plain.tokens, "{what}");
            let calls = g.drafter.as_ref().unwrap().forward_calls;
            assert_eq!(calls > 0, reads, "{what}: {calls} forward calls");
            assert_eq!(g.stats.drafted > 0, reads, "{what}");
        }
    }
}
