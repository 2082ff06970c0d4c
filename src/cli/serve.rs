//! `cascade serve`: the OpenAI-compatible server over a config's engine.

use super::{build, label, load_plan};
use anyhow::{bail, Result};
use cascade::config::RawConfig;
use cascade::model::ModelStore;
use cascade::server::{host_name, listen, serve, Cors, ServeOptions};
use clap::Args;
use std::path::PathBuf;
use std::time::Duration;

/// Most requests that may wait: the queue's slots are allocated up front.
const MAX_QUEUE: usize = 4096;

#[derive(Args)]
pub struct ServeArgs {
    /// TOML config naming the target, the drafter and the default settings.
    #[arg(short, long, default_value = "configs/adaptive.toml")]
    config: PathBuf,
    /// Address to listen on (0.0.0.0 for every interface: the API has no authentication).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests that may wait while one generates; more are answered 429.
    #[arg(long, default_value_t = 16)]
    queue: usize,
    /// Seconds running requests may take after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0, allow_negative_numbers = true)]
    grace: f64,
    /// Let web pages from this origin call the API from a browser (CORS), e.g.
    /// http://localhost:3000; repeat for more, or * for any. Off by default.
    #[arg(long, value_name = "ORIGIN")]
    cors: Vec<String>,
    /// Bound to a loopback address, also answer requests addressed to this host name (a
    /// reverse proxy's that passes its own on); repeat for more.
    #[arg(long, value_name = "NAME")]
    allow_host: Vec<String>,
}

pub fn serve_command(args: ServeArgs) -> Result<()> {
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        bail!(
            "--grace must be a number of seconds >= 0, got {}",
            args.grace
        );
    }
    let Ok(grace) = Duration::try_from_secs_f64(args.grace) else {
        bail!(
            "--grace must be at most {} seconds, got {}",
            u64::MAX,
            args.grace
        );
    };
    if !(1..=MAX_QUEUE).contains(&args.queue) {
        bail!(
            "--queue must be between 1 and {MAX_QUEUE}, got {}",
            args.queue
        );
    }
    let cors = Cors::parse(&args.cors)?;
    let raw = RawConfig::load(&args.config)?;
    // The port before the plan, which may download a model from the hub: a port in use is
    // reported at once.
    let listener = listen(&args.host, args.port)?;
    let plan = load_plan(&args.config, &raw)?;
    if plan.options.lenience != 1.0 {
        bail!("a server's output must be exactly the target's: lenience must be 1 at the target");
    }
    let engine = build(&args.config, &plan, &mut ModelStore::default())?;
    let opts = ServeOptions {
        listener,
        queue: args.queue,
        grace,
        model: label(&args.config),
        system: plan.system.clone(),
        cors,
        allowed_hosts: args.allow_host.iter().map(|h| host_name(h)).collect(),
    };
    let model = opts.model.clone();
    serve(engine, plan.options.clone(), opts, |addr| {
        eprintln!("cascade: serving `{model}` on http://{addr} (OpenAI API under /v1)");
    })?;
    Ok(())
}
