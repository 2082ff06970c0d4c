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
    let result = match Cli::parse().command {
        Command::Generate(args) => cli::generate::generate(args),
        Command::Bench(args) => cli::bench::bench_command(args).map(drop),
        Command::Plan(args) => cli::bench::plan(args),
        Command::Calibrate(args) => cli::bench::calibrate(args),
        Command::Serve(args) => cli::serve::serve_command(args),
        Command::Ngram {
            command: NgramCommand::Build(args),
        } => cli::ngram::ngram_build(args),
    };
    if let Err(e) = result {
        // Output piped into a reader that stopped reading (`| head`): nothing left to say.
        if e.is::<cli::generate::StdoutClosed>() {
            std::process::exit(0);
        }
        eprintln!("cascade: {e:#}");
        std::process::exit(1);
    }
}
