#include "q3vl/data/chat.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "q3vl/core/error.hpp"
#include "q3vl/data/tokenizer.hpp"

namespace q3vl {

using json = nlohmann::json;

namespace {

const char* kWhitespace = " \t\n\r\f\v";

std::string strip(const std::string& s) {
  const size_t a = s.find_first_not_of(kWhitespace);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(kWhitespace) - a + 1);
}

// Type names as a user reads them, for "must be a string, got a number".
std::string kind_of(const json& j) {
  if (j.is_null()) return "null";
  if (j.is_string()) return "a string";
  if (j.is_array()) return "a list";
  if (j.is_object()) return "an object";
  if (j.is_boolean()) return "a boolean";
  return "a number";
}

void check_roles(Conversation& c) {
  if (c.messages.empty()) fail(c.where() + ": the record has no messages");
  for (size_t i = 0; i < c.messages.size(); ++i) {
    const ChatMessage& m = c.messages[i];
    const std::string at = c.where() + ": message " + std::to_string(i + 1);
    if (m.role == "system" && i != 0) fail(at + ": a system message must come first");
    for (const ChatPart& p : m.parts) {
      if (!p.image) continue;
      if (m.role != "user") fail(at + ": images are allowed in user turns only (this is a " + m.role + " turn)");
      c.images.push_back(p.text);
    }
  }
}

Conversation parse_messages(const json& msgs, Conversation c) {
  if (!msgs.is_array()) fail(c.where() + ": \"messages\" must be a list, got " + kind_of(msgs));
  for (size_t i = 0; i < msgs.size(); ++i) {
    const json& m = msgs[i];
    const std::string at = c.where() + ": message " + std::to_string(i + 1);
    if (!m.is_object()) fail(at + " must be an object, got " + kind_of(m));
    if (!m.contains("role") || !m["role"].is_string()) fail(at + " has no \"role\" string");
    ChatMessage out{m["role"].get<std::string>(), {}};
    if (out.role != "system" && out.role != "user" && out.role != "assistant")
      fail(at + ": unknown role '" + out.role + "' (roles: system, user, assistant)");
    if (!m.contains("content") || m["content"].is_null()) fail(at + " has no \"content\"");
    const json& content = m["content"];
    if (content.is_string()) {
      out.parts.push_back({false, content.get<std::string>()});
    } else if (content.is_array()) {
      for (size_t k = 0; k < content.size(); ++k) {
        const json& p = content[k];
        const std::string pat = at + " part " + std::to_string(k + 1);
        if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
          fail(pat + " must be an object with a \"type\"");
        const std::string type = p["type"].get<std::string>();
        const char* key = type == "image" ? "image" : type == "text" ? "text" : nullptr;
        if (!key) fail(pat + ": unknown type '" + type + "' (types: text, image)");
        if (!p.contains(key) || !p[key].is_string()) fail(pat + ": a " + type + " part needs a \"" + key + "\" string");
        if (type == "image" && p[key].get<std::string>().empty()) fail(pat + ": empty image path");
        out.parts.push_back({type == "image", p[key].get<std::string>()});
      }
    } else {
      fail(at + ": \"content\" must be a string or a list of parts, got " + kind_of(content));
    }
    c.messages.push_back(std::move(out));
  }
  return c;
}

Conversation parse_llava(const json& rec, Conversation c) {
  std::vector<std::string> images;
  if (rec.contains("image") && !rec["image"].is_null()) {
    const json& im = rec["image"];
    if (im.is_string()) {
      images.push_back(im.get<std::string>());
    } else if (im.is_array()) {
      for (const json& x : im) {
        if (!x.is_string()) fail(c.where() + ": \"image\" must be a path or a list of paths");
        images.push_back(x.get<std::string>());
      }
    } else {
      fail(c.where() + ": \"image\" must be a path or a list of paths, got " + kind_of(im));
    }
  }
  const json& convs = rec["conversations"];
  if (!convs.is_array()) fail(c.where() + ": \"conversations\" must be a list, got " + kind_of(convs));
  size_t next_image = 0, placeholders = 0;
  for (size_t i = 0; i < convs.size(); ++i) {
    const json& t = convs[i];
    const std::string at = c.where() + ": conversation turn " + std::to_string(i + 1);
    if (!t.is_object()) fail(at + " must be an object, got " + kind_of(t));
    if (!t.contains("from") || !t["from"].is_string()) fail(at + " has no \"from\" string");
    if (!t.contains("value") || !t["value"].is_string()) fail(at + " has no \"value\" string");
    const std::string from = t["from"].get<std::string>(), value = t["value"].get<std::string>();
    ChatMessage m;
    if (from == "human" || from == "user") m.role = "user";
    else if (from == "gpt" || from == "assistant") m.role = "assistant";
    else if (from == "system") m.role = "system";
    else fail(at + ": unknown speaker '" + from + "' (from: human, gpt, system)");
    if (m.role != "user") {
      m.parts.push_back({false, value});
    } else {
      size_t pos = 0;
      while (true) {
        const size_t hit = value.find("<image>", pos);
        const std::string piece = strip(value.substr(pos, hit == std::string::npos ? std::string::npos : hit - pos));
        if (!piece.empty()) m.parts.push_back({false, piece});
        if (hit == std::string::npos) break;
        ++placeholders;
        if (next_image < images.size()) m.parts.push_back({true, images[next_image++]});
        pos = hit + 7;
      }
    }
    c.messages.push_back(std::move(m));
  }
  if (placeholders != images.size())
    fail(c.where() + ": " + std::to_string(placeholders) + " <image> placeholder(s) in human turns but " +
         std::to_string(images.size()) + " image(s)");
  return c;
}

}  // namespace

Conversation parse_record(const json& rec, const std::string& file, long line) {
  Conversation c;
  c.file = file;
  c.line = line;
  if (!rec.is_object()) fail(c.where() + ": a record must be a JSON object, got " + kind_of(rec));
  if (rec.contains("messages")) c = parse_messages(rec["messages"], std::move(c));
  else if (rec.contains("conversations")) c = parse_llava(rec, std::move(c));
  else fail(c.where() + ": the record has neither \"messages\" nor \"conversations\"");
  check_roles(c);
  return c;
}

Conversation parse_line(const std::string& text, const std::string& file, long line) {
  json rec;
  try {
    rec = json::parse(text);
  } catch (const json::exception& e) {
    fail(file + ":" + std::to_string(line) + ": bad JSON: " + e.what());
  }
  return parse_record(rec, file, line);
}

std::string render_chat(const Conversation& conv) {
  std::string s;
  for (const ChatMessage& m : conv.messages) {
    s += "<|im_start|>" + m.role + "\n";
    for (const ChatPart& p : m.parts) s += p.image ? "<|vision_start|><|image_pad|><|vision_end|>" : p.text;
    s += "<|im_end|>\n";
  }
  return s;
}

std::vector<int32_t> assistant_labels(const std::vector<int32_t>& ids, int32_t im_start, int32_t assistant,
                                      int32_t im_end) {
  const size_t n = ids.size();
  std::vector<int32_t> labels(n, -100);
  for (size_t pos = 1; pos < n; ++pos) {
    if (ids[pos] != assistant || ids[pos - 1] != im_start) continue;
    size_t end = pos + 2;
    while (end < n && ids[end] != im_end) ++end;
    if (end == n) continue;  // an unfinished answer is not supervised
    for (size_t k = pos + 2; k < std::min(end + 2, n); ++k) labels[k] = ids[k];
    pos = end;
  }
  return labels;
}

EncodedChat encode_conversation(const Conversation& conv, const Tokenizer& tok, const std::vector<ImageGrid>& grids,
                                int merge) {
  if (grids.size() != conv.images.size())
    fail(conv.where() + ": " + std::to_string(conv.images.size()) + " image(s) but " + std::to_string(grids.size()) +
         " grid(s)");
  const int32_t pad = tok.token_id("<|image_pad|>");
  const std::vector<int32_t> text_ids = tok.encode(render_chat(conv));
  EncodedChat out;
  size_t image = 0;
  for (int32_t id : text_ids) {
    if (id != pad) {
      out.input_ids.push_back(id);
      continue;
    }
    if (image == grids.size())
      fail(conv.where() + ": the text contains <|image_pad|> itself (" + std::to_string(grids.size()) +
           " image(s)); write images as image parts or <image>");
    out.input_ids.insert(out.input_ids.end(), size_t(image_tokens(grids[image++], merge)), pad);
  }
  out.labels = assistant_labels(out.input_ids, tok.token_id("<|im_start|>"), tok.token_id("assistant"),
                                tok.token_id("<|im_end|>"));
  return out;
}

}  // namespace q3vl
