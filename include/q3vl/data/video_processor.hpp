// Qwen3-VL video preprocessing, as transformers 5.17's Qwen3VLVideoProcessor and Qwen3VLProcessor do it (spec 6.2),
// on frames already decoded (data/video.hpp decodes files; a frame list is decoded as images):
//  - sampling: n = int(frames / video_fps * fps), clamped to [min_frames, max_frames] and to the frame count;
//    indices round(linspace(0, frames - 1, n)) with numpy's arithmetic and round-half-to-even;
//  - resize: one size for the clip, smart_resize over (n, h, w) with the pixel budget counted over all sampled frames
//    (factor patch*merge, temporal factor 2), then torchvision's resize (bicubic, antialias) on uint8 tensors, which
//    is torch's own uint8 kernel (int16 weights, per-axis precision): not PIL's (data/image.hpp's resize_bicubic);
//  - normalisation in float32 as the torchvision backend fuses it: (v - 255*mean) / (255*std);
//  - an odd frame count repeats the last frame; temporal patches of 2 frames; rows (t, br, bc, ir, ic), columns
//    (c, tt, py, px), as for images;
//  - per temporal patch the timestamp (t[2i] + t[2i+1]) / 2 with t = index / video_fps, written "<%.1f seconds>".
// In the prompt each temporal patch is "<T seconds><|vision_start|>" + pads + "<|vision_end|>", all inside the
// template's "<|vision_start|>" ... "<|vision_end|>" (data/chat.hpp), and
// the model sees each as an image-like grid [1, h, w] whose placeholder is video_token_id (model/positions.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "q3vl/data/image.hpp"

namespace q3vl {

// The released video_preprocessor_config.json (Qwen3-VL-2B-Instruct and the other sizes).
struct VideoConfig {
  int patch = 16;
  int temporal_patch = 2;
  int merge = 2;
  long min_pixels = 4096;      // size.shortest_edge: fewest pixels over all sampled frames
  long max_pixels = 25165824;  // size.longest_edge: the clip's budget over all sampled frames
  double fps = 2;              // frames sampled per second of video
  int min_frames = 4, max_frames = 768;
  bool cap_pixels_per_frame = false;  // transformers' qwen-vl-utils-style per-frame cap (off by default in 5.17)
  float mean[3] = {0.5f, 0.5f, 0.5f};
  float std[3] = {0.5f, 0.5f, 0.5f};
  int factor() const { return patch * merge; }
  // The image processor's view of the same patching (patchify's layout and token count).
  ImageConfig image() const;
};

// `base` with the values of a video_preprocessor_config.json (size, fps, min/max_frames, patch sizes, mean/std, and
// cap_pixels_per_frame when present); errors name the file.
VideoConfig read_video_config(const std::string& path, VideoConfig base = {});

// The video settings of a run: model.hf's video_preprocessor_config.json when there is one, else the released
// values; the deck's video.* keys win where given.
class Deck;
VideoConfig video_config(const Deck& d);

// Per-sample overrides as qwen-vl-utils spells them in a video part: fps, min_frames, max_frames, min_pixels,
// max_pixels or total_pixels (the clip's budget). Other keys of the part are the caller's (type, video, ...).
// `where` names the record in messages ("file:line: message 2 part 1").
VideoConfig apply_video_overrides(VideoConfig c, const std::string& key, double value, const std::string& where);
// Whether `key` is one of those override keys.
bool is_video_override(const std::string& key);

// Frame indices to decode from a clip of `frames` frames at `video_fps` (> 0).
std::vector<int64_t> sample_frame_indices(int64_t frames, double video_fps, const VideoConfig& c,
                                          const std::string& what = "video");

// Target (height, width) for `frames` sampled frames of h x w: transformers' video smart_resize (Python rounding).
// Fails naming `what` for fewer than temporal_patch frames or an aspect ratio beyond 200:1.
std::pair<int, int> video_smart_resize(int frames, int h, int w, const VideoConfig& c,
                                       const std::string& what = "video");

// A sampled clip as the model sees it and the dataset stores it: the resized uint8 frames (the sampled count, not
// padded), their indices in the source and the source's frame rate (timestamps).
struct VideoClip {
  std::vector<RgbImage> frames;
  std::vector<int64_t> indices;
  double fps = 0;
  int temporal_patches(int temporal_patch = 2) const {
    return int((frames.size() + size_t(temporal_patch) - 1) / size_t(temporal_patch));
  }
};

// Resizes the sampled frames (all the same size, frames[i] being source frame indices[i]) to the clip's target size.
VideoClip resize_clip(std::vector<RgbImage> sampled, std::vector<int64_t> indices, double video_fps,
                      const VideoConfig& c, const std::string& what = "video");

// Normalises and patchifies a resized clip: appends grid.patches() rows of 3*Tp*P*P floats; grid.t = temporal patches.
ImageGrid patchify_clip(const VideoClip& clip, const VideoConfig& c, std::vector<float>& patches_out);

// Each temporal patch's time in seconds: the mean of its two frames' index / fps (the last index repeated if odd).
std::vector<double> clip_timestamps(const std::vector<int64_t>& indices, double video_fps, int temporal_patch = 2);
// "<1.2 seconds>": Python's f"<{t:.1f} seconds>".
std::string timestamp_text(double seconds);

// Everything a prompt and the model need for one video: its temporal patches' grid ([t, h, w] in patches, t =
// temporal patches) and timestamps.
struct VideoGrid {
  ImageGrid grid;
  std::vector<double> timestamps;  // [grid.t]
};

}  // namespace q3vl
