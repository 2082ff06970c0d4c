"""`cascade serve` against the official openai client (run by scripts/test-server.sh)."""

import json
import os
import threading
import time
import urllib.error
import urllib.request

import openai

BASE = os.environ["BASE"]
client = openai.OpenAI(base_url=BASE, api_key="unused", max_retries=0, timeout=600)
REF_HI = json.loads(os.environ["REF_HI"])["samples"][0]["text"]
REF_PRIME = json.loads(os.environ["REF_PRIME"])["samples"][0]["text"]
HI = "Write a haiku about speculative decoding."
PRIME = "Write a Python function is_prime(n) with a docstring."


def chat(prompt, n_tokens, **kw):
    return client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}],
        max_tokens=n_tokens, temperature=0, **kw)


def check(name, ok, detail=""):
    if not ok:
        raise SystemExit(f"FAILED: {name} {detail}")
    print(f"ok: {name}")


# Greedy text equals the CLI's, streamed and whole.
pieces = [c.choices[0].delta.content or "" for c in chat(HI, 48, stream=True) if c.choices]
check("streamed greedy text equals cascade generate", "".join(pieces) == REF_HI,
      repr(("".join(pieces), REF_HI)))
whole = chat(HI, 48)
check("whole greedy text equals cascade generate", whole.choices[0].message.content == REF_HI)
extra = whole.usage.model_extra
check("usage carries the speculative counters",
      all(k in extra for k in ("drafted_tokens", "accepted_tokens", "target_calls")), str(extra))

# Four concurrent clients each get their own greedy text (queue 3 + 1 running).
results = {}
def run(i, prompt, n):
    results[i] = chat(prompt, n).choices[0].message.content
threads = [threading.Thread(target=run, args=(i, *[(HI, 48), (PRIME, 96)][i % 2])) for i in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
check("4 concurrent clients all answered correctly",
      [results.get(i) for i in range(4)] == [REF_HI, REF_PRIME, REF_HI, REF_PRIME])

# A burst beyond the queue gets 429, with an OpenAI-style error.
codes = []
def burst():
    try:
        chat(HI, 48)
        codes.append(200)
    except openai.RateLimitError as e:
        codes.append(429)
        check("429 body names the reason", "queue is full" in str(e.body), str(e.body))
        check("429 says when to retry", e.response.headers.get("retry-after") == "1",
              str(dict(e.response.headers)))
threads = [threading.Thread(target=burst) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
check("a full queue answers 429", 429 in codes and 200 in codes, str(codes))

# Any request's status and JSON error (None when it succeeded).
def request(path, method, body=None):
    req = urllib.request.Request(BASE.rsplit("/v1", 1)[0] + path, data=body, method=method,
                                 headers={"content-type": "application/json"})
    try:
        urllib.request.urlopen(req)
        return 200, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())

# Malformed requests get 400 with a JSON error naming the field.
def post(body):
    return request("/v1/chat/completions", "POST", body.encode())
for body, param in [('{"messages": [', None),
                    ('{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
                    ('{"messages": [{"role": "user", "content": "x"}], "top_p": 0}', "top_p"),
                    ('{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', "logprobs"),
                    ('{"messages": [{"role": "user", "content": "' + "word " * 40000 + '"}]}', "messages"),
                    ('{"messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content", "content": "'
                     + "word " * 40000 + '"}}', "prediction.content")]:
    code, err = post(body)
    check(f"400 for {body[:60]!r}", code == 400 and err["error"]["param"] == param, str((code, err)))

# Settings sent as null are unset; a temperature too small to divide by is the client's error.
code, err = post('{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": null}')
check("stream: null is accepted", code == 200, str((code, err)))
code, err = post('{"messages": [{"role": "user", "content": "x"}], "temperature": 1e-40}')
check("400 for a temperature of 1e-40", code == 400 and err["error"]["param"] == "temperature", str((code, err)))

# Unknown endpoints, wrong methods and oversized bodies get OpenAI-style JSON errors too.
for path, method, body, status in [("/v1/embeddings", "POST", b"{}", 404),
                                   ("/v1/chat/completions", "GET", None, 405),
                                   ("/v1/completions", "POST", b" " * ((2 << 20) + 1), 413)]:
    # The server may close an oversized upload before reading it all, and the reset can beat
    # its answer to the client: a few tries.
    for _ in range(5):
        try:
            code, err = request(path, method, body)
            break
        except (urllib.error.URLError, ConnectionError) as e:
            code, err = None, e
    check(f"{status} as JSON for {method} {path}", code == status and err["error"]["message"], str((code, err)))
    if status == 413:
        check("413 names the limit", code == 413 and "limit of 2097152 bytes" in err["error"]["message"], str(err))

# A body not declared JSON (a web page's plain-text POST, which needs no CORS preflight) gets
# 415; a request addressed to another host name (DNS rebinding) 403; a model is retrievable.
def raw(path, body, headers):
    req = urllib.request.Request(BASE.rsplit("/v1", 1)[0] + path, data=body, method="POST", headers=headers)
    try:
        return urllib.request.urlopen(req).status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
ok_body = b'{"prompt": "1, 2,", "max_tokens": 1}'
code, err = raw("/v1/completions", ok_body, {"content-type": "text/plain"})
check("415 for a plain-text body", code == 415 and "application/json" in err["error"]["message"], str((code, err)))
code, err = raw("/v1/completions", ok_body, {"content-type": "application/json", "host": "evil.example:8080"})
check("403 for a request to another host name", code == 403 and "evil.example" in err["error"]["message"], str((code, err)))
code, _ = raw("/v1/completions", ok_body, {"content-type": "application/json; charset=utf-8", "host": "localhost"})
check("a JSON body with a charset, sent to localhost, is answered", code == 200, str(code))
# With stream_options.include_usage, every chunk carries `usage`: null but in the last one.
body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True,
                   "stream_options": {"include_usage": True}}).encode()
req = urllib.request.Request(BASE + "/chat/completions", data=body, method="POST",
                             headers={"content-type": "application/json"})
chunks = [json.loads(l[6:]) for l in urllib.request.urlopen(req).read().decode().splitlines()
          if l.startswith("data: {")]
check("with include_usage every chunk has usage, null until the last",
      all("usage" in c for c in chunks) and all(c["usage"] is None for c in chunks[:-1])
      and chunks[-1]["usage"]["completion_tokens"] >= 1, str(chunks))
served = client.models.list().data[0].id
check("/v1/models/{id} retrieves the served model", client.models.retrieve(served).id == served)
try:
    client.models.retrieve(served + "-other")
    check("another model id is not found", False)
except openai.NotFoundError as e:
    check("another model id is not found", "this server serves" in str(e.body), str(e.body))

# A streaming client that leaves while queued costs nothing: its long prompt is never read.
def metric(name):
    text = urllib.request.urlopen(BASE.rsplit("/v1", 1)[0] + "/metrics").read().decode()
    return float(next(l.split()[1] for l in text.splitlines() if l.startswith(f"cascade_{name} ")))
read_before = metric("prompt_tokens_total")
answers = []
busy = threading.Thread(target=lambda: answers.append(chat(PRIME, 96)))
busy.start()
time.sleep(0.5)
queued = chat("word " * 3000 + "\nCount the words.", 16, stream=True)
queued.close()
busy.join()
after = chat(HI, 48)
check("after a client left the queue the next request is served", after.choices[0].message.content == REF_HI)
# A started generation counts its prompt when it ends, a cancelled one too; a skipped one never.
read = metric("prompt_tokens_total") - read_before
served = answers[0].usage.prompt_tokens + after.usage.prompt_tokens
check("the queued request that lost its client was never started", read == served, f"{read} != {served}")

# Clients that leave while queued give their places back at once: with 3 places, 3 streams
# that left and then 3 new requests all fit while the engine is still busy.
busy = threading.Thread(target=lambda: chat(PRIME, 300))
busy.start()
time.sleep(0.5)
for _ in range(3):
    chat(HI, 48, stream=True).close()
deadline = time.time() + 5
while metric("queue_depth") > 0 and time.time() < deadline:
    time.sleep(0.1)
check("clients that left while queued are off the queue's count", metric("queue_depth") == 0)
codes = []
def queued_request():
    try:
        chat(HI, 8)
        codes.append(200)
    except openai.RateLimitError:
        codes.append(429)
threads = [threading.Thread(target=queued_request) for _ in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
busy.join()
check("clients that left while queued hold no place in it", codes == [200] * 3, str(codes))

# A client that leaves mid-stream frees the engine for the next request.
stream = chat(PRIME, 2000, stream=True)
next(iter(stream)); next(iter(stream))
stream.close()
start = time.time()
check("after a disconnect the next request is served", chat(HI, 48).choices[0].message.content == REF_HI)
check("the abandoned generation did not run on", time.time() - start < 60, f"{time.time() - start:.0f}s")
metrics = urllib.request.urlopen(BASE.rsplit("/v1", 1)[0] + "/metrics").read().decode()
cancelled = [l for l in metrics.splitlines() if l.startswith("cascade_requests_cancelled_total")]
check("metrics count the cancelled request", cancelled and float(cancelled[0].split()[1]) >= 1, str(cancelled))

# A prediction speeds up an edit: the answer mostly repeats it. The speed is compared on a
# server without a drafter (BASE_PLAIN); on the main server the text must not change either.
plain_client = openai.OpenAI(base_url=os.environ["BASE_PLAIN"], api_key="unused", max_retries=0, timeout=600)
edit = {"type": "content", "content": REF_PRIME.replace("is_prime", "isPrime")}
def plain_chat(prompt, n_tokens, **kw):
    return plain_client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": prompt}],
        max_tokens=n_tokens, temperature=0, **kw)
plain = plain_chat(PRIME, 96)
predicted = plain_chat(PRIME, 96, prediction=edit)
per_call = lambda r: r.usage.completion_tokens / r.usage.model_extra["target_calls"]
check("a prediction leaves the greedy text unchanged", predicted.choices[0].message.content == REF_PRIME)
check(f"a prediction gives >= 2x tokens per target call ({per_call(plain):.2f} -> {per_call(predicted):.2f})",
      per_call(predicted) >= 2 * per_call(plain))
with_drafter = chat(PRIME, 96, prediction=edit)
check(f"behind the config's drafter too, the text is unchanged ({per_call(with_drafter):.2f} tokens per call)",
      with_drafter.choices[0].message.content == REF_PRIME)

# `n` samples take seeds seed..seed+n-1, as `cascade generate --num-samples` does: without a
# drafter the seed fixes each text, so they are the CLI's, in order.
samples = [s["text"] for s in json.loads(os.environ["REF_SAMPLES"])["samples"]]
several = plain_client.chat.completions.create(
    model="any", messages=[{"role": "user", "content": HI}], max_tokens=24, temperature=0.8,
    seed=5, n=3)
got = [c.message.content for c in sorted(several.choices, key=lambda c: c.index)]
check("n samples are the CLI's samples at seeds seed..seed+n-1", got == samples, repr((got, samples)))
check("n samples differ from one another", len(set(got)) > 1, repr(got))
