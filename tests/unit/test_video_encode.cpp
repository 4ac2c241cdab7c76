// Video encoding (src/data/video_encode.cpp): frames encoded, then probed and decoded back by our decoder (and
// counted by ffprobe), equal to the originals within codec loss; the same frames give the same bytes; bad paths and
// bad frames are refused naming the file, and leave nothing behind.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../errors.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/video.hpp"

namespace {

namespace fs = std::filesystem;
using q3vl::RgbImage;

struct TempDir {
  std::string dir;
  TempDir() {
    char t[] = "/tmp/q3vl_venc_XXXXXX";
    if (!mkdtemp(t)) throw std::runtime_error("cannot make a temporary folder");
    dir = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

// A smooth gradient with a square of another colour moving right: frame k differs from frame k+1.
std::vector<RgbImage> moving_square(int w, int h, int n) {
  std::vector<RgbImage> out(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    RgbImage& im = out[size_t(k)];
    im.w = w, im.h = h;
    im.px.resize(size_t(w) * size_t(h) * 3);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        const bool in = x >= 4 + 3 * k && x < 20 + 3 * k && y >= h / 2 - 8 && y < h / 2 + 8;
        uint8_t* p = &im.px[(size_t(y) * size_t(w) + size_t(x)) * 3];
        p[0] = uint8_t(in ? 220 : 40 + 2 * x);
        p[1] = uint8_t(in ? 60 : 60 + 2 * y);
        p[2] = uint8_t(in ? 40 : 120);
      }
  }
  return out;
}

double mean_abs_diff(const RgbImage& a, const RgbImage& b) {
  double s = 0;
  for (size_t i = 0; i < a.px.size(); ++i) s += std::fabs(double(a.px[i]) - double(b.px[i]));
  return s / double(a.px.size());
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

#if !defined(Q3VL_FFMPEG) || Q3VL_FFMPEG

// Encodes 12 frames of 64x48 at 8 fps with `encoder`, then checks what the decoder and ffprobe make of the file.
void round_trip(const std::string& file, const std::string& encoder, const std::string& codec) {
  TempDir t;
  const std::string path = t.dir + "/" + file;
  const std::vector<RgbImage> frames = moving_square(64, 48, 12);
  EXPECT_EQ(q3vl::encode_video(path, frames, 8.0, encoder), encoder.empty() ? q3vl::default_video_encoder() : encoder);
  EXPECT_FALSE(fs::exists(path + ".partial"));
  const q3vl::VideoInfo info = q3vl::probe_video(path);
  EXPECT_EQ(info.frames, 12);
  EXPECT_NEAR(info.fps, 8.0, 1e-9);
  EXPECT_NEAR(info.duration, 1.5, 1e-6);
  EXPECT_EQ(info.width, 64);
  EXPECT_EQ(info.height, 48);
  EXPECT_EQ(info.codec, codec);
  std::vector<int64_t> all;
  for (int64_t k = 0; k < 12; ++k) all.push_back(k);
  const std::vector<RgbImage> back = q3vl::decode_frames(path, all);
  ASSERT_EQ(back.size(), 12u);
  for (size_t k = 0; k < back.size(); ++k) {
    ASSERT_EQ(back[k].w, 64);
    ASSERT_EQ(back[k].h, 48);
    // Within codec loss (4:2:0 chroma blurs the square's edges): measured 1.6-2.8 for libx264 and mpeg4.
    EXPECT_LT(mean_abs_diff(back[k], frames[k]), 3.5) << file << " frame " << k;
    // ... and in order: of all the originals, frame k is the nearest.
    size_t nearest = 0;
    for (size_t j = 1; j < frames.size(); ++j)
      if (mean_abs_diff(back[k], frames[j]) < mean_abs_diff(back[k], frames[nearest])) nearest = j;
    EXPECT_EQ(nearest, k) << file;
  }
  // The command line reads the same file: its codec and frame count.
  FILE* p = popen(("ffprobe -v error -count_frames -select_streams v:0 -show_entries stream=codec_name,nb_read_frames "
                   "-of csv=p=0 " + path + " 2>&1").c_str(), "r");
  ASSERT_TRUE(p);
  char line[256] = {0};
  const bool got = fgets(line, sizeof line, p) != nullptr;
  pclose(p);
  ASSERT_TRUE(got) << "no output from ffprobe (make deps installs it)";
  EXPECT_EQ(std::string(line), codec + ",12\n");
}

TEST(VideoEncode, DefaultEncoderIsH264WhenThereIsOne) {
  const std::string enc = q3vl::default_video_encoder();
  EXPECT_TRUE(enc == "libx264" || enc == "mpeg4") << enc;
}

TEST(VideoEncode, Mp4RoundTripWithTheDefaultEncoder) {
  round_trip("clip.mp4", "", q3vl::default_video_encoder() == "libx264" ? "h264" : "mpeg4");
}

TEST(VideoEncode, Mpeg4InAviAndMkvRoundTrip) {
  round_trip("clip.avi", "mpeg4", "mpeg4");
  round_trip("clip.mkv", "mpeg4", "mpeg4");
}

TEST(VideoEncode, SameFramesSameBytes) {
  TempDir t;
  const std::vector<RgbImage> frames = moving_square(32, 32, 6);
  q3vl::encode_video(t.dir + "/a.mp4", frames, 4.0);
  q3vl::encode_video(t.dir + "/b.mp4", frames, 4.0);
  const std::string a = read_bytes(t.dir + "/a.mp4");
  EXPECT_GT(a.size(), 100u);
  EXPECT_EQ(a, read_bytes(t.dir + "/b.mp4"));
}

TEST(VideoEncode, BadPathsAndFramesAreNamedAndLeaveNothing) {
  TempDir t;
  const std::vector<RgbImage> frames = moving_square(32, 32, 4);
  const std::string d = t.dir;
  expect_error([&] { q3vl::encode_video(d + "/no/such/dir/a.mp4", frames, 8); },
               {"no/such/dir/a.mp4", "cannot create", "No such file or directory"});
  expect_error([&] { q3vl::encode_video(d + "/a.qqq", frames, 8); }, {"a.qqq", "no container for this file name"});
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", frames, 8, "nope"); }, {"a.mp4", "no video encoder 'nope'"});
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", frames, 8, "aac"); }, {"a.mp4", "no video encoder 'aac'"});
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", {}, 8); }, {"a.mp4", "no frames"});
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", frames, 0); }, {"a.mp4", "fps"});
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", moving_square(33, 32, 2), 8); },
               {"a.mp4", "33x32", "even sides"});
  std::vector<RgbImage> mixed = frames;
  mixed[2] = moving_square(32, 16, 1)[0];
  expect_error([&] { q3vl::encode_video(d + "/a.mp4", mixed, 8); }, {"a.mp4", "frame 2 is 32x16", "frame 0 is 32x32"});
  // An encoder that refuses the frames when it opens (MJPEG takes no yuv420p in limited range): FFmpeg says why.
  expect_error([&] { q3vl::encode_video(d + "/a.avi", frames, 8, "mjpeg"); }, {"a.avi", "mjpeg", "cannot open the encoder"});
  EXPECT_TRUE(fs::is_empty(d)) << "a refused clip left a file behind";
}

#else  // FFMPEG=0

TEST(VideoEncode, WithoutFfmpegEncodingIsRefusedByName) {
  expect_error([] { q3vl::encode_video("/tmp/x.mp4", moving_square(32, 32, 2), 8); },
               {"/tmp/x.mp4", "without FFmpeg"});
  EXPECT_EQ(q3vl::default_video_encoder(), "");
}

#endif

}  // namespace
