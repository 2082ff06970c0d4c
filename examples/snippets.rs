//! A plug-in drafter, registered under its own kind and used from TOML inside a cascade.
//!
//! `SnippetDrafter` is a tiny code-completion dictionary: when the text ends with the start
//! of one of its snippets, it proposes the rest. The config (`examples/snippets.toml`) names it
//! with `kind = "snippets"` like a built-in kind, first in an adaptive cascade with Max-Gram;
//! the target's reviews of each drafter are printed at the end.
//!
//! ```sh
//! scripts/fetch-models.sh target && cargo run --release --example snippets
//! ```

use cascade::config::{PluginContext, RawConfig, Registry};
use cascade::draft::{Draft, Drafter, NodeKind, NodeStats, Request};
use cascade::sampling::Dist;
use std::io::Write;
use std::path::Path;

/// Proposes the rest of a snippet whose first tokens end the text.
struct SnippetDrafter {
    name: String,
    snippets: Vec<Vec<u32>>,
    /// The fewest snippet tokens the text must end with.
    min_overlap: usize,
}

impl SnippetDrafter {
    /// The snippet whose longest start ends `context`, and how many tokens of it do.
    fn best_match(&self, context: &[u32]) -> Option<(&[u32], usize)> {
        self.snippets
            .iter()
            .filter_map(|s| {
                let overlap = (self.min_overlap..s.len())
                    .rev()
                    .find(|&n| context.ends_with(&s[..n]))?;
                Some((s.as_slice(), overlap))
            })
            .max_by_key(|&(_, n)| n)
    }
}

impl Drafter for SnippetDrafter {
    fn name(&self) -> &str {
        &self.name
    }

    fn draft(&mut self, context: &[u32], request: &mut Request) -> cascade::Result<Draft> {
        let mut draft = Draft::new();
        if let Some((snippet, overlap)) = self.best_match(context) {
            // Confidence grows with the overlap; the gate learns what it is worth.
            let confidence = overlap as f32 / (overlap as f32 + 1.0);
            for &token in &snippet[overlap..] {
                if !request.admit(Some(confidence)) {
                    break;
                }
                draft.push(token, Dist::Point(token)); // deterministic: a point mass
            }
        }
        Ok(draft)
    }

    fn stats(&self) -> NodeStats {
        NodeStats::new(&self.name, NodeKind::Plugin("snippets".into()))
    }
}

/// Builds the drafter from its TOML table: `snippets` (required), `min_overlap` (default 2).
fn snippets(cx: &PluginContext) -> cascade::Result<Box<dyn Drafter>> {
    cx.only(&["snippets", "min_overlap"])?;
    let texts = cx
        .strings("snippets")?
        .ok_or_else(|| cx.error("snippets", "is required: a list of strings"))?;
    let snippets = texts
        .iter()
        .map(|t| cx.tokenizer.encode_plain(t))
        .collect::<cascade::Result<Vec<_>>>()?;
    let min_overlap = cx.usize("min_overlap")?.unwrap_or(2).max(1);
    Ok(Box::new(SnippetDrafter {
        name: cx.name.to_string(),
        snippets,
        min_overlap,
    }))
}

fn main() -> anyhow::Result<()> {
    let mut registry = Registry::default();
    registry.register("snippets", snippets);

    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/snippets.toml");
    let raw = RawConfig::load(&path)?;
    let plan = raw.validate_with(path.parent().unwrap(), &registry)?;
    let mut engine = plan.build(&mut |_, _, _| {})?;

    let prompt = "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(";
    print!("{prompt}");
    let tokens = engine.tokenizer.encode(prompt)?;
    let out = engine.generate(&tokens, &plan.options, &mut |piece| {
        print!("{piece}");
        let _ = std::io::stdout().flush();
    })?;
    println!("\n");
    let st = &out.stats;
    println!(
        "{} tokens, {:.2} per target call, {}/{} drafted tokens accepted",
        st.generated_tokens,
        st.tokens_per_call(),
        st.accepted,
        st.drafted
    );
    for source in &st.acceptance_by_confidence {
        let (reviewed, accepted) = source
            .buckets
            .iter()
            .fold((0, 0), |(r, a), b| (r + b.reviewed, a + b.accepted));
        println!(
            "drafter `{}`: {accepted} of {reviewed} reviewed positions accepted",
            source.drafter
        );
    }
    Ok(())
}
