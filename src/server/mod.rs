//! `cascade serve`: an OpenAI-compatible HTTP server over one engine.
//!
//! axum on tokio answers HTTP; the engine runs on its own thread (the `worker` module), fed FIFO
//! through a bounded queue, so a full queue is a 429 and never unbounded memory. Text is
//! streamed as server-sent events as the engine commits it, through the same
//! [`TextStream`](crate::stream::TextStream) as the CLI, stop strings included. A request's
//! `prediction` becomes a drafter at the front of the tree for that request only.

mod api;
mod metrics;
mod worker;

use crate::engine::{Engine, GenerateOptions, Generation};
use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use api::{ApiError, Endpoint, Settings};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as Sse, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics::Metrics;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use worker::Ticket;
use worker::{Event, Job};

/// Where and how to serve.
#[derive(Debug)]
pub struct ServeOptions {
    /// Where to take connections ([`listen`]): bound before the models load, so that a port
    /// in use is reported at once.
    pub listener: std::net::TcpListener,
    /// Requests that may wait for the engine; more get 429.
    pub queue: usize,
    /// After SIGINT/SIGTERM, how long running requests may take before they are cancelled.
    pub grace: Duration,
    /// The model id `/v1/models` lists.
    pub model: String,
    /// The system prompt of chats that bring none (the config's `generation.system`).
    pub system: Option<String>,
    /// Which web pages may call the API from a browser.
    pub cors: Cors,
    /// Host names answered besides loopback ones when the listener is on a loopback address
    /// (as [`host_name`] gives them).
    pub allowed_hosts: Vec<String>,
}

/// Which web pages' scripts a browser lets read the API's answers and send it JSON requests
/// (CORS): none by default.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Cors {
    /// No CORS headers: browsers keep other origins' scripts from reading the answers and from
    /// sending JSON-typed requests (tools outside a browser are not affected).
    #[default]
    Off,
    /// Any origin (`*`).
    Any,
    /// These origins, as browsers send them (`scheme://host[:port]`, lowercase, no default
    /// port).
    Origins(Vec<String>),
}

impl Cors {
    /// From `--cors` values: none is [`Cors::Off`], `*` alone [`Cors::Any`], else origins,
    /// each `http://` or `https://`, a host and an optional port (1-65535), nothing after;
    /// written as a browser sends them (lowercase, without the scheme's default port), since
    /// they are compared byte for byte.
    pub fn parse(values: &[String]) -> Result<Cors> {
        let bad = |message: String| Err(Error::config("--cors", message));
        match values {
            [] => return Ok(Cors::Off),
            [any] if any == "*" => return Ok(Cors::Any),
            _ => {}
        }
        let mut origins = Vec::new();
        for v in values {
            if v == "*" {
                return bad("`*` allows any origin: give it alone".into());
            }
            match origin(v) {
                Some(o) => origins.push(o),
                None => {
                    return bad(format!(
                        "`{v}` is not an origin: scheme://host[:port], as a browser sends it \
                         (e.g. http://localhost:3000), or * for any"
                    ))
                }
            }
        }
        Ok(Cors::Origins(origins))
    }

    /// The layer that answers preflight requests and marks responses, if any origin is allowed.
    fn layer(&self) -> Option<tower_http::cors::CorsLayer> {
        use tower_http::cors::{AllowOrigin, CorsLayer};
        let origin = match self {
            Cors::Off => return None,
            Cors::Any => AllowOrigin::any(),
            // `parse` admits only visible ASCII, which every header value takes.
            Cors::Origins(list) => AllowOrigin::list(list.iter().filter_map(|o| o.parse().ok())),
        };
        Some(
            CorsLayer::new()
                .allow_origin(origin)
                .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
                // Whatever headers the page asks for: OpenAI's clients send `Authorization`
                // (which a `*` would not cover), `Content-Type` and `X-Stainless-*` ones.
                .allow_headers(tower_http::cors::AllowHeaders::mirror_request())
                .max_age(Duration::from_secs(600)),
        )
    }
}

/// The channel to the engine holds this many times `--queue` jobs: the waiting ones, and
/// those whose clients left, until the engine reaches them.
const QUEUED_LEFT_ROOM: usize = 4;

/// What every handler shares.
struct App {
    jobs: SyncSender<Job>,
    /// The most requests waiting for the engine (`--queue`).
    queue: usize,
    tokenizer: Tokenizer,
    defaults: GenerateOptions,
    context: usize,
    model: String,
    system: Option<String>,
    metrics: Arc<Metrics>,
    /// Response ids are `chatcmpl-{run}-{n}`: `run` is drawn at start, so that ids differ
    /// from one run of the server to the next.
    run: u32,
    next_id: AtomicU64,
    /// One request is checked at a time, in the order the handlers asked (tokio's semaphore
    /// is fair), so requests reach the queue in that order and a burst of long prompts does
    /// not take every core from the engine.
    checking: Arc<tokio::sync::Semaphore>,
    /// Unknown request fields already named in the log ([`api::UnknownFields`]).
    unknown: std::sync::Mutex<api::UnknownFields>,
}

/// A listener on `host:port` (port 0: any free port), for [`ServeOptions::listener`].
pub fn listen(host: &str, port: u16) -> Result<std::net::TcpListener> {
    let cannot = |e: std::io::Error| {
        std::io::Error::new(e.kind(), format!("cannot listen on {host}:{port}: {e}"))
    };
    let listener = std::net::TcpListener::bind((host, port)).map_err(cannot)?;
    // Tokio takes over a listener only in non-blocking mode.
    listener.set_nonblocking(true).map_err(cannot)?;
    Ok(listener)
}

/// Serves until SIGINT or SIGTERM; `ready` is called with the bound address.
pub fn serve(
    engine: Engine,
    defaults: GenerateOptions,
    opts: ServeOptions,
    ready: impl FnOnce(std::net::SocketAddr),
) -> Result<()> {
    // Room for jobs whose clients left while queued too: they leave the channel only when
    // the engine reaches them.
    let (jobs, queue) = sync_channel(QUEUED_LEFT_ROOM * opts.queue.max(1));
    let metrics = Arc::new(Metrics::default());
    let abort = Arc::new(AtomicBool::new(false));
    let app = Arc::new(App {
        jobs,
        queue: opts.queue,
        tokenizer: engine.tokenizer.clone(),
        context: engine.target().max_len(),
        defaults,
        model: opts.model.clone(),
        system: opts.system.clone(),
        metrics: metrics.clone(),
        run: rand::random(),
        next_id: AtomicU64::new(1),
        checking: Arc::new(tokio::sync::Semaphore::new(1)),
        unknown: Default::default(),
    });
    let engine_thread = {
        let (metrics, abort) = (metrics.clone(), abort.clone());
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || worker::run(engine, queue, metrics, abort))?
    };
    let router = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(render_metrics))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!("no endpoint {}: this server answers /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics", uri.path()),
            )
        })
        .method_not_allowed_fallback(|method: axum::http::Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{} does not answer {method}", uri.path()),
            )
        })
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(app);
    let router = match opts.cors.layer() {
        Some(cors) => router.layer(cors),
        None => router,
    };
    let loopback = opts.listener.local_addr()?.ip().is_loopback();
    if !loopback && !opts.allowed_hosts.is_empty() {
        eprintln!(
            "cascade: warning: --allow-host changes nothing: the server listens on {}, not a \
             loopback address, and answers every host name",
            opts.listener.local_addr()?.ip()
        );
    }
    let router = match loopback {
        true => router.layer(axum::middleware::from_fn_with_state(
            Arc::new(opts.allowed_hosts.clone()),
            loopback_host,
        )),
        false => router,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let aborting = abort.clone();
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(opts.listener)?;
        ready(listener.local_addr()?);
        let grace = opts.grace;
        let shutdown = async move {
            stop_signal().await;
            eprintln!(
                "cascade: stopping: no new requests; running ones get {} s",
                grace.as_secs_f64()
            );
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                abort.store(true, Ordering::Relaxed);
            });
            // A second signal does not wait for the grace period.
            tokio::spawn(async {
                stop_signal().await;
                eprintln!("cascade: second signal: exiting now");
                std::process::exit(130);
            });
        };
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
    })?;
    // Every connection is closed: what still runs or waits has no client. Stop it at its next
    // chunk or round (the signal handlers are gone with the runtime), then close the queue.
    aborting.store(true, Ordering::Relaxed);
    drop(runtime);
    let _ = engine_thread.join();
    Ok(())
}

async fn stop_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! { _ = interrupt => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

/// 200 while the engine thread runs, 503 once it has ended.
async fn health(State(app): State<Arc<App>>) -> Response {
    match app.metrics.engine_stopped.load(Ordering::Relaxed) {
        false => Json(json!({"status": "ok"})).into_response(),
        true => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "the engine has stopped"})),
        )
            .into_response(),
    }
}

async fn models(State(app): State<Arc<App>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&app)]}))
}

/// `GET /v1/models/{id}`, which clients ask to check that a model is served.
async fn model(
    State(app): State<Arc<App>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Response {
    match id == app.model {
        true => Json(model_object(&app)).into_response(),
        false => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no model `{id}`: this server serves `{}`", app.model),
        )
        .into_response(),
    }
}

fn model_object(app: &App) -> Value {
    json!({"id": app.model, "object": "model", "created": 0, "owned_by": "cascade"})
}

async fn render_metrics(State(app): State<Arc<App>>) -> impl IntoResponse {
    (
        [("content-type", "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}

/// A request body, or the error its reading met (too large, cut off) as OpenAI-style JSON.
type Body = std::result::Result<Bytes, BytesRejection>;

/// The largest request body read: axum's default, set here so that its error can name it.
const BODY_LIMIT: usize = 2 << 20;

fn read(body: Body) -> std::result::Result<Value, ApiError> {
    match body {
        Ok(bytes) => api::body(&bytes),
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => Err(ApiError::new(
            e.status(),
            format!("the request body is larger than this server's limit of {BODY_LIMIT} bytes"),
        )),
        Err(e) => Err(ApiError::new(e.status(), e.body_text())),
    }
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    match json_typed(&headers) {
        Ok(()) => handle(app, Endpoint::Chat, body).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    match json_typed(&headers) {
        Ok(()) => handle(app, Endpoint::Completions, body).await,
        Err(e) => e.into_response(),
    }
}

/// A server bound to a loopback address answers only requests addressed to a local name
/// ([`is_local_name`]), as Ollama's does: a web page whose own host name its DNS turns into 127.0.0.1
/// (DNS rebinding) would otherwise be the server's origin, and read its answers.
/// Names given with `--allow-host` pass too (a reverse proxy's that passes its own on).
async fn loopback_host(
    State(allowed): State<Arc<Vec<String>>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let host = request
        .headers()
        .get(axum::http::header::HOST)
        .map(|v| v.to_str().unwrap_or("?"));
    match host.is_none_or(|h| is_local_name(h, &allowed)) {
        true => next.run(request).await,
        false => ApiError::new(
            StatusCode::FORBIDDEN,
            format!(
                "this server listens on a loopback address and answers requests to an IP \
                 address, localhost or this machine's name only, not to `{}` (`cascade serve \
                 --allow-host NAME` answers another name, such as a reverse proxy's)",
                host.unwrap_or_default()
            ),
        )
        .into_response(),
    }
}

/// Whether a `Host` header may reach a server on a loopback address: an IP address (a page
/// whose origin is an address has no DNS to rebind), `localhost` or a name under it, this
/// machine's name, or one of `allowed`; with or without a port.
fn is_local_name(host: &str, allowed: &[String]) -> bool {
    let name = host_name(host);
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok()
        || allowed.contains(&name)
        || machine_name().is_some_and(|m| m == name)
}

/// The name a `Host` header (or `--allow-host`) gives, lowercase, without a port, the
/// brackets of an IPv6 address or a final dot.
pub fn host_name(host: &str) -> String {
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.split(':').next().unwrap_or(""),
    };
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// This machine's host name (which its own resolver maps to a local address).
fn machine_name() -> Option<&'static str> {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
        Some(host_name(name.trim())).filter(|n| !n.is_empty())
    })
    .as_deref()
}

/// A request body must be declared JSON, as OpenAI's clients declare it: a web page's script
/// may send any site a plain-text POST without asking first (no CORS preflight), which would
/// otherwise start a generation.
fn json_typed(headers: &HeaderMap) -> std::result::Result<(), ApiError> {
    let declared = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let essence = declared.split(';').next().unwrap_or("").trim();
    match essence.eq_ignore_ascii_case("application/json") {
        true => Ok(()),
        false => Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            match declared {
                "" => "the body must be sent with Content-Type: application/json (none was given)"
                    .to_string(),
                _ => format!(
                    "the body must be sent with Content-Type: application/json, not `{declared}`"
                ),
            },
        )),
    }
}

/// Sets the cancel flag when dropped: the handler (or its stream) went away. A job still
/// queued then gives its place back at once, though it leaves the channel only when the
/// engine reaches it.
struct CancelOnDrop {
    cancel: Arc<AtomicBool>,
    ticket: Ticket,
    metrics: Arc<Metrics>,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        if self.ticket.leave() {
            self.metrics.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A checked request: its prompt (and prediction) as tokens, and its settings.
struct Checked {
    prompt: Vec<u32>,
    prediction: Option<Vec<u32>>,
    settings: Settings,
}

/// Checks a request, then queues its job and answers it, streamed or whole. Checking parses,
/// renders and tokenizes, milliseconds of work for a long prompt: it runs on a blocking
/// thread, so the runtime's one thread goes on streaming every other response meanwhile.
async fn handle(app: Arc<App>, endpoint: Endpoint, body: Body) -> Response {
    let arrived = Instant::now();
    let checked = {
        let Ok(turn) = app.checking.clone().acquire_owned().await else {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping")
                .into_response();
        };
        let app = app.clone();
        // The turn goes with the check, which runs on even if this client leaves meanwhile.
        tokio::task::spawn_blocking(move || {
            let _turn = turn;
            check(&app, endpoint, body)
        })
        .await
    };
    match checked {
        Ok(Ok(checked)) => respond(app, endpoint, checked, arrived).await,
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("checking the request failed: {e}"),
        )
        .into_response(),
    }
}

/// The request's fields checked, its chat rendered and its text tokenized.
fn check(app: &App, endpoint: Endpoint, body: Body) -> std::result::Result<Checked, ApiError> {
    let body = read(body)?;
    api::refuse_unsupported(&body)?;
    let (text, settings, field, unknown) = match endpoint {
        Endpoint::Chat => {
            let (req, common, unknown) = api::read::<api::ChatRequest>(&body)?;
            let settings = common.settings()?;
            if app.tokenizer.chat_template().is_none() {
                return Err(ApiError::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "the model has no chat template: use /v1/completions",
                ));
            }
            let turns = req.turns(app.system.as_deref())?;
            let turns: Vec<(&str, &str)> = turns
                .iter()
                .map(|(r, c)| (r.as_str(), c.as_str()))
                .collect();
            let text = crate::chat::render(&app.tokenizer, &turns)
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            (text, settings, "messages", unknown)
        }
        Endpoint::Completions => {
            let (req, common, unknown) = api::read::<api::CompletionRequest>(&body)?;
            let settings = common.settings()?;
            (req.prompt()?, settings, "prompt", unknown)
        }
    };
    let prompt = app
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::invalid(field, e.to_string()))?;
    if prompt.is_empty() {
        return Err(ApiError::invalid(field, "the prompt is empty"));
    }
    if prompt.len() >= app.context {
        return Err(ApiError::invalid(
            field,
            format!("the prompt has {} tokens but the context holds {}, with room for at least one new token needed", prompt.len(), app.context),
        ));
    }
    let prediction = match &settings.prediction {
        Some(p) => {
            let field = "prediction.content";
            let tokens = app
                .tokenizer
                .encode_plain(p)
                .map_err(|e| ApiError::invalid(field, e.to_string()))?;
            // Indexed on the engine's thread before the answer starts: bounded as a prompt is.
            if tokens.len() > app.context {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "the prediction has {} tokens but the context holds {}",
                        tokens.len(),
                        app.context
                    ),
                ));
            }
            Some(tokens)
        }
        None => None,
    };
    // Named once the request is known to run, and each name once.
    if !unknown.is_empty() {
        let mut logged = app.unknown.lock().unwrap_or_else(|e| e.into_inner());
        let new = logged.first_seen(unknown);
        if !new.is_empty() {
            eprintln!("cascade: warning: {}", api::unknown_fields_warning(&new));
        }
    }
    Ok(Checked {
        prompt,
        prediction,
        settings,
    })
}

/// Queues the job of a checked request and answers it, streamed or whole.
async fn respond(
    app: Arc<App>,
    endpoint: Endpoint,
    checked: Checked,
    arrived: Instant,
) -> Response {
    let Checked {
        prompt,
        prediction,
        settings: s,
    } = checked;
    let cancel = Arc::new(AtomicBool::new(false));
    let mut opts = s.options(endpoint, &app.defaults, app.context - prompt.len());
    opts.cancel = Some(cancel.clone());
    let (events, rx) = unbounded_channel();
    let prompt_tokens = prompt.len();
    let ticket = Ticket::default();
    let job = Job {
        prompt,
        opts,
        n: s.n,
        prediction,
        events,
        ticket: ticket.clone(),
    };
    // A place in the queue, among the requests still waiting (not those whose client left).
    let queued = &app.metrics.queued;
    let admitted = queued
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
            (q < app.queue).then_some(q + 1)
        })
        .is_ok();
    let sent = match admitted {
        true => app.jobs.try_send(job),
        false => Err(TrySendError::Full(job)),
    };
    match sent {
        Ok(()) => {}
        Err(e) => {
            if admitted {
                queued.fetch_sub(1, Ordering::Relaxed);
            }
            let (status, message) = match e {
                TrySendError::Full(_) => {
                    app.metrics.rejected();
                    (
                        StatusCode::TOO_MANY_REQUESTS,
                        "the request queue is full; retry later",
                    )
                }
                TrySendError::Disconnected(_) => {
                    (StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped")
                }
            };
            return ApiError::new(status, message).into_response();
        }
    }
    let id = app.next_id.fetch_add(1, Ordering::Relaxed);
    let head = Head {
        id: match endpoint {
            Endpoint::Chat => format!("chatcmpl-{:08x}-{id}", app.run),
            Endpoint::Completions => format!("cmpl-{:08x}-{id}", app.run),
        },
        created: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: app.model.clone(),
        endpoint,
    };
    let guard = CancelOnDrop {
        cancel,
        ticket,
        metrics: app.metrics.clone(),
    };
    if s.stream {
        stream(app, head, rx, s, prompt_tokens, guard, arrived)
    } else {
        whole(app, head, rx, s.n, prompt_tokens, guard, arrived).await
    }
}

/// The fields every response and chunk of one request repeats.
struct Head {
    id: String,
    created: u64,
    model: String,
    endpoint: Endpoint,
}

impl Head {
    fn wrap(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id, "object": self.endpoint.object(chunk), "created": self.created,
            "model": self.model, "choices": choices,
        })
    }
}

async fn whole(
    app: Arc<App>,
    head: Head,
    mut rx: UnboundedReceiver<Event>,
    n: usize,
    prompt_tokens: usize,
    _guard: CancelOnDrop,
    arrived: Instant,
) -> Response {
    let mut outs: Vec<Generation> = Vec::with_capacity(n);
    while let Some(event) = rx.recv().await {
        match event {
            Event::Text { .. } => {}
            Event::Done { generation, .. } => outs.push(*generation),
            Event::Failed(message) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message).into_response()
            }
        }
    }
    if outs.len() < n {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down",
        )
        .into_response();
    }
    let choices = outs
        .iter()
        .enumerate()
        .map(|(i, g)| head.endpoint.choice(i, g))
        .collect();
    let mut body = head.wrap(false, choices);
    body["usage"] = api::usage(prompt_tokens, &outs);
    app.metrics.answered(arrived.elapsed().as_secs_f64());
    Json(body).into_response()
}

fn stream(
    app: Arc<App>,
    head: Head,
    mut rx: UnboundedReceiver<Event>,
    s: Settings,
    prompt_tokens: usize,
    guard: CancelOnDrop,
    arrived: Instant,
) -> Response {
    let (tx, sse) = unbounded_channel::<std::result::Result<Sse, Infallible>>();
    tokio::spawn(async move {
        let _guard = guard; // the client leaving drops `sse`, ends this task, cancels the job
        let send = |mut v: Value| {
            // With `include_usage`, every chunk carries `usage`, null until the last, as
            // OpenAI's do.
            if s.include_usage && v.get("choices").is_some() && v.get("usage").is_none() {
                v["usage"] = Value::Null;
            }
            tx.send(Ok(Sse::default().data(v.to_string()))).is_ok()
        };
        if head.endpoint == Endpoint::Chat {
            let opened = (0..s.n)
                .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null, "logprobs": null}))
                .collect();
            if !send(head.wrap(true, opened)) {
                return;
            }
        }
        let mut outs = Vec::new();
        // A client that leaves ends this task at once, even before the job starts (dropping
        // the guard cancels it), not at the next event.
        while let Some(event) = tokio::select! {
            event = rx.recv() => event,
            _ = tx.closed() => None,
        } {
            let sent = match event {
                Event::Text { index, text } => {
                    send(head.wrap(true, vec![head.endpoint.delta(index, Some(&text), None)]))
                }
                Event::Done { index, generation } => {
                    let reason = api::finish_reason(generation.finish_reason);
                    outs.push(*generation);
                    send(head.wrap(true, vec![head.endpoint.delta(index, None, Some(reason))]))
                }
                Event::Failed(message) => {
                    send(
                        json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}}),
                    );
                    return;
                }
            };
            if !sent {
                return;
            }
        }
        if outs.len() < s.n {
            // Cancelled at shutdown: an error event says the answer was cut off (a stream
            // that merely stopped would read as finished), and no [DONE] follows.
            send(
                json!({"error": {"message": "the server is shutting down: the answer was cut off", "type": "server_error", "param": null, "code": null}}),
            );
            return;
        }
        if s.include_usage {
            let mut last = head.wrap(true, Vec::new());
            last["usage"] = api::usage(prompt_tokens, &outs);
            send(last);
        }
        let _ = tx.send(Ok(Sse::default().data("[DONE]")));
        app.metrics.answered(arrived.elapsed().as_secs_f64());
    });
    axum::response::Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(sse))
        .keep_alive(KeepAlive::default())
        .into_response()
}

/// `v` as a browser writes an origin (`http` or `https`, a host, an optional port; lowercase,
/// the scheme's default port left out), or `None` if it is not one.
fn origin(v: &str) -> Option<String> {
    let v = v.to_ascii_lowercase();
    let (scheme, rest) = v.split_once("://")?;
    let default_port = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    if rest.contains(['/', '?', '#', '@']) || !rest.chars().all(|c| c.is_ascii_graphic()) {
        return None;
    }
    // The host, then an optional port (an IPv6 host is in brackets).
    let (host, port) = match rest.strip_prefix('[') {
        Some(inner) => {
            let (ip, after) = inner.split_once(']')?;
            if ip.is_empty() || ip.contains('[') {
                return None;
            }
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':')?),
            };
            (format!("[{ip}]"), port)
        }
        None => {
            let (host, port) = match rest.split_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (rest, None),
            };
            if host.is_empty() || host.contains(['[', ']']) {
                return None;
            }
            (host.to_string(), port)
        }
    };
    match port {
        None => Some(format!("{scheme}://{host}")),
        Some(p) => {
            let port: u16 = p
                .parse()
                .ok()
                .filter(|&n| n > 0 && p.bytes().all(|b| b.is_ascii_digit()))?;
            Some(match port == default_port {
                true => format!("{scheme}://{host}"),
                false => format!("{scheme}://{host}:{port}"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{host_name, is_local_name, Cors};

    fn parse(values: &[&str]) -> Result<Cors, String> {
        let values: Vec<String> = values.iter().map(|v| v.to_string()).collect();
        Cors::parse(&values).map_err(|e| e.to_string())
    }

    #[test]
    fn local_names_are_told_from_others() {
        for host in [
            "localhost",
            "LOCALHOST:8080",
            "127.0.0.1:8080",
            "127.1.2.3",
            "[::1]:80",
            "a.localhost",
            "localhost.",
        ] {
            assert!(is_local_name(host, &[]), "{host}");
        }
        // Addresses cannot be rebound: any address passes.
        for host in [
            "192.168.1.2:80",
            "0.0.0.0:8080",
            "[::ffff:127.0.0.1]:80",
            "[::1]",
        ] {
            assert!(is_local_name(host, &[]), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "",
            "?",
        ] {
            assert!(!is_local_name(host, &[]), "{host}");
        }
        // A name given with --allow-host, as `host_name` reads it.
        let proxy = [host_name("Proxy.Example.:443")];
        assert!(is_local_name("proxy.example:8080", &proxy));
        assert!(!is_local_name("evil.example", &proxy));
    }

    #[test]
    fn cors_origins_are_parsed_or_refused_with_the_reason() {
        assert_eq!(parse(&[]), Ok(Cors::Off));
        assert_eq!(parse(&["*"]), Ok(Cors::Any));
        assert_eq!(
            parse(&["http://localhost:3000", "https://chat.example.org"]),
            Ok(Cors::Origins(vec![
                "http://localhost:3000".into(),
                "https://chat.example.org".into()
            ]))
        );
        assert_eq!(
            parse(&["http://localhost:3000", "*"]),
            Err("--cors: `*` allows any origin: give it alone".into())
        );
        let not_an_origin = |v: &str| {
            format!(
                "--cors: `{v}` is not an origin: scheme://host[:port], as a browser sends it \
                 (e.g. http://localhost:3000), or * for any"
            )
        };
        for v in [
            "localhost:3000",
            "http://",
            "http://localhost:3000/",
            "https://example.org/chat",
            "ftp://example.org",
            "http://exa mple.org",
            "http://user@example.org",
            "http://localhost:",
            "http://localhost:abc",
            "http://localhost:0",
            "http://localhost:65536",
            "http://localhost:+80",
            "http://[::1",
            "http://[]:80",
            "http://[::1]x",
        ] {
            assert_eq!(parse(&[v]), Err(not_an_origin(v)), "{v}");
        }
        // As a browser writes them: lowercase, without the scheme's default port.
        for (given, origin) in [
            ("HTTP://LocalHost:3000", "http://localhost:3000"),
            ("https://example.org:443", "https://example.org"),
            ("http://example.org:80", "http://example.org"),
            ("http://example.org:443", "http://example.org:443"),
            ("http://[::1]:8080", "http://[::1]:8080"),
            ("http://[::1]", "http://[::1]"),
            ("http://127.0.0.1:03000", "http://127.0.0.1:3000"),
        ] {
            assert_eq!(
                parse(&[given]),
                Ok(Cors::Origins(vec![origin.into()])),
                "{given}"
            );
        }
    }
}
