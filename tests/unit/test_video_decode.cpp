// Video decoding (src/data/video_decode.cpp) against the ffmpeg command line. The clips are made at test time by
// the ffmpeg CLI in a temporary folder (no binary videos in the repository); every sampled frame must equal, byte
// for byte, `ffmpeg -vf select='eq(n\,K)' -pix_fmt rgb24`, and probes `ffprobe -count_frames`. The CLI is required
// (make deps installs it): without it these tests fail rather than skip.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/data/chat.hpp"
#include "q3vl/data/image.hpp"
#include "q3vl/data/video.hpp"
#include "q3vl/data/video_processor.hpp"

namespace {

namespace fs = std::filesystem;
using q3vl::RgbImage;
using q3vl::VideoInfo;

// Runs a shell command; its standard output, byte for byte. Throws when it exits non-zero.
std::string run(const std::string& cmd) {
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("cannot run: " + cmd);
  std::string out;
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  if (pclose(p) != 0) throw std::runtime_error("command failed: " + cmd);
  return out;
}

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
}

constexpr const char* kFfmpeg = "timeout 300 ffmpeg -nostdin -v error -y ";
constexpr const char* kTestsrc = "-f lavfi -i testsrc=size=320x240:rate=24 -t 2 ";
constexpr const char* kVp9 = "-c:v libvpx-vp9 -deadline realtime -cpu-used 8 ";
constexpr const char* kVfr = "-vf \"setpts='if(lt(N,24),N/24,1+(N-24)/12)/TB'\" -vsync vfr ";

// ffmpeg arguments (after the output-overwriting prefix) that make each clip; "{dir}" is the fixture folder.
const std::map<std::string, std::string>& recipes() {
  static const std::map<std::string, std::string> r = {
      // H.264 with B-frames and a keyframe every 12 frames, so that seeking has somewhere to go
      {"clip.mp4", std::string(kTestsrc) + "-c:v libx264 -g 12 -pix_fmt yuv420p"},
      {"clip.webm", "-f lavfi -i testsrc=size=320x240:rate=25 -t 2 " + std::string(kVp9) + "-g 10"},
      // variable frame rate: 24 fps for a second, then 12 fps (mp4 stores nb_frames, mkv does not)
      {"vfr.mp4", std::string(kTestsrc) + kVfr + "-c:v libx264 -g 10"},
      {"vfr.mkv", std::string(kTestsrc) + kVfr + "-c:v libx264 -g 10"},
      {"clip.ts", "-i {dir}/clip.mp4 -c copy"},
      // an edit list that starts at 0.7 s: the packets before it are read and decoded, their frames discarded
      {"trim.mp4", "-ss 0.7 -i {dir}/clip.mp4 -c copy"},
      // VP9 with hidden alt-ref frames (superframes), and VP8
      {"arf.webm", "-f lavfi -i testsrc=size=160x120:rate=24 -t 2 -c:v libvpx-vp9 -cpu-used 5 -g 24 -auto-alt-ref 1 "
                   "-lag-in-frames 16"},
      {"vp8.webm", "-f lavfi -i testsrc=size=160x120:rate=24 -t 2 -c:v libvpx -cpu-used 5 -g 24 -auto-alt-ref 1 "
                   "-lag-in-frames 16 -b:v 300k"},
      // no timestamps at all: frames are found by counting, as the command line numbers them
      {"clip.h264", "-i {dir}/clip.mp4 -c copy -bsf:v h264_mp4toannexb"},
      {"rot90.mp4", "-i {dir}/clip.mp4 -c copy -metadata:s:v rotate=90"},
      {"rot180.mp4", "-i {dir}/clip.mp4 -c copy -metadata:s:v rotate=180"},
      {"rot270.mp4", "-i {dir}/clip.mp4 -c copy -metadata:s:v rotate=270"},
      {"odd.webm", "-f lavfi -i testsrc=size=317x239:rate=24 -t 1 " + std::string(kVp9)},
      {"odd444.mp4", "-f lavfi -i testsrc=size=317x239:rate=24 -t 1 -c:v libx264 -pix_fmt yuv444p"},
      {"bt709.mp4", std::string(kTestsrc) + "-c:v libx264 -pix_fmt yuv420p -colorspace bt709 -color_primaries bt709 "
                                            "-color_trc bt709"},
      {"full.mp4", std::string(kTestsrc) + "-c:v libx264 -pix_fmt yuvj420p"},
      {"10bit.mp4", std::string(kTestsrc) + "-c:v libx264 -pix_fmt yuv420p10le"},
      {"422.mp4", std::string(kTestsrc) + "-c:v libx264 -pix_fmt yuv422p"},
      // 4:2:2 cannot be transposed plane by plane: the command line converts to RGB before it turns the frame
      {"422rot90.mp4", "-i {dir}/422.mp4 -c copy -metadata:s:v rotate=90"},
      {"odd444rot90.mp4", "-i {dir}/odd444.mp4 -c copy -metadata:s:v rotate=90"},
      {"long.mp4", "-f lavfi -i testsrc=size=640x360:rate=24 -t 20 -c:v libx264 -g 48 -pix_fmt yuv420p"},
      {"faststart.mp4", std::string(kTestsrc) + "-c:v libx264 -pix_fmt yuv420p -movflags +faststart"},
      {"audio.wav", "-f lavfi -i sine=duration=1"},
      {"red.png", "-f lavfi -i color=red:s=64x64 -frames:v 1"},
      // audio with a cover picture, which libavformat lists as a video stream
      {"cover.m4a", "-f lavfi -i sine=duration=1 -i {dir}/red.png -map 0:a -map 1:v -c:v png -disposition:v:0 "
                    "attached_pic -c:a aac"},
      {"no_video.mp4", std::string(kTestsrc) + "-frames:v 0 -c:v libx264"},  // a container with no stream
  };
  return r;
}

// The fixture folder, made once and removed at exit.
struct Fixtures {
  std::string dir;
  std::map<std::string, std::string> made;
  Fixtures() {
    if (std::system("command -v ffmpeg >/dev/null 2>&1 && command -v ffprobe >/dev/null 2>&1") != 0)
      throw std::runtime_error("the ffmpeg and ffprobe command line tools are needed (make deps installs them)");
    char t[] = "/tmp/q3vl_video_XXXXXX";
    if (!mkdtemp(t)) throw std::runtime_error("cannot make a temporary folder");
    dir = t;
  }
  ~Fixtures() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  std::string path(const std::string& name) {
    const std::string p = dir + "/" + name;
    if (made.count(name)) return p;
    std::string args = recipes().at(name);
    for (size_t at; (at = args.find("{dir}")) != std::string::npos;) {
      const std::string src = args.substr(at + 6, args.find(' ', at) - at - 6);
      path(src);
      args.replace(at, 5, dir);
    }
    run(std::string(kFfmpeg) + args + " " + p);
    made[name] = p;
    return p;
  }
};

Fixtures& fx() {
  static Fixtures f;
  return f;
}
std::string clip(const std::string& name) { return fx().path(name); }

// Frames of the file as the ffmpeg command line gives them in rgb24: select's n, in increasing n, one call.
std::string cli_frames(const std::string& path, std::vector<int64_t> ns) {
  std::sort(ns.begin(), ns.end());
  ns.erase(std::unique(ns.begin(), ns.end()), ns.end());
  std::string expr;
  for (int64_t n : ns) expr += (expr.empty() ? "" : "+") + std::string("eq(n\\,") + std::to_string(n) + ")";
  return run(std::string(kFfmpeg) + "-i " + path + " -vf \"select='" + expr + "'\" -vsync 0 -frames:v " +
             std::to_string(ns.size()) + " -f rawvideo -pix_fmt rgb24 -");
}

// ffprobe's view of the video stream (and the container's duration), counting frames by decoding.
std::map<std::string, std::string> ffprobe(const std::string& path) {
  const std::string out = run("ffprobe -v error -count_frames -select_streams v:0 -show_entries "
                              "stream=nb_read_frames,avg_frame_rate,duration,width,height:stream_side_data=rotation:"
                              "format=duration "
                              "-of default=nw=1 " + path);
  std::map<std::string, std::string> kv;
  size_t a = 0;
  for (size_t b; (b = out.find('\n', a)) != std::string::npos; a = b + 1) {
    const std::string line = out.substr(a, b - a);
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq);
    if (!kv.count(key)) kv[key] = line.substr(eq + 1);  // stream duration first, the format's after it
    else if (key == "duration" && kv[key] == "N/A") kv[key] = line.substr(eq + 1);
  }
  return kv;
}

double rational(const std::string& s) {
  const size_t slash = s.find('/');
  return slash == std::string::npos ? std::stod(s) : std::stod(s.substr(0, slash)) / std::stod(s.substr(slash + 1));
}

// Every byte of each image got[i] equals the command line's frame ns[i].
void expect_cli_frames(const std::string& path, const std::vector<int64_t>& ns, const std::vector<RgbImage>& got) {
  ASSERT_EQ(ns.size(), got.size());
  std::vector<int64_t> sorted(ns);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  const std::string all = cli_frames(path, ns);
  for (size_t i = 0; i < ns.size(); ++i) {
    const RgbImage& im = got[i];
    const size_t at = size_t(std::lower_bound(sorted.begin(), sorted.end(), ns[i]) - sorted.begin());
    ASSERT_EQ(all.size(), sorted.size() * im.px.size()) << path << " frame " << ns[i] << " (" << im.w << "x" << im.h
                                                         << ")";
    const uint8_t* ref = reinterpret_cast<const uint8_t*>(all.data()) + at * im.px.size();
    size_t diff = 0, first = 0;
    for (size_t k = 0; k < im.px.size(); ++k)
      if (ref[k] != im.px[k] && diff++ == 0) first = k;
    EXPECT_EQ(diff, 0u) << path << " frame " << ns[i] << ": " << diff << " bytes differ, the first at pixel "
                        << first / 3 % im.w << "," << first / 3 / im.w << " channel " << first % 3 << " ("
                        << int(im.px[first]) << " vs the CLI's " << int(ref[first]) << ")";
  }
}

const std::vector<std::string> kDecoded = {"clip.mp4",  "clip.webm",  "vfr.mp4",    "vfr.mkv",    "clip.ts",
                                           "trim.mp4",  "arf.webm",   "vp8.webm",   "rot90.mp4",  "rot180.mp4",
                                           "rot270.mp4", "odd.webm",  "odd444.mp4", "bt709.mp4",  "full.mp4",
                                           "10bit.mp4", "422.mp4",    "422rot90.mp4", "odd444rot90.mp4"};

TEST(VideoDecode, ProbeMatchesFfprobeCountFrames) {
  for (const std::string& name : kDecoded) {
    SCOPED_TRACE(name);
    const std::string p = clip(name);
    const VideoInfo v = q3vl::probe_video(p);
    auto ref = ffprobe(p);
    EXPECT_EQ(v.frames, std::stoll(ref.at("nb_read_frames")));
    EXPECT_NEAR(v.fps, rational(ref.at("avg_frame_rate")), 1e-9);
    EXPECT_NEAR(v.duration, std::stod(ref.at("duration")), 1e-6);
    const bool turned = name.find("rot90") != std::string::npos || name == "rot270.mp4";
    EXPECT_EQ(v.width, std::stoi(ref.at(turned ? "height" : "width")));
    EXPECT_EQ(v.height, std::stoi(ref.at(turned ? "width" : "height")));
    // ffprobe's rotation is counterclockwise (av_display_rotation_get), ours clockwise
    EXPECT_EQ(v.rotation, (360 - (ref.count("rotation") ? std::stoi(ref.at("rotation")) : 0)) % 360);
  }
  const VideoInfo mp4 = q3vl::probe_video(clip("clip.mp4")), webm = q3vl::probe_video(clip("clip.webm"));
  EXPECT_EQ(mp4.codec, "h264");
  EXPECT_EQ(mp4.nb_frames, 48);
  EXPECT_EQ(webm.nb_frames, 0);
  const VideoInfo trim = q3vl::probe_video(clip("trim.mp4"));
  EXPECT_GT(trim.nb_frames, trim.frames) << "the edit list should discard some frames";
  EXPECT_EQ(webm.codec, "vp9");
  EXPECT_EQ(mp4.rotation, 0);
  EXPECT_EQ(q3vl::probe_video(clip("rot90.mp4")).rotation, 270);  // "rotate=90" turns it counterclockwise
  EXPECT_EQ(q3vl::probe_video(clip("rot180.mp4")).rotation, 180);
  EXPECT_EQ(q3vl::probe_video(clip("rot270.mp4")).rotation, 90);
}

TEST(VideoDecode, SampledFramesEqualTheFfmpegCommandLine) {
  std::vector<std::string> names = kDecoded;
  names.push_back("clip.h264");
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    const std::string p = clip(name);
    q3vl::VideoFile v(p);
    const int64_t n = v.info().frames;
    // out of order, a repeat, both ends, frames on and off keyframes
    const std::vector<int64_t> want = {n - 1, 0, 5, 5, 13, n / 2, n / 2 + 1, 23};
    const std::vector<RgbImage> got = v.frames(want);
    ASSERT_EQ(got.size(), want.size());
    for (const RgbImage& im : got) {
      EXPECT_EQ(im.w, v.info().width);
      EXPECT_EQ(im.h, v.info().height);
    }
    expect_cli_frames(p, want, got);
  }
}

TEST(VideoDecode, EveryFrameInOrderEqualsTheCommandLine) {
  // every frame of the VFR clip and of the keyframe-every-12 H.264 clip, one call each
  for (const std::string name : {"vfr.mkv", "clip.mp4"}) {
    SCOPED_TRACE(name);
    const std::string p = clip(name);
    const std::string all = run(std::string(kFfmpeg) + "-i " + p + " -vsync 0 -f rawvideo -pix_fmt rgb24 -");
    q3vl::VideoFile v(p);
    std::vector<int64_t> idx(size_t(v.info().frames));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = int64_t(i);
    const std::vector<RgbImage> got = v.frames(idx);
    ASSERT_EQ(all.size(), got.size() * got[0].px.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(0, std::memcmp(all.data() + i * got[i].px.size(), got[i].px.data(), got[i].px.size())) << i;
  }
}

TEST(VideoDecode, SeeksInsteadOfDecodingTheWholeClip) {
  const std::string p = clip("long.mp4");  // 480 frames, a keyframe every 48
  q3vl::VideoFile v(p);
  ASSERT_EQ(v.info().frames, 480);
  const std::vector<RgbImage> late = v.frames({400});
  expect_cli_frames(p, {400}, late);
  EXPECT_LE(v.frames_decoded(), 60) << "decoding frame 400 should start at the keyframe at 384";
  // backwards after forwards, on the same open file
  const std::vector<RgbImage> early = v.frames({3});
  expect_cli_frames(p, {3}, early);
  EXPECT_LE(v.frames_decoded(), 70);
  // one frame after another, each call going on from the last (the ones before were skipped or given)
  for (const int64_t k : {200, 201, 203, 202, 250}) {
    const int64_t before = v.frames_decoded();
    expect_cli_frames(p, {k}, v.frames({k}));
    EXPECT_LE(v.frames_decoded() - before, 60) << k;
  }
}

// A sampler's request on a realistic clip: 32 frames spread over 20 s of 640x360 H.264. Its speed is a benchmark's
// business, not a unit test's (the decoding CPU time is printed for the log).
TEST(VideoDecode, ThirtyTwoFramesOf640x360EqualTheCommandLine) {
  const std::string p = clip("long.mp4");
  std::vector<int64_t> idx;
  for (int i = 0; i < 32; ++i) idx.push_back(int64_t(std::llround(i * 479.0 / 31)));
  timespec c0, c1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
  q3vl::VideoFile v(p);
  const std::vector<RgbImage> got = v.frames(idx);
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
  const double cpu = double(c1.tv_sec - c0.tv_sec) + 1e-9 * double(c1.tv_nsec - c0.tv_nsec);
  std::printf("32 frames of a 640x360 H.264 clip (20 s, 480 frames): %.3f s CPU, %lld frames decoded\n", cpu,
              (long long)v.frames_decoded());
  ASSERT_EQ(got.size(), 32u);
  EXPECT_LE(v.frames_decoded(), 480);
  expect_cli_frames(p, idx, got);
}

TEST(VideoDecode, BytesInMemoryDecodeAsTheFile) {
  for (const std::string name : {"clip.mp4", "clip.webm", "vfr.mkv", "rot90.mp4"}) {
    SCOPED_TRACE(name);
    const std::string p = clip(name);
    const std::string bytes = read_bytes(p);
    const VideoInfo a = q3vl::probe_video(p), b = q3vl::probe_video(bytes, "upload.mp4");
    EXPECT_EQ(a.frames, b.frames);
    EXPECT_EQ(a.fps, b.fps);
    EXPECT_EQ(a.duration, b.duration);
    EXPECT_EQ(a.width, b.width);
    EXPECT_EQ(a.height, b.height);
    const std::vector<RgbImage> f = q3vl::decode_frames(bytes, "upload.mp4", {1, 30, 7});
    ASSERT_EQ(f.size(), 3u);
    expect_cli_frames(p, {1, 30, 7}, f);
  }
}

// sample_clip (generate's and serve's path: a chunk of frames at a time, each resized at once) gives resize_clip's
// clip of all the sampled frames decoded together, over several chunks (48 sampled frames).
TEST(VideoDecode, SampleClipIsResizeClipOfTheSampledFrames) {
  q3vl::VideoConfig c;
  c.fps = 1000, c.max_pixels = 48L * 64 * 64;  // every frame, resized down
  q3vl::VideoFile v(clip("clip.mp4"));
  const q3vl::VideoClip got = q3vl::sample_clip(v, c, "clip");
  const std::vector<int64_t> idx = q3vl::sample_frame_indices(v.info().frames, v.info().fps, c);
  ASSERT_EQ(idx.size(), 48u);
  const q3vl::VideoClip want = q3vl::resize_clip(q3vl::decode_frames(clip("clip.mp4"), idx), idx, v.info().fps, c);
  EXPECT_EQ(got.indices, want.indices);
  EXPECT_EQ(got.fps, want.fps);
  ASSERT_EQ(got.frames.size(), want.frames.size());
  EXPECT_LT(want.frames[0].w, v.info().width);
  for (size_t i = 0; i < got.frames.size(); ++i) {
    EXPECT_EQ(got.frames[i].w, want.frames[i].w);
    EXPECT_EQ(got.frames[i].h, want.frames[i].h);
    EXPECT_TRUE(got.frames[i].px == want.frames[i].px) << "frame " << i;
  }
}

TEST(VideoDecode, BadFilesNameTheFileAndSayWhatIsWrong) {
  const std::string dir = fx().dir;
  const std::string good = read_bytes(clip("clip.mp4"));
  // moov at the end: half the file has no index at all
  write_bytes(dir + "/cut.mp4", good.substr(0, good.size() / 2));
  expect_error([&] { q3vl::probe_video(dir + "/cut.mp4"); }, {"cut.mp4", "moov atom not found"});
  // moov first: the index is whole, the frames after the cut are not there
  const std::string fs = read_bytes(clip("faststart.mp4"));
  write_bytes(dir + "/cut_faststart.mp4", fs.substr(0, fs.size() / 3));
  expect_error([&] { q3vl::decode_frames(dir + "/cut_faststart.mp4", {47}); }, {"cut_faststart.mp4", "past the end"});
  std::mt19937 rng(7);
  std::string noise(20000, '\0');
  for (char& c : noise) c = char(rng());
  write_bytes(dir + "/noise.mp4", noise);
  expect_error([&] { q3vl::probe_video(dir + "/noise.mp4"); }, {"noise.mp4", "Invalid data"});
  expect_error([&] { q3vl::probe_video(noise, "upload 3"); }, {"upload 3", "Invalid data"});
  expect_error([&] { q3vl::probe_video(dir + "/missing.mp4"); }, {"missing.mp4", "No such file"});
  expect_error([&] { q3vl::probe_video(std::string_view(), "empty upload"); }, {"empty upload", "0 bytes"});
  expect_error([&] { q3vl::probe_video(clip("audio.wav")); }, {"audio.wav", "has no video stream"});
  expect_error([&] { q3vl::probe_video(clip("cover.m4a")); }, {"cover.m4a", "has no video stream"});
  expect_error([&] { q3vl::probe_video(clip("no_video.mp4")); }, {"no_video.mp4", "has no video stream"});
  // a codec FFmpeg has no decoder for: the webm's codec id renamed
  std::string webm = read_bytes(clip("clip.webm"));
  const size_t at = webm.find("V_VP9");
  ASSERT_NE(at, std::string::npos);
  webm.replace(at, 5, "V_ZZZ");
  write_bytes(dir + "/strange.webm", webm);
  expect_error([&] { q3vl::probe_video(dir + "/strange.webm"); }, {"strange.webm", "unsupported video codec"});
  // a video stream with no frames in it
  write_bytes(dir + "/empty.y4m", "YUV4MPEG2 W320 H240 F24:1 Ip A1:1 C420jpeg\n");
  expect_error([&] { q3vl::probe_video(dir + "/empty.y4m"); }, {"empty.y4m", "no frames"});
}

TEST(VideoDecode, HugeFramesAreRefusedFromTheHeader) {
  const std::string dir = fx().dir;
  const std::string body = "FRAME\n" + std::string(1000, '\x10');
  // FFmpeg itself refuses this size; its own message says which
  write_bytes(dir + "/huge.y4m", "YUV4MPEG2 W100000 H100000 F24:1 Ip A1:1 C420jpeg\n" + body);
  expect_error([&] { q3vl::probe_video(dir + "/huge.y4m"); }, {"huge.y4m", "100000x100000"});
  // a size FFmpeg allows, over our limits (the default and the caller's)
  write_bytes(dir + "/big.y4m", "YUV4MPEG2 W16000 H16000 F24:1 Ip A1:1 C420jpeg\n" + body);
  expect_error([&] { q3vl::probe_video(dir + "/big.y4m"); }, {"big.y4m", "16000x16000", "over the limit"});
  q3vl::VideoLimits small;
  small.max_pixels = 320 * 200;
  expect_error([&] { q3vl::probe_video(clip("clip.mp4"), small); }, {"clip.mp4", "320x240", "over the limit"});
  small = {};
  small.max_frames = 40;
  expect_error([&] { q3vl::probe_video(clip("clip.mp4"), small); }, {"clip.mp4", "48 frames", "limit of 40 frames"});
  expect_error([&] { q3vl::probe_video(clip("clip.webm"), small); }, {"clip.webm", "limit of 40 frames"});
}

TEST(VideoDecode, IndicesPastTheEndAreRefused) {
  const std::string p = clip("clip.webm");
  q3vl::VideoFile v(p);
  expect_error([&] { v.frames({3, 50}); }, {"clip.webm", "frame 50", "past the end", "50 frames"});
  expect_error([&] { v.frames({-1}); }, {"clip.webm", "frame -1"});
  EXPECT_TRUE(v.frames({}).empty());
  expect_cli_frames(p, {49}, v.frames({49}));  // still usable after an error
}

TEST(VideoDecode, FrameListsAreDecodedAsImages) {
  const std::string dir = fx().dir;
  std::vector<std::string> paths;
  std::vector<RgbImage> ims;
  for (int i = 0; i < 3; ++i) {
    RgbImage im;
    im.w = 40;
    im.h = 30;
    for (int k = 0; k < im.w * im.h * 3; ++k) im.px.push_back(uint8_t(k * (i + 3)));
    paths.push_back(dir + "/frame" + std::to_string(i) + ".png");
    q3vl::write_png(paths.back(), im);
    ims.push_back(im);
  }
  const VideoInfo v = q3vl::probe_frame_list(paths);
  EXPECT_EQ(v.frames, 3);
  EXPECT_EQ(v.fps, 2.0);
  EXPECT_EQ(v.duration, 1.5);
  EXPECT_EQ(v.width, 40);
  EXPECT_EQ(v.height, 30);
  EXPECT_EQ(v.codec, "image");
  EXPECT_EQ(q3vl::probe_frame_list(paths, 4.0).duration, 0.75);
  const std::vector<RgbImage> got = q3vl::load_frame_list(paths, {2, 0});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].px, ims[2].px);
  EXPECT_EQ(got[1].px, ims[0].px);
  expect_error([&] { q3vl::load_frame_list(paths, {3}); }, {"frame 3", "past the end", "frame0.png"});
  RgbImage other;
  other.w = other.h = 8;
  other.px.assign(8 * 8 * 3, 0);
  q3vl::write_png(dir + "/other.png", other);
  paths.push_back(dir + "/other.png");
  expect_error([&] { q3vl::probe_frame_list(paths); }, {"other.png", "8x8", "40x30"});
  expect_error([&] { q3vl::probe_frame_list({}); }, {"empty list"});
}

}  // namespace
