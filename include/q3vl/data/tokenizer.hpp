// Qwen byte-level BPE tokenizer, read from a Hugging Face tokenizer.json (model BPE, NFC normalizer,
// Split-regex + ByteLevel pre-tokenizer, ByteLevel decoder). It reproduces the reference encoder
// (@lenml/tokenizers, a port of transformers.js; see tools/tokenizer_ref.mjs):
//  - added tokens (special or not) are matched in the raw text first, longest match at the earliest position,
//    and are never normalized or split;
//  - the text between them is NFC-normalized, split by the pre-tokenizer regex (with JavaScript's meaning of
//    \s and of the case-insensitive contraction group), mapped byte-wise to GPT-2's printable alphabet and
//    merged by BPE rank (lowest rank first, leftmost on ties);
//  - invalid UTF-8 input is read as a browser or Node would: every maximal invalid subsequence becomes U+FFFD
//    (WHATWG Encoding Standard), and that replacement character is what gets tokenized;
//  - decode joins token bytes and turns invalid UTF-8 in the result into U+FFFD the same way; added tokens
//    decode to their content. No special tokens are added or skipped.
// Unicode tables (NFC and the regex's \p{L} / \p{N}) are Unicode 14; characters assigned later may differ
// from the reference, which uses the Unicode version of its JavaScript engine.
// encode/decode are const and safe to call from several threads.
#pragma once
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace q3vl {

class Tokenizer {
 public:
  // Reads tokenizer.json; fails naming the file and what is missing or malformed.
  static Tokenizer load(const std::string& tokenizer_json);

  std::vector<int32_t> encode(std::string_view text) const;
  // Fails on an id that names no token.
  std::string decode(const std::vector<int32_t>& ids) const;
  // Id of a vocabulary or added token given by its exact text (e.g. "<|im_start|>"); fails if absent.
  int32_t token_id(std::string_view token) const;
  // One past the largest token id.
  size_t vocab_size() const;

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// CLI contract of `q3vl tokenize`. Encode: every input line is a JSON string; writes one JSON array of ids per
// line. Decode: every input line is a JSON array of ids; writes one JSON string per line. A malformed line
// fails naming its line number.
void tokenize_stream(const Tokenizer& tokenizer, std::istream& in, std::ostream& out, bool decode);

}  // namespace q3vl
