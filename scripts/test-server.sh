#!/usr/bin/env bash
# Checks `cascade serve` with the official `openai` Python client, installed from PyPI into a
# throwaway virtual environment: greedy text equal to `cascade generate`'s (streamed and
# whole), 4 concurrent clients, 429 on a full queue (clients that left holding no place), 400 on
# malformed requests, a client that disconnects mid-stream or while queued, JSON errors for unknown endpoints, wrong methods
# and oversized bodies, a prediction that speeds up an edit, and exit 0 on SIGTERM.
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
export REF_HI REF_PRIME
REF_HI=$(reference "Write a haiku about speculative decoding." 48)
REF_PRIME=$(reference "Write a Python function is_prime(n) with a docstring." 96)

# start PORT CONFIG: a server in the background, waited for until it answers.
start() {
    "$CASCADE" serve -c "$2" --port "$1" --queue 3 --grace 5 2>>"$log" &
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
start $((PORT + 1)) configs/autoregressive.toml; plain_server=$pid
BASE="http://127.0.0.1:$PORT/v1" BASE_PLAIN="http://127.0.0.1:$((PORT + 1))/v1" \
    "$venv/bin/python" scripts/server/client_test.py
stop "$plain_server"
stop "$server"
echo "server test: all checks passed"
