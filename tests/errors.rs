//! Bad input gets a clear error: one test per configuration and model-file error.

mod common;

use cascade::config::RawConfig;
use cascade::model::LoadedModel;
use common::{models_dir, serial, DRAFT, GEMMA3, SMOLLM2};
use std::path::Path;

/// Validates `toml` with model paths relative to the models folder; returns the error text.
fn config_error(toml: &str) -> String {
    let err = RawConfig::parse(toml, "test.toml")
        .and_then(|c| c.validate(&models_dir()).map(drop))
        .expect_err("config should be refused");
    err.to_string()
}

const TARGET_ONLY: &str = "[target]\nmodel = \"qwen2.5-coder-1.5b-instruct-q4_k_m.gguf\"\n";

#[test]
fn malformed_toml() {
    let e = config_error("[target\nmodel = 1");
    assert!(
        e.starts_with("test.toml: TOML parse error at line 1, column 8"),
        "{e}"
    );
}

#[test]
fn unknown_keys() {
    let e = config_error(&format!("{TARGET_ONLY}temprature = 0.5\n"));
    assert!(
        e.starts_with("test.toml: TOML parse error at line 3"),
        "{e}"
    );
    assert!(e.contains("unknown field `temprature`"), "{e}");
    let e = config_error(&format!("{TARGET_ONLY}[sampling]\ntopp = 0.5\n"));
    assert!(
        e.contains("unknown field `topp`, expected one of `temperature`, `top_k`, `top_p`"),
        "{e}"
    );
}

/// An error inside a drafter's table points at that table, not at the first drafter's.
#[test]
fn an_error_in_a_drafter_table_points_at_that_table() {
    let drafters = "[drafters.a]\nkind = \"max_gram\"\n\n[drafters.b]\nkind = \"max_gram\"\n";
    let e = config_error(&format!("{TARGET_ONLY}{drafters}foo = 3\n"));
    assert!(
        e.starts_with("test.toml: TOML parse error at line 6, column 1\n  |\n6 | [drafters.b]\n"),
        "{e}"
    );
    assert!(e.contains("unknown field `foo`"), "{e}");
    let e = config_error(&format!(
        "{TARGET_ONLY}{drafters}\n[drafters.c]\nmin_match = 2\n"
    ));
    assert!(e.contains("9 | [drafters.c]"), "{e}");
    assert!(e.ends_with("missing `kind`"), "{e}");
}

#[test]
fn k_zero_or_huge() {
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}k = 0\n")),
        "target.k: must be between 1 and 64 (tokens drafted per target call), got 0"
    );
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}k = 1000000000000\n")),
        "target.k: must be between 1 and 64 (tokens drafted per target call), got 1000000000000"
    );
}

#[test]
fn context_and_generation_lengths_out_of_range() {
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}context = 0\n")),
        "target.context: must be between 1 and 16777216 (tokens), got 0"
    );
    assert_eq!(
        config_error(&format!(
            "{TARGET_ONLY}[generation]\nmax_new_tokens = 99999999999\n"
        )),
        "generation.max_new_tokens: must be between 1 and 16777216 (tokens), got 99999999999"
    );
    let e = config_error(&format!("{TARGET_ONLY}k = -3\n"));
    assert!(
        e.starts_with("test.toml: TOML parse error at line 3"),
        "{e}"
    );
}

#[test]
fn an_empty_stop_string_is_refused_with_its_path() {
    assert_eq!(
        config_error(&format!(
            "{TARGET_ONLY}[generation]\nstop = [\"END\", \"\"]\n"
        )),
        "generation.stop[1]: a stop string is empty (it would stop before any text)"
    );
}

#[test]
fn negative_or_nan_temperature() {
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}[sampling]\ntemperature = -1.0\n")),
        "sampling: invalid sampling setting: temperature must be a finite number >= 0, got -1"
    );
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}[sampling]\ntemperature = nan\n")),
        "sampling: invalid sampling setting: temperature must be a finite number >= 0, got NaN"
    );
}

#[test]
fn top_p_outside_unit_interval() {
    for (p, shown) in [("0.0", "0"), ("1.5", "1.5"), ("-0.2", "-0.2")] {
        let e = config_error(&format!("{TARGET_ONLY}[sampling]\ntop_p = {p}\n"));
        assert_eq!(
            e,
            format!("sampling: invalid sampling setting: top_p must be in (0, 1], got {shown}")
        );
    }
}

#[test]
fn lenience_at_the_target_needs_an_explicit_opt_in() {
    assert_eq!(
        config_error(&format!("{TARGET_ONLY}lenience = 2.0\n")),
        "target.lenience: lenience 2 at the target changes the output distribution; \
         set target.allow_inexact = true to accept that"
    );
    assert_eq!(
        config_error(&format!(
            "{TARGET_ONLY}lenience = 0.5\nallow_inexact = true\n"
        )),
        "target.lenience: must be a finite number >= 1, got 0.5"
    );
    let ok = RawConfig::parse(
        &format!("{TARGET_ONLY}lenience = 2.0\nallow_inexact = true\n"),
        "t",
    )
    .unwrap();
    assert_eq!(ok.validate(&models_dir()).unwrap().options.lenience, 2.0);
}

#[test]
fn unknown_drafter_name() {
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"big\"\n[drafters.small]\nkind = \"model\"\nmodel = \"{DRAFT}\"\n"
    ));
    assert_eq!(
        e,
        "target.drafter: unknown drafter `big` (defined in [drafters]: small)"
    );
}

#[test]
fn unknown_drafter_kind() {
    let e = config_error(&format!(
        "{TARGET_ONLY}[drafters.small]\nkind = \"oracle\"\nmodel = \"{DRAFT}\"\n"
    ));
    assert_eq!(
        e,
        "drafters.small.kind: unknown drafter kind `oracle` (built in: model, bigram, max_gram, \
         vertical, horizontal, adaptive, k_matrix; registered: none)"
    );
}

#[test]
fn missing_model_file() {
    let e = config_error("[target]\nmodel = \"no-such-model.gguf\"\n");
    assert_eq!(
        e,
        format!(
            "target.model: model file not found: {}",
            models_dir().join("no-such-model.gguf").display()
        )
    );
    // A folder where a file is named is said to be one, for a model and for a table.
    let folder = tempfile::tempdir().unwrap();
    let at = folder.path().display();
    let e = config_error(&format!("[target]\nmodel = \"{at}\"\n"));
    assert_eq!(
        e,
        format!("target.model: model {at} is a folder, not a file")
    );
    // A drafter's model is named by its key too.
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"small\"\n[drafters.small]\nkind = \"model\"\nmodel = \"nope.gguf\"\n"
    ));
    assert_eq!(
        e,
        format!(
            "drafters.small.model: model file not found: {}",
            models_dir().join("nope.gguf").display()
        )
    );
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\ntable = \"{at}\"\n"
    ));
    assert_eq!(
        e,
        format!("drafters.mag.table: {at} is a folder, not a file")
    );
}

#[test]
fn truncated_gguf() {
    let src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let half = dir.path().join("half.gguf");
    std::fs::write(&half, &src[..src.len() / 2]).unwrap();
    let load_error = |path: &Path| {
        LoadedModel::load(path, None, &mut |_, _| {})
            .err()
            .unwrap()
            .to_string()
    };
    // The first tensor the cut reaches is named (not one in hash order), as candle's own
    // reader lays the file out.
    let mut file = std::fs::File::open(models_dir().join(SMOLLM2)).unwrap();
    let content = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let cut = (src.len() / 2) as u64;
    let (name, end) = content
        .tensor_infos
        .iter()
        .map(|(name, t)| {
            let bytes = t.shape.elem_count() / t.ggml_dtype.block_size() * t.ggml_dtype.type_size();
            let end = content.tensor_data_offset + t.offset + bytes as u64;
            (name, end)
        })
        .filter(|&(_, end)| end > cut)
        .min_by_key(|&(name, end)| (end, name.clone()))
        .unwrap();
    assert_eq!(
        load_error(&half),
        format!(
            "cannot read GGUF file {}: file is truncated: tensor `{name}` ends at byte {end} but \
             the file has {cut} bytes",
            half.display()
        )
    );
    let header = dir.path().join("header.gguf");
    std::fs::write(&header, &src[..1000]).unwrap();
    let e = LoadedModel::load(&header, None, &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        format!(
            "cannot read GGUF file {}: tensor count at byte 8 is 272, more than the 984 bytes left in the file can hold: the file is cut short, or damaged",
            header.display()
        )
    );
    let e = LoadedModel::load(Path::new("/nonexistent/x.gguf"), None, &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    assert_eq!(e, "model file not found: /nonexistent/x.gguf");
}

/// A file that is not GGUF, and one whose metadata holds a key twice, are named as such.
#[test]
fn a_file_that_is_not_gguf_or_repeats_a_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let load_error = |path: &Path| {
        LoadedModel::load(path, None, &mut |_, _| {})
            .err()
            .unwrap()
            .to_string()
    };
    let text = dir.path().join("notes.gguf");
    std::fs::write(&text, "not a model, only a text file".repeat(8)).unwrap();
    assert_eq!(
        load_error(&text),
        format!(
            "cannot read GGUF file {}: not a GGUF file (magic 0x20746f6e, expected 0x46554747 \"GGUF\")",
            text.display()
        )
    );
    // SmolLM2 with its end-of-sequence id's key renamed to the beginning-of-sequence one's.
    let mut src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    let (eos, bos) = (
        b"tokenizer.ggml.eos_token_id",
        b"tokenizer.ggml.bos_token_id",
    );
    let at = src.windows(eos.len()).position(|w| w == eos).unwrap();
    src[at..at + eos.len()].copy_from_slice(bos);
    let twice = dir.path().join("twice.gguf");
    std::fs::write(&twice, &src).unwrap();
    assert_eq!(
        load_error(&twice),
        format!(
            "cannot read GGUF file {}: metadata `tokenizer.ggml.bos_token_id` appears twice",
            twice.display()
        )
    );
}

/// A tensor named twice, and one whose data does not start on the file's alignment, are named
/// as such (SmolLM2's tensor infos, edited in place).
#[test]
fn a_repeated_or_misaligned_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    let find = |bytes: &[u8], name: &[u8]| bytes.windows(name.len()).position(|w| w == name);
    let load_error = |bytes: &[u8], file: &str| {
        let path = dir.path().join(file);
        std::fs::write(&path, bytes).unwrap();
        let e = LoadedModel::load(&path, None, &mut |_, _| {})
            .err()
            .unwrap();
        (path, e.to_string())
    };
    let (q, k) = (b"blk.0.attn_q.weight", b"blk.0.attn_k.weight");
    let mut twice = src.clone();
    let at = find(&twice, q).unwrap();
    twice[at..at + q.len()].copy_from_slice(k);
    let (path, e) = load_error(&twice, "twice.gguf");
    assert_eq!(
        e,
        format!(
            "cannot read GGUF file {}: tensor `blk.0.attn_k.weight` appears twice",
            path.display()
        )
    );
    // After the name: its dimension count (u32), the dimensions (u64 each), the type (u32),
    // then the offset (u64) into the data.
    let v = b"blk.0.attn_v.weight";
    let mut shifted = src.clone();
    let mut at = find(&shifted, v).unwrap() + v.len();
    let dims = u32::from_le_bytes(shifted[at..at + 4].try_into().unwrap()) as usize;
    at += 4 + 8 * dims + 4;
    let offset = u64::from_le_bytes(shifted[at..at + 8].try_into().unwrap()) + 1;
    shifted[at..at + 8].copy_from_slice(&offset.to_le_bytes());
    let (path, e) = load_error(&shifted, "misaligned.gguf");
    assert_eq!(
        e,
        format!(
            "cannot read GGUF file {}: tensor `blk.0.attn_v.weight`: offset {offset} is not a \
             multiple of the alignment 32",
            path.display()
        )
    );
}

/// A SentencePiece vocabulary is read for Gemma models only: elsewhere (a Llama 2 GGUF, say)
/// the model's tokenizer.json is asked for.
#[test]
fn a_sentencepiece_vocabulary_outside_gemma_asks_for_tokenizer_json() {
    use candle_core::quantized::gguf_file::Value;
    let path = models_dir().join(SMOLLM2);
    let mut gguf = cascade::model::gguf::GgufFile::open(&path).unwrap();
    gguf.content
        .metadata
        .insert("tokenizer.ggml.model".into(), Value::String("llama".into()));
    let e = cascade::tokenizer::Tokenizer::load(&gguf, None)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        format!(
            "tokenizer: cannot load {}: a SentencePiece vocabulary (tokenizer model `llama`) is read \
             for Gemma models only, not `llama`; give the model's tokenizer.json instead \
             (`tokenizer = ...` in the config)",
            path.display()
        )
    );
}

/// A byte-level BPE vocabulary whose pre-tokenizer is unknown, or not named, is refused rather
/// than split by a guess (candle's fallback added a space before every text).
#[test]
fn an_unknown_pre_tokenizer_asks_for_tokenizer_json() {
    use candle_core::quantized::gguf_file::Value;
    let path = models_dir().join(SMOLLM2);
    let load_with = |pre: Option<&str>| {
        let mut gguf = cascade::model::gguf::GgufFile::open(&path).unwrap();
        let m = &mut gguf.content.metadata;
        match pre {
            Some(p) => m.insert("tokenizer.ggml.pre".into(), Value::String(p.into())),
            None => m.remove("tokenizer.ggml.pre"),
        };
        cascade::tokenizer::Tokenizer::load(&gguf, None)
            .err()
            .unwrap()
            .to_string()
    };
    let start = format!("tokenizer: cannot load {}: ", path.display());
    assert_eq!(
        load_with(Some("jais")),
        format!(
            "{start}its pre-tokenizer `jais` (`tokenizer.ggml.pre`) is not one cascade builds \
             (qwen2, deepseek-r1-qwen, llama-bpe, llama3, smaug-bpe, gpt-2, gpt2, smollm, \
             starcoder, refact); give the model's tokenizer.json (`tokenizer = ...` in the config)"
        )
    );
    assert_eq!(
        load_with(None),
        format!(
            "{start}it names no pre-tokenizer (`tokenizer.ggml.pre`), so how it splits text is \
             unknown; give the model's tokenizer.json (`tokenizer = ...` in the config)"
        )
    );
}

#[test]
fn unsupported_architecture_is_named_before_the_tokenizer_loads() {
    let mut src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    // general.architecture: key, u32 type 8 (string), u64 length 5, "llama" -> "gemma".
    let key = b"general.architecture";
    let at = src.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
    assert_eq!(&src[at..at + 5], b"llama");
    src[at..at + 5].copy_from_slice(b"gemma");
    // An unknown tokenizer too: the architecture is the error to report.
    let key = b"tokenizer.ggml.model";
    let at = src.windows(key.len()).position(|w| w == key).unwrap() + key.len() + 12;
    assert_eq!(&src[at..at + 4], b"gpt2");
    src[at..at + 4].copy_from_slice(b"none");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gemma.gguf");
    std::fs::write(&path, &src).unwrap();
    let load_error = |path: &Path| {
        LoadedModel::load(path, None, &mut |_, _| {})
            .err()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        load_error(&path),
        format!(
            "unsupported model architecture `gemma` in {} (supported: qwen2, llama, gemma3)",
            path.display()
        )
    );
    // With a known architecture, the tokenizer's error, as one line (no backtrace).
    let arch = src.windows(5).position(|w| w == b"gemma").unwrap();
    src[arch..arch + 5].copy_from_slice(b"llama");
    std::fs::write(&path, &src).unwrap();
    assert_eq!(
        load_error(&path),
        format!(
            "tokenizer: cannot load {}: unsupported tokenizer model `none` (cascade builds \
             `gpt2`, and `llama` for Gemma); give the model's tokenizer.json (`tokenizer = ...` \
             in the config)",
            path.display()
        )
    );
}

/// The load error of a copy of SmolLM2 whose info of tensor `name` (from its u32 dimension
/// count on, at the offset given) `edit` changed, without the message's file prefix.
fn tensor_info_error(name: &str, edit: impl FnOnce(&mut [u8], usize)) -> String {
    let mut src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    let name = name.as_bytes();
    let at = src.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    edit(&mut src, at);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edited.gguf");
    std::fs::write(&path, &src).unwrap();
    let e = LoadedModel::load(&path, None, &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    let prefix = format!("cannot read GGUF file {}: ", path.display());
    assert!(e.starts_with(&prefix), "{e}");
    e[prefix.len()..].to_string()
}

/// The load error of SmolLM2 with its header edited in memory by `edit`, without the
/// message's file prefix.
fn edited_smollm2_error(
    edit: impl FnOnce(&mut candle_core::quantized::gguf_file::Content),
) -> String {
    let path = models_dir().join(SMOLLM2);
    let mut gguf = cascade::model::gguf::GgufFile::open(&path).unwrap();
    edit(&mut gguf.content);
    let kernels = cascade::model::Kernels::detect().unwrap();
    let e = LoadedModel::from_gguf(gguf, None, kernels, &mut |_, _| {})
        .err()
        .unwrap()
        .to_string();
    let prefix = format!("cannot read GGUF file {}: ", path.display());
    e.strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("{e}"))
        .to_string()
}

/// A tensor the transformer does not read (a bias of the attention output, as some Llama
/// variants have) is refused: loading without it would compute other logits.
#[test]
fn a_tensor_the_transformer_does_not_use_is_refused() {
    use candle_core::quantized::gguf_file::TensorInfo;
    let e = edited_smollm2_error(|c| {
        let norm = &c.tensor_infos["blk.0.attn_norm.weight"];
        let bias = TensorInfo {
            ggml_dtype: norm.ggml_dtype,
            shape: norm.shape.clone(),
            offset: norm.offset,
        };
        c.tensor_infos.insert("blk.0.attn_output.bias".into(), bias);
    });
    assert_eq!(
        e,
        "tensor `blk.0.attn_output.bias` is not one the llama transformer uses: the file is of \
         a variant it does not implement"
    );
}

/// Weights are packed only for a kernel family this CPU runs: loading for another is refused
/// before the file is read, naming the families it runs. (Every family is refused this way on
/// a CPU without it: AVX-VNNI on AMD Zen 4, AVX-512 on an AVX2 laptop.)
#[test]
fn loading_for_kernels_this_cpu_cannot_run_is_refused() {
    use cascade::model::Kernels;
    let path = models_dir().join(SMOLLM2);
    let runs: Vec<_> = Kernels::supported().iter().map(|k| k.name()).collect();
    for k in Kernels::ALL {
        let loaded = LoadedModel::load_with(&path, None, k, &mut |_, _| {});
        match k.runs_here() {
            true => assert!(loaded.is_ok(), "{k}: {}", loaded.err().unwrap()),
            false => assert_eq!(
                loaded.err().unwrap().to_string(),
                format!(
                    "CASCADE_KERNELS: this CPU cannot run the {k} kernels (it runs: {})",
                    runs.join(", ")
                )
            ),
        }
    }
}

#[test]
fn an_unsupported_quantization_is_named() {
    for (id, name) in [(23u32, "IQ4_XS"), (30, "BF16"), (15, "Q8_K")] {
        // Tensor info: name, u32 dimension count, u64 dimensions, u32 type id (Q4_1 is 3).
        let e = tensor_info_error("blk.0.attn_q.weight", |src, at| {
            let dims = u32::from_le_bytes(src[at..at + 4].try_into().unwrap()) as usize;
            let ty = at + 4 + 8 * dims;
            assert_eq!(src[ty..ty + 4], 3u32.to_le_bytes());
            src[ty..ty + 4].copy_from_slice(&id.to_le_bytes());
        });
        assert_eq!(
            e,
            format!(
                "tensor `blk.0.attn_q.weight` is {name}, a type cascade cannot read (it reads F32, \
                 F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K)"
            )
        );
    }
}

/// RoPE scaling is linear unless a type says otherwise, by `rope.scaling.factor`, else by the
/// older `rope.scale_linear` (as llama.cpp reads them).
#[test]
fn linear_rope_scaling_is_read_under_either_key() {
    use candle_core::quantized::gguf_file::Value;
    use cascade::model::transformer::Config;
    let scale = |keys: &[(&str, Value)]| {
        let mut gguf = cascade::model::gguf::GgufFile::open(&models_dir().join(SMOLLM2)).unwrap();
        for (k, v) in keys {
            gguf.content
                .metadata
                .insert(format!("llama.{k}"), v.clone());
        }
        Config::from_gguf(&gguf).unwrap().rope_scale
    };
    let (linear, none) = (
        ("rope.scaling.type", Value::String("linear".into())),
        ("rope.scaling.type", Value::String("none".into())),
    );
    let (factor, old) = (
        ("rope.scaling.factor", Value::F32(2.0)),
        ("rope.scale_linear", Value::F32(4.0)),
    );
    assert_eq!(scale(&[]), 1.0);
    assert_eq!(scale(std::slice::from_ref(&old)), 0.25);
    assert_eq!(scale(std::slice::from_ref(&factor)), 0.5);
    assert_eq!(scale(&[linear.clone(), factor.clone(), old.clone()]), 0.5);
    assert_eq!(scale(&[linear, old]), 0.25);
    assert_eq!(scale(&[none, factor]), 1.0);
}

/// A RoPE scaling type that is not a string is an error, not read as no scaling.
#[test]
fn a_rope_scaling_type_that_is_not_a_string_is_named() {
    use candle_core::quantized::gguf_file::Value;
    let e = edited_smollm2_error(|c| {
        let key = "llama.rope.scaling.type";
        c.metadata.insert(key.into(), Value::U32(1));
    });
    assert_eq!(
        e,
        "metadata `llama.rope.scaling.type` is missing or not a string"
    );
}

/// A tensor whose data size overflows 64 bits is refused, even when the size wraps around to
/// a few bytes that the file holds (it would be read as billions of blocks).
#[test]
fn a_tensor_size_that_wraps_around_is_refused() {
    // Q8_0 [576, 49152]: 576 / 32 blocks of 34 bytes per row, 612 bytes. 612 x rows wraps
    // to less than 612 bytes; 576 x rows elements still fit in 64 bits.
    let rows = (u64::MAX / 612) + 1;
    assert!(rows.checked_mul(576).is_some() && rows.wrapping_mul(612) < 612);
    let e = tensor_info_error("token_embd.weight", |src, at| {
        let dims = at + 4;
        assert_eq!(
            src[dims..dims + 16],
            [576u64.to_le_bytes(), 49152u64.to_le_bytes()].concat()
        );
        src[dims + 8..dims + 16].copy_from_slice(&rows.to_le_bytes());
    });
    assert_eq!(
        e,
        format!(
            "tensor `token_embd.weight` has dimensions [576, {rows}]: zero or too many elements"
        )
    );
}

/// The bench refuses configs over different targets by comparing their paths, and models are
/// loaded once per path: one file named two ways must give one path.
#[test]
fn one_model_file_named_two_ways_is_one_path() {
    let models = models_dir();
    let named = |path: &str| {
        RawConfig::parse(&format!("[target]\nmodel = \"{path}\"\n"), "t")
            .unwrap()
            .validate(&models)
            .unwrap()
            .target
            .path
    };
    let plain = named("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let dir = models.file_name().unwrap().to_str().unwrap();
    assert_eq!(
        named(&format!(
            "../{dir}/./qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
        )),
        plain
    );
    let absolute = models.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    assert_eq!(named(absolute.to_str().unwrap()), plain);
}

#[test]
fn vocabulary_mismatch_is_refused_at_load_time() {
    let _s = serial();
    let toml = format!("{TARGET_ONLY}drafter = \"smol\"\n[drafters.smol]\nkind = \"model\"\nmodel = \"{SMOLLM2}\"\n");
    let plan = RawConfig::parse(&toml, "t")
        .unwrap()
        .validate(&models_dir())
        .unwrap();
    let e = plan.build(&mut |_, _, _| {}).err().unwrap().to_string();
    assert!(
        e.starts_with("vocabulary mismatch: drafter `smol` (49152 tokens, fingerprint ")
            && e.contains("cannot draft for `target` (151936 tokens, fingerprint ")
            && e.ends_with("a drafter must use its reviewer's tokenizer (or its first ids)"),
        "{e}"
    );
}

/// A drafter whose vocabulary is the beginning of the target's, with logits no wider, may draft
/// for it (as the Qwen2.5 0.5B's 151,936 ids for the 7B's 152,064); one with other text at a
/// shared id, or wider logits, may not. Real weights (SmolLM2's 49,152 rows, Gemma 3's 262,144)
/// under toy vocabularies.
#[test]
fn a_drafter_may_have_the_beginning_of_the_targets_vocabulary() {
    use cascade::config::check_vocab;
    let _s = serial();
    let with = |file: &str, tokenizer: cascade::tokenizer::Tokenizer| {
        let m = common::real(file);
        LoadedModel {
            path: m.path.clone(),
            weights: m.weights.clone(),
            tokenizer,
        }
    };
    let (narrow, wide) = (common::toy_tokenizer(5), common::toy_tokenizer(6));
    let target = with(GEMMA3, wide.clone());
    assert!(check_vocab(&target, "target", &with(SMOLLM2, narrow.clone()), "d").is_ok());
    assert!(check_vocab(&target, "target", &with(SMOLLM2, wide.clone()), "d").is_ok());
    // Wider logits than the target's.
    let e = check_vocab(
        &with(SMOLLM2, wide.clone()),
        "target",
        &with(GEMMA3, narrow),
        "d",
    );
    assert_eq!(
        e.unwrap_err().to_string(),
        "drafters.d: its model scores 262144 ids, more than the 49152 of `target`: a drafter's \
         logits may be no wider than its reviewer's"
    );
    // Another token at a shared id: t0..t3, then `x`.
    let words = (0..4u32)
        .map(|i| (format!("t{i}"), i))
        .chain([("x".into(), 4)]);
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(words.collect())
        .unk_token("t0".into())
        .build()
        .unwrap();
    let other =
        cascade::tokenizer::Tokenizer::from_parts(tokenizers::Tokenizer::new(model), vec![]);
    assert_eq!(other.vocab_size(), 5);
    let e = check_vocab(&target, "target", &with(SMOLLM2, other.clone()), "d");
    // The target's fingerprint of the ids compared, the drafter's five.
    let want = format!(
        "vocabulary mismatch: drafter `d` (5 tokens, fingerprint {:016x}) cannot draft for \
         `target` (6 tokens, fingerprint {:016x}); a drafter must use its reviewer's tokenizer (or \
         its first ids)",
        other.fingerprint(),
        wide.fingerprint_of_first(5)
    );
    assert_eq!(e.unwrap_err().to_string(), want);
}

#[test]
fn missing_table_and_bad_max_gram_settings() {
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\ntable = \"nope.bigram\"\n"
    ));
    assert_eq!(
        e,
        format!(
            "drafters.mag.table: file not found: {}",
            models_dir().join("nope.bigram").display()
        )
    );
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\nmax_ngram = 0\n"
    ));
    assert_eq!(
        e,
        "drafters.mag.max_ngram: must be between 1 and 1024 (tokens), got 0"
    );
    let e = config_error(&format!("{TARGET_ONLY}drafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\nmin_match = 5\nmax_ngram = 4\n"));
    assert_eq!(
        e,
        "drafters.mag.min_match: must be between 1 and max_ngram (4)"
    );
    let e = config_error(&format!(
        "{TARGET_ONLY}drafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\nbigram_tokens = 2\n"
    ));
    assert_eq!(
        e,
        "drafters.mag.bigram_tokens: drafts from the bigram table, and this drafter names none (`table`)"
    );
}

/// `[target.acceptance]`: for an adaptive target, named drafters, one value in [0, 1] per
/// confidence bucket.
#[test]
fn malformed_acceptance_priors() {
    let cfg = |adaptive: bool, acceptance: &str| {
        format!(
            "{TARGET_ONLY}drafter = \"mag\"\nadaptive = {adaptive}\n[target.acceptance]\n{acceptance}\n\
             [drafters.mag]\nkind = \"max_gram\"\n"
        )
    };
    let fourteen = format!("[{}]", vec!["0.5"; 14].join(", "));
    assert_eq!(
        config_error(&cfg(false, &format!("mag = {fourteen}"))),
        "target.acceptance: starts an adaptive gate's estimates: it needs `adaptive = true`"
    );
    assert_eq!(
        config_error(&cfg(true, &format!("small = {fourteen}"))),
        "target.acceptance.small: unknown drafter `small` (defined in [drafters]: mag)"
    );
    assert_eq!(
        config_error(&cfg(true, "mag = [0.5, 0.5]")),
        "target.acceptance.mag: expected 14 values (one per confidence bucket up to 0.1, 0.2, \
         0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 1, then positions without \
         confidence), got 2"
    );
    // A K matrix's parts learn under their own names (`plan --write` writes them): accepted.
    let k_matrix = format!(
        "{TARGET_ONLY}drafter = \"cs\"\nadaptive = true\n[target.acceptance]\n\
         \"cs.d1\" = {fourteen}\n{MAG}[drafters.cs]\nkind = \"k_matrix\"\n\
         reviewers = [\"{DRAFT}\"]\nlast = \"mag\"\nk_matrix = [[4, 2]]\n"
    );
    let plan = RawConfig::parse(&k_matrix, "test.toml")
        .and_then(|c| c.validate(&models_dir()))
        .unwrap();
    assert_eq!(plan.acceptance[0].0, "cs.d1");
    let high = format!("[{}, 1.5]", vec!["0.5"; 13].join(", "));
    assert_eq!(
        config_error(&cfg(true, &format!("mag = {high}"))),
        "target.acceptance.mag: values must be in [0, 1], got 1.5"
    );
}

/// The engine of config `toml` (paths relative to the models folder), after it generated
/// `n` greedy tokens of a short code prompt, and that generation.
fn generate_with(toml: &str, n: usize) -> (cascade::engine::Engine, cascade::engine::Generation) {
    let mut engine = RawConfig::parse(toml, "t")
        .unwrap()
        .validate(&models_dir())
        .unwrap()
        .build(&mut |_, _, _| {})
        .unwrap();
    let prompt = engine.tokenizer.encode("def add(a, b):").unwrap();
    let opts = cascade::engine::GenerateOptions {
        max_new_tokens: n,
        ..Default::default()
    };
    let out = engine.generate(&prompt, &opts, &mut |_| {}).unwrap();
    (engine, out)
}

/// A Max-Gram history: its size in range, a path that is not a folder, and a file that is
/// damaged or written for another tokenizer refused when the engine is built.
#[test]
fn a_max_gram_history_out_of_range_damaged_or_foreign_is_refused() {
    let _s = serial();
    let mag = |target: &str, extra: &str| {
        format!("[target]\nmodel = \"{target}\"\ndrafter = \"mag\"\n[drafters.mag]\nkind = \"max_gram\"\n{extra}")
    };
    assert_eq!(
        config_error(&mag(DRAFT, "history = \"h.hist\"\nhistory_tokens = 0\n")),
        "drafters.mag.history_tokens: must be between 16 and 4194304 (tokens), got 0"
    );
    let dir = tempfile::tempdir().unwrap();
    let e = config_error(&mag(
        DRAFT,
        &format!("history = \"{}\"\n", dir.path().display()),
    ));
    assert_eq!(
        e,
        format!(
            "drafters.mag.history: {} is a folder, not a file",
            dir.path().display()
        )
    );
    let build = |toml: String| {
        RawConfig::parse(&toml, "t")
            .unwrap()
            .validate(&models_dir())
            .unwrap()
            .build(&mut |_, _, _| {})
            .map(drop)
    };
    // A history written through the 0.5B's tokenizer, then read with SmolLM2's.
    let path = dir.path().join("outputs.hist");
    let history = format!("history = \"{}\"\n", path.display());
    generate_with(&mag(DRAFT, &history), 4);
    assert!(path.is_file());
    let e = build(mag(SMOLLM2, &history)).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "Max-Gram history {}: written for another tokenizer (fingerprint ",
            path.display()
        )),
        "{e}"
    );
    let mut bytes = std::fs::read(&path).unwrap();
    build(mag(DRAFT, &history)).unwrap();
    bytes.truncate(bytes.len() - 1);
    std::fs::write(&path, &bytes).unwrap();
    let e = build(mag(DRAFT, &history)).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "Max-Gram history {}: truncated or corrupt: {} bytes, the header implies {}",
            path.display(),
            bytes.len(),
            bytes.len() + 1
        )
    );
}

/// A Max-Gram node placed twice in the tree (here, both parts of a schedule) shares its
/// history, and each output goes in once.
#[test]
fn a_history_named_by_two_nodes_records_each_output_once() {
    let _s = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("outputs.hist");
    let toml = format!(
        "[target]\nmodel = \"{DRAFT}\"\ndrafter = \"h\"\n[drafters.mag]\nkind = \"max_gram\"\nhistory = \"{}\"\n[drafters.h]\nkind = \"horizontal\"\nschedule = [[\"mag\", 2], [\"mag\", 2]]\n",
        path.display()
    );
    let (engine, out) = generate_with(&toml, 6);
    let vocab = engine.target().vocab_size();
    let fingerprint = engine.tokenizer.fingerprint();
    let history = cascade::drafter::History::open(&path, fingerprint, vocab, 1000, 16).unwrap();
    // The output and its separator, once.
    assert_eq!(history.len(), out.tokens.len() + 1);
}

#[test]
fn a_table_built_for_another_tokenizer_is_refused() {
    let _s = serial();
    let table = Path::new(env!("CARGO_MANIFEST_DIR")).join("ngram/qwen2.5-coder-cpython311.bigram");
    let toml = format!(
        "[target]\nmodel = \"{SMOLLM2}\"\ndrafter = \"b\"\n[drafters.b]\nkind = \"bigram\"\ntable = \"{}\"\n",
        table.display()
    );
    let plan = RawConfig::parse(&toml, "t")
        .unwrap()
        .validate(&models_dir())
        .unwrap();
    let e = plan.build(&mut |_, _, _| {}).err().unwrap().to_string();
    assert!(
        e.starts_with(&format!(
            "bigram table {}: built for another tokenizer (fingerprint ",
            table.display()
        )),
        "{e}"
    );
    assert!(
        e.contains("; the model's first 49152 of 49152 ids give ")
            && e.ends_with("rebuild it with `cascade ngram build`"),
        "{e}"
    );
}

#[test]
fn a_trimmed_vocabulary_needs_its_table_and_a_size_below_the_models() {
    let small = |extra: &str| {
        format!("{TARGET_ONLY}drafter = \"small\"\n[drafters.small]\nkind = \"model\"\nmodel = \"{DRAFT}\"\n{extra}")
    };
    let table = Path::new(env!("CARGO_MANIFEST_DIR")).join("ngram/qwen2.5-coder-cpython311.bigram");
    assert_eq!(
        config_error(&small("vocabulary = 32768\n")),
        "drafters.small.vocabulary: needs `vocabulary_table`: a bigram table (`cascade ngram build`) whose corpus ranks the tokens"
    );
    assert_eq!(
        config_error(&small(&format!("vocabulary_table = \"{}\"\n", table.display()))),
        "drafters.small.vocabulary_table: is read only with `vocabulary` (how many of its most frequent tokens to score)"
    );
    assert_eq!(
        config_error(&small(&format!(
            "vocabulary = 0\nvocabulary_table = \"{}\"\n",
            table.display()
        ))),
        "drafters.small.vocabulary: must be between 1 and 16777216 (tokens), got 0"
    );
    let _s = serial();
    let toml = small(&format!(
        "vocabulary = 151936\nvocabulary_table = \"{}\"\n",
        table.display()
    ));
    let plan = RawConfig::parse(&toml, "t")
        .unwrap()
        .validate(&models_dir())
        .unwrap();
    let e = plan.build(&mut |_, _, _| {}).err().unwrap().to_string();
    assert_eq!(
        e,
        "drafters.small.vocabulary: 151936 is not below the model's vocabulary (151936 tokens): leave it out to score every token"
    );
}

/// A config with `[target]` plus these drafter tables.
fn tree_error(drafters: &str) -> String {
    config_error(&format!("{TARGET_ONLY}drafter = \"top\"\n{drafters}"))
}

const MAG: &str = "[drafters.mag]\nkind = \"max_gram\"\n";

#[test]
fn cascade_unknown_names() {
    let e = tree_error(&format!(
        "{MAG}[drafters.top]\nkind = \"vertical\"\nreviewer = \"{DRAFT}\"\ndraft = \"nope\"\n"
    ));
    assert_eq!(
        e,
        "drafters.top.draft: unknown drafter `nope` (defined in [drafters]: mag, top)"
    );
    let e = tree_error(&format!(
        "{MAG}[drafters.top]\nkind = \"horizontal\"\nschedule = [[\"mag\", 2], [\"gone\", 3]]\n"
    ));
    assert_eq!(
        e,
        "drafters.top.schedule[1]: unknown drafter `gone` (defined in [drafters]: mag, top)"
    );
}

#[test]
fn cascade_cycles() {
    let e = tree_error(&format!(
        "[drafters.top]\nkind = \"vertical\"\nreviewer = \"{DRAFT}\"\ndraft = \"h\"\n\
         [drafters.h]\nkind = \"horizontal\"\nschedule = [[\"top\", 2]]\n"
    ));
    assert_eq!(
        e,
        "drafters.h.schedule[0]: drafters form a cycle: top -> h -> top"
    );
    let e = tree_error("[drafters.top]\nkind = \"horizontal\"\nschedule = [[\"top\", 1]]\n");
    assert_eq!(
        e,
        "drafters.top.schedule[0]: drafters form a cycle: top -> top"
    );
}

/// `levels` horizontal drafters `{prefix}1..`, the last named `top`, each drafting `copies`
/// times from the one before it (the first from `mag`).
fn stacked_tree(prefix: &str, levels: usize, copies: usize) -> String {
    let name = |i: usize| match i {
        0 => "mag".to_string(),
        i if i == levels => "top".to_string(),
        i => format!("{prefix}{i}"),
    };
    (1..=levels)
        .map(|i| {
            let part = format!("[\"{}\", 1]", name(i - 1));
            let schedule = vec![part; copies].join(", ");
            format!(
                "[drafters.{}]\nkind = \"horizontal\"\nschedule = [{schedule}]\n",
                name(i)
            )
        })
        .collect()
}

#[test]
fn cascade_trees_too_large_or_too_deep() {
    // Each drafter names the one below twice: 2^22 drafters from 23 tables, refused at once
    // (it took seconds and gigabytes to expand).
    let e = tree_error(&format!("{MAG}{}", stacked_tree("h", 22, 2)));
    assert!(
        e.ends_with(
            "the drafter tree holds more than 256 drafters (a drafter named in several places \
             is built once per place)"
        ),
        "{e}"
    );
    // A chain of 200,000 overflowed the stack; one deeper than 32 is refused.
    assert_eq!(
        tree_error(&format!("{MAG}{}", stacked_tree("c", 40, 1))),
        "drafters.c9.schedule[0]: drafters nest more than 32 deep: top -> ..."
    );
}

#[test]
fn cascade_empty_schedule_and_zero_counts() {
    let e = tree_error("[drafters.top]\nkind = \"horizontal\"\nschedule = []\n");
    assert_eq!(
        e,
        "drafters.top.schedule: must list at least one [drafter, tokens] pair"
    );
    let e = tree_error(&format!(
        "{MAG}[drafters.top]\nkind = \"horizontal\"\nschedule = [[\"mag\", 0]]\n"
    ));
    assert_eq!(
        e,
        "drafters.top.schedule[0]: must be between 1 and 64 (tokens drafted by `mag`), got 0"
    );
    let e = tree_error(&format!("{MAG}[drafters.top]\nkind = \"vertical\"\nreviewer = \"{DRAFT}\"\ndraft = \"mag\"\nk = 0\n"));
    assert_eq!(
        e,
        "drafters.top.k: must be between 1 and 64 (tokens asked of the inner drafter), got 0"
    );
    let e = tree_error(&format!(
        "{MAG}[drafters.top]\nkind = \"adaptive\"\ndrafters = [\"mag\", \"mag\"]\n"
    ));
    assert_eq!(e, "drafters.top.drafters[1]: `mag` is listed twice");
}

#[test]
fn cascade_lenience_below_one() {
    let e = tree_error(&format!(
        "{MAG}[drafters.top]\nkind = \"vertical\"\nreviewer = \"{DRAFT}\"\ndraft = \"mag\"\nlenience = 0.5\n"
    ));
    assert_eq!(
        e,
        "drafters.top.lenience: must be a finite number >= 1, got 0.5"
    );
}

#[test]
fn k_matrix_shape() {
    let km = |m: &str| {
        tree_error(&format!(
            "{MAG}[drafters.top]\nkind = \"k_matrix\"\nreviewers = [\"{DRAFT}\", \"{DRAFT}\"]\nlast = \"mag\"\nk_matrix = {m}\n"
        ))
    };
    assert_eq!(
        km("[[3, 1, 0]]"),
        "drafters.top.k_matrix: expected 2 rows (one per reviewer), got 1"
    );
    assert_eq!(
        km("[[3, 1], [4, 0]]"),
        "drafters.top.k_matrix[0]: expected 3 entries (drafters d1..d2 and the last), got 2"
    );
    assert_eq!(
        km("[[3, 1, 0], [0, 0]]"),
        "drafters.top.k_matrix[1]: drafts nothing: at least one entry must be >= 1"
    );
    let ok = RawConfig::parse(
        &format!(
            "{TARGET_ONLY}drafter = \"top\"\n{MAG}[drafters.top]\nkind = \"k_matrix\"\nreviewers = [\"{DRAFT}\", \"{DRAFT}\"]\nlast = \"mag\"\nk_matrix = [[3, 1, 0], [4, 0]]\n"
        ),
        "t",
    )
    .unwrap();
    // Row 1: 3 tokens from d1 (reviewing row 2: 4 tokens from d2, which reviews Max-Gram),
    // then 1 token from d2.
    let plan = ok.validate(&models_dir()).unwrap();
    let shape = format!("{:?}", plan.drafter.unwrap());
    assert_eq!(shape.matches("Vertical").count(), 3, "{shape}");
    assert_eq!(shape.matches("Horizontal").count(), 2, "{shape}");
}

/// The error of building a config whose target drafts with `top`, defined in `drafters`.
fn build_error(drafters: &str) -> String {
    let toml = format!("{TARGET_ONLY}drafter = \"top\"\n{drafters}");
    let plan = RawConfig::parse(&toml, "t")
        .unwrap()
        .validate(&models_dir())
        .unwrap();
    plan.build(&mut |_, _, _| {}).err().unwrap().to_string()
}

#[test]
fn a_reviewer_with_another_vocabulary_is_refused() {
    let _s = serial();
    let e = build_error(&format!(
        "{MAG}[drafters.top]\nkind = \"vertical\"\nreviewer = \"{SMOLLM2}\"\ndraft = \"mag\"\n"
    ));
    assert!(
        e.starts_with("vocabulary mismatch: drafter `top` (49152 tokens"),
        "{e}"
    );
}

/// A model under a vertical cascade drafts for the cascade's reviewer, and its vocabulary is
/// checked against the reviewer's (here both refuse it; the message names which was asked).
#[test]
fn a_model_under_a_vertical_cascade_is_checked_against_its_reviewer() {
    let _s = serial();
    let e = build_error(&format!(
        "[drafters.top]\nkind = \"vertical\"\nreviewer = \"{DRAFT}\"\ndraft = \"inner\"\n[drafters.inner]\nkind = \"model\"\nmodel = \"{SMOLLM2}\"\n"
    ));
    assert!(
        e.starts_with("vocabulary mismatch: drafter `inner` (49152 tokens")
            && e.contains("cannot draft for `top` (151936 tokens"),
        "{e}"
    );
}

/// A copy of SmolLM2 with the u32 metadata value of `key` set to `value`.
fn smollm2_with(key: &str, value: u32) -> (tempfile::TempDir, std::path::PathBuf) {
    let mut src = std::fs::read(models_dir().join(SMOLLM2)).unwrap();
    let at = src
        .windows(key.len())
        .position(|w| w == key.as_bytes())
        .unwrap();
    let value_at = at + key.len() + 4; // after the key and its value type
    assert_eq!(src[at + key.len()], 4, "{key} is a u32");
    src[value_at..value_at + 4].copy_from_slice(&value.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("edited.gguf");
    std::fs::write(&path, &src).unwrap();
    (dir, path)
}

#[test]
fn inconsistent_gguf_metadata_is_named() {
    let error = |key, value| {
        let (_dir, path) = smollm2_with(key, value);
        let e = LoadedModel::load(&path, None, &mut |_, _| {})
            .err()
            .unwrap()
            .to_string();
        let prefix = format!("cannot read GGUF file {}: ", path.display());
        assert!(e.starts_with(&prefix), "{e}");
        e[prefix.len()..].to_string()
    };
    assert_eq!(
        error("llama.attention.head_count", 0),
        "metadata `llama.attention.head_count` is 0, expected 1 to 1024"
    );
    assert_eq!(
        error("llama.attention.head_count_kv", 2),
        "9 attention heads cannot be shared evenly by 2 key-value heads"
    );
    assert_eq!(
        error("llama.block_count", 0),
        "metadata `llama.block_count` is 0, expected 1 to 1024"
    );
    assert_eq!(
        error("llama.feed_forward_length", 1000),
        "tensor `blk.0.ffn_gate.weight` has shape [1536, 576], expected [1000, 576] from the metadata"
    );
    assert_eq!(
        error("llama.embedding_length", 1152),
        "tensor `token_embd.weight` has shape [49152, 576], expected [vocabulary, 1152]"
    );
    assert_eq!(
        error("llama.embedding_length", 512),
        "embedding length 512 is not shared evenly by 9 heads"
    );
    assert_eq!(
        error("llama.embedding_length", 567),
        "head dimension 63 is odd"
    );
}

/// A token id of the tokenizer's metadata outside the vocabulary would never match (an EOS
/// that never ends a generation): the file is refused.
#[test]
fn a_special_token_id_outside_the_vocabulary_is_named() {
    let (_dir, path) = smollm2_with("tokenizer.ggml.eos_token_id", 49152);
    let e = LoadedModel::load(&path, None, &mut |_, _| {})
        .err()
        .unwrap();
    assert_eq!(
        e.to_string(),
        format!(
            "tokenizer: cannot load {}: metadata `tokenizer.ggml.eos_token_id` is 49152, outside \
             the vocabulary (49152 tokens)",
            path.display()
        )
    );
}

/// The command line prints one line naming the config and the file, exits 1, and shows no
/// backtrace even with RUST_BACKTRACE set.
#[test]
fn the_cli_reports_a_bad_model_in_one_line() {
    let (dir, path) = smollm2_with("llama.attention.head_count", 0);
    let config = dir.path().join("c.toml");
    std::fs::write(&config, format!("[target]\nmodel = {:?}\n", path)).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cascade"))
        .args(["generate", "-c", config.to_str().unwrap(), "-p", "hi"])
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let last = stderr.trim_end().lines().last().unwrap();
    assert_eq!(
        last,
        format!(
            "cascade: {}: cannot read GGUF file {}: metadata `llama.attention.head_count` is 0, expected 1 to 1024",
            config.display(),
            path.display()
        )
    );
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
}

/// `serve` takes its port before it loads the models: a port in use is reported at once, not
/// after a minute of loading (here the model would fail to load, and that error never comes).
#[test]
fn serve_reports_a_port_in_use_before_loading_the_models() {
    let (dir, path) = smollm2_with("llama.attention.head_count", 0);
    let config = dir.path().join("c.toml");
    std::fs::write(&config, format!("[target]\nmodel = {:?}\n", path)).unwrap();
    let taken = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cascade"))
        .args(["serve", "-c", config.to_str().unwrap(), "--port", &port])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr
            .trim_end()
            .starts_with(&format!("cascade: cannot listen on 127.0.0.1:{port}: ")),
        "{stderr}"
    );
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

/// A plug-in's drafter must name itself as the config names it: acceptance priors and the
/// reports go by that name.
#[test]
fn a_plug_in_that_names_its_drafter_otherwise_is_refused() {
    let _s = serial();
    let mut registry = cascade::config::Registry::default();
    registry.register("copy", |_| {
        let drafter = cascade::drafter::MaxGramDrafter::new("mine", Default::default(), None);
        Ok(Box::new(drafter))
    });
    let toml = format!(
        "[target]\nmodel = \"{SMOLLM2}\"\ndrafter = \"quick\"\n[drafters.quick]\nkind = \"copy\"\n"
    );
    let plan = RawConfig::parse(&toml, "t")
        .unwrap()
        .validate_with(&models_dir(), &registry)
        .unwrap();
    assert_eq!(
        plan.build(&mut |_, _, _| {}).err().unwrap().to_string(),
        "drafters.quick: the `copy` plug-in named its drafter `mine`: `Drafter::name` must \
         return the config's name (`PluginContext::name`), which acceptance priors and reports \
         go by"
    );
}

/// A 2-token bench of SmolLM2 drafted by the plug-in `make` (registered as `kind`, and named
/// so in the config, as its drafter names itself), one config per label, over `prompts` (raw
/// code); `progress` sees each finished run and may set `stop` (Ctrl-C).
fn plugin_bench(
    kind: &str,
    make: impl Fn() -> Box<dyn cascade::draft::Drafter> + Send + Sync + 'static,
    labels: &[&str],
    prompts: &[&str],
    stop: &std::sync::atomic::AtomicBool,
    progress: &mut dyn FnMut(usize),
) -> (
    Vec<cascade::bench::RunRecord>,
    Option<cascade::bench::EarlyEnd>,
) {
    use cascade::bench::{run, BenchConfig, BenchOptions, SuitePrompt};
    let mut registry = cascade::config::Registry::default();
    registry.register(kind, move |_| Ok(make()));
    let toml = format!(
        "[target]\nmodel = \"{SMOLLM2}\"\ndrafter = \"{kind}\"\n[drafters.{kind}]\nkind = \"{kind}\"\n"
    );
    let configs: Vec<BenchConfig> = labels
        .iter()
        .map(|label| BenchConfig {
            label: label.to_string(),
            plan: RawConfig::parse(&toml, "t")
                .unwrap()
                .validate_with(&models_dir(), &registry)
                .unwrap(),
        })
        .collect();
    let suite: Vec<SuitePrompt> = prompts
        .iter()
        .map(|text| SuitePrompt {
            category: "code".into(),
            prompt: text.to_string(),
            chat: false,
            line: 0,
        })
        .collect();
    let opts = BenchOptions {
        max_new_tokens: 2,
        repeats: 1,
        warmup_prompts: 0,
        sampling: None,
    };
    let mut store = cascade::model::ModelStore::default();
    let mut progress = |done, _, _: &str| progress(done);
    run(&configs, &suite, &opts, &mut store, stop, &mut progress).unwrap()
}

/// A generation that fails in the middle of a bench ends it, with the runs finished before it
/// kept for the report and the failure named.
#[test]
fn a_failing_generation_ends_a_bench_with_the_runs_before_it() {
    use cascade::bench::EarlyEnd;
    use cascade::draft::{Draft, Drafter, Request};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    let _s = serial();
    /// A plug-in drafter that drafts nothing and fails to start its second sequence.
    struct FailsOnSecond(Arc<AtomicUsize>);
    impl Drafter for FailsOnSecond {
        fn name(&self) -> &str {
            "fails"
        }
        fn draft(&mut self, _: &[u32], _: &mut Request) -> cascade::Result<Draft> {
            Ok(Draft::new())
        }
        fn start(&mut self, _: &[u32]) -> cascade::Result<()> {
            match self.0.fetch_add(1, Ordering::Relaxed) {
                1 => Err(cascade::Error::DrafterFailed {
                    drafter: "fails".into(),
                    message: "cannot start".into(),
                }),
                _ => Ok(()),
            }
        }
    }
    let starts = Arc::new(AtomicUsize::new(0));
    let (records, end) = plugin_bench(
        "fails",
        move || Box::new(FailsOnSecond(starts.clone())),
        &["fails"],
        &["def add(a, b):", "def sub(a, b):"],
        &AtomicBool::new(false),
        &mut |_| {},
    );
    // The first prompt's runs (the baseline's and the config's), then the failure.
    assert_eq!(records.len(), 2);
    assert!(records.iter().all(|r| r.prompt == 0));
    match end {
        Some(EarlyEnd::Failed(e)) => {
            assert_eq!(e.to_string(), "drafter `fails` failed: cannot start")
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// A bench interrupted (Ctrl-C) in the middle of a prompt keeps that prompt's runs finished
/// with their baseline: the report is not emptied by a run still to come.
#[test]
fn an_interrupted_bench_keeps_the_runs_finished_in_its_last_prompt() {
    use cascade::bench::EarlyEnd;
    use cascade::draft::{Draft, Drafter, Request};
    use std::sync::atomic::{AtomicBool, Ordering};

    let _s = serial();
    struct Quiet;
    impl Drafter for Quiet {
        fn name(&self) -> &str {
            "quiet"
        }
        fn draft(&mut self, _: &[u32], _: &mut Request) -> cascade::Result<Draft> {
            Ok(Draft::new())
        }
    }
    let stop = AtomicBool::new(false);
    // Ctrl-C after the second run (the baseline's, then `a`'s): `b` never runs.
    let (records, end) = plugin_bench(
        "quiet",
        || Box::new(Quiet),
        &["a", "b"],
        &["def add(a, b):"],
        &stop,
        &mut |done| stop.store(done == 2, Ordering::Relaxed),
    );
    let labels: Vec<&str> = records.iter().map(|r| r.config.as_str()).collect();
    assert_eq!(labels, ["autoregressive", "a"]);
    assert!(matches!(end, Some(EarlyEnd::Interrupted)), "{end:?}");
}

/// A chat prompt for a model without a chat template says how to give it as raw text.
#[test]
fn a_chat_prompt_for_a_model_without_a_template_says_how_to_run_it() {
    let t = common::toy_tokenizer(4);
    let e = cascade::chat::apply(&t, None, "hi").unwrap_err();
    assert_eq!(
        e.to_string(),
        "chat template: the model has no chat template (tokenizer.chat_template): give the \
         prompt as raw text (`--no-chat`; `chat = false` under [generation]; `\"chat\": \
         false` on a bench suite's line)"
    );
}
