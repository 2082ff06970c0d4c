//! The `cascade` command line: the commands and their wiring; each command's arguments and
//! printing are in `cli/`, the work in the library.

mod cli;

use clap::{Parser, Subcommand};
use cli::bench::{BenchArgs, CalibrateArgs, PlanArgs};
use cli::generate::GenerateArgs;
use cli::ngram::NgramCommand;

/// Lossless speculative decoding with cascades of drafters.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt with the target model and (optionally) a drafter.
    Generate(GenerateArgs),
    /// Compare configs on a prompt suite against autoregressive decoding, in one process.
    Bench(BenchArgs),
    /// Plan every review of a config's tree (draft lengths, schedules, K-matrix rows) from a
    /// bench report's measured acceptance and costs, or from a short calibration run.
    Plan(PlanArgs),
    /// Measure the forward costs of every model the configs name on this machine (adaptive
    /// drafting uses them) and store them in the cost cache.
    Calibrate(CalibrateArgs),
    /// Serve the config's engine over HTTP with the OpenAI API (chat completions,
    /// completions, predicted outputs, streaming), plus /health and /metrics.
    Serve(cli::serve::ServeArgs),
    /// Bigram tables for the statistical drafters (bigram, Max-Gram).
    Ngram {
        #[command(subcommand)]
        command: NgramCommand,
    },
}

fn main() {
    let command = Cli::parse().command;
    if !matches!(command, Command::Serve(_)) {
        end_quietly_on_a_closed_pipe();
    }
    let result = match command {
        Command::Generate(args) => cli::generate::generate(args),
        Command::Bench(args) => cli::bench::bench(args),
        Command::Plan(args) => cli::bench::plan(args),
        Command::Calibrate(args) => cli::bench::calibrate(args),
        Command::Serve(args) => cli::serve::serve_command(args),
        Command::Ngram {
            command: NgramCommand::Build(args),
        } => cli::ngram::ngram_build(args),
    };
    if let Err(e) = result {
        eprintln!("cascade: {e:#}");
        std::process::exit(1);
    }
}

/// A command whose reader stops reading (`cascade plan ... | head`, or its progress on
/// standard error piped too) ends as Unix tools do, by SIGPIPE, quietly. Rust ignores the
/// signal, which makes every later print a panic with a backtrace. The server keeps ignoring
/// it: a client that hangs up is an error on its connection only; and so do model downloads
/// (`cli::load_plan`).
fn end_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: called before any thread is started; restores the signal's default action.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
