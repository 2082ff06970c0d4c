//! The engine on the real test models (Qwen2.5-Coder 1.5B target, 0.5B draft, SmolLM2 135M,
//! Gemma 3 270M), fetched by scripts/fetch-models.sh.

mod common;

use cascade::drafter::{Drafter, NeuralDrafter};
use cascade::engine::{Engine, GenerateOptions, Generation};
use cascade::model::{LoadedModel, Model};
use cascade::sampling::Sampling;
use cascade::stream::TextStream;
use common::{real, serial, DRAFT, GEMMA3, SMOLLM2, TARGET};

const PROMPTS: [&str; 3] = [
    "def quicksort(arr):\n",
    "Write a Python function that returns the n-th Fibonacci number.",
    "# Parse a CSV file and print the sum of the second column\nimport csv\n",
];

fn engine(drafter: Option<Box<dyn Drafter>>) -> Engine {
    let t = real(TARGET);
    Engine::new(
        Box::new(t.instance("target", None)),
        drafter,
        t.tokenizer.clone(),
    )
}

fn draft_model(file: &str) -> Option<Box<dyn Drafter>> {
    Some(Box::new(NeuralDrafter::new(
        "draft",
        Box::new(real(file).instance("draft", None)),
    )))
}

fn encode(text: &str) -> Vec<u32> {
    real(TARGET).tokenizer.encode(text).unwrap()
}

fn run(e: &mut Engine, prompt: &str, opts: &GenerateOptions) -> Generation {
    e.generate(&encode(prompt), opts, &mut |_| {}).unwrap()
}

/// On the target, on its Q5_K requantization (`common::q5k_target`) and on the draft's Q5_1
/// one (`common::q5_1_draft`).
#[test]
fn k_token_forward_equals_k_one_token_forwards_bit_for_bit() {
    let _s = serial();
    let load = |path: std::path::PathBuf| {
        std::sync::Arc::new(LoadedModel::load(&path, None, &mut |_, _| {}).unwrap())
    };
    for (name, model) in [
        (TARGET, real(TARGET)),
        ("Q5_K", load(common::q5k_target())),
        ("Q5_1", load(common::q5_1_draft())),
    ] {
        let mut m = model.instance("target", None);
        let prompt = encode(PROMPTS[0]);
        m.prefill(&prompt).unwrap();
        // A verify's length, and one of more than two kernel row groups (16 rows each).
        let long = " if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n    \
                    left = [x for x in arr if x < pivot]\n    right = [x for x in arr if x > pivot]";
        let long = encode(long);
        assert!(long.len() > 32, "{} tokens", long.len());
        for next in [encode(" if len(arr) <= 1: return arr"), long] {
            let batch = m.forward(&next).unwrap();
            m.truncate(prompt.len());
            for (i, &t) in next.iter().enumerate() {
                let one = m.forward(&[t]).unwrap();
                assert!(
                    batch.row(i) == one.row(0),
                    "{name}: row {i} differs between the {}-token and the 1-token forward",
                    next.len()
                );
            }
            m.truncate(prompt.len());
        }
    }
}

/// A trimmed vocabulary scores its tokens exactly as the whole output projection does, gives
/// the others `-inf`, and is undone by `None`.
#[test]
fn a_trimmed_vocabulary_scores_its_tokens_like_the_whole_projection() {
    let _s = serial();
    let model = real(DRAFT);
    let prompt = encode(PROMPTS[2]);
    let mut full = model.instance("full", None);
    let want = full.forward(&prompt).unwrap();
    let scored: Vec<u32> = (0..want.vocab() as u32)
        .filter(|t| t % 7 == 3 || *t < 500)
        .collect();
    let mut m = model.instance("trimmed", None);
    m.restrict_vocabulary(Some(&scored)).unwrap();
    let got = m.forward(&prompt).unwrap();
    for r in 0..prompt.len() {
        for (t, (&g, &w)) in got.row(r).iter().zip(want.row(r)).enumerate() {
            if scored.binary_search(&(t as u32)).is_ok() {
                assert_eq!(g.to_bits(), w.to_bits(), "row {r}, token {t}");
            } else {
                assert_eq!(g, f32::NEG_INFINITY, "row {r}, token {t}");
            }
        }
    }
    m.truncate(0);
    m.restrict_vocabulary(None).unwrap();
    assert!(m.forward(&prompt).unwrap().row(3) == want.row(3));
    let e = m.restrict_vocabulary(Some(&[1u32 << 30])).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "trimmed: cannot score token id 1073741824: the vocabulary has {} tokens",
            want.vocab()
        )
    );
}

#[test]
fn rollback_then_refeed_equals_a_fresh_forward() {
    let _s = serial();
    // Bit-exact (tolerance 0): rows are computed independently, so chunking cannot matter.
    let prompt = encode(PROMPTS[1]);
    let cont = encode(" Here is the function:");
    let junk = encode(" banana banana banana");
    let mut rolled = real(TARGET).instance("a", None);
    rolled.prefill(&prompt).unwrap();
    rolled.forward(&junk).unwrap();
    rolled.truncate(prompt.len());
    assert_eq!(rolled.len(), prompt.len());
    let after_rollback = rolled.forward(&cont).unwrap();
    let mut fresh = real(TARGET).instance("b", None);
    let all: Vec<u32> = prompt.iter().chain(&cont).copied().collect();
    let fresh_logits = fresh.forward(&all).unwrap();
    for i in 0..cont.len() {
        assert!(
            after_rollback.row(i) == fresh_logits.row(prompt.len() + i),
            "position {i} differs after rollback"
        );
    }
}

/// A forward or prefill that fails (here on a token outside the vocabulary, in the second chunk
/// of a long prompt) leaves the cache as it was, so the next forward is a fresh model's.
#[test]
fn a_failed_forward_leaves_the_cache_as_it_was() {
    let _s = serial();
    let model = real(SMOLLM2);
    let vocab = model.weights.vocab_size() as u32;
    let prompt: Vec<u32> = (0..300).map(|i| 100 + i % 50).collect();
    let mut bad = prompt.clone();
    bad.push(vocab);
    let mut m = model.instance("m", None);
    m.prefill(&prompt[..10]).unwrap();
    for _ in 0..2 {
        assert!(m.prefill(&bad).is_err());
        assert_eq!(m.len(), 10);
        assert!(m.forward(&bad[290..]).is_err());
        assert_eq!(m.len(), 10);
    }
    assert_eq!(m.forward(&[]).unwrap().rows(), 0);
    assert_eq!(m.len(), 10);
    let after = m.forward(&prompt[10..20]).unwrap();
    let fresh = model
        .instance("fresh", None)
        .forward(&prompt[..20])
        .unwrap();
    for i in 0..10 {
        assert!(after.row(i) == fresh.row(10 + i), "position {i} differs");
    }
    let err = m.restrict_vocabulary(Some(&[])).unwrap_err();
    assert_eq!(
        err.to_string(),
        "m: cannot score an empty vocabulary: give at least one token"
    );
}

#[test]
fn greedy_speculative_output_equals_autoregressive_output() {
    let _s = serial();
    let opts = |k| GenerateOptions {
        max_new_tokens: 40,
        k,
        ..Default::default()
    };
    let mut ar = engine(None);
    let mut spec = engine(draft_model(DRAFT));
    for prompt in PROMPTS {
        let expected = run(&mut ar, prompt, &opts(1));
        assert_eq!(expected.stats.target_calls, expected.tokens.len());
        for k in [1, 4, 8] {
            let got = run(&mut spec, prompt, &opts(k));
            assert_eq!(got.tokens, expected.tokens, "K={k}, prompt {prompt:?}");
            assert_eq!(got.text, expected.text);
            assert!(
                got.stats.accepted > 0,
                "the 0.5B draft should be accepted sometimes (K={k})"
            );
            eprintln!(
                "K={k}: {:.2} tokens per target call",
                got.stats.tokens_per_call()
            );
        }
    }
}

fn table() -> std::sync::Arc<cascade::ngram::BigramTable> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("ngram/qwen2.5-coder-cpython311.bigram");
    let t = cascade::ngram::BigramTable::load(&path).unwrap();
    t.check_tokenizer(&real(TARGET).tokenizer, &path).unwrap();
    std::sync::Arc::new(t)
}

#[test]
fn greedy_output_with_statistical_drafters_equals_autoregressive_output() {
    let _s = serial();
    use cascade::drafter::{BigramDrafter, MaxGramDrafter, MaxGramPolicy};
    let opts = GenerateOptions {
        max_new_tokens: 40,
        k: 6,
        ..Default::default()
    };
    let mut ar = engine(None);
    // One bigram token per miss, so the table fallback is exercised too.
    let policy = MaxGramPolicy {
        bigram_tokens: 1,
        ..Default::default()
    };
    let mut mag = engine(Some(Box::new(MaxGramDrafter::new(
        "mag",
        policy,
        Some(table()),
    ))));
    let mut bigram = engine(Some(Box::new(BigramDrafter::new("bigram", table(), false))));
    let grounded =
        "Add type hints to this function:\n\ndef area(width, height):\n    return width * height\n";
    for prompt in [PROMPTS[0], PROMPTS[2], grounded] {
        let expected = run(&mut ar, prompt, &opts);
        for (label, e) in [("max-gram", &mut mag), ("bigram", &mut bigram)] {
            let got = run(e, prompt, &opts);
            assert_eq!(got.tokens, expected.tokens, "{label}, prompt {prompt:?}");
            assert!(got.stats.drafted > 0, "{label} drafted nothing");
        }
    }
}

/// A task run again drafts its answer from the history file the first run wrote (a new
/// engine, as another process would build): most of the tokens come out of accepted drafts,
/// and the text is the same, exactly.
#[test]
fn a_repeated_task_drafts_from_the_history_of_earlier_runs() {
    let _s = serial();
    use cascade::drafter::{History, MaxGramDrafter, MaxGramPolicy};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outputs.hist");
    let t = real(TARGET);
    let with_history = || {
        let history = History::open(
            &path,
            t.tokenizer.fingerprint(),
            t.weights.vocab_size(),
            1 << 16,
            16,
        )
        .unwrap();
        let mag = MaxGramDrafter::new("mag", MaxGramPolicy::default(), None);
        engine(Some(Box::new(mag.with_history(history))))
    };
    let opts = GenerateOptions {
        max_new_tokens: 48,
        k: 8,
        ..Default::default()
    };
    let first = run(&mut with_history(), PROMPTS[1], &opts);
    let again = run(&mut with_history(), PROMPTS[1], &opts);
    assert_eq!(again.tokens, first.tokens);
    assert_eq!(
        again.tokens,
        run(&mut engine(None), PROMPTS[1], &opts).tokens
    );
    assert!(
        again.stats.accepted * 4 >= again.tokens.len() * 3,
        "accepted {} of {} tokens on the second run (first run: {})",
        again.stats.accepted,
        again.tokens.len(),
        first.stats.accepted
    );
    assert!(again.stats.target_calls * 3 <= first.stats.target_calls);
}

#[test]
fn the_target_as_its_own_draft_is_always_accepted() {
    let _s = serial();
    let t = real(TARGET);
    let own = NeuralDrafter::new("self", Box::new(t.instance("self", None)));
    let mut e = engine(Some(Box::new(own)));
    let opts = GenerateOptions {
        max_new_tokens: 30,
        k: 4,
        ..Default::default()
    };
    let out = run(&mut e, PROMPTS[2], &opts);
    assert!(out.stats.drafted > 0);
    assert_eq!(out.stats.accepted, out.stats.drafted, "{:?}", out.stats);
}

#[test]
fn a_prompt_repeating_the_last_sequence_reuses_the_cache_and_decodes_the_same() {
    let _s = serial();
    let opts = GenerateOptions {
        max_new_tokens: 24,
        k: 4,
        ..Default::default()
    };
    // A conversation's second turn repeats the first turn's prompt and answer, as the ids
    // they were (a client sends text, whose tokenization may join the two at their border).
    let p1 = encode(PROMPTS[1]);
    let mut warm = engine(draft_model(DRAFT));
    let generate = |e: &mut Engine, prompt: &[u32]| e.generate(prompt, &opts, &mut |_| {}).unwrap();
    let answer = generate(&mut warm, &p1);
    assert_eq!(answer.stats.cached_tokens, 0);
    // Ended by the length limit, its last token is the one the cache does not hold yet.
    assert_eq!(format!("{:?}", answer.finish_reason), "Length");
    let p2 = [
        &p1[..],
        &answer.tokens,
        &encode("\nNow make it iterative.\n"),
    ]
    .concat();
    let expected = generate(&mut engine(draft_model(DRAFT)), &p2);
    let got = generate(&mut warm, &p2);
    assert_eq!(got.tokens, expected.tokens);
    assert_eq!(got.stats.cached_tokens, p1.len() + answer.tokens.len() - 1);
    // The same prompt again: all but its last token are cached.
    let again = generate(&mut warm, &p2);
    assert_eq!(again.stats.cached_tokens, p2.len() - 1);
    assert_eq!(again.tokens, expected.tokens);
    // Forgotten: read whole again, same output.
    warm.forget();
    let cold = generate(&mut warm, &p2);
    assert_eq!(cold.stats.cached_tokens, 0);
    assert_eq!(cold.tokens, expected.tokens);
}

#[test]
fn sampling_is_reproducible_from_the_seed() {
    let _s = serial();
    let mut e = engine(draft_model(DRAFT));
    let s = Sampling {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
    };
    let opts = |seed| GenerateOptions {
        max_new_tokens: 24,
        k: 4,
        seed,
        sampling: s,
        ..Default::default()
    };
    let a = run(&mut e, PROMPTS[1], &opts(5));
    let b = run(&mut e, PROMPTS[1], &opts(5));
    assert_eq!(a.tokens, b.tokens);
    let others: Vec<_> = (6..9)
        .map(|seed| run(&mut e, PROMPTS[1], &opts(seed)).tokens)
        .collect();
    assert!(
        others.iter().any(|o| *o != a.tokens),
        "different seeds should give different samples"
    );
}

#[test]
fn stop_conditions_hold_inside_an_accepted_block() {
    let _s = serial();
    let mut ar = engine(None);
    let mut spec = engine(draft_model(DRAFT));
    let base = GenerateOptions {
        max_new_tokens: 40,
        k: 8,
        ..Default::default()
    };
    let full = run(&mut ar, PROMPTS[0], &base);
    // max_new_tokens is never overshot, even when a whole block is accepted.
    for n in [1, 5, 13] {
        let out = run(
            &mut spec,
            PROMPTS[0],
            &GenerateOptions {
                max_new_tokens: n,
                ..base.clone()
            },
        );
        assert_eq!(out.tokens, full.tokens[..n]);
    }
    // A stop string ends the text just before it, wherever it falls in a block; of several,
    // the one that appears first in the text, whatever their order. The streamed text is the
    // same (no piece of a stop string goes out before it is found), and the tokens keep the
    // ones that spelled it.
    let line = |n: usize| full.text.lines().nth(n).unwrap().trim().to_string();
    for stop in [vec![line(1)], vec![line(2), line(1)]] {
        let mut streamed = String::new();
        let opts = GenerateOptions {
            stop: stop.clone(),
            ..base.clone()
        };
        let out = spec
            .generate(&encode(PROMPTS[0]), &opts, &mut |piece| streamed += piece)
            .unwrap();
        assert_eq!(format!("{:?}", out.finish_reason), "Stop");
        assert_eq!(out.text, full.text[..full.text.find(&line(1)).unwrap()]);
        assert_eq!(streamed, out.text);
        assert!(full.tokens.starts_with(&out.tokens));
        let spelled = real(TARGET).tokenizer.decode(&out.tokens).unwrap();
        assert!(spelled.contains(&line(1)), "{spelled:?}");
        assert!(out.stats.accepted > 0, "no block was accepted");
    }
}

#[test]
fn eos_ends_generation_and_is_not_emitted() {
    let _s = serial();
    let t = real(TARGET);
    let chat = cascade::chat::apply(&t.tokenizer, None, "Reply with the single word: yes").unwrap();
    assert!(chat.ends_with("<|im_start|>assistant\n"), "{chat:?}");
    let mut spec = engine(draft_model(DRAFT));
    let prompt = t.tokenizer.encode(&chat).unwrap();
    let out = spec
        .generate(
            &prompt,
            &GenerateOptions {
                max_new_tokens: 20,
                k: 4,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert_eq!(format!("{:?}", out.finish_reason), "Eos");
    assert!(out
        .tokens
        .iter()
        .all(|&t| !real(TARGET).tokenizer.is_eos(t)));
    assert!(
        out.tokens.len() < 20 && !out.text.is_empty(),
        "{:?}",
        out.text
    );
}

#[test]
fn llama_architecture_generates_sensible_text() {
    let _s = serial();
    let m = real(SMOLLM2);
    let mut e = Engine::new(
        Box::new(m.instance("smollm2", None)),
        None,
        m.tokenizer.clone(),
    );
    let prompt = m.tokenizer.encode("The capital of France is").unwrap();
    let out = e
        .generate(
            &prompt,
            &GenerateOptions {
                max_new_tokens: 8,
                ..Default::default()
            },
            &mut |_| {},
        )
        .unwrap();
    assert!(out.text.contains("Paris"), "{:?}", out.text);
}

/// Gemma 3's tokenizer, rebuilt from the GGUF's SentencePiece vocabulary, gives the ids Hugging
/// Face transformers gives for the same file (its `gemma_tokenizer` GGUF builder, transformers
/// 5.24), whitespace runs, byte-level characters, HTML-like and control tokens included; and
/// decoding gives the text back.
#[test]
fn gemma3_tokenizer_gives_the_reference_ids_and_decodes_back() {
    let t = &real(GEMMA3).tokenizer;
    let cases: [(&str, &[u32]); 10] = [
        ("The capital of France is", &[818, 5279, 529, 7001, 563]),
        (
            "def f(x):\n    return  x\t+1\n\n\n",
            &[
                2063, 517, 236769, 236781, 1473, 107, 140, 2060, 138, 236781, 255968, 236862,
                236770, 109,
            ],
        ),
        (
            "h\u{e9}llo w\u{f6}rld \u{1f642} \u{65e5}\u{672c}\u{8a9e}",
            &[236754, 7869, 844, 515, 4010, 671, 57235, 33375, 238582],
        ),
        (
            "<start_of_turn>user\nhi<end_of_turn>\n",
            &[105, 2364, 107, 2202, 106, 107],
        ),
        ("a    b     c", &[236746, 140, 236763, 141, 236755]),
        (" leading space", &[5830, 2557]),
        ("trailing  ", &[136697, 138]),
        (
            "<table><tr><td>1</td></tr></table>",
            &[168, 173, 175, 236770, 183, 181, 176],
        ),
        ("\u{1}\u{7f}", &[249732, 251541]),
        (
            "x = [i**2 for i in range(10)]  # squares",
            &[
                236781, 578, 870, 236747, 1018, 236778, 573, 858, 528, 2644, 236769, 236770,
                236771, 7066, 138, 236865, 23441,
            ],
        ),
    ];
    for (text, want) in cases {
        let ids = t.encode_plain(text).unwrap();
        assert_eq!(ids, want, "{text:?}");
        let plain: Vec<u32> = ids.into_iter().filter(|&i| i != 105 && i != 106).collect();
        let back = t.decode(&plain).unwrap();
        assert_eq!(
            back,
            text.replace("<start_of_turn>", "")
                .replace("<end_of_turn>", "")
        );
    }
    // The file asks for a BOS before a text.
    assert_eq!(t.encode("The").unwrap(), [2, 818]);
}

/// Gemma 3 scores text as an independent f32 implementation of transformers' Gemma 3 does on the
/// same weights (`scripts/gemma3-reference.py`: its first 11 greedy tokens, each ahead of the
/// runner-up by more than 0.25 in logit there): fed those tokens, the model ranks each one
/// first or within 0.5 of its first, with its logits as spread as the model's, at every step;
/// and it answers sensibly. Greedy decoding itself is not compared: 8-bit activations move
/// Gemma's logits by a few tenths (its massive activations make a block's scale coarse: the
/// AVX-512 kernels, one scale per 256 values, took a runner-up 0.05 ahead at step 5), while a
/// wrong architecture misses by far more.
#[test]
fn gemma3_architecture_scores_like_the_reference() {
    let _s = serial();
    let m = real(GEMMA3);
    let mut model = m.instance("gemma3", None);
    let prompt = m.tokenizer.encode("The capital of France is").unwrap();
    assert_eq!(prompt, [2, 818, 5279, 529, 7001, 563]);
    let reference = [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506];
    let fed: Vec<u32> = prompt.iter().chain(&reference[..10]).copied().collect();
    let logits = model.forward(&fed).unwrap();
    for (step, &want) in reference.iter().enumerate() {
        let row = logits.row(prompt.len() - 1 + step);
        let top = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert!(
            top - row[want as usize] <= 0.5,
            "step {step}: token {want} scores {} against the top {top}",
            row[want as usize]
        );
        // ... among logits spread as the model's are (the top about 20 above the median at
        // every step, on every family), so a flattened scale cannot pass the 0.5 window.
        let mut sorted = row.to_vec();
        sorted.sort_by(f32::total_cmp);
        let median = sorted[sorted.len() / 2];
        assert!(
            top - median > 10.0,
            "step {step}: top {top}, median {median}"
        );
    }
    let mut e = Engine::new(
        Box::new(m.instance("gemma3", None)),
        None,
        m.tokenizer.clone(),
    );
    let opts = GenerateOptions {
        max_new_tokens: 11,
        ..Default::default()
    };
    let prompt = m
        .tokenizer
        .encode("Question: What is the capital of France?\nAnswer:");
    let out = e.generate(&prompt.unwrap(), &opts, &mut |_| {}).unwrap();
    assert!(out.text.starts_with(" Paris"), "{:?}", out.text);
}

/// Past Gemma 3's 512-position window, its sliding-window layers still give a k-token forward
/// the logits of k one-token forwards, and Max-Gram drafting decodes greedily like the model.
#[test]
fn gemma3_past_its_attention_window_verifies_like_it_decodes() {
    let _s = serial();
    use cascade::drafter::{MaxGramDrafter, MaxGramPolicy};
    let g = real(GEMMA3);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    let prompt = g.tokenizer.encode(&text).unwrap();
    assert!(prompt.len() > 560, "{}", prompt.len());
    let mut m = g.instance("gemma3", None);
    m.prefill(&prompt).unwrap();
    let next = g.tokenizer.encode_plain(" The quick brown fox").unwrap();
    let batch = m.forward(&next).unwrap();
    m.truncate(prompt.len());
    for (i, &t) in next.iter().enumerate() {
        assert!(batch.row(i) == m.forward(&[t]).unwrap().row(0), "row {i}");
    }
    let opts = GenerateOptions {
        max_new_tokens: 24,
        k: 6,
        ..Default::default()
    };
    let plain = |drafter: Option<Box<dyn Drafter>>| {
        let mut e = Engine::new(
            Box::new(g.instance("g", None)),
            drafter,
            g.tokenizer.clone(),
        );
        e.generate(&prompt, &opts, &mut |_| {}).unwrap()
    };
    let expected = plain(None);
    let mag = MaxGramDrafter::new("mag", MaxGramPolicy::default(), None);
    let got = plain(Some(Box::new(mag)));
    assert_eq!(got.tokens, expected.tokens);
    assert!(got.stats.accepted > 0, "nothing drafted was accepted");
}

#[test]
fn a_prompt_longer_than_the_context_is_refused() {
    let _s = serial();
    let t = real(TARGET);
    let mut e = Engine::new(
        Box::new(t.instance("target", Some(16))),
        None,
        t.tokenizer.clone(),
    );
    let prompt = vec![9707u32; 20];
    let err = e
        .generate(&prompt, &GenerateOptions::default(), &mut |_| {})
        .unwrap_err();
    assert_eq!(err.to_string(), "prompt has 20 tokens but the context of `target` holds 16, with room for at least one new token needed");
}

/// Every shipped config, greedy, gives the autoregressive output token for token.
#[test]
fn every_config_decodes_greedily_like_the_target() {
    let _s = serial();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut configs: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    configs.sort();
    assert!(configs.len() >= 6, "{configs:?}");
    let prompts = [PROMPTS[1], "Rewrite with type hints:\n\ndef scale(values, factor):\n    return [v * factor for v in values]\n", PROMPTS[2]];
    let mut ar = engine(None);
    let opts = GenerateOptions {
        max_new_tokens: 32,
        ..Default::default()
    };
    let expected: Vec<Generation> = prompts.iter().map(|p| run(&mut ar, p, &opts)).collect();
    drop(ar);
    for path in configs {
        let raw = cascade::config::RawConfig::load(&path).unwrap();
        let plan = raw.validate(&dir).unwrap();
        let mut e = plan.build(&mut |_, _, _| {}).unwrap();
        let opts = GenerateOptions {
            max_new_tokens: 32,
            k: plan.options.k,
            ..Default::default()
        };
        let mut drafted = 0;
        for (prompt, want) in prompts.iter().zip(&expected) {
            let got = e.generate(&encode(prompt), &opts, &mut |_| {}).unwrap();
            assert_eq!(
                got.tokens,
                want.tokens,
                "{}, prompt {prompt:?}",
                path.display()
            );
            drafted += got.stats.drafted;
        }
        // Equal output means something only where drafts were reviewed (the rewrite prompt
        // gives even an adaptive gate copies worth verifying).
        assert!(
            plan.drafter.is_none() || drafted > 0,
            "{}: nothing drafted",
            path.display()
        );
        eprintln!("{}: ok, {drafted} tokens drafted", path.display());
    }
}

/// Processes that keep every core busy while they live.
struct BusyCores(Vec<std::process::Child>);

impl BusyCores {
    /// Two busy processes per core.
    fn start() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self(
            (0..2 * cores)
                .map(|_| {
                    std::process::Command::new("sh")
                        .args(["-c", "while :; do :; done"])
                        .spawn()
                        .unwrap()
                })
                .collect(),
        )
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn costs_measured_while_other_work_has_the_cpu_are_flagged_every_time_they_are_used() {
    use cascade::costs::{CostCache, CostEvent, MIN_CPU_SHARE};
    let _s = serial();
    let model = real(SMOLLM2);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("costs.json");
    let contended = |cache: &mut CostCache, remeasure: bool| {
        let mut flagged = Vec::new();
        cache
            .costs(&[model.as_ref().into()], remeasure, &mut |e| {
                if let CostEvent::Contended { cpu_share, .. } = e {
                    flagged.push((cpu_share, e.to_string()));
                }
            })
            .unwrap();
        flagged
    };
    let open = || CostCache::open(&path).unwrap();
    // Measured alone (the test machine otherwise idle): nothing to flag.
    assert_eq!(contended(&mut open(), true), vec![]);
    let busy = BusyCores::start();
    let flagged = contended(&mut open(), true);
    drop(busy);
    let [(share, message)] = &flagged[..] else {
        panic!("one contended measurement expected, got {flagged:?}")
    };
    assert!(*share < MIN_CPU_SHARE, "{share}");
    let name = format!("the forward costs of {SMOLLM2} were measured (");
    assert!(message.starts_with(&name), "{message}");
    assert!(
        message.ends_with("run `cascade calibrate` when the machine is idle"),
        "{message}"
    );
    // Cached, and flagged again when the next run reads them; until measured anew.
    assert_eq!(contended(&mut open(), false), flagged);
    assert_eq!(contended(&mut open(), true), vec![]);
}

/// Qwen's `<tool_call>` tags are user-defined tokens in the GGUF: text the model writes, which
/// decoding keeps (as Hugging Face's does), while control tokens such as `<|im_end|>` are left
/// out; and both end-of-turn and end-of-text tokens end a generation.
#[test]
fn user_defined_tokens_are_text_and_control_tokens_are_not() {
    let t = &real(TARGET).tokenizer;
    let ids = t.encode_plain("<tool_call>{}</tool_call>").unwrap();
    assert_eq!((ids[0], *ids.last().unwrap()), (151657, 151658), "{ids:?}");
    assert_eq!(t.decode(&ids).unwrap(), "<tool_call>{}</tool_call>");
    let with_control = [&ids[..], &[151645, 151643]].concat();
    assert_eq!(
        t.decode(&with_control).unwrap(),
        "<tool_call>{}</tool_call>"
    );
    assert!(t.is_eos(151645) && t.is_eos(151643) && !t.is_eos(151657));
}

/// What a stream of `ids` (no stop strings) releases token by token and at the end, and its
/// whole text.
fn streamed(t: &cascade::tokenizer::Tokenizer, ids: &[u32]) -> (String, String) {
    let mut s = TextStream::new(t, &[]).unwrap();
    let mut out = String::new();
    for &id in ids {
        s.push(id).unwrap();
        out += s.take_final(false);
    }
    out += s.take_final(true);
    (out, s.text().to_string())
}

/// A stream holds back only a few tokens: stray bytes (no character) come out as replacement
/// characters before the generation ends, control tokens do not keep growing the decoded
/// window, and the streamed text is the whole decode all the same.
#[test]
fn a_stream_holds_back_at_most_a_few_tokens() {
    let t = &real(TARGET).tokenizer;
    let stray = (0..t.vocab_size() as u32)
        .find(|&id| t.decode(&[id]).unwrap() == "\u{FFFD}")
        .expect("a byte token that is no character alone");
    let control = t.encode("<|fim_prefix|>").unwrap();
    assert_eq!(control.len(), 1);
    let mut ids = vec![stray; 12];
    ids.extend([control[0]; 20]);
    ids.extend(t.encode_plain(" café, naïve").unwrap());
    let mut s = TextStream::new(t, &[]).unwrap();
    for &id in &ids[..12] {
        s.push(id).unwrap();
    }
    let early = s.take_final(false).to_string();
    assert!(early.starts_with('\u{FFFD}'), "{early:?}");
    for &id in &ids[12..] {
        s.push(id).unwrap();
    }
    let rest = s.take_final(true).to_string();
    assert_eq!(early + &rest, t.decode(&ids).unwrap());
    // A character split over two byte tokens, after a run of control tokens long enough to
    // release the text early, still comes out whole.
    let strays: Vec<u32> = (0..t.vocab_size() as u32)
        .filter(|&id| t.decode(&[id]).unwrap() == "\u{FFFD}")
        .collect();
    let (lead, next) = strays
        .iter()
        .flat_map(|&a| strays.iter().map(move |&b| (a, b)))
        .find(|&(a, b)| t.decode(&[a, b]).unwrap() == "é")
        .expect("the two byte tokens of é");
    for controls in [7, 8, 9, 12] {
        let mut ids = vec![control[0]; controls];
        ids.extend([lead, next]);
        ids.extend(t.encode_plain(" h").unwrap());
        assert_eq!(
            streamed(t, &ids).0,
            "é h",
            "after {controls} control tokens"
        );
    }
    // A generation cut off in the middle of a character ends before it: half a character is
    // no text (its bytes stay in the tokens).
    let mut ids = t.encode_plain("naïve x").unwrap();
    ids.push(lead);
    assert_eq!(streamed(t, &ids), ("naïve x".into(), "naïve x".into()));
    // A stop string found by an early release of invalid bytes ends the text there, though
    // tokens after it were pending: here the stop string ends in a token that also begins a
    // character, control tokens follow, then a byte that cannot continue that character.
    let (tail, letters) = (0..t.vocab_size() as u32)
        .find_map(|id| {
            let text = t.decode(&[id]).ok()?;
            let letters = text.strip_suffix('\u{FFFD}')?;
            (!letters.is_empty() && !letters.contains('\u{FFFD}'))
                .then(|| (id, letters.to_string()))
        })
        .expect("a token of text and a lead byte");
    let broken = format!("{letters}\u{FFFD}\u{FFFD}");
    let lead = *strays
        .iter()
        .find(|&&b| t.decode(&[tail, b]).unwrap() == broken)
        .expect("a byte that does not continue the character");
    let mut ids = t.encode_plain("x").unwrap();
    ids.push(tail);
    ids.extend([control[0]; 7]);
    ids.push(lead);
    let stop = [letters];
    let mut s = TextStream::new(t, &stop).unwrap();
    let mut streamed = String::new();
    for &id in &ids {
        let stopped = s.push(id).unwrap();
        streamed += s.take_final(false);
        if stopped {
            break;
        }
    }
    streamed += s.take_final(true);
    assert_eq!(streamed, "x");
    // The same token last, still held back as half a character when the generation ends: its
    // whole characters are searched for the stop string before they go out.
    let mut ids = t.encode_plain("x").unwrap();
    ids.push(tail);
    let mut s = TextStream::new(t, &stop).unwrap();
    let mut streamed = String::new();
    for &id in &ids {
        assert!(!s.push(id).unwrap());
        streamed += s.take_final(false);
    }
    assert!(!s.stopped());
    streamed += s.take_final(true);
    assert_eq!((streamed.as_str(), s.stopped()), ("x", true));
}

/// A GGUF naming Llama 3's pre-tokenizer as llama.cpp does (`llama-bpe`) splits text as Llama 3
/// does (candle's `llama3` pipeline), not as GPT-2 does: here on SmolLM2's vocabulary, with
/// only the name edited.
#[test]
fn llama_3_pre_tokenizer_is_recognized_by_llama_cpp_name() {
    use candle_core::quantized::gguf_file::Value;
    let encode_as = |pre: &str| {
        let mut gguf =
            cascade::model::gguf::GgufFile::open(&common::models_dir().join(SMOLLM2)).unwrap();
        gguf.content
            .metadata
            .insert("tokenizer.ggml.pre".into(), Value::String(pre.into()));
        let t = cascade::tokenizer::Tokenizer::load(&gguf, None).unwrap();
        t.encode_plain("x=(hello) IT'S 12345;\n\n\tdone a \n\nb")
            .unwrap()
    };
    let (llama_bpe, llama3, gpt2) = (
        encode_as("llama-bpe"),
        encode_as("llama3"),
        encode_as("gpt2"),
    );
    assert_eq!(llama_bpe, llama3);
    // Llama 3 keeps a space before line breaks with them (` \n\n`); GPT-2 splits it off.
    assert_ne!(llama3, gpt2, "the sample must tell the two splits apart");
}

/// The text of one of Qwen's unused tokens is text, encoded as transformers encodes it, and
/// decodes back; control tokens stay control tokens.
#[test]
fn an_unused_tokens_text_is_text() {
    // Qwen's GGUF marks ids 151665.. unused (type 5); candle would make each a special token
    // that text matches. transformers 4.53 encodes the text as these ids.
    for file in [TARGET, DRAFT] {
        let t = cascade::tokenizer::Tokenizer::from_file(&common::models_dir().join(file)).unwrap();
        let ids = t.encode_plain("x[PAD151700]y").unwrap();
        assert_eq!(
            ids,
            [87, 42347, 1808, 16, 20, 16, 22, 15, 15, 60, 88],
            "{file}"
        );
        assert_eq!(t.decode(&ids).unwrap(), "x[PAD151700]y");
        // Control tokens are still read as such.
        assert_eq!(t.encode_plain("<|im_end|>").unwrap(), [151645], "{file}");
    }
}

/// The byte-level BPE tokenizers built from the GGUFs give the ids llama.cpp gives for the same
/// files (`llama-tokenize --no-bos`, llama.cpp c392e50 of 2025-02-20): Qwen's split, and
/// SmolLM2's (`smollm`: every digit apart, then GPT-2's split, with no space added before the
/// text, which candle's fallback added); and decoding gives the text back.
#[test]
fn byte_level_tokenizers_give_llama_cpp_ids_and_decode_back() {
    const TEXTS: [&str; 9] = [
        "Count: 12345 apples, isn't it?",
        "def f(x):\n    return  x\t+1\n\n\n",
        "h\u{e9}llo w\u{f6}rld \u{1f642} \u{65e5}\u{672c}\u{8a9e}",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "a    b     c",
        " leading space",
        "trailing  ",
        "x = [i**2 for i in range(10)]  # squares",
        "IT'S 3.14159 o'clock; WE'LL see\r\n\tdone",
    ];
    let smollm2: [&[u32]; 9] = [
        &[
            9825, 42, 216, 33, 34, 35, 36, 37, 13855, 28, 3247, 982, 357, 47,
        ],
        &[
            1604, 275, 24, 104, 727, 472, 1003, 216, 1792, 197, 27, 33, 16506,
        ],
        &[
            88, 2756, 31394, 267, 29989, 400, 47526, 17097, 241, 115, 40993, 179, 120, 248,
        ],
        &[1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198],
        &[81, 333, 278, 289, 265],
        &[2899, 1898],
        &[4861, 4966, 256],
        &[
            104, 446, 933, 89, 828, 34, 327, 2056, 281, 1845, 24, 33, 32, 8307, 216, 907, 16207,
        ],
        &[
            2901, 23, 67, 216, 35, 30, 33, 36, 33, 37, 41, 263, 23, 17466, 43, 26587, 23, 16421,
            963, 2738, 197, 22744,
        ],
    ];
    let qwen: [&[u32]; 9] = [
        &[
            2507, 25, 220, 16, 17, 18, 19, 20, 40676, 11, 4436, 944, 432, 30,
        ],
        &[750, 282, 2075, 982, 262, 470, 220, 856, 197, 10, 16, 1406],
        &[71, 18503, 385, 289, 9416, 507, 27484, 75402, 21894, 102819],
        &[151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198],
        &[64, 262, 293, 257, 272],
        &[6388, 3550],
        &[376, 14277, 256],
        &[
            87, 284, 508, 72, 334, 17, 369, 600, 304, 2088, 7, 16, 15, 7252, 220, 671, 31340,
        ],
        &[
            952, 13272, 220, 18, 13, 16, 19, 16, 20, 24, 297, 62410, 26, 19677, 6, 4086, 1490, 319,
            40495,
        ],
    ];
    for (file, want) in [(SMOLLM2, smollm2), (DRAFT, qwen), (TARGET, qwen)] {
        let t = cascade::tokenizer::Tokenizer::from_file(&common::models_dir().join(file)).unwrap();
        for (text, want) in TEXTS.iter().zip(want) {
            let ids = t.encode_plain(text).unwrap();
            assert_eq!(ids, want, "{file}: {text:?}");
            let plain = text.replace("<|im_start|>", "").replace("<|im_end|>", "");
            assert_eq!(t.decode(&ids).unwrap(), plain, "{file}: {text:?}");
        }
    }
}

/// A plug-in drafter's constructor learns the target's context length: the config's
/// `context`, capped at the model's trained one.
#[test]
fn a_plug_in_learns_the_targets_context_length() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let trained = real(SMOLLM2).weights.config.context_length;
    let seen = std::sync::Arc::new(AtomicUsize::new(0));
    let mut registry = cascade::config::Registry::default();
    let probe = seen.clone();
    registry.register("probe", move |cx| {
        probe.store(cx.context, Ordering::Relaxed);
        Ok(Box::new(cascade::drafter::MaxGramDrafter::new(
            cx.name,
            Default::default(),
            None,
        )))
    });
    for (cap, want) in [
        ("context = 100\n", 100),
        ("", trained),
        ("context = 1000000\n", trained),
    ] {
        let toml = format!(
            "[target]\nmodel = \"{SMOLLM2}\"\ndrafter = \"p\"\n{cap}[drafters.p]\nkind = \"probe\"\n"
        );
        let plan = cascade::config::RawConfig::parse(&toml, "t")
            .unwrap()
            .validate_with(&common::models_dir(), &registry)
            .unwrap();
        plan.build(&mut |_, _, _| {}).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), want, "{cap:?}");
    }
}

/// A chat template renders as Hugging Face renders it: blocks trimmed (`trim_blocks`,
/// `lstrip_blocks`), Python's string methods, and the GGUF's `bos_token` and `eos_token`. The
/// expected text is Jinja2's (3.1) for the same template and messages, with the settings
/// transformers uses.
#[test]
fn a_chat_template_renders_as_jinja2_does_for_hugging_face() {
    let template = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role == 'assistant' %}\n\
                    {{ m.role }}: {{ m.content.split('</think>')[-1].strip() }}{{ eos_token }}\n    \
                    {% else %}\n{{ m.role }}: {{ m.content }}\n    {% endif %}\n{% endfor %}\n\
                    {% if add_generation_prompt %}\nassistant:\n{% endif %}";
    let t = real(SMOLLM2).tokenizer.clone().with_chat_template(template);
    let turns = [
        ("user", "Hi"),
        ("assistant", "<think>greet</think>  Hello!"),
        ("user", "Bye"),
    ];
    assert_eq!(
        cascade::chat::render(&t, &turns).unwrap(),
        "<|im_start|>\nuser: Hi\nassistant: Hello!<|im_end|>\nuser: Bye\nassistant:\n"
    );
    // The models' own templates, the same way.
    let turns = [
        ("user", "Hi"),
        ("assistant", "Hello!"),
        ("user", "Write code."),
    ];
    for (file, system) in [
        (
            TARGET,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        ),
        (
            SMOLLM2,
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
        ),
    ] {
        assert_eq!(
            cascade::chat::render(&real(file).tokenizer, &turns).unwrap(),
            format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
                 <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWrite code.<|im_end|>\n\
                 <|im_start|>assistant\n"
            ),
            "{file}"
        );
    }
}
