// Image decode / resize / patchify against goldens made by tools/golden_images.py from PIL and transformers'
// Qwen2-VL image processor (tests/data/images/golden.json + golden.h5).
#include <gtest/gtest.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <type_traits>
#include <vector>

#include "../compare.hpp"
#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/data/image.hpp"

namespace {

using q3vl::RgbImage;
using json = nlohmann::json;

const std::string kDir = "tests/data/images/";

const json& golden() {
  static const json g = [] {
    std::ifstream f(kDir + "golden.json");
    if (!f) throw std::runtime_error("cannot open " + kDir + "golden.json (run from the repository root)");
    return json::parse(f);
  }();
  return g;
}

// Reads a whole dataset of golden.h5; dims gets its shape.
template <class T>
std::vector<T> read_h5(const std::string& name, std::vector<hsize_t>& dims) {
  const hid_t type = std::is_same_v<T, float> ? H5T_NATIVE_FLOAT : H5T_NATIVE_UINT8;
  const hid_t file = H5Fopen((kDir + "golden.h5").c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) throw std::runtime_error("cannot open golden.h5");
  const hid_t ds = H5Dopen2(file, name.c_str(), H5P_DEFAULT);
  if (ds < 0) throw std::runtime_error("no dataset " + name + " in golden.h5");
  const hid_t space = H5Dget_space(ds);
  dims.resize(H5Sget_simple_extent_ndims(space));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  size_t n = 1;
  for (hsize_t d : dims) n *= d;
  std::vector<T> out(n);
  const herr_t rc = H5Dread(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data());
  H5Sclose(space);
  H5Dclose(ds);
  H5Fclose(file);
  if (rc < 0) throw std::runtime_error("cannot read " + name + " from golden.h5");
  return out;
}

RgbImage read_rgb(const std::string& name) {
  std::vector<hsize_t> d;
  RgbImage im;
  im.px = read_h5<uint8_t>(name, d);
  EXPECT_EQ(d.size(), 3u);
  EXPECT_EQ(d[2], 3u);
  im.h = int(d[0]);
  im.w = int(d[1]);
  return im;
}

int max_abs_diff(const RgbImage& a, const RgbImage& b) {
  if (a.w != b.w || a.h != b.h || a.px.size() != b.px.size()) return 256;
  int m = 0;
  for (size_t i = 0; i < a.px.size(); ++i) m = std::max(m, std::abs(int(a.px[i]) - int(b.px[i])));
  return m;
}

q3vl::ImageConfig config(const json& c) {
  q3vl::ImageConfig cfg;
  cfg.min_pixels = c["min_pixels"].get<long>();
  cfg.max_pixels = c["max_pixels"].get<long>();
  return cfg;
}

TEST(ImageDecode, EveryPngAndJpegMatchesPilConvertRgb) {
  ASSERT_FALSE(golden()["decode"].empty());
  for (const auto& c : golden()["decode"]) {
    const std::string file = c["file"];
    SCOPED_TRACE(file + " (PIL mode " + c["pil_mode"].get<std::string>() + ")");
    const RgbImage got = q3vl::load_image(kDir + file);
    const RgbImage want = read_rgb(c["rgb"]);
    ASSERT_EQ(got.w, c["w"].get<int>());
    ASSERT_EQ(got.h, c["h"].get<int>());
    EXPECT_EQ(max_abs_diff(got, want), 0);
  }
}

TEST(ImageDecode, FromMemoryEqualsFromFile) {
  for (const std::string file : {"photo_q90_64x48.jpg", "pal8_40x30_trns.png"}) {
    std::ifstream f(kDir + file, std::ios::binary);
    const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const RgbImage a = q3vl::decode_image(bytes.data(), bytes.size(), file);
    const RgbImage b = q3vl::load_image(kDir + file);
    EXPECT_EQ(max_abs_diff(a, b), 0) << file;
  }
}

std::vector<uint8_t> file_bytes(const std::string& file) {
  std::ifstream f(kDir + file, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The header's size is the decoded size, for every golden file of both formats (what a server budgets with).
TEST(ImageHeader, SizeEqualsTheDecodedSize) {
  int n = 0;
  for (const auto& c : golden()["decode"]) {
    const std::string file = c["file"].get<std::string>();
    const std::vector<uint8_t> b = file_bytes(file);
    const q3vl::ImageHeader h = q3vl::read_image_header(b.data(), b.size(), file);
    EXPECT_EQ(h.w, c["w"].get<int>()) << file;
    EXPECT_EQ(h.h, c["h"].get<int>()) << file;
    EXPECT_EQ(h.jpeg, file.ends_with(".jpg")) << file;
    ++n;
  }
  EXPECT_GE(n, 4);
}

// A JPEG decoded at 1/s has sides ceil(side / s) and is the full decode averaged over s x s blocks, to within 1.5
// of 255 on average (libjpeg's scaled IDCT is a low-pass of the same picture; PIL's draft() gives the same pixels).
// Files without chroma subsampling: the test pictures are noise, whose subsampled chroma the scaled upsampling
// smooths differently. A PNG cannot be scaled and says so.
TEST(ImageDecode, JpegScaledDecode) {
  for (const std::string file : {"photo_444_31x17.jpg", "gray_40x24.jpg", "cmyk_24x16.jpg"}) {
    const std::vector<uint8_t> b = file_bytes(file);
    const RgbImage full = q3vl::decode_image(b.data(), b.size(), file);
    for (int s : {2, 4, 8}) {
      const RgbImage im = q3vl::decode_image(b.data(), b.size(), file, s);
      ASSERT_EQ(im.w, (full.w + s - 1) / s) << file;
      ASSERT_EQ(im.h, (full.h + s - 1) / s) << file;
      double err = 0;
      const int bh = full.h / s, bw = full.w / s;
      for (int y = 0; y < bh; ++y)
        for (int x = 0; x < bw; ++x)
          for (int c = 0; c < 3; ++c) {
            double avg = 0;
            for (int dy = 0; dy < s; ++dy)
              for (int dx = 0; dx < s; ++dx) avg += full.px[((y * s + dy) * full.w + x * s + dx) * 3 + c];
            err += std::abs(avg / (s * s) - im.px[(y * im.w + x) * 3 + c]);
          }
      EXPECT_LT(err / (bh * bw * 3), 1.5) << file << " at 1/" << s;
    }
  }
  const std::vector<uint8_t> p = file_bytes("pal8_40x30_trns.png");
  expect_error([&] { q3vl::decode_image(p.data(), p.size(), "pal", 2); }, {"pal", "JPEG only"});
}

TEST(ImageErrors, BrokenFilesFailNamingTheFile) {
  const std::map<std::string, std::string> words = {
      {"truncated", "truncated"}, {"corrupt", "corrupt"}, {"unsupported", "unsupported"}, {"empty", "empty"}};
  ASSERT_EQ(golden()["broken"].size(), 6u);
  for (const auto& c : golden()["broken"]) {
    const std::string path = kDir + c["file"].get<std::string>();
    SCOPED_TRACE(path + " (PIL: " + c["pil"].get<std::string>() + ")");
    expect_error([&] { q3vl::load_image(path); }, {path, words.at(c["kind"])});
  }
}

TEST(ImageErrors, MissingFile) {
  expect_error([] { q3vl::load_image(kDir + "no_such_image.png"); }, {"no_such_image.png", "cannot open"});
}

// A PNG chunk with its CRC (the standard reflected CRC-32).
void png_chunk(std::vector<uint8_t>& out, const char* tag, const std::vector<uint8_t>& data) {
  auto be32 = [&](uint32_t v) { for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(v >> s)); };
  be32(uint32_t(data.size()));
  const size_t start = out.size();
  out.insert(out.end(), tag, tag + 4);
  out.insert(out.end(), data.begin(), data.end());
  uint32_t crc = 0xffffffffu;
  for (size_t i = start; i < out.size(); ++i) {
    crc ^= out[i];
    for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  be32(~crc);
}

TEST(ImageErrors, HugeImageRefusedBeforeDecoding) {
  // 20000 x 20000 RGB: more than PIL's decompression-bomb limit (2 * 89478485 pixels).
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  png_chunk(png, "IHDR", {0, 0, 0x4e, 0x20, 0, 0, 0x4e, 0x20, 8, 2, 0, 0, 0});
  png_chunk(png, "IDAT", {0x78, 0x9c, 0x03, 0x00});
  expect_error([&] { q3vl::decode_image(png.data(), png.size(), "huge.png"); }, {"huge.png", "20000x20000"});
}

TEST(ImageErrors, TooSmallAndExtremeAspectRatio) {
  q3vl::ImageConfig cfg;
  cfg.min_side = 4;
  RgbImage im{3, 5, std::vector<uint8_t>(3 * 5 * 3, 7)};
  expect_error([&] { q3vl::resize_for_model(im, cfg, "tiny.png"); }, {"tiny.png", "too small", "3x5"});
  cfg.min_side = 1;
  RgbImage wide{201, 1, std::vector<uint8_t>(201 * 3, 7)};
  expect_error([&] { q3vl::resize_for_model(wide, cfg, "wide.png"); }, {"wide.png", "aspect ratio"});
  std::vector<float> out;
  expect_error([&] { q3vl::preprocess(wide, cfg, out, "wide.png"); }, {"wide.png", "aspect ratio"});
  wide.w = 200;  // exactly 200:1 is allowed
  wide.px.resize(200 * 3);
  EXPECT_NO_THROW(q3vl::resize_for_model(wide, cfg, "wide.png"));
}

TEST(ImageSmartResize, MatchesTransformersTable) {
  const json& t = golden()["smart_resize"];
  SCOPED_TRACE(t["source"].get<std::string>());
  ASSERT_GT(t["cases"].size(), 500u);
  for (const auto& c : t["cases"]) {
    const int h = c[0], w = c[1], factor = c[2];
    const long mn = c[3], mx = c[4];
    const int rh = c[5], rw = c[6];
    if (rh < 0) {
      EXPECT_THROW(q3vl::smart_resize(h, w, factor, mn, mx), q3vl::Error) << h << "x" << w;
    } else {
      EXPECT_EQ(q3vl::smart_resize(h, w, factor, mn, mx), std::make_pair(rh, rw)) << c.dump();
    }
  }
}

TEST(ImageResize, BicubicMatchesPil) {
  int worst = 0;
  for (const auto& c : golden()["resize"]) {
    const std::string file = c["file"];
    const int w = c["w"], h = c["h"];
    const RgbImage got = q3vl::resize_bicubic(q3vl::load_image(kDir + file), w, h);
    const int d = max_abs_diff(got, read_rgb(c["rgb"]));
    EXPECT_LE(d, 2) << file << " -> " << w << "x" << h;
    worst = std::max(worst, d);
  }
  RecordProperty("max_abs_diff", worst);
  std::printf("[ImageResize] max |C++ - PIL| over %zu resizes: %d/255\n", golden()["resize"].size(), worst);
}

// Full pipeline: sizes, grid and token count exact; pixels within 2/255; pixel_values layout and values.
TEST(ImagePreprocess, MatchesGolden) {
  int worst_px = 0;
  float worst_pv = 0;
  for (const auto& c : golden()["preprocess"]) {
    const std::string file = c["file"];
    SCOPED_TRACE(file + " min_pixels=" + std::to_string(c["min_pixels"].get<long>()) + " source: " +
                 c["source"].get<std::string>());
    const q3vl::ImageConfig cfg = config(c);
    const RgbImage in = q3vl::load_image(kDir + file);
    const RgbImage resized = q3vl::resize_for_model(in, cfg, file);
    ASSERT_EQ(resized.h, c["resized_h"].get<int>());
    ASSERT_EQ(resized.w, c["resized_w"].get<int>());
    if (c.contains("resized")) {
      const int d = max_abs_diff(resized, read_rgb(c["resized"]));
      EXPECT_LE(d, 2);
      worst_px = std::max(worst_px, d);
    }
    std::vector<float> pv(5, -7.0f);  // preprocess appends: earlier content must survive
    const q3vl::ImageGrid g = q3vl::preprocess(in, cfg, pv, file);
    EXPECT_EQ(std::vector<int>({g.t, g.h, g.w}), c["grid"].get<std::vector<int>>());
    EXPECT_EQ(q3vl::image_tokens(g, cfg.merge), c["tokens"].get<long>());
    EXPECT_EQ(q3vl::image_tokens(g, cfg.merge), long(resized.h) * resized.w / 1024);
    ASSERT_EQ(pv.size(), 5 + size_t(g.patches()) * 1536);
    EXPECT_EQ(pv[4], -7.0f);
    const float* rows = pv.data() + 5;

    std::vector<hsize_t> d;
    std::vector<long> idx;
    std::vector<float> want;
    if (c.contains("pixel_values")) {
      want = read_h5<float>(c["pixel_values"], d);
      for (long r = 0; r < g.patches(); ++r) idx.push_back(r);
    } else {
      want = read_h5<float>(c["pv_sampled"], d);
      idx = c["pv_rows"].get<std::vector<long>>();
    }
    ASSERT_EQ(d.size(), 2u);
    ASSERT_EQ(d[0], idx.size());
    ASSERT_EQ(d[1], 1536u);
    float m = 0;
    for (size_t i = 0; i < idx.size(); ++i)
      for (size_t j = 0; j < 1536; ++j)
        m = std::max(m, float(q3vl::test::abs_diff(rows[idx[i] * 1536 + j], want[i * 1536 + j])));  // NaN: +inf
    EXPECT_LE(m, 2 * (2.0f / 255.0f) + 1e-6f);  // 2/255 in pixels is 4/255 after (x-0.5)/0.5
    worst_pv = std::max(worst_pv, m);
  }
  RecordProperty("max_abs_diff_pixels", worst_px);
  std::printf("[ImagePreprocess] max |C++ - golden|: resized %d/255, pixel_values %g\n", worst_px, worst_pv);
}

// Layout check independent of the goldens: a pixel's value tells where it came from.
TEST(ImagePatchify, LayoutAndNormalisation) {
  q3vl::ImageConfig cfg;
  cfg.mean[1] = 0.25f;
  cfg.std[2] = 0.125f;
  RgbImage im{64, 96, {}};
  im.px.resize(size_t(im.w) * im.h * 3);
  for (int y = 0; y < im.h; ++y)
    for (int x = 0; x < im.w; ++x)
      for (int c = 0; c < 3; ++c) im.px[(size_t(y) * im.w + x) * 3 + c] = uint8_t((y * 7 + x * 3 + c * 50) % 256);
  std::vector<float> pv;
  const q3vl::ImageGrid g = q3vl::patchify(im, cfg, pv);
  EXPECT_EQ(g.t, 1);
  EXPECT_EQ(g.h, 6);
  EXPECT_EQ(g.w, 4);
  ASSERT_EQ(pv.size(), 24u * 1536);
  const int P = 16, m = 2, Tp = 2;
  for (int row = 0; row < 24; ++row) {
    // rows run over (block row, block col, row in block, col in block)
    const int br = row / ((g.w / m) * m * m), bc = row / (m * m) % (g.w / m), ir = row / m % m, ic = row % m;
    for (int col = 0; col < 1536; col += 37) {
      const int c = col / (Tp * P * P), py = col / P % P, px = col % P;
      const int y = (br * m + ir) * P + py, x = (bc * m + ic) * P + px;
      const int v = (y * 7 + x * 3 + c * 50) % 256;
      const float want = (float(v / 255.0) - cfg.mean[c]) / cfg.std[c];
      ASSERT_EQ(pv[size_t(row) * 1536 + col], want) << "row " << row << " col " << col;
    }
    // both temporal frames are the same image
    for (int c = 0; c < 3; ++c)
      for (int i = 0; i < P * P; ++i)
        ASSERT_EQ(pv[size_t(row) * 1536 + (c * Tp + 0) * P * P + i], pv[size_t(row) * 1536 + (c * Tp + 1) * P * P + i]);
  }
  RgbImage odd{48, 64, std::vector<uint8_t>(48 * 64 * 3)};
  expect_error([&] { q3vl::patchify(odd, cfg, pv); }, {"48x64", "multiple of 32"});
}

TEST(ImagePng, WriteThenReadBack) {
  RgbImage im = q3vl::load_image(kDir + "rgb8_37x23.png");
  const std::string path = "/tmp/q3vl_test_image_" + std::to_string(getpid()) + ".png";
  q3vl::write_png(path, im);
  const RgbImage back = q3vl::load_image(path);
  std::remove(path.c_str());
  EXPECT_EQ(max_abs_diff(im, back), 0);
  expect_error([&] { q3vl::write_png("/nonexistent_dir/x.png", im); }, {"/nonexistent_dir/x.png"});
}

}  // namespace
