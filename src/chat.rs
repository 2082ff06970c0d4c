//! Chat templates: the model's own Jinja template from its GGUF, rendered with minijinja as
//! Hugging Face renders it (blocks trimmed, Python's string and dict methods, `bos_token`,
//! `eos_token` and `strftime_now`, in UTC).

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
        Error::ChatTemplate(
            "the model has no chat template (tokenizer.chat_template): give the prompt as raw \
             text (`--no-chat`; `chat = false` under [generation]; `\"chat\": false` on a \
             bench suite's line)"
                .into(),
        )
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
    // Hugging Face defines it (Llama 3.x templates date their system turn with it).
    env.add_function(
        "strftime_now",
        |format: String| -> std::result::Result<String, minijinja::Error> {
            strftime(&format, std::time::SystemTime::now())
                .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e))
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

/// `time` (UTC) formatted by the `strftime` directives chat templates use: `%Y %y %m %d %e %b
/// %B %a %A %H %M %S %j %%`.
fn strftime(format: &str, time: std::time::SystemTime) -> std::result::Result<String, String> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let secs = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "the clock is before 1970".to_string())?
        .as_secs();
    let days = secs / 86_400;
    // humantime's RFC 3339 date gives the civil date without a calendar of our own.
    let date = humantime::format_rfc3339_seconds(time).to_string();
    let num = |r: std::ops::Range<usize>| date[r].parse::<usize>().expect("RFC 3339 digits");
    let (year, month, day) = (num(0..4), num(5..7), num(8..10));
    let year_start = humantime::parse_rfc3339(&format!("{year}-01-01T00:00:00Z"))
        .expect("a valid date")
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
        / 86_400;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let month_name = MONTHS[month - 1];
        let day_name = DAYS[(days % 7) as usize];
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year % 100),
            Some('m') => out += &format!("{month:02}"),
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:2}"),
            Some('b') => out += &month_name[..3],
            Some('B') => out += month_name,
            Some('a') => out += &day_name[..3],
            Some('A') => out += day_name,
            Some('H') => out += &date[11..13],
            Some('M') => out += &date[14..16],
            Some('S') => out += &date[17..19],
            Some('j') => out += &format!("{:03}", days - year_start + 1),
            Some('%') => out.push('%'),
            Some(other) => return Err(format!("strftime_now: `%{other}` is not supported")),
            None => return Err("strftime_now: the format ends with `%`".into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::strftime;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn strftime_formats_as_python_does() {
        // 2024-02-29 13:05:09 UTC, a Thursday (Python: datetime(2024, 2, 29, 13, 5, 9)).
        let t = UNIX_EPOCH + Duration::from_secs(1_709_211_909);
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "29 Feb 2024");
        assert_eq!(
            strftime("%A, %B %e %y %H:%M:%S day %j %a %m %%", t).unwrap(),
            "Thursday, February 29 24 13:05:09 day 060 Thu 02 %"
        );
        assert_eq!(strftime("%d", UNIX_EPOCH).unwrap(), "01");
        assert_eq!(
            strftime("%Z", t).unwrap_err(),
            "strftime_now: `%Z` is not supported"
        );
    }
}
