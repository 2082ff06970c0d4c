//! The OpenAI wire format: requests parsed and checked field by field, responses and
//! stream chunks built, errors as OpenAI-style JSON.

use crate::engine::{FinishReason, GenerateOptions, Generation};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::HashSet;

/// An error answered as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    /// A 400 naming the offending field.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            param: Some(param.to_string()),
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_exceeded",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        };
        let body = json!({"error": {
            "message": self.message, "type": kind, "param": self.param, "code": null,
        }});
        // OpenAI's clients retry a 5xx (twice, by default) unless told not to: what this
        // server does not implement will not work the next time either; a full queue may.
        let header = match self.status {
            StatusCode::NOT_IMPLEMENTED => Some(("x-should-retry", "false")),
            StatusCode::TOO_MANY_REQUESTS => Some(("retry-after", "1")),
            _ => None,
        };
        (self.status, header.map(|h| [h]), axum::Json(body)).into_response()
    }
}

/// Text given as a string or as an array of `{"type": "text", "text": ...}` parts.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "must be a string or an array of {\"type\": \"text\", \"text\": ...} parts"
)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// A completion's prompt: [`Content`], under an error that says what is not supported.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "must be a string or an array of {\"type\": \"text\", \"text\": ...} parts (lists of prompts and token ids are not supported)"
)]
pub enum Prompt {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// The text of text parts, joined by line breaks (as vLLM and llama.cpp's server join them).
fn parts_text(parts: &[Part], at: &str) -> Result<String, ApiError> {
    let texts = parts
        .iter()
        .enumerate()
        .map(|(i, p)| match (p.kind.as_str(), &p.text) {
            ("text", Some(text)) => Ok(text.as_str()),
            ("text", None) => Err(ApiError::invalid(
                &format!("{at}[{i}].text"),
                "a text part needs its `text`",
            )),
            (other, _) => Err(ApiError::invalid(
                &format!("{at}[{i}].type"),
                format!("only text parts are supported, got `{other}`"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(texts.join("\n"))
}

impl Content {
    fn text(&self, at: &str) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Parts(parts) => parts_text(parts, at),
        }
    }
}

#[derive(Deserialize)]
pub struct Message {
    pub role: String,
    /// `null` in an assistant turn that only called tools, as clients replay it.
    pub content: Option<Content>,
    /// An assistant turn's tool calls: refused unless empty (this server takes no tools, and
    /// dropping them would render another conversation than the one sent).
    #[serde(default)]
    pub tool_calls: Option<Value>,
}

/// Any 64-bit integer, as OpenAI takes it, or an unsigned one as the CLI and configs take it
/// (a negative one stands for its two's complement).
#[derive(Deserialize)]
#[serde(untagged, expecting = "must be a 64-bit integer")]
pub enum Seed {
    Signed(i64),
    Unsigned(u64),
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "must be a string or an array of strings")]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct Prediction {
    #[serde(rename = "type")]
    pub kind: String,
    pub content: Content,
}

#[derive(Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// The fields both endpoints share; unknown fields are ignored, as OpenAI clients send
/// many this server has no use for (`model` among them: one server serves one model set),
/// and logged if not known to change nothing ([`read`]).
#[derive(Deserialize)]
pub struct Common {
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<Seed>,
    pub stop: Option<Stop>,
    pub n: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub prediction: Option<Prediction>,
}

#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
}

/// Reads a JSON object body.
pub fn body(bytes: &[u8]) -> Result<Value, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
        )),
        Err(e) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("malformed JSON body: {e}"),
        )),
    }
}

/// Reads the fields `T` knows from a body, with the top-level fields it skipped; a missing
/// field or one of the wrong type is named by its path.
fn parse<T: serde::de::DeserializeOwned>(body: &Value) -> Result<(T, HashSet<String>), ApiError> {
    let mut skipped = HashSet::new();
    let mut note = |path: serde_ignored::Path| {
        if let serde_ignored::Path::Map {
            parent: serde_ignored::Path::Root,
            key,
        } = path
        {
            skipped.insert(key);
        }
    };
    let tracked = serde_ignored::Deserializer::new(body, &mut note);
    let read = serde_path_to_error::deserialize(tracked).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        match path.as_str() {
            "." => {
                // serde names a missing field in its message only: `param` names it too.
                let missing = inner
                    .strip_prefix("missing field `")
                    .and_then(|f| f.split('`').next());
                ApiError {
                    param: missing.map(str::to_string),
                    ..ApiError::new(StatusCode::BAD_REQUEST, inner.as_str())
                }
            }
            _ => ApiError::invalid(&path, inner),
        }
    })?;
    Ok((read, skipped))
}

/// Reads a request body: the endpoint's fields `R`, the [`Common`] ones, and the top-level
/// fields neither reads that are neither refused ([`refuse_unsupported`]) nor OpenAI fields
/// known to change nothing here (`model`, `user`, `metadata`, ...): most likely a typo
/// (`temprature`), which would otherwise leave the config's value in place unnoticed. The
/// request still runs with those, as OpenAI clients send fields newer than this server; the
/// server logs them.
pub fn read<R: serde::de::DeserializeOwned>(
    body: &Value,
) -> Result<(R, Common, Vec<&str>), ApiError> {
    const NO_EFFECT: [&str; 11] = [
        "model",
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "tool_choice",
        "function_call",
        "reasoning_effort",
        "prompt_cache_key",
        "safety_identifier",
    ];
    let (request, skipped) = parse::<R>(body)?;
    let (common, skipped_too) = parse::<Common>(body)?;
    let unknown = body.as_object().map_or_else(Vec::new, |o| {
        o.keys()
            .map(String::as_str)
            .filter(|&k| skipped.contains(k) && skipped_too.contains(k))
            .filter(|k| !NO_EFFECT.contains(k) && !UNSUPPORTED.contains(k))
            .collect()
    });
    Ok((request, common, unknown))
}

/// OpenAI fields this server does not implement ([`refuse_unsupported`]).
const UNSUPPORTED: [&str; 11] = [
    "logprobs",
    "top_logprobs",
    "echo",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "response_format",
    "tools",
    "functions",
    "best_of",
    "suffix",
];

/// Refuses the OpenAI fields this server does not implement. Clients send many of them with values that
/// ask for nothing (`"logprobs": false`, `"presence_penalty": 0`), which pass; any other value
/// is refused, since ignoring it would answer another request than the one sent.
pub fn refuse_unsupported(body: &Value) -> Result<(), ApiError> {
    let asks_nothing = |field: &str, v: &Value| {
        v.is_null()
            || match field {
                "logprobs" | "echo" => v == &Value::Bool(false),
                "top_logprobs" | "presence_penalty" | "frequency_penalty" => {
                    v.as_f64() == Some(0.0)
                }
                "logit_bias" => v.as_object().is_some_and(|o| o.is_empty()),
                "tools" | "functions" => v.as_array().is_some_and(|a| a.is_empty()),
                "response_format" => v.get("type").and_then(Value::as_str) == Some("text"),
                "best_of" => v.as_u64() == Some(1),
                "suffix" => v.as_str() == Some(""),
                _ => false,
            }
    };
    match UNSUPPORTED
        .iter()
        .find(|&&f| body.get(f).is_some_and(|v| !asks_nothing(f, v)))
    {
        Some(field) => Err(ApiError::invalid(field, "not supported by this server")),
        None => Ok(()),
    }
}

/// The unknown field names a server has logged: each is named once (a client that sends the
/// same odd field with every request would otherwise fill the log), the first 1,024 names.
#[derive(Default)]
pub struct UnknownFields(std::collections::HashSet<String>);

impl UnknownFields {
    /// Those of `fields` not logged before, now counted as logged.
    pub fn first_seen<'a>(&mut self, fields: Vec<&'a str>) -> Vec<&'a str> {
        fields
            .into_iter()
            .filter(|f| self.0.len() < 1024 && self.0.insert(f.to_string()))
            .collect()
    }
}

/// The log line naming a request's unknown fields ([`read`]): quoted and escaped (a client's field
/// name could hold a line break), at most 8 of them, each cut to 64 characters.
pub fn unknown_fields_warning(fields: &[&str]) -> String {
    let mut names: Vec<String> = fields
        .iter()
        .take(8)
        .map(|f| format!("{:?}", f.chars().take(64).collect::<String>()))
        .collect();
    if fields.len() > 8 {
        names.push(format!("and {} more", fields.len() - 8));
    }
    format!(
        "a request's fields unknown to this server were ignored: {}",
        names.join(", ")
    )
}

/// The checked settings of one request.
pub struct Settings {
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    /// The request's stop strings; `None` keeps the config's.
    pub stop: Option<Vec<String>>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub prediction: Option<String>,
}

/// The most choices one request may ask for.
pub const MAX_N: usize = 8;

/// A completion's token limit when it gives none (OpenAI's, and vLLM's).
pub const COMPLETION_TOKENS: usize = 16;

/// The longest stop string a request may give.
pub const MAX_STOP_BYTES: usize = 1024;

impl Settings {
    /// The generation options of a request to `endpoint`: its settings where it gives them,
    /// the config's (`defaults`) elsewhere, but a seed of its own if it gives none (sampled
    /// requests differ), and as OpenAI's, a chat without a token limit goes on until the
    /// context's end, a completion stops at 16 tokens: at most `room` new tokens.
    pub fn options(
        &self,
        endpoint: Endpoint,
        defaults: &GenerateOptions,
        room: usize,
    ) -> GenerateOptions {
        let unset = match endpoint {
            Endpoint::Chat => room,
            Endpoint::Completions => COMPLETION_TOKENS,
        };
        let mut opts = defaults.clone();
        opts.max_new_tokens = self.max_tokens.unwrap_or(unset).min(room);
        opts.sampling.temperature = self.temperature.unwrap_or(opts.sampling.temperature);
        opts.sampling.top_p = self.top_p.unwrap_or(opts.sampling.top_p);
        opts.sampling.top_k = self.top_k.unwrap_or(opts.sampling.top_k);
        opts.seed = self.seed.unwrap_or_else(rand::random);
        if let Some(stop) = &self.stop {
            opts.stop = stop.clone();
        }
        opts
    }
}

impl Common {
    pub fn settings(&self) -> Result<Settings, ApiError> {
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some(("max_completion_tokens", m)),
            (None, Some(m)) => Some(("max_tokens", m)),
            (None, None) => None,
        };
        if let Some((field, m)) = max_tokens {
            // The bound of a config's `max_new_tokens` and of the CLI's `-n`.
            let most = crate::config::MAX_CONTEXT as u64;
            if !(1..=most).contains(&m) {
                return Err(ApiError::invalid(
                    field,
                    format!("must be between 1 and {most}, got {m}"),
                ));
            }
        }
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(
                    "temperature",
                    format!("must be between 0 and 2, got {t}"),
                ));
            }
            if t > 0.0 && t < f32::MIN_POSITIVE {
                return Err(ApiError::invalid(
                    "temperature",
                    format!("{t:e} is too small to divide by; use 0 for greedy decoding"),
                ));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(
                    "top_p",
                    format!("must be in (0, 1], got {p}"),
                ));
            }
        }
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(ApiError::invalid(
                "n",
                format!("must be between 1 and {MAX_N}, got {n}"),
            ));
        }
        let stop = match &self.stop {
            None => None,
            Some(Stop::One(s)) => Some(vec![s.clone()]),
            Some(Stop::Many(v)) => Some(v.clone()),
        };
        if let Some(stop) = &stop {
            if stop.len() > 4 {
                return Err(ApiError::invalid("stop", "at most 4 stop strings"));
            }
            if stop.iter().any(String::is_empty) {
                return Err(ApiError::invalid("stop", "a stop string is empty"));
            }
            // Each token's text is checked against every prefix of every stop string.
            if stop.iter().any(|s| s.len() > MAX_STOP_BYTES) {
                return Err(ApiError::invalid(
                    "stop",
                    format!("a stop string is longer than {MAX_STOP_BYTES} bytes"),
                ));
            }
        }
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid(
                "stream_options",
                "is read only with \"stream\": true",
            ));
        }
        let prediction = match &self.prediction {
            None => None,
            Some(p) if p.kind == "content" => Some(p.content.text("prediction.content")?),
            Some(p) => {
                return Err(ApiError::invalid(
                    "prediction.type",
                    format!("must be \"content\", got `{}`", p.kind),
                ))
            }
        };
        Ok(Settings {
            max_tokens: max_tokens.map(|(_, m)| m.min(usize::MAX as u64) as usize),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed.as_ref().map(|s| match *s {
                Seed::Signed(s) => s as u64,
                Seed::Unsigned(s) => s,
            }),
            stop,
            n,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage == Some(true)),
            prediction,
        })
    }
}

impl ChatRequest {
    /// The conversation as `(role, content)` turns, opened by `system` (the config's) if it
    /// has no system turn of its own.
    pub fn turns(&self, system: Option<&str>) -> Result<Vec<(String, String)>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "must hold at least one message",
            ));
        }
        self.messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let role = match m.role.as_str() {
                    "developer" => "system",
                    r @ ("system" | "user" | "assistant") => r,
                    other => {
                        return Err(ApiError::invalid(
                            &format!("messages[{i}].role"),
                            format!("must be system, developer, user or assistant, got `{other}`"),
                        ))
                    }
                };
                if m.tool_calls
                    .as_ref()
                    .is_some_and(|c| c.as_array().is_none_or(|a| !a.is_empty()))
                {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].tool_calls"),
                        "not supported by this server (it takes no tools)",
                    ));
                }
                let at = format!("messages[{i}].content");
                let content = match &m.content {
                    Some(c) => c.text(&at)?,
                    None if role == "assistant" => String::new(),
                    None => return Err(ApiError::invalid(&at, "is missing or null")),
                };
                Ok((role.to_string(), content))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|mut turns| {
                if let Some(system) = system.filter(|_| turns.iter().all(|t| t.0 != "system")) {
                    turns.insert(0, ("system".into(), system.into()));
                }
                turns
            })
    }
}

impl CompletionRequest {
    pub fn prompt(&self) -> Result<String, ApiError> {
        match &self.prompt {
            Prompt::Text(t) => Ok(t.clone()),
            Prompt::Parts(parts) => parts_text(parts, "prompt"),
        }
    }
}

/// OpenAI's finish reasons.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Eos | FinishReason::Stop | FinishReason::Cancelled => "stop",
    }
}

/// The `usage` object, with the speculative counters beside OpenAI's. `cached_tokens` are
/// the prompt tokens the first choice found in the cache (later choices find all of them).
pub fn usage(prompt_tokens: usize, outs: &[Generation]) -> Value {
    let sum = |f: fn(&Generation) -> usize| outs.iter().map(f).sum::<usize>();
    let completion = sum(|g| g.stats.generated_tokens);
    let cached = outs.first().map_or(0, |g| g.stats.cached_tokens);
    json!({
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "drafted_tokens": sum(|g| g.stats.drafted),
        "accepted_tokens": sum(|g| g.stats.accepted),
        "target_calls": sum(|g| g.stats.target_calls),
    })
}

/// Which endpoint a response is for: the object names and the shape of a choice differ.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    /// A whole choice of a non-streamed response.
    pub fn choice(self, index: usize, g: &Generation) -> Value {
        let reason = finish_reason(g.finish_reason);
        match self {
            Endpoint::Chat => json!({
                "index": index, "finish_reason": reason, "logprobs": null,
                "message": {"role": "assistant", "content": g.text},
            }),
            Endpoint::Completions => json!({
                "index": index, "finish_reason": reason, "logprobs": null, "text": g.text,
            }),
        }
    }

    /// A streamed choice: a piece of text, or the end with its reason.
    pub fn delta(self, index: usize, text: Option<&str>, reason: Option<&str>) -> Value {
        match self {
            Endpoint::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "finish_reason": reason, "logprobs": null})
            }
            Endpoint::Completions => json!({
                "index": index, "text": text.unwrap_or(""), "finish_reason": reason, "logprobs": null,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(body: &str) -> Settings {
        let r: Common = serde_json::from_str(body).unwrap();
        r.settings().unwrap_or_else(|e| panic!("{}", e.message))
    }

    #[test]
    fn a_missing_or_mistyped_field_is_the_errors_param() {
        let error = |body: &str| {
            read::<ChatRequest>(&serde_json::from_str(body).unwrap())
                .err()
                .unwrap()
        };
        let e = error(r#"{"model": "m"}"#);
        assert_eq!(
            (e.message.as_str(), e.param.as_deref()),
            ("missing field `messages`", Some("messages"))
        );
        let e = error(r#"{"messages": 3}"#);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(
            e.message.starts_with("messages: invalid type: integer `3`"),
            "{}",
            e.message
        );
    }

    #[test]
    fn the_configs_system_prompt_opens_a_chat_without_one() {
        let chat = |body: &str| {
            let r: ChatRequest = serde_json::from_str(body).unwrap();
            r.turns(Some("Be brief.")).unwrap()
        };
        let user = r#"{"messages": [{"role": "user", "content": "hi"}]}"#;
        assert_eq!(
            chat(user),
            [
                ("system".into(), "Be brief.".into()),
                ("user".into(), "hi".into())
            ]
        );
        let own = r#"{"messages": [{"role": "developer", "content": "Be long."}, {"role": "user", "content": "hi"}]}"#;
        assert_eq!(
            chat(own),
            [
                ("system".into(), "Be long.".into()),
                ("user".into(), "hi".into())
            ]
        );
    }

    /// Text parts are joined by line breaks; a part without its text, a `null` content but an
    /// assistant's, and `stream_options` without streaming are refused.
    #[test]
    fn message_contents_read_as_clients_send_them() {
        let turns = |body: Value| {
            read::<ChatRequest>(&body)
                .and_then(|(r, ..)| r.turns(None))
                .map_err(|e| e.message)
        };
        let parts = serde_json::json!({"messages": [{"role": "user", "content":
            [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null}]});
        assert_eq!(
            turns(parts),
            Ok(vec![
                ("user".into(), "Say\nhi".into()),
                ("assistant".into(), String::new())
            ])
        );
        let no_text =
            serde_json::json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]});
        assert_eq!(
            turns(no_text),
            Err("messages[0].content[0].text: a text part needs its `text`".into())
        );
        let calls = serde_json::json!({"messages": [{"role": "assistant", "content": null,
            "tool_calls": [{"id": "1", "type": "function"}]}]});
        assert_eq!(
            turns(calls),
            Err("messages[0].tool_calls: not supported by this server (it takes no tools)".into())
        );
        let none = serde_json::json!({"messages": [{"role": "assistant", "content": "a",
            "tool_calls": []}, {"role": "user", "content": "b", "tool_calls": null}]});
        assert!(turns(none).is_ok());
        let null = serde_json::json!({"messages": [{"role": "user", "content": null}]});
        assert_eq!(
            turns(null),
            Err("messages[0].content: is missing or null".into())
        );
        let r: Common =
            serde_json::from_str(r#"{"stream_options": {"include_usage": true}}"#).unwrap();
        assert_eq!(
            r.settings().err().map(|e| e.message).as_deref(),
            Some("stream_options: is read only with \"stream\": true")
        );
    }

    #[test]
    fn a_prompt_list_is_refused_with_what_is_accepted() {
        let body = serde_json::json!({"prompt": ["a", "b"]});
        let e = read::<CompletionRequest>(&body).err().unwrap();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "prompt: must be a string or an array of {\"type\": \"text\", \"text\": ...} parts (lists of prompts and token ids are not supported)"
        );
    }

    #[test]
    fn unset_settings_take_the_configs_values_but_the_seed() {
        let mut defaults = GenerateOptions {
            stop: vec!["\n\n".into()],
            max_new_tokens: 100,
            ..Default::default()
        };
        defaults.sampling.temperature = 0.7;
        let o = settings(r#"{"prompt": "x"}"#).options(Endpoint::Chat, &defaults, 500);
        assert_eq!(o.stop, ["\n\n"]);
        assert_eq!(o.sampling.temperature, 0.7);
        // A seed of its own: two sampled requests differ.
        let other = settings(r#"{"prompt": "x"}"#).options(Endpoint::Chat, &defaults, 500);
        assert_ne!(o.seed, other.seed);
        // No limit but the context's room, as OpenAI's, not the config's 100.
        assert_eq!(o.max_new_tokens, 500);
        let body = r#"{"prompt": "x", "stop": ["END"], "temperature": 0, "max_tokens": 7}"#;
        let o = settings(body).options(Endpoint::Chat, &defaults, 500);
        assert_eq!(o.stop, ["END"]);
        assert_eq!(o.sampling.temperature, 0.0);
        assert_eq!(o.max_new_tokens, 7);
        assert_eq!(
            settings(r#"{"max_tokens": 900}"#)
                .options(Endpoint::Chat, &defaults, 500)
                .max_new_tokens,
            500
        );
        // A negative seed, which OpenAI takes, is a seed too.
        assert_eq!(
            settings(r#"{"seed": -1}"#)
                .options(Endpoint::Chat, &defaults, 500)
                .seed,
            u64::MAX
        );
        let most = r#"{"seed": 18446744073709551615}"#;
        assert_eq!(
            settings(most).options(Endpoint::Chat, &defaults, 500).seed,
            u64::MAX
        );
        // A completion without a limit takes OpenAI's 16 tokens.
        let completion = settings(r#"{"prompt": "x"}"#);
        assert_eq!(
            completion
                .options(Endpoint::Completions, &defaults, 500)
                .max_new_tokens,
            16
        );
    }

    /// A token limit is checked as a config's `max_new_tokens` and the CLI's `-n` are, under
    /// either name.
    #[test]
    fn a_token_limit_out_of_range_is_refused() {
        let refused = |body: &str| {
            let r: Common = serde_json::from_str(body).unwrap();
            r.settings().err().map(|e| e.message)
        };
        assert_eq!(
            refused(r#"{"max_tokens": 0}"#).as_deref(),
            Some("max_tokens: must be between 1 and 16777216, got 0")
        );
        assert_eq!(
            refused(r#"{"max_completion_tokens": 16777217}"#).as_deref(),
            Some("max_completion_tokens: must be between 1 and 16777216, got 16777217")
        );
        assert_eq!(refused(r#"{"max_tokens": 16777216}"#), None);
    }

    #[test]
    fn unsupported_fields_are_refused_unless_they_ask_for_nothing() {
        let check = |body: Value| refuse_unsupported(&body).map_err(|e| e.message);
        let neutral = serde_json::json!({"prompt": "x", "logprobs": false, "echo": null,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [],
            "response_format": {"type": "text"}, "best_of": 1, "suffix": "", "top_logprobs": 0});
        assert_eq!(check(neutral), Ok(()));
        for (field, value) in [
            ("logprobs", serde_json::json!(5)),
            ("logprobs", serde_json::json!(true)),
            ("echo", serde_json::json!(true)),
            ("logit_bias", serde_json::json!({"50256": -100})),
            ("presence_penalty", serde_json::json!(0.5)),
            (
                "response_format",
                serde_json::json!({"type": "json_object"}),
            ),
            ("tools", serde_json::json!([{"type": "function"}])),
            ("best_of", serde_json::json!(3)),
            ("suffix", serde_json::json!("}")),
        ] {
            let body = serde_json::json!({"prompt": "x", field: value});
            assert_eq!(
                check(body),
                Err(format!("{field}: not supported by this server"))
            );
        }
    }

    #[test]
    fn only_fields_unknown_to_the_server_are_named_as_ignored() {
        // Only top-level fields count: `stream` is read, though `stream_options.stream` is not.
        let body = serde_json::json!({"model": "x", "messages": [], "temprature": 0.2,
            "user": "u", "logprobs": false, "stream": true, "top-p": 0.5,
            "stream_options": {"include_usage": true, "stream": 1}});
        fn unknown<R: serde::de::DeserializeOwned>(body: &Value) -> Vec<&str> {
            match read::<R>(body) {
                Ok((.., unknown)) => unknown,
                Err(e) => panic!("{}", e.message),
            }
        }
        let mut named = unknown::<ChatRequest>(&body);
        named.sort();
        assert_eq!(named, ["temprature", "top-p"]);
        // Every field the endpoints read is known: a field added to a request struct needs
        // no list kept beside it.
        let every = serde_json::json!({"prompt": "x", "max_tokens": 1,
            "max_completion_tokens": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 4,
            "seed": 1, "stop": "x", "n": 2, "stream": true,
            "stream_options": {"include_usage": true},
            "prediction": {"type": "content", "content": "x"}});
        assert!(unknown::<CompletionRequest>(&every).is_empty());
        // A chat's `prompt` is not read: unknown to that endpoint.
        let completion = serde_json::json!({"prompt": "x", "messages": []});
        assert_eq!(unknown::<ChatRequest>(&completion), ["prompt"]);
        assert_eq!(
            unknown_fields_warning(&["temprature", "a\nb"]),
            r#"a request's fields unknown to this server were ignored: "temprature", "a\nb""#
        );
        // Each name is logged once.
        let mut logged = UnknownFields::default();
        assert_eq!(
            logged.first_seen(vec!["temprature", "top-p"]),
            ["temprature", "top-p"]
        );
        assert_eq!(
            logged.first_seen(vec!["top-p", "tempreature"]),
            ["tempreature"]
        );
        assert!(logged.first_seen(vec!["temprature"]).is_empty());
        let many: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(unknown_fields_warning(&many).ends_with(r#""f7", and 2 more"#));
    }

    #[test]
    fn nulls_mean_unset_and_an_undividable_temperature_is_the_clients_error() {
        let s = settings(r#"{"stream": null, "stream_options": null}"#);
        assert!(!s.stream && !s.include_usage);
        let s = settings(r#"{"stream": true, "stream_options": {"include_usage": null}}"#);
        assert!(s.stream && !s.include_usage);
        let s = settings(r#"{"stream": true, "stream_options": {"include_usage": true}}"#);
        assert!(s.stream && s.include_usage);
        let long = format!(r#"{{"stop": "{}"}}"#, "x".repeat(1025));
        let r: Common = serde_json::from_str(&long).unwrap();
        let e = r.settings().err().unwrap();
        assert_eq!(e.message, "stop: a stop string is longer than 1024 bytes");
        let r: Common = serde_json::from_str(r#"{"temperature": 1e-40}"#).unwrap();
        let e = r.settings().err().unwrap();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "temperature: 1e-40 is too small to divide by; use 0 for greedy decoding"
        );
    }
}
