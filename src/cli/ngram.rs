//! `cascade ngram build`.

use super::bar;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum NgramCommand {
    /// Build a bigram table from a corpus of text or code files.
    Build(BuildArgs),
}

#[derive(Args)]
pub struct BuildArgs {
    /// Tokenizer: a GGUF model (its embedded tokenizer) or a tokenizer.json.
    #[arg(long)]
    tokenizer: PathBuf,
    /// Where to write the table.
    #[arg(short, long)]
    out: PathBuf,
    /// Successors kept per token.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Only files with these extensions (comma-separated; default: all files).
    #[arg(long, value_delimiter = ',')]
    ext: Vec<String>,
    /// Skip files under folders with these names (repeatable), e.g. site-packages: a name,
    /// not a path.
    #[arg(long)]
    exclude: Vec<String>,
    /// Corpus files or folders (searched recursively).
    #[arg(required = true)]
    corpus: Vec<PathBuf>,
}

pub fn ngram_build(args: BuildArgs) -> Result<()> {
    use cascade::ngram::{build_table, corpus_files, BigramTable};
    if args.top == 0 {
        bail!("--top must be >= 1");
    }
    // Arguments in the wrong order, or a typo, must not replace a file with the table; a table
    // rebuilt inside its corpus folder is not part of its corpus. Checked before any work.
    if args.out.is_dir() {
        bail!(
            "--out {} is a folder: name the table's file",
            args.out.display()
        );
    }
    match BigramTable::replaceable(&args.out) {
        Ok(true) => {}
        Ok(false) => bail!(
            "--out {} is a file and no bigram table: the table would replace it",
            args.out.display()
        ),
        Err(e) => bail!(
            "--out {}: cannot read it to check that it is a bigram table: {e}",
            args.out.display()
        ),
    }
    if let Some(x) = args.exclude.iter().find(|x| x.contains(['/', '\\'])) {
        bail!("--exclude {x}: give a folder's name (e.g. site-packages), not a path");
    }
    let start = std::time::Instant::now();
    let tokenizer = cascade::tokenizer::Tokenizer::from_file(&args.tokenizer)?;
    let mut files = corpus_files(&args.corpus, &args.ext, &args.exclude)?;
    if let Ok(out) = args.out.canonicalize() {
        files.retain(|f| f.canonicalize().ok() != Some(out.clone()));
    }
    if files.is_empty() {
        let only = match args.ext.is_empty() {
            true => String::new(),
            false => format!(" with extension {}", args.ext.join(", ")),
        };
        bail!("no corpus files{only} found under {:?}", args.corpus);
    }
    let bytes: u64 = files
        .iter()
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    let bar = bar("tokenizing [{bar:30}] {bytes}/{total_bytes} ({eta} left)");
    bar.set_length(bytes);
    let (table, read) = build_table(&files, &tokenizer, args.top, &mut |b| bar.inc(b))?;
    bar.finish_and_clear();
    table.save(&args.out)?;
    if let Some(first) = &read.first_unreadable {
        eprintln!(
            "cascade: warning: {} files could not be read and were left out (the first: {first})",
            read.unreadable
        );
    }
    eprintln!(
        "{}: {} files ({} skipped as non-UTF-8), {} tokens, {} table entries, {} bytes, {:.1}s",
        args.out.display(),
        read.files,
        read.skipped,
        read.tokens,
        table.entries(),
        std::fs::metadata(&args.out)?.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
