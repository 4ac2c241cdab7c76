#include "q3vl/data/chat.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "q3vl/core/error.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/data/video.hpp"

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
      if (!p.image && !p.video) continue;
      if (m.role != "user")
        fail(at + ": images and videos are allowed in user turns only (this is a " + m.role + " turn)");
      if (p.image) c.images.push_back(p.text);
    }
  }
}

VideoRef parse_video(const json& p, const std::string& at) {
  VideoRef v;
  v.where = at;
  if (!p.contains("video")) fail(at + ": a video part needs a \"video\": a path or a list of frame paths");
  const json& src = p["video"];
  if (src.is_string()) {
    v.path = src.get<std::string>();
    if (v.path.empty()) fail(at + ": empty video path");
  } else if (src.is_array()) {
    for (const json& f : src) {
      if (!f.is_string() || f.get<std::string>().empty()) fail(at + ": \"video\" frames must be non-empty paths");
      v.frames.push_back(f.get<std::string>());
    }
    if (v.frames.empty()) fail(at + ": a video part with no frames");
  } else {
    fail(at + ": \"video\" must be a path or a list of frame paths, got " + kind_of(src));
  }
  for (const auto& [key, val] : p.items()) {
    if (key == "type" || key == "video") continue;
    if (!is_video_override(key))
      fail(at + ": unknown key \"" + key + "\" in a video part (fps, min_frames, max_frames, min_pixels, "
           "max_pixels, total_pixels)");
    if (!val.is_number()) fail(at + ": \"" + key + "\" must be a number, got " + kind_of(val));
    v.settings.emplace_back(key, val.get<double>());
  }
  v.config(VideoConfig{});  // checks the values now, naming the part
  return v;
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
      out.parts.push_back({false, false, content.get<std::string>()});
    } else if (content.is_array()) {
      for (size_t k = 0; k < content.size(); ++k) {
        const json& p = content[k];
        const std::string pat = at + " part " + std::to_string(k + 1);
        if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
          fail(pat + " must be an object with a \"type\"");
        const std::string type = p["type"].get<std::string>();
        if (type == "video") {
          c.videos.push_back(parse_video(p, pat));
          out.parts.push_back({false, true, c.videos.back().path});
          continue;
        }
        const char* key = type == "image" ? "image" : type == "text" ? "text" : nullptr;
        if (!key) fail(pat + ": unknown type '" + type + "' (types: text, image, video)");
        if (!p.contains(key) || !p[key].is_string()) fail(pat + ": a " + type + " part needs a \"" + key + "\" string");
        if (type == "image" && p[key].get<std::string>().empty()) fail(pat + ": empty image path");
        out.parts.push_back({type == "image", false, p[key].get<std::string>()});
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
      m.parts.push_back({false, false, value});
    } else {
      size_t pos = 0;
      while (true) {
        const size_t hit = value.find("<image>", pos);
        const std::string piece = strip(value.substr(pos, hit == std::string::npos ? std::string::npos : hit - pos));
        if (!piece.empty()) m.parts.push_back({false, false, piece});
        if (hit == std::string::npos) break;
        ++placeholders;
        if (next_image < images.size()) m.parts.push_back({true, false, images[next_image++]});
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

VideoConfig VideoRef::config(const VideoConfig& base) const {
  VideoConfig c = base;
  for (const auto& [key, value] : settings) {
    const VideoConfig checked = apply_video_overrides(c, key, value, where);
    if (!(key == "fps" && !frames.empty())) c = checked;
  }
  return c;
}

std::string video_part_name(const VideoRef& v) {
  return v.where + ": video '" + (v.path.empty() ? v.frames.at(0) + ", ..." : v.path) + "'";
}

VideoClip sample_clip(VideoFile& file, const VideoConfig& c, const std::string& name) {
  const VideoInfo& info = file.info();
  std::vector<int64_t> idx = sample_frame_indices(info.frames, info.fps, c, name);
  // resize_clip's size and frames, a chunk at a time: a long clip's full-size frames are never all in memory.
  const auto [th, tw] = video_smart_resize(int(idx.size()), info.height, info.width, c, name);
  constexpr size_t kChunk = 16;
  VideoClip clip;
  clip.fps = info.fps;
  clip.frames.reserve(idx.size());
  for (size_t a = 0; a < idx.size(); a += kChunk) {
    const std::vector<int64_t> part(idx.begin() + ptrdiff_t(a), idx.begin() + ptrdiff_t(std::min(idx.size(), a + kChunk)));
    for (RgbImage& f : file.frames(part)) {
      if (f.h != info.height || f.w != info.width)
        fail(name + ": a frame is " + std::to_string(f.w) + "x" + std::to_string(f.h) + ", the video's header says " +
             std::to_string(info.width) + "x" + std::to_string(info.height));
      clip.frames.push_back(resize_bicubic_aa(f, tw, th));
      f = RgbImage{};
    }
  }
  clip.indices = std::move(idx);
  return clip;
}

VideoClip load_video_part(const VideoRef& v, const VideoConfig& base, const std::string& root,
                          const std::string& name) {
  namespace fs = std::filesystem;
  const VideoConfig c = v.config(base);
  if (v.frames.empty()) {  // a file: its frame count and rate from the container, only the sampled frames decoded
    const fs::path path = fs::path(v.path).is_absolute() ? fs::path(v.path) : fs::path(root) / v.path;
    if (!fs::is_regular_file(path)) fail(name + ": no such file " + path.string());
    try {
      VideoFile file(path.string());
      return sample_clip(file, c, name);
    } catch (const Error& e) {
      const std::string what = e.what();
      fail(what.rfind(name, 0) == 0 ? what : name + ": " + what);
    }
  }
  const std::vector<int64_t> idx = sample_frame_indices(int64_t(v.frames.size()), v.source_fps(), c, name);
  std::vector<RgbImage> frames;
  for (int64_t i : idx) {
    const std::string& rel = v.frames[size_t(i)];
    const fs::path path = fs::path(rel).is_absolute() ? fs::path(rel) : fs::path(root) / rel;
    const std::string fname = name + " frame " + std::to_string(i + 1) + " '" + rel + "'";
    if (!fs::is_regular_file(path)) fail(fname + ": no such file " + path.string());
    try {
      frames.push_back(load_image(path.string()));
    } catch (const Error& e) {
      fail(fname + ": " + e.what());
    }
  }
  return resize_clip(std::move(frames), idx, v.source_fps(), c, name);
}

double VideoRef::source_fps() const {
  double fps = 2.0;
  for (const auto& [key, value] : settings)
    if (key == "fps") fps = value;
  return fps;
}

std::string render_chat(const Conversation& conv, const std::vector<VideoGrid>* videos) {
  if (videos && videos->size() != conv.videos.size())
    fail(conv.where() + ": " + std::to_string(conv.videos.size()) + " video(s) but " +
         std::to_string(videos->size()) + " processed");
  std::string s;
  size_t video = 0;
  for (const ChatMessage& m : conv.messages) {
    s += "<|im_start|>" + m.role + "\n";
    for (const ChatPart& p : m.parts) {
      if (p.image) {
        s += "<|vision_start|><|image_pad|><|vision_end|>";
      } else if (!p.video) {
        s += p.text;
      } else if (!videos) {
        s += "<|vision_start|><|video_pad|><|vision_end|>";
      } else {
        const VideoGrid& v = (*videos)[video++];
        if (v.timestamps.size() != size_t(v.grid.t))
          fail(conv.where() + ": video " + std::to_string(video) + " has " + std::to_string(v.grid.t) +
               " temporal patches but " + std::to_string(v.timestamps.size()) + " timestamps");
        // As transformers 5.17's Qwen3VLProcessor expands the chat template's "<|vision_start|><|video_pad|>
        // <|vision_end|>": the pad alone is replaced, so the patches sit inside the template's own markers.
        s += "<|vision_start|>";
        for (double t : v.timestamps) s += timestamp_text(t) + "<|vision_start|><|video_pad|><|vision_end|>";
        s += "<|vision_end|>";
      }
    }
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
                                int merge, const std::vector<VideoGrid>& videos) {
  if (grids.size() != conv.images.size())
    fail(conv.where() + ": " + std::to_string(conv.images.size()) + " image(s) but " + std::to_string(grids.size()) +
         " grid(s)");
  const int32_t pad = tok.token_id("<|image_pad|>"), vpad = tok.token_id("<|video_pad|>");
  const std::vector<int32_t> text_ids = tok.encode(render_chat(conv, &videos));
  EncodedChat out;
  size_t image = 0, video = 0, patch = 0;  // the next image; the next video and its next temporal patch
  for (int32_t id : text_ids) {
    if (id == vpad) {
      if (video == videos.size())
        fail(conv.where() + ": the text contains <|video_pad|> itself; write videos as video parts");
      const ImageGrid& g = videos[video].grid;
      out.input_ids.insert(out.input_ids.end(), size_t(g.h) * g.w / (size_t(merge) * merge), vpad);
      if (++patch == size_t(g.t)) patch = 0, ++video;
      continue;
    }
    if (id != pad) {
      out.input_ids.push_back(id);
      continue;
    }
    if (image == grids.size())
      fail(conv.where() + ": the text contains <|image_pad|> itself (" + std::to_string(grids.size()) +
           " image(s)); write images as image parts or <image>");
    out.input_ids.insert(out.input_ids.end(), size_t(image_tokens(grids[image++], merge)), pad);
  }
  if (video != videos.size() || patch != 0)
    fail(conv.where() + ": the text contains <|video_pad|> itself; write videos as video parts");
  out.labels = assistant_labels(out.input_ids, tok.token_id("<|im_start|>"), tok.token_id("assistant"),
                                tok.token_id("<|im_end|>"));
  return out;
}

}  // namespace q3vl
