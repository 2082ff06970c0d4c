#!/usr/bin/env bash
# Checks `cascade serve` with the official `openai` Python client, installed from PyPI into a
# throwaway virtual environment: greedy text equal to `cascade generate`'s (streamed and
# whole), `n` samples equal to its `--num-samples`, 4 concurrent clients, 429 on a full queue
# (with Retry-After) (clients that left holding no place), 400 on
# malformed requests, a client that disconnects mid-stream or while queued, JSON errors for unknown endpoints, wrong methods
# and oversized bodies, 415 for a body not declared JSON, 403 for another host name, a prediction that speeds up an edit, CORS headers for the origins
# `--cors` allows and no other, exit 0 on SIGTERM, and a stream cut off by the end of its grace
# period ending with an error event.
# Needs python3 with venv, the release build and the test models (scripts/fetch-models.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
CASCADE=target/release/cascade
CONFIG=${CONFIG:-configs/adaptive.toml}
PORT=${PORT:-8187}
venv=$(mktemp -d)
log=$(mktemp)
trap 'kill "${server:-0}" "${plain_server:-0}" 2>/dev/null || true; rm -rf "$venv" "$log"' EXIT
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check openai

cargo build --release --quiet
# The reference texts, from the CLI with the same prompts and settings.
reference() { "$CASCADE" generate -c "$CONFIG" --chat -p "$1" -n "$2" -t 0 --json 2>/dev/null; }
export REF_HI REF_PRIME REF_SAMPLES
REF_HI=$(reference "Write a haiku about speculative decoding." 48)
REF_PRIME=$(reference "Write a Python function is_prime(n) with a docstring." 96)
# Three samples at seeds 5, 6 and 7 from plain decoding (no drafter: the seed fixes the text).
REF_SAMPLES=$("$CASCADE" generate -c configs/autoregressive.toml --chat \
    -p "Write a haiku about speculative decoding." -n 24 -t 0.8 -s 5 --num-samples 3 --json 2>/dev/null)

# start PORT CONFIG [ARGS...]: a server in the background, waited for until it answers.
start() {
    "$CASCADE" serve -c "$2" --port "$1" --queue 3 --grace 5 "${@:3}" 2>>"$log" &
    pid=$!
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$1/health" >/dev/null && return
        kill -0 "$pid" 2>/dev/null || { cat "$log"; exit 1; }
        sleep 1
    done
}
# stop PID: SIGTERM must end the server with status 0.
stop() {
    kill -TERM "$1"
    status=0
    wait "$1" || status=$?
    if [ "$status" -ne 0 ]; then
        echo "the server exited with status $status after SIGTERM"; cat "$log"; exit 1
    fi
}
start "$PORT" "$CONFIG"; server=$pid
# The prediction's effect is measured against a server without a drafter of its own, where
# tokens per target call are 1 without a prediction (the default config's 0.5B may already
# predict a plain code answer well, leaving nothing to compare).
start $((PORT + 1)) configs/autoregressive.toml --cors http://localhost:3000; plain_server=$pid
BASE="http://127.0.0.1:$PORT/v1" BASE_PLAIN="http://127.0.0.1:$((PORT + 1))/v1" \
    "$venv/bin/python" scripts/server/client_test.py

# CORS: the plain server lets pages from http://localhost:3000 call it (preflight included),
# and no other origin; the default server lets no page.
# header PORT ORIGIN NAME [CURL ARGS...]: the response header NAME's value (empty if absent)
# for /v1/models, or the PATH given as CURL_PATH.
header() {
    curl -s -o /dev/null -D - -H "Origin: $2" "${@:4}" "http://127.0.0.1:$1${CURL_PATH:-/v1/models}" \
        | tr -d '\r' | awk -v name="$3" 'tolower($1) == tolower(name) ":" { print $2 }'
}
expect() { [ "$2" = "$3" ] || { echo "CORS: $1: got '$2', expected '$3'"; exit 1; }; }
plain=$((PORT + 1))
expect "allowed origin" "$(header $plain http://localhost:3000 access-control-allow-origin)" \
    http://localhost:3000
expect "other origin" "$(header $plain http://evil.example access-control-allow-origin)" ""
expect "without --cors" "$(header "$PORT" http://localhost:3000 access-control-allow-origin)" ""
preflight=(-X OPTIONS -H "Access-Control-Request-Method: POST"
    -H "Access-Control-Request-Headers: authorization,content-type")
export CURL_PATH=/v1/chat/completions
expect "preflight origin" \
    "$(header $plain http://localhost:3000 access-control-allow-origin "${preflight[@]}")" \
    http://localhost:3000
expect "preflight headers" \
    "$(header $plain http://localhost:3000 access-control-allow-headers "${preflight[@]}")" \
    authorization,content-type
expect "preflight methods" \
    "$(header $plain http://localhost:3000 access-control-allow-methods "${preflight[@]}")" \
    GET,POST
unset CURL_PATH
# A field the server does not know (a typo) does not fail the request, and the log names it.
curl -sf "http://127.0.0.1:$plain/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "1, 2,", "max_tokens": 1, "temprature": 0.2, "user": "u"}' | grep -q '"choices"' \
    || { echo "a request with an unknown field failed"; exit 1; }
grep -q 'fields unknown to this server were ignored: "temprature"$' "$log" \
    || { echo "the log does not name the unknown field alone:"; cat "$log"; exit 1; }
# A stream still running when SIGTERM's grace period ends is cut off with an error event and
# no [DONE], so that a client cannot take it for a whole answer.
cut=$(mktemp)
curl -sN "http://127.0.0.1:$plain/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "1, 2, 3, 4, 5,", "max_tokens": 20000, "stream": true}' >"$cut" &
reader=$!
sleep 2
stop "$plain_server"
wait "$reader" || true
if grep -q '\[DONE\]' "$cut"; then
    # The count ended (an end of sequence) within the grace period: nothing was cut off.
    grep -q '"the answer was cut off"' "$cut" && { echo "a finished stream said it was cut off"; exit 1; }
    echo "note: the counting answer finished before the grace period ended; no cut-off to check"
elif ! grep -q '"the server is shutting down: the answer was cut off"' "$cut"; then
    echo "a stream cut off at shutdown ended without its error event:"; tail -3 "$cut"; exit 1
fi
rm -f "$cut"
stop "$server"
echo "server test: all checks passed"
