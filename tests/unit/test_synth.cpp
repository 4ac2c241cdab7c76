// The demo's synthetic data: deterministic files for a seed, the requested counts, PNGs that decode, and answers that
// say what was drawn (the colour from the dominant saturated pixels, the shape from how they fill their box).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unistd.h>

#include "q3vl/data/synth.hpp"

using namespace q3vl;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> lines(const fs::path& p) {
  std::vector<std::string> out;
  std::ifstream f(p);
  for (std::string l; std::getline(f, l);) out.push_back(l);
  return out;
}

// What a reader of the picture would answer: colour = nearest palette entry to the mean of the saturated pixels;
// shape from the fill ratio of their bounding box and where their centroid sits in it.
std::string read_picture(const RgbImage& im) {
  double sum[3] = {0, 0, 0}, cy = 0;
  int n = 0, x0 = im.w, x1 = -1, y0 = im.h, y1 = -1;
  for (int y = 0; y < im.h; ++y)
    for (int x = 0; x < im.w; ++x) {
      const uint8_t* p = &im.px[((size_t)y * im.w + x) * 3];
      if (std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}) < 80) continue;  // grey background
      for (int c = 0; c < 3; ++c) sum[c] += p[c];
      ++n, cy += y;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (n == 0) return "nothing";
  std::string colour;
  double best = 1e300;
  for (const auto& c : synth_colours()) {
    double d = 0;
    for (int k = 0; k < 3; ++k) d += (sum[k] / n - c.rgb[k]) * (sum[k] / n - c.rgb[k]);
    if (d < best) best = d, colour = c.name;
  }
  const double fill = n / double((x1 - x0 + 1) * (y1 - y0 + 1));
  const double low = (cy / n - y0) / (y1 - y0 + 1);  // 0.5: centroid in the middle; the triangle's is lower
  const char* shape = fill > 0.9 ? "square" : fill > 0.65 ? "circle" : fill < 0.42 ? "star" : low > 0.58 ? "triangle" : "cross";
  return "a " + colour + " " + shape;
}

}  // namespace

TEST(Synth, DeterministicCountsDecodableAndAnswersMatchThePictures) {
  const fs::path dir = fs::temp_directory_path() / ("q3vl_synth_" + std::to_string(getpid()));
  fs::remove_all(dir);
  write_synth((dir / "a").string(), 60, 12, 64, 5);
  write_synth((dir / "b").string(), 60, 12, 64, 5);
  write_synth((dir / "c").string(), 60, 12, 64, 6);

  for (const char* f : {"train.jsonl", "eval.jsonl", "images/train_000007.png", "images/eval_000011.png"})
    EXPECT_EQ(slurp(dir / "a" / f), slurp(dir / "b" / f)) << f << " differs for the same seed";
  EXPECT_NE(slurp(dir / "a" / "train.jsonl"), slurp(dir / "c" / "train.jsonl")) << "the seed changes nothing";
  EXPECT_NE(slurp(dir / "a" / "images/train_000000.png"), slurp(dir / "a" / "images/eval_000000.png"))
      << "train and eval share pictures";

  std::map<std::string, int> seen;
  for (const char* split : {"train", "eval"}) {
    const auto recs = lines(dir / "a" / (std::string(split) + ".jsonl"));
    ASSERT_EQ(recs.size(), std::string(split) == "train" ? 60u : 12u) << split;
    for (size_t i = 0; i < recs.size(); ++i) {
      const auto j = nlohmann::json::parse(recs[i]);
      const auto& msgs = j.at("messages");
      ASSERT_EQ(msgs.size(), 2u);
      EXPECT_EQ(msgs[0].at("role"), "user");
      EXPECT_EQ(msgs[1].at("role"), "assistant");
      const std::string img = msgs[0].at("content")[0].at("image");
      EXPECT_EQ(msgs[0].at("content")[0].at("type"), "image");
      EXPECT_EQ(msgs[0].at("content")[1].at("type"), "text");
      const RgbImage im = load_image((dir / "a" / img).string());
      ASSERT_EQ(im.w, 64);
      ASSERT_EQ(im.h, 64);
      const std::string answer = msgs[1].at("content");
      EXPECT_EQ(read_picture(im), answer) << split << " line " << i + 1 << " (" << img << ")";
      ++seen[answer.substr(answer.find(' ', 2) + 1)];
    }
  }
  EXPECT_EQ(seen.size(), synth_shapes().size()) << "every shape should occur in 72 pictures";
  fs::remove_all(dir);
}

TEST(Synth, SampleAgreesWithItsAnswer) {
  for (int i = 0; i < 1000; ++i) {
    const SynthSample s = synth_sample(9, 0, i, 64);
    EXPECT_EQ(s.answer, std::string("a ") + synth_colours()[s.colour].name + " " + synth_shapes()[s.shape]);
    EXPECT_EQ(read_picture(s.image), s.answer) << "sample " << i;
    EXPECT_FALSE(s.question.empty());
  }
  EXPECT_THROW(synth_sample(1, 0, 0, 8), std::exception);
}
