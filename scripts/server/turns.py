"""A conversation's second turn on `cascade serve`, with the first turn still in the prompt
cache and with another conversation there instead. Prints the cached prompt tokens and the time
to the first token of each, and checks that both give the same (greedy) answer.

    cascade serve -c configs/adaptive.toml --port 8080 &
    python3 scripts/server/turns.py --base http://127.0.0.1:8080/v1

Standard library only. The first turn asks about the first document-QA prompt of
prompts/suite.jsonl; the second asks for the supporting quote.
"""

import argparse
import json
import pathlib
import time
import urllib.request

SUITE = pathlib.Path(__file__).resolve().parents[2] / "prompts" / "suite.jsonl"


def chat(base, messages, max_tokens):
    """Streams a greedy chat completion: (text, seconds to the first text, usage)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    start, first, text, usage = time.time(), None, "", None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first if first is not None else time.time() - start
                    text += piece
    return text, first, usage


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    prompts = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
    document = next(p["prompt"] for p in prompts if p["category"] == "document-qa")
    turn1 = [{"role": "user", "content": document}]
    answer, _, _ = chat(args.base, turn1, args.max_tokens)
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "Quote the sentence of the document that supports your answer."},
    ]
    answers = set()
    for _ in range(args.repeats):
        for label in ["first turn cached", "another conversation cached"]:
            if label == "first turn cached":
                chat(args.base, turn1, args.max_tokens)
            else:
                chat(args.base, [{"role": "user", "content": "Say hi."}], 4)
            text, first, usage = chat(args.base, turn2, args.max_tokens)
            answers.add(text)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            print(f"second turn, {label}: {usage['prompt_tokens']} prompt tokens, {cached} cached, "
                  f"first token after {first:.2f} s")
    if len(answers) != 1:
        raise SystemExit("the answers differ between a warm and a cold cache")


if __name__ == "__main__":
    main()
