#include "q3vl/data/video_processor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q3vl/core/deck.hpp"
#include "q3vl/core/error.hpp"

namespace q3vl {

ImageConfig VideoConfig::image() const {
  ImageConfig ic;
  ic.patch = patch;
  ic.temporal_patch = temporal_patch;
  ic.merge = merge;
  for (int c = 0; c < 3; ++c) ic.mean[c] = mean[c], ic.std[c] = std[c];
  return ic;
}

VideoConfig read_video_config(const std::string& path, VideoConfig c) {
  try {
    std::ifstream f(path);
    if (!f) fail(path + ": cannot open");
    const nlohmann::json j = nlohmann::json::parse(f);
    const nlohmann::json size = j.value("size", nlohmann::json::object());
    c.min_pixels = size.value("shortest_edge", j.value("min_pixels", c.min_pixels));
    c.max_pixels = size.value("longest_edge", j.value("max_pixels", c.max_pixels));
    c.fps = j.value("fps", c.fps);
    c.min_frames = j.value("min_frames", c.min_frames);
    c.max_frames = j.value("max_frames", c.max_frames);
    c.patch = j.value("patch_size", c.patch);
    c.temporal_patch = j.value("temporal_patch_size", c.temporal_patch);
    c.merge = j.value("merge_size", c.merge);
    if (j.contains("cap_pixels_per_frame") && j["cap_pixels_per_frame"].is_boolean())
      c.cap_pixels_per_frame = j["cap_pixels_per_frame"].get<bool>();
    for (const char* key : {"image_mean", "image_std"}) {
      if (!j.contains(key)) continue;
      const auto v = j[key].get<std::vector<float>>();
      if (v.size() != 3) fail(path + ": " + key + " must have 3 values");
      for (int k = 0; k < 3; ++k) (key[6] == 'm' ? c.mean : c.std)[k] = v[size_t(k)];
    }
  } catch (const nlohmann::json::exception& e) {
    fail(path + ": " + e.what());
  }
  if (c.min_pixels > c.max_pixels || c.min_frames > c.max_frames || c.fps <= 0 || c.min_frames < 1)
    fail(path + ": inconsistent video settings (pixels " + std::to_string(c.min_pixels) + ".." +
         std::to_string(c.max_pixels) + ", frames " + std::to_string(c.min_frames) + ".." +
         std::to_string(c.max_frames) + ", fps " + std::to_string(c.fps) + ")");
  return c;
}

VideoConfig video_config(const Deck& d) {
  VideoConfig c;
  const std::string hf = d.str("model.hf"), file = hf + "/video_preprocessor_config.json";
  if (!hf.empty() && std::ifstream(file)) c = read_video_config(file, c);
  if (d.given("video.fps")) c.fps = d.real("video.fps");
  if (d.given("video.min_frames")) c.min_frames = int(d.integer("video.min_frames"));
  if (d.given("video.max_frames")) c.max_frames = int(d.integer("video.max_frames"));
  if (d.given("video.min_pixels")) c.min_pixels = long(d.integer("video.min_pixels"));
  if (d.given("video.max_pixels")) c.max_pixels = long(d.integer("video.max_pixels"));
  if (d.given("video.cap_pixels_per_frame")) c.cap_pixels_per_frame = d.boolean("video.cap_pixels_per_frame");
  if (c.min_frames > c.max_frames) fail("video.min_frames is larger than video.max_frames");
  if (c.min_pixels > c.max_pixels) fail("video.min_pixels is larger than video.max_pixels");
  return c;
}

bool is_video_override(const std::string& key) {
  for (const char* k : {"fps", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels"})
    if (key == k) return true;
  return false;
}

VideoConfig apply_video_overrides(VideoConfig c, const std::string& key, double v, const std::string& where) {
  const auto whole = [&](double lo, double hi) {
    if (!(v >= lo && v <= hi) || v != std::floor(v))
      fail(where + ": \"" + key + "\" must be a whole number in [" + std::to_string(long(lo)) + ", " +
           std::to_string(long(hi)) + "], got " + std::to_string(v));
    return long(v);
  };
  if (key == "fps") {
    if (!(v > 0 && v <= 1000)) fail(where + ": \"fps\" must be in (0, 1000], got " + std::to_string(v));
    c.fps = v;
  } else if (key == "min_frames") {
    c.min_frames = int(whole(1, 1 << 20));
  } else if (key == "max_frames") {
    c.max_frames = int(whole(1, 1 << 20));
  } else if (key == "min_pixels") {
    c.min_pixels = whole(1, 1e12);
  } else if (key == "max_pixels" || key == "total_pixels") {
    c.max_pixels = whole(1, 1e12);
  } else {
    fail(where + ": unknown video setting \"" + key +
         "\" (fps, min_frames, max_frames, min_pixels, max_pixels, total_pixels)");
  }
  if (c.min_frames > c.max_frames)
    fail(where + ": min_frames " + std::to_string(c.min_frames) + " > max_frames " + std::to_string(c.max_frames));
  if (c.min_pixels > c.max_pixels)
    fail(where + ": min_pixels " + std::to_string(c.min_pixels) + " > max_pixels " + std::to_string(c.max_pixels));
  return c;
}

std::vector<int64_t> sample_frame_indices(int64_t frames, double video_fps, const VideoConfig& c,
                                          const std::string& what) {
  if (frames <= 0) fail(what + ": the video has no frames");
  if (!(video_fps > 0)) fail(what + ": the video has no frame rate");
  // Python: int(total_num_frames / metadata.fps * fps), then min(max(n, min_frames), max_frames, total).
  int64_t n = int64_t(double(frames) / video_fps * c.fps);
  n = std::min({std::max<int64_t>(n, c.min_frames), int64_t(c.max_frames), frames});
  // np.linspace(0, frames - 1, n): i * step, the last exactly frames - 1; then .round() (half to even).
  std::vector<int64_t> idx(size_t(n), 0);
  if (n > 1) {
    const double step = double(frames - 1) / double(n - 1);
    for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = int64_t(std::nearbyint(double(i) * step));
    idx.back() = frames - 1;
  }
  return idx;
}

std::pair<int, int> video_smart_resize(int frames, int h, int w, const VideoConfig& c, const std::string& what) {
  const int factor = c.factor(), tf = c.temporal_patch;
  if (frames < tf)
    fail(what + ": " + std::to_string(frames) + " frame(s) sampled; a video needs at least " + std::to_string(tf));
  if (h <= 0 || w <= 0) fail(what + ": frames have no pixels");
  double hh = h, ww = w;
  if (h < factor || w < factor) {  // Python: scale up, then int() truncates
    const double scale = std::max(double(factor) / h, double(factor) / w);
    hh = double(int64_t(h * scale));
    ww = double(int64_t(w * scale));
  }
  if (std::max(hh, ww) / std::min(hh, ww) > 200)
    fail(what + ": aspect ratio " + std::to_string(w) + "x" + std::to_string(h) +
         " is more extreme than 200:1 (transformers' smart_resize refuses it)");
  // Python's round() on an exact quotient is round-half-to-even: nearbyint.
  int64_t hb = int64_t(std::nearbyint(hh / factor)) * factor;
  int64_t wb = int64_t(std::nearbyint(ww / factor)) * factor;
  const int64_t tb = int64_t(std::nearbyint(double(frames) / tf)) * tf;
  long max_pixels = c.max_pixels;
  if (c.cap_pixels_per_frame) {  // max(min(768 * factor^2, longest // frames), int(shortest * 1.05)) per frame
    const long per = std::max(std::min(768L * factor * factor, c.max_pixels / frames), long(c.min_pixels * 1.05));
    max_pixels = per * frames;
  }
  const double thw = double(frames) * hh * ww;
  if (double(tb) * double(hb) * double(wb) > double(max_pixels)) {
    const double beta = std::sqrt(thw / double(max_pixels));
    hb = std::max<int64_t>(factor, int64_t(std::floor(hh / beta / factor)) * factor);
    wb = std::max<int64_t>(factor, int64_t(std::floor(ww / beta / factor)) * factor);
  } else if (double(tb) * double(hb) * double(wb) < double(c.min_pixels)) {
    const double beta = std::sqrt(double(c.min_pixels) / thw);
    hb = int64_t(std::ceil(hh * beta / factor)) * factor;
    wb = int64_t(std::ceil(ww * beta / factor)) * factor;
  }
  return {int(hb), int(wb)};
}

VideoClip resize_clip(std::vector<RgbImage> sampled, std::vector<int64_t> indices, double video_fps,
                      const VideoConfig& c, const std::string& what) {
  if (sampled.empty()) fail(what + ": no frames");
  if (sampled.size() != indices.size())
    fail(what + ": " + std::to_string(sampled.size()) + " frames for " + std::to_string(indices.size()) + " indices");
  const int h = sampled[0].h, w = sampled[0].w;
  for (size_t i = 0; i < sampled.size(); ++i)
    if (sampled[i].h != h || sampled[i].w != w)
      fail(what + ": frame " + std::to_string(indices[i]) + " is " + std::to_string(sampled[i].w) + "x" +
           std::to_string(sampled[i].h) + ", the first is " + std::to_string(w) + "x" + std::to_string(h));
  const auto [th, tw] = video_smart_resize(int(sampled.size()), h, w, c, what);
  VideoClip clip;
  clip.indices = std::move(indices);
  clip.fps = video_fps;
  clip.frames.reserve(sampled.size());
  for (RgbImage& f : sampled) {
    clip.frames.push_back(resize_bicubic_aa(f, tw, th));
    f = RgbImage{};  // the source frame is not needed any more
  }
  return clip;
}

ImageGrid patchify_clip(const VideoClip& clip, const VideoConfig& c, std::vector<float>& out) {
  const int P = c.patch, Tp = c.temporal_patch, m = c.merge;
  if (clip.frames.empty()) fail("patchify_clip: the clip has no frames");
  const int H = clip.frames[0].h, W = clip.frames[0].w;
  if (H % (P * m) || W % (P * m))
    fail("patchify_clip: frames " + std::to_string(W) + "x" + std::to_string(H) + " are not a multiple of " +
         std::to_string(P * m) + " on each side");
  // The torchvision backend's fused rescale and normalise: float32 (v - mean*255) / (std*255).
  float lut[3][256];
  for (int ch = 0; ch < 3; ++ch) {
    const float mu = c.mean[ch] * 255.0f, sd = c.std[ch] * 255.0f;
    for (int v = 0; v < 256; ++v) lut[ch][v] = (float(v) - mu) / sd;
  }
  ImageGrid g{clip.temporal_patches(Tp), H / P, W / P};
  const size_t nf = clip.frames.size(), row_len = size_t(3) * Tp * P * P;
  size_t pos = out.size();
  out.resize(pos + size_t(g.patches()) * row_len);
  for (int t = 0; t < g.t; ++t)
    for (int br = 0; br < g.h / m; ++br)
      for (int bc = 0; bc < g.w / m; ++bc)
        for (int ir = 0; ir < m; ++ir)
          for (int ic = 0; ic < m; ++ic) {
            const int y0 = (br * m + ir) * P, x0 = (bc * m + ic) * P;
            float* row = &out[pos];
            for (int ch = 0; ch < 3; ++ch)
              for (int tt = 0; tt < Tp; ++tt) {
                const RgbImage& f = clip.frames[std::min(size_t(t) * Tp + tt, nf - 1)];  // odd: the last again
                if (f.h != H || f.w != W) fail("patchify_clip: the clip's frames differ in size");
                for (int py = 0; py < P; ++py) {
                  const uint8_t* src = &f.px[(size_t(y0 + py) * W + x0) * 3 + ch];
                  float* dst = row + ((size_t(ch) * Tp + tt) * P + py) * P;
                  for (int px = 0; px < P; ++px) dst[px] = lut[ch][src[size_t(px) * 3]];
                }
              }
            pos += row_len;
          }
  return g;
}

std::vector<double> clip_timestamps(const std::vector<int64_t>& indices, double video_fps, int tp) {
  std::vector<int64_t> idx = indices;
  while (!idx.empty() && idx.size() % size_t(tp)) idx.push_back(idx.back());
  std::vector<double> out;
  for (size_t i = 0; i < idx.size(); i += size_t(tp))
    out.push_back((double(idx[i]) / video_fps + double(idx[i + size_t(tp) - 1]) / video_fps) / 2);
  return out;
}

std::string timestamp_text(double seconds) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "<%.1f seconds>", seconds);  // glibc rounds the exact value, half to even: Python's
  return buf;
}

}  // namespace q3vl
