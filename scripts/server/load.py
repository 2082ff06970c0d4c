"""Throughput of `cascade serve` under load: the same requests sent one at a time, then by
4 concurrent clients. Prints total tokens/s and p50/p95 latency of each run.

    cascade serve -c configs/adaptive.toml --port 8080 &
    python3 scripts/server/load.py --base http://127.0.0.1:8080/v1 --requests 12

Standard library only (no openai package needed). Requests are greedy chat completions over
a few prompt kinds (code, chat, an edit with a prediction).
"""

import argparse
import json
import statistics
import threading
import time
import urllib.request

PROMPTS = [
    ("Write a Python function that checks whether a string is a palindrome.", None),
    ("Explain in three sentences what a hash map is.", None),
    ("Write a Python class Stack with push, pop and peek.", None),
    ("Rename the function to `total` and return the result:\n\ndef s(xs):\n    r = 0\n    for x in xs:\n        r += x\n    print(r)\n",
     "```python\ndef total(xs):\n    r = 0\n    for x in xs:\n        r += x\n    return r\n```"),
]


def request(base, i, max_tokens):
    prompt, prediction = PROMPTS[i % len(PROMPTS)]
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if prediction:
        body["prediction"] = {"type": "content", "content": prediction}
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    start = time.time()
    with urllib.request.urlopen(req, timeout=3600) as r:
        usage = json.loads(r.read())["usage"]
    return time.time() - start, usage["completion_tokens"]


def run(base, n, clients, max_tokens):
    results, lock, next_i = [], threading.Lock(), iter(range(n))

    def worker():
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            r = request(base, i, max_tokens)
            with lock:
                results.append(r)

    start = time.time()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.time() - start
    latencies = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    p95 = latencies[min(len(latencies) - 1, int(round(0.95 * (len(latencies) - 1))))]
    return {"clients": clients, "requests": n, "tokens": tokens, "seconds": wall,
            "tokens_per_second": tokens / wall, "p50": statistics.median(latencies), "p95": p95}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    print("| clients | requests | tokens | seconds | tokens/s | p50 latency (s) | p95 latency (s) |")
    print("|---|---|---|---|---|---|---|")
    for clients in (1, 4):
        r = run(args.base, args.requests, clients, args.max_tokens)
        print(f"| {r['clients']} | {r['requests']} | {r['tokens']} | {r['seconds']:.1f} | "
              f"{r['tokens_per_second']:.2f} | {r['p50']:.2f} | {r['p95']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
