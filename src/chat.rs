//! Chat templates: the model's own Jinja template from its GGUF, rendered with minijinja as
//! Hugging Face renders it (blocks trimmed, Python's string and dict methods, `bos_token` and
//! `eos_token`).

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use serde::Serialize;

#[derive(Serialize)]
struct Message<'a> {
    role: &'a str,
    content: &'a str,
}

/// Wraps `prompt` as one user turn (after an optional system turn) in the tokenizer's chat
/// template, ending with the assistant's turn opened.
pub fn apply(tokenizer: &Tokenizer, system: Option<&str>, prompt: &str) -> Result<String> {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(("system", s));
    }
    messages.push(("user", prompt));
    render(tokenizer, &messages)
}

/// Renders a conversation of `(role, content)` turns in the tokenizer's chat template, ending
/// with the assistant's turn opened.
pub fn render(tokenizer: &Tokenizer, turns: &[(&str, &str)]) -> Result<String> {
    let template = tokenizer.chat_template().ok_or_else(|| {
        Error::ChatTemplate("the model has no chat template (tokenizer.chat_template)".into())
    })?;
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| Error::ChatTemplate(format!("cannot parse: {e}")))?;
    let messages: Vec<Message> = turns
        .iter()
        .map(|&(role, content)| Message { role, content })
        .collect();
    env.get_template("chat")
        .and_then(|t| {
            t.render(minijinja::context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => tokenizer.bos_token().unwrap_or(""),
                eos_token => tokenizer.eos_token().unwrap_or(""),
            })
        })
        .map_err(|e| Error::ChatTemplate(format!("cannot render: {e}")))
}
