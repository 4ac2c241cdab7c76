#include "q3vl/data/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <istream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <ostream>
#include <queue>
#include <unordered_map>

#include "q3vl/core/error.hpp"

namespace q3vl {
namespace {

#include "tokenizer_nfc.inc"

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------------------------
// UTF-8

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Decodes the code point at s[i] of valid UTF-8 and advances i.
char32_t next_code_point(std::string_view s, size_t& i) {
  const auto b = static_cast<unsigned char>(s[i]);
  int n = b < 0x80 ? 0 : b < 0xE0 ? 1 : b < 0xF0 ? 2 : 3;
  char32_t cp = n == 0 ? b : n == 1 ? (b & 0x1F) : n == 2 ? (b & 0x0F) : (b & 0x07);
  for (int k = 1; k <= n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += n + 1;
  return cp;
}

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid; `prefix` gets how many of its bytes
// form the longest valid prefix (the "maximal subpart" that becomes one U+FFFD, WHATWG Encoding Standard).
size_t utf8_sequence(std::string_view s, size_t i, size_t& prefix) {
  const auto b = static_cast<unsigned char>(s[i]);
  prefix = 1;
  if (b < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;  // overlong
    if (b == 0xED) hi = 0x9F;  // surrogates
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;  // overlong
    if (b == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return 0;
    const auto c = static_cast<unsigned char>(s[i + k]);
    if (c < lo || c > hi) return 0;
    lo = 0x80, hi = 0xBF;
    prefix = k + 1;
  }
  return need + 1;
}

// Replaces each maximal invalid subsequence by U+FFFD, as TextDecoder does. Returns false (out untouched)
// when the text is already valid.
bool replace_invalid_utf8(std::string_view s, std::string& out) {
  size_t i = 0, prefix = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0x80) {
      ++i;
      continue;
    }
    const size_t n = utf8_sequence(s, i, prefix);
    if (n == 0) break;
    i += n;
  }
  if (i == s.size()) return false;
  out.assign(s.data(), i);
  while (i < s.size()) {
    const size_t n = utf8_sequence(s, i, prefix);
    if (n) {
      out.append(s.data() + i, n);
      i += n;
    } else {
      out += "\xEF\xBF\xBD";
      i += prefix;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// NFC (Unicode Standard Annex 15), tables from tokenizer_nfc.inc

constexpr char32_t kHangulS = 0xAC00, kHangulL = 0x1100, kHangulV = 0x1161, kHangulT = 0x11A7;
constexpr char32_t kHangulLCount = 19, kHangulVCount = 21, kHangulTCount = 28, kHangulSCount = 11172;

template <size_t N, typename Row>
const Row* find_row(const Row (&table)[N], uint64_t key) {
  const Row* it = std::lower_bound(table, table + N, key, [](const Row& r, uint64_t k) { return r[0] < k; });
  return it != table + N && (*it)[0] == key ? it : nullptr;
}

uint32_t combining_class(char32_t cp) {
  if (cp < 0x300) return 0;
  const auto* row = find_row(kCombiningClass, cp);
  return row ? (*row)[1] : 0;
}

bool nfc_unsafe(char32_t cp) {
  if (cp < 0x300) return false;
  const auto* it = std::upper_bound(std::begin(kNfcUnsafe), std::end(kNfcUnsafe), cp,
                                    [](char32_t c, const uint32_t(&r)[2]) { return c < r[0]; });
  return it != std::begin(kNfcUnsafe) && cp <= (*(it - 1))[1];
}

void decompose(char32_t cp, std::vector<char32_t>& out) {
  if (cp >= kHangulS && cp < kHangulS + kHangulSCount) {
    const char32_t s = cp - kHangulS;
    out.push_back(kHangulL + s / (kHangulVCount * kHangulTCount));
    out.push_back(kHangulV + (s % (kHangulVCount * kHangulTCount)) / kHangulTCount);
    if (s % kHangulTCount) out.push_back(kHangulT + s % kHangulTCount);
  } else if (const auto* row = cp >= 0xC0 ? find_row(kDecomposition, cp) : nullptr) {
    out.insert(out.end(), kDecompositionData + (*row)[1], kDecompositionData + (*row)[1] + (*row)[2]);
  } else {
    out.push_back(cp);
  }
}

// The primary composite of a starter and the following character, or 0.
char32_t compose(char32_t a, char32_t b) {
  if (a >= kHangulL && a < kHangulL + kHangulLCount && b >= kHangulV && b < kHangulV + kHangulVCount)
    return kHangulS + ((a - kHangulL) * kHangulVCount + (b - kHangulV)) * kHangulTCount;
  if (a >= kHangulS && a < kHangulS + kHangulSCount && (a - kHangulS) % kHangulTCount == 0 && b > kHangulT &&
      b < kHangulT + kHangulTCount)
    return a + (b - kHangulT);
  const auto* row = find_row(kComposition, (uint64_t{a} << 21) | b);
  return row ? static_cast<char32_t>((*row)[1]) : 0;
}

// NFC of valid UTF-8. Returns false (out untouched) when the text passes the quick check and is already NFC.
bool nfc(std::string_view s, std::string& out) {
  bool unsafe = false;
  for (size_t i = 0; i < s.size() && !unsafe;) {
    if (static_cast<unsigned char>(s[i]) < 0xCC) {  // every code point below U+0300 is safe
      i += static_cast<unsigned char>(s[i]) < 0x80 ? 1 : 2;
      continue;
    }
    unsafe = nfc_unsafe(next_code_point(s, i));
  }
  if (!unsafe) return false;

  std::vector<char32_t> cps;
  for (size_t i = 0; i < s.size();) decompose(next_code_point(s, i), cps);
  // Canonical ordering: stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (combining_class(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && combining_class(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](char32_t a, char32_t b) { return combining_class(a) < combining_class(b); });
    i = j;
  }
  // Canonical composition: a character combines with the last starter unless something in between blocks it.
  std::vector<char32_t> res;
  res.reserve(cps.size());
  ptrdiff_t starter = -1;
  uint32_t last_class = 0;
  for (char32_t cp : cps) {
    const uint32_t cls = combining_class(cp);
    if (starter >= 0) {
      const bool adjacent = starter == static_cast<ptrdiff_t>(res.size()) - 1;
      if (adjacent || (last_class != 0 && last_class < cls)) {
        if (char32_t c = compose(res[starter], cp)) {
          res[starter] = c;
          continue;
        }
      }
    }
    if (cls == 0) starter = static_cast<ptrdiff_t>(res.size());
    last_class = cls;
    res.push_back(cp);
  }
  out.clear();
  for (char32_t cp : res) append_utf8(out, cp);
  return true;
}

// ---------------------------------------------------------------------------------------------------------------
// Pre-tokenizer regex

// JavaScript's \s (WhiteSpace + LineTerminator), which the reference uses: unlike PCRE2's Unicode \s it has
// U+FEFF but neither U+0085 nor U+180E.
constexpr const char* kJsSpace = "\\t\\n\\x{0B}\\f\\r \\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
                                 "\\x{202F}\\x{205F}\\x{3000}\\x{FEFF}";

// Rewrites the tokenizer.json regex so that PCRE2 matches what the reference's JavaScript RegExp ("gu") matches.
std::string to_pcre2_pattern(std::string p, const std::string& where) {
  // The reference rewrites the (unsupported in JS) case-insensitive contraction group to ASCII case pairs;
  // PCRE2's caseless UCP mode would also accept e.g. U+017F for 's'.
  const std::string ci = "(?i:'s|'t|'re|'ve|'m|'ll|'d)";
  for (size_t at; (at = p.find(ci)) != std::string::npos;)
    p.replace(at, ci.size(), "(?:'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))");
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 's') {
        out += in_class ? std::string(kJsSpace) : "[" + std::string(kJsSpace) + "]";
      } else if (e == 'S') {
        if (in_class) fail(where + ": \\S inside a character class is not supported in pattern " + p);
        out += "[^" + std::string(kJsSpace) + "]";
      } else if (e == '#' || e == '&' || e == '~') {
        out += e;  // the reference drops these Python-only escapes
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (c == '[' && !in_class) in_class = true;
    else if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

struct Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() { pcre2_code_free(code); }
};

// ---------------------------------------------------------------------------------------------------------------
// GPT-2 byte-level alphabet: printable bytes stand for themselves, the others are moved to U+0100 and up.

std::array<char32_t, 256> byte_to_unicode() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

struct Merge {
  int32_t rank;
  int32_t id;
};

}  // namespace

// ---------------------------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> raw_to_id;  // raw token bytes -> id
  std::vector<std::string> id_to_raw;                                              // "" for unused ids
  std::vector<uint8_t> id_is_added;
  std::array<int32_t, 256> byte_id{};
  std::unordered_map<uint64_t, Merge> merges;  // (left id << 32 | right id) -> rank and merged id
  std::vector<std::string> added;              // added token contents, longest first
  std::array<bool, 256> added_first{};         // bytes that start some added token
  bool normalize_nfc = false;
  Regex regex;

  // Pieces seen before; words repeat a lot in text.
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;
  static constexpr size_t kCacheEntries = 1 << 18, kCachedPieceBytes = 64;

  void bpe(std::string_view piece, std::vector<int32_t>& ids) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& ids) const;
  void encode_section(std::string_view text, std::vector<int32_t>& ids) const;
};

namespace {

// Merges of one piece, lowest rank first and leftmost on ties, like the reference's priority queue.
struct PairEntry {
  int32_t rank, left, right, left_id, right_id, merged;
  bool operator>(const PairEntry& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
};

}  // namespace

void Tokenizer::Impl::bpe(std::string_view piece, std::vector<int32_t>& ids) const {
  const int n = static_cast<int>(piece.size());
  std::vector<int32_t> sym(n), next(n);
  std::vector<int32_t> prev(n);
  for (int i = 0; i < n; ++i) {
    sym[i] = byte_id[static_cast<unsigned char>(piece[i])];
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::priority_queue<PairEntry, std::vector<PairEntry>, std::greater<>> queue;
  auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    const int right = next[left];
    const auto it = merges.find((uint64_t(uint32_t(sym[left])) << 32) | uint32_t(sym[right]));
    if (it != merges.end()) queue.push({it->second.rank, left, right, sym[left], sym[right], it->second.id});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const PairEntry e = queue.top();
    queue.pop();
    // Stale entries: a side has been merged away or changed since the pair was queued.
    if (sym[e.left] != e.left_id || next[e.left] != e.right || sym[e.right] != e.right_id) continue;
    sym[e.left] = e.merged;
    sym[e.right] = -1;
    next[e.left] = next[e.right];
    if (next[e.left] >= 0) prev[next[e.left]] = e.left;
    push(prev[e.left]);
    push(e.left);
  }
  for (int i = 0; i >= 0; i = next[i]) ids.push_back(sym[i]);
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<int32_t>& ids) const {
  if (piece.size() == 1) {
    ids.push_back(byte_id[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (piece.size() > kCachedPieceBytes) {
    bpe(piece, ids);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    const auto it = cache.find(piece);
    if (it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = ids.size();
  bpe(piece, ids);
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheEntries) cache.clear();  // bounded memory; refills from the current text
  cache.emplace(std::string(piece), std::vector<int32_t>(ids.begin() + start, ids.end()));
}

void Tokenizer::Impl::encode_section(std::string_view text, std::vector<int32_t>& ids) const {
  std::string normalized;
  if (normalize_nfc && nfc(text, normalized)) text = normalized;
  if (text.empty()) return;

  thread_local std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match_data(
      pcre2_match_data_create(1, nullptr), &pcre2_match_data_free);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;     // end of the last piece
  size_t search = 0;  // where the next match may start
  while (search < text.size()) {
    const int rc = regex.jit ? pcre2_jit_match(regex.code, subject, text.size(), search, 0, match_data.get(), nullptr)
                             : pcre2_match(regex.code, subject, text.size(), search, PCRE2_NO_UTF_CHECK,
                                           match_data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      fail(path + ": pre-tokenizer regex failed on a text of " + std::to_string(text.size()) +
           " bytes: " + reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match_data.get());
    // Text between matches is a piece of its own ("Isolated" split).
    if (ov[0] > pos) encode_piece(text.substr(pos, ov[0] - pos), ids);
    if (ov[1] > ov[0]) encode_piece(text.substr(ov[0], ov[1] - ov[0]), ids);
    pos = ov[1];
    search = ov[1];
    if (ov[1] == ov[0] && search < text.size()) next_code_point(text, search);  // JavaScript steps over a code point after an empty match
  }
  if (pos < text.size()) encode_piece(text.substr(pos), ids);
}

// ---------------------------------------------------------------------------------------------------------------

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

namespace {

// Checks that a tokenizer.json component is the kind this implementation supports.
void expect(bool ok, const std::string& path, const std::string& what) {
  if (!ok) fail(path + ": unsupported tokenizer.json: " + what);
}

void check_byte_level(const json& j, const std::string& path, const std::string& where) {
  expect(j.is_object() && j.value("type", "") == "ByteLevel", path, where + " must be ByteLevel, got " + j.dump());
  expect(!j.value("add_prefix_space", false), path, where + ".add_prefix_space=true");
  expect(!j.value("use_regex", true) || where != "pre_tokenizer", path, where + ".use_regex=true");
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("tokenizer: cannot open '" + path + "' (run `make deps` to fetch the Qwen tokenizer)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(path + ": not valid JSON: " + e.what());
  }
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  try {
    const json& model = j.at("model");
    expect(model.value("type", "") == "BPE", path, "model.type must be BPE");
    expect(!model.value("byte_fallback", false), path, "model.byte_fallback=true");
    expect(!model.value("ignore_merges", false), path, "model.ignore_merges=true");
    expect(model.value("continuing_subword_prefix", "").empty() && model.value("end_of_word_suffix", "").empty(),
           path, "model subword prefix/suffix");

    const json& normalizer = j.at("normalizer");
    expect(normalizer.is_null() || normalizer.value("type", "") == "NFC", path,
           "normalizer must be NFC or null, got " + normalizer.dump());
    impl->normalize_nfc = !normalizer.is_null();

    // pre_tokenizer: Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)]
    const json& pre = j.at("pre_tokenizer");
    expect(pre.value("type", "") == "Sequence" && pre.at("pretokenizers").size() == 2, path,
           "pre_tokenizer must be Sequence[Split, ByteLevel], got " + pre.dump());
    const json& split = pre.at("pretokenizers")[0];
    expect(split.value("type", "") == "Split" && split.at("pattern").contains("Regex") &&
               split.value("behavior", "") == "Isolated" && !split.value("invert", false),
           path, "pre_tokenizer[0] must be an Isolated, non-inverted regex Split, got " + split.dump());
    check_byte_level(pre.at("pretokenizers")[1], path, "pre_tokenizer");
    check_byte_level(j.at("decoder"), path, "decoder");

    const std::string pattern = to_pcre2_pattern(split.at("pattern").at("Regex").get<std::string>(), path);
    int err = 0;
    PCRE2_SIZE err_at = 0;
    impl->regex.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &err_at, nullptr);
    if (!impl->regex.code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      fail(path + ": pre-tokenizer regex does not compile at offset " + std::to_string(err_at) + ": " +
           reinterpret_cast<const char*>(msg) + " (translated pattern: " + pattern + ")");
    }
    impl->regex.jit = pcre2_jit_compile(impl->regex.code, PCRE2_JIT_COMPLETE) == 0;

    // Vocabulary keys are in the byte-level alphabet; keep their raw bytes.
    const auto b2u = byte_to_unicode();
    std::unordered_map<char32_t, unsigned char> u2b;
    for (int b = 0; b < 256; ++b) u2b[b2u[b]] = static_cast<unsigned char>(b);
    std::unordered_map<std::string, int32_t> symbol_to_id;  // byte-level spelling -> id, for the merges
    int32_t max_id = -1;
    for (const auto& [symbol, value] : model.at("vocab").items()) {
      const int32_t id = value.get<int32_t>();
      expect(id >= 0, path, "negative id for vocab token '" + symbol + "'");
      std::string raw;
      for (size_t i = 0; i < symbol.size();) {
        const auto it = u2b.find(next_code_point(symbol, i));
        expect(it != u2b.end(), path, "vocab token '" + symbol + "' has a character outside the byte alphabet");
        raw += static_cast<char>(it->second);
      }
      if (id >= static_cast<int32_t>(impl->id_to_raw.size())) {
        impl->id_to_raw.resize(id + 1);
        impl->id_is_added.resize(id + 1);
      }
      impl->id_to_raw[id] = raw;
      impl->raw_to_id[raw] = id;
      symbol_to_id[symbol] = id;
      max_id = std::max(max_id, id);
    }
    for (int b = 0; b < 256; ++b) {
      std::string symbol;
      append_utf8(symbol, b2u[b]);
      const auto it = symbol_to_id.find(symbol);
      expect(it != symbol_to_id.end(), path, "vocab lacks the byte token '" + symbol + "'");
      impl->byte_id[b] = it->second;
    }

    // Merges are ["a", "b"] pairs (tokenizers >= 0.20) or "a b" strings; the merged symbol must be in the vocab.
    const json& merges = model.at("merges");
    impl->merges.reserve(merges.size() * 2);
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      std::string a, b;
      if (merges[rank].is_array()) {
        a = merges[rank].at(0).get<std::string>(), b = merges[rank].at(1).get<std::string>();
      } else {
        const std::string m = merges[rank].get<std::string>();
        const size_t sp = m.find(' ');
        expect(sp != std::string::npos, path, "merge " + std::to_string(rank) + " '" + m + "' has no space");
        a = m.substr(0, sp), b = m.substr(sp + 1);
      }
      const auto ia = symbol_to_id.find(a), ib = symbol_to_id.find(b), iab = symbol_to_id.find(a + b);
      expect(ia != symbol_to_id.end() && ib != symbol_to_id.end() && iab != symbol_to_id.end(), path,
             "merge " + std::to_string(rank) + " ('" + a + "', '" + b + "') uses a token missing from the vocab");
      // A repeated pair keeps its last rank, as in the reference's Map.
      impl->merges[(uint64_t(uint32_t(ia->second)) << 32) | uint32_t(ib->second)] = {static_cast<int32_t>(rank),
                                                                                  iab->second};
    }

    for (const json& t : j.at("added_tokens")) {
      const std::string content = t.at("content").get<std::string>();
      const int32_t id = t.at("id").get<int32_t>();
      expect(!content.empty() && id >= 0, path, "added token " + t.dump());
      expect(!t.value("lstrip", false) && !t.value("rstrip", false) && !t.value("single_word", false), path,
             "added token with lstrip/rstrip/single_word: " + t.dump());
      if (id >= static_cast<int32_t>(impl->id_to_raw.size())) {
        impl->id_to_raw.resize(id + 1);
        impl->id_is_added.resize(id + 1);
      }
      impl->id_to_raw[id] = content;
      impl->id_is_added[id] = 1;
      impl->raw_to_id[content] = id;
      impl->added.push_back(content);
      impl->added_first[static_cast<unsigned char>(content[0])] = true;
    }
    std::stable_sort(impl->added.begin(), impl->added.end(),
                     [](const std::string& a, const std::string& b) { return a.size() > b.size(); });
  } catch (const json::exception& e) {
    fail(path + ": malformed tokenizer.json: " + e.what());
  }
  return Tokenizer(std::move(impl));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  std::string valid;
  if (replace_invalid_utf8(text, valid)) text = valid;
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  // Added tokens are cut out of the raw text first: the longest one starting at the earliest position.
  size_t section = 0;
  for (size_t i = 0; i < text.size();) {
    if (!impl_->added_first[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const std::string* hit = nullptr;
    for (const std::string& a : impl_->added)
      if (text.compare(i, a.size(), a) == 0) {
        hit = &a;
        break;
      }
    if (!hit) {
      ++i;
      continue;
    }
    impl_->encode_section(text.substr(section, i - section), ids);
    ids.push_back(impl_->raw_to_id.find(*hit)->second);
    i += hit->size();
    section = i;
  }
  impl_->encode_section(text.substr(section), ids);
  return ids;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  // Byte runs between added tokens are decoded separately, each with invalid UTF-8 replaced, as the reference does.
  std::string out, run, fixed;
  auto flush = [&] {
    out += replace_invalid_utf8(run, fixed) ? fixed : run;
    run.clear();
  };
  for (size_t k = 0; k < ids.size(); ++k) {
    const int32_t id = ids[k];
    if (id < 0 || id >= static_cast<int32_t>(impl_->id_to_raw.size()) ||
        (impl_->id_to_raw[id].empty() && !impl_->id_is_added[id]))
      fail("tokenizer: cannot decode id " + std::to_string(id) + " at position " + std::to_string(k) +
           ": no such token in " + impl_->path);
    if (impl_->id_is_added[id]) {
      flush();
      out += impl_->id_to_raw[id];
    } else {
      run += impl_->id_to_raw[id];
    }
  }
  flush();
  return out;
}

int32_t Tokenizer::token_id(std::string_view token) const {
  const auto it = impl_->raw_to_id.find(token);
  if (it == impl_->raw_to_id.end())
    fail("tokenizer: no token " + json(std::string(token)).dump(-1, ' ', false, json::error_handler_t::replace) +
         " in " + impl_->path);
  return it->second;
}

size_t Tokenizer::vocab_size() const { return impl_->id_to_raw.size(); }

void tokenize_stream(const Tokenizer& tokenizer, std::istream& in, std::ostream& out, bool decode) {
  std::string line, text;
  for (size_t lineno = 1; std::getline(in, line); ++lineno) {
    try {
      const json value = json::parse(line);
      if (decode) {
        if (!value.is_array()) fail("expected a JSON array of token ids");
        std::vector<int32_t> ids;
        ids.reserve(value.size());
        for (const json& v : value) {
          if (!v.is_number_integer()) fail("expected integer token ids, got " + v.dump());
          ids.push_back(v.get<int32_t>());
        }
        out << json(tokenizer.decode(ids)).dump() << '\n';
      } else {
        if (!value.is_string()) fail("expected a JSON string");
        const std::vector<int32_t> ids = tokenizer.encode(value.get_ref<const std::string&>());
        text.assign(1, '[');
        for (size_t k = 0; k < ids.size(); ++k) {
          if (k) text += ',';
          text += std::to_string(ids[k]);
        }
        text += "]\n";
        out << text;
      }
    } catch (const json::exception& e) {
      fail("tokenize: input line " + std::to_string(lineno) + ": " + e.what());
    } catch (const Error& e) {
      fail("tokenize: input line " + std::to_string(lineno) + ": " + e.what());
    }
  }
}

}  // namespace q3vl
