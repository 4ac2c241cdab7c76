// Conversations for supervised fine-tuning: one JSONL record -> the Qwen3-VL chat template -> token ids and labels.
//
// Two record formats (one JSON object per line):
//  - messages: {"messages": [{"role": "system"|"user"|"assistant",
//                             "content": "text" | [{"type": "image", "image": "path"}, {"type": "text", "text": ...},
//                                                  {"type": "video", "video": "clip.mp4" | ["f0.png", "f1.png", ...],
//                                                   "fps": 2, "max_frames": 64, "total_pixels": ...}]}]}
//    A video part's other keys are qwen-vl-utils' per-sample settings (data/video_processor.hpp's overrides); for a
//    list of frames, "fps" is the rate the frames were taken at (qwen-vl-utils' convention, default 2).
//  - LLaVA:    {"image": "a.jpg" | ["a.jpg", ...], "conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
//    converted as the official fine-tuning code does (qwen-vl-finetune data_processor.py _build_messages): human ->
//    user, gpt -> assistant; a human value is split at each "<image>", which takes the next image; every text piece is
//    stripped of ASCII whitespace and dropped when empty. "system" is q3vl's addition; "user"/"assistant" are also read.
// Template (spec 6.4, Qwen3-VL Instruct): no default system prompt; "<|im_start|>ROLE\n" + content + "<|im_end|>\n";
// an image is "<|vision_start|><|image_pad|><|vision_end|>", text parts are written raw with nothing in between.
// A video is "<|vision_start|><|video_pad|><|vision_end|>" in the template; Qwen3VLProcessor (transformers 5.17)
// replaces the pad alone, per temporal patch, by "<T seconds><|vision_start|>" + pads + "<|vision_end|>", so the
// patches sit inside the template's own markers (the spec's "replaced as a whole" is not what transformers does:
// tests/data/video/processor.h5), then tokenizes the text.
// Images and videos are allowed in user turns only, and a system message only first.
// Labels (spec 5.2, the official rule): -100 everywhere except, after every "<|im_start|>assistant", from two tokens
// later up to and including the next <|im_end|> and the token after it ("\n").
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "q3vl/data/image.hpp"
#include "q3vl/data/video_processor.hpp"

namespace q3vl {

class Tokenizer;
class VideoFile;

struct ChatPart {
  bool image = false, video = false;
  std::string text;  // the text, or the image or video path as written in the record (empty: a list of frames)
};

// A video part: a file, or a list of frame images; its per-sample settings in the order written.
struct VideoRef {
  std::string path;
  std::vector<std::string> frames;
  std::vector<std::pair<std::string, double>> settings;
  std::string where;  // "file:line: message M part P", for messages
  // base with the settings applied (errors name `where`); for a list of frames "fps" is the frames' own rate
  // (source_fps), not the sampling rate.
  VideoConfig config(const VideoConfig& base) const;
  double source_fps() const;  // a frame list's rate: its "fps" setting, else 2 (qwen-vl-utils)
};

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::vector<ChatPart> parts;
};

struct Conversation {
  std::vector<ChatMessage> messages;
  std::vector<std::string> images;  // image paths in order of appearance
  std::vector<VideoRef> videos;     // videos in order of appearance
  std::string file;                 // source, for messages
  long line = 0;
  std::string where() const { return file + ":" + std::to_string(line); }
};

// A video part read and processed (relative paths under `root`): a file probed and only its sampled frames decoded
// (data/video.hpp, FFmpeg), or a list of frame images decoded frame by frame (only the sampled ones) at its
// source_fps; sampled and resized with v.config(base). `name` names the part in errors (a missing file: "NAME: no
// such file ...", a missing frame: "NAME frame K 'PATH': no such file ...").
VideoClip load_video_part(const VideoRef& v, const VideoConfig& base, const std::string& root, const std::string& name);
// An open video's clip (generate's and serve's, from a file or a request's bytes): the indices sample_frame_indices
// picks from its frame count and rate, decoded a few at a time, each frame resized at once to video_smart_resize's
// size (resize_clip's result, without a long clip's full-size frames all in memory). Errors name `name`.
VideoClip sample_clip(VideoFile& file, const VideoConfig& c, const std::string& name);
// "FILE:LINE: message M part P: video 'clip.mp4'" (a frame list: its first frame and ", ...").
std::string video_part_name(const VideoRef& v);

// One record, either format. Every problem is an error "FILE:LINE: ...".
Conversation parse_record(const nlohmann::json& record, const std::string& file, long line);
// One JSONL line: JSON syntax errors are reported as "FILE:LINE: bad JSON: ...".
Conversation parse_line(const std::string& text, const std::string& file, long line);

// The template's text, one <|image_pad|> per image (what tokenizer.apply_chat_template returns). With `videos` (one
// per video of conv), each video is written as the processor expands it, with one <|video_pad|> per temporal patch.
std::string render_chat(const Conversation& conv, const std::vector<VideoGrid>* videos = nullptr);

struct EncodedChat {
  std::vector<int32_t> input_ids;
  std::vector<int32_t> labels;  // -100 where not supervised
};

// Renders, tokenizes and expands image i's pad to image_tokens(grids[i], merge) pads and each temporal patch of video
// v to h*w/merge^2 pads (as Qwen3VLProcessor does); fails when grids do not match the images and videos or the text
// itself contains <|image_pad|> or <|video_pad|>.
EncodedChat encode_conversation(const Conversation& conv, const Tokenizer& tok, const std::vector<ImageGrid>& grids,
                                int merge = 2, const std::vector<VideoGrid>& videos = {});

// The official label rule on finished ids.
std::vector<int32_t> assistant_labels(const std::vector<int32_t>& ids, int32_t im_start, int32_t assistant,
                                      int32_t im_end);

}  // namespace q3vl
