//! The server's engine survives a bug: a panic while generating fails that request with 500,
//! empties the caches it may have left half-updated, and the next request is served.
//! (`scripts/test-server.sh` checks the server from outside with the real models and the
//! official OpenAI client; a panic cannot be caused from there.)

mod common;

use cascade::draft::{Draft, Drafter, Request};
use cascade::engine::{Engine, GenerateOptions};
use cascade::server::{serve, Cors, ServeOptions};
use common::{toy_tokenizer, ToyModel};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// Drafts nothing, and panics on the text `t1 t2 t3 t4 t5` (a bug one request meets; the toy
/// target, deterministic, does not answer `t1 t2 t3 t4` with `t5`).
struct PanicsOnOneText;

impl Drafter for PanicsOnOneText {
    fn name(&self) -> &str {
        "panics"
    }

    fn draft(&mut self, context: &[u32], _: &mut Request) -> cascade::Result<Draft> {
        assert!(context != [1, 2, 3, 4, 5], "a drafter bug");
        Ok(Draft::new())
    }
}

/// The status and JSON body of a request to the server at `addr`.
fn call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    // The answer is sent whole or in chunks: the JSON document is what lies between braces.
    let json = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
    (status, serde_json::from_str(json).unwrap())
}

#[test]
fn a_panic_fails_its_request_empties_the_caches_and_the_server_goes_on() {
    let engine = Engine::new(
        Box::new(ToyModel::new(5, 8, 3.0)),
        Some(Box::new(PanicsOnOneText)),
        toy_tokenizer(8),
    );
    let defaults = GenerateOptions {
        max_new_tokens: 3,
        ..Default::default()
    };
    let opts = ServeOptions {
        listener: TcpListener::bind("127.0.0.1:0").unwrap(),
        queue: 2,
        grace: Duration::from_secs(1),
        model: "toy".into(),
        system: None,
        cors: Cors::Off,
        allowed_hosts: Vec::new(),
    };
    let (ready, address) = std::sync::mpsc::channel();
    // The server runs until the test process ends.
    std::thread::spawn(move || serve(engine, defaults, opts, |a| ready.send(a).unwrap()));
    let addr = address.recv_timeout(Duration::from_secs(30)).unwrap();
    let complete = |prompt: &str| {
        let body = format!(r#"{{"prompt": "{prompt}", "max_tokens": 3, "temperature": 0}}"#);
        call(addr, "POST", "/v1/completions", &body)
    };
    let (status, first) = complete("t1 t2 t3 t4");
    assert_eq!(status, 200, "{first}");
    // The same start again: read from the cache.
    let (status, again) = complete("t1 t2 t3 t4 t6");
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
    let (status, failed) = complete("t1 t2 t3 t4 t5");
    assert_eq!(status, 500, "{failed}");
    assert_eq!(
        failed["error"]["message"],
        "the engine failed on this request (a drafter bug); its caches were emptied"
    );
    assert_eq!(failed["error"]["type"], "server_error");
    // Served again, its prompt read from the start: the caches were emptied.
    let (status, after) = complete("t1 t2 t3 t4 t6");
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(after["choices"][0]["text"], again["choices"][0]["text"]);
    let (status, health) = call(addr, "GET", "/health", "");
    assert_eq!(status, 200, "{health}");
}
