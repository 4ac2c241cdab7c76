// The demo's synthetic data: deterministic files for its seeds, the requested counts, PNGs that decode, answers that
// say what was drawn (the colour from the dominant saturated pixels, the shape from how they fill their box), and
// pictures that vary in more than the answer (place, size, background, shade).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

struct Reading {
  std::string answer;
  // Centroid, box width and mean level of the shape's pixels; mean level of the background.
  double cx = 0, cy = 0, width = 0, level = 0, background = 0;
};

// What a reader of the picture would answer: colour = the palette entry that, at its best brightness, is nearest
// the mean of the saturated pixels (shades vary); shape from the fill ratio of their bounding box and where their
// centroid sits in it.
Reading read_picture(const RgbImage& im) {
  double sum[3] = {0, 0, 0}, cx = 0, cy = 0, bg = 0;
  int n = 0, x0 = im.w, x1 = -1, y0 = im.h, y1 = -1;
  for (int y = 0; y < im.h; ++y)
    for (int x = 0; x < im.w; ++x) {
      const uint8_t* p = &im.px[((size_t)y * im.w + x) * 3];
      if (std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]}) < 55) {  // grey background, however tinted
        bg += (p[0] + p[1] + p[2]) / 3.0;
        continue;
      }
      for (int c = 0; c < 3; ++c) sum[c] += p[c];
      ++n, cx += x, cy += y;
      x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
    }
  if (n == 0) return {"nothing"};
  std::string colour;
  double best = 1e300;
  for (const auto& c : synth_colours()) {
    double dot = 0, norm = 0, d = 0;
    for (int k = 0; k < 3; ++k) dot += sum[k] / n * c.rgb[k], norm += double(c.rgb[k]) * c.rgb[k];
    for (int k = 0; k < 3; ++k) d += std::pow(sum[k] / n - dot / norm * c.rgb[k], 2);
    if (d < best) best = d, colour = c.name;
  }
  const double fill = n / double((x1 - x0 + 1) * (y1 - y0 + 1));
  const double low = (cy / n - y0) / (y1 - y0 + 1);  // 0.5: centroid in the middle; the triangle's is lower
  const char* shape = fill > 0.9 ? "square" : fill > 0.65 ? "circle" : fill < 0.42 ? "star" : low > 0.58 ? "triangle" : "cross";
  const char* article = std::string("aeiou").find(colour[0]) != std::string::npos ? "an " : "a ";
  return {article + colour + " " + shape, cx / n,        cy / n, double(x1 - x0 + 1),
          (sum[0] + sum[1] + sum[2]) / (3.0 * n), bg / (im.w * im.h - n)};
}

}  // namespace

TEST(Synth, DeterministicCountsDecodableAndAnswersMatchThePictures) {
  const fs::path dir = fs::temp_directory_path() / ("q3vl_synth_" + std::to_string(getpid()));
  fs::remove_all(dir);
  write_synth((dir / "a").string(), {60, 10, 12}, 64, 5, 7);
  write_synth((dir / "b").string(), {60, 10, 12}, 64, 5, 7);
  write_synth((dir / "c").string(), {60, 10, 12}, 64, 6, 7);
  write_synth((dir / "d").string(), {60, 10, 12}, 64, 5, 8);
  write_synth((dir / "e").string(), {60, 0, 12}, 64, 5, 7);

  for (const char* f : {"train.jsonl", "val.jsonl", "eval.jsonl", "images/train_000007.png", "images/val_000009.png",
                        "images/eval_000011.png"})
    EXPECT_EQ(slurp(dir / "a" / f), slurp(dir / "b" / f)) << f << " differs for the same seeds";
  // synth.seed draws train and val, synth.eval_seed the held-out pictures, and neither touches the other's.
  EXPECT_NE(slurp(dir / "a" / "train.jsonl"), slurp(dir / "c" / "train.jsonl")) << "the seed changes nothing";
  EXPECT_NE(slurp(dir / "a" / "images/val_000000.png"), slurp(dir / "c" / "images/val_000000.png"));
  EXPECT_EQ(slurp(dir / "a" / "images/eval_000000.png"), slurp(dir / "c" / "images/eval_000000.png"));
  EXPECT_NE(slurp(dir / "a" / "images/eval_000000.png"), slurp(dir / "d" / "images/eval_000000.png"));
  EXPECT_EQ(slurp(dir / "a" / "images/train_000000.png"), slurp(dir / "d" / "images/train_000000.png"));
  EXPECT_NE(slurp(dir / "a" / "images/train_000000.png"), slurp(dir / "a" / "images/val_000000.png"))
      << "train and val share pictures";
  EXPECT_EQ(slurp(dir / "a" / "eval.jsonl"), slurp(dir / "e" / "eval.jsonl"));
  EXPECT_FALSE(fs::exists(dir / "e" / "val.jsonl")) << "no validation split was asked for";

  std::map<std::string, int> seen;
  for (const char* split : {"train", "val", "eval"}) {
    const auto recs = lines(dir / "a" / (std::string(split) + ".jsonl"));
    ASSERT_EQ(recs.size(), std::string(split) == "train" ? 60u : std::string(split) == "val" ? 10u : 12u) << split;
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
      EXPECT_EQ(read_picture(im).answer, answer) << split << " line " << i + 1 << " (" << img << ")";
      ++seen[answer.substr(answer.rfind(' ') + 1)];
    }
  }
  EXPECT_EQ(seen.size(), synth_shapes().size()) << "every shape should occur in 82 pictures";
  fs::remove_all(dir);
}

TEST(Synth, SampleAgreesWithItsAnswer) {
  for (int split = 0; split < 3; ++split)
    for (int i = 0; i < 1000; ++i) {
      const SynthSample s = synth_sample(9, split, i, 64);
      EXPECT_EQ(s.answer, synth_answer(s.colour, s.shape));
      EXPECT_EQ(read_picture(s.image).answer, s.answer) << "split " << split << " sample " << i;
      EXPECT_FALSE(s.question.empty());
    }
  EXPECT_THROW(synth_sample(1, 0, 0, 8), std::exception);
}

TEST(Synth, AnswersReadAsEnglish) {
  EXPECT_EQ(synth_answer(0, 0), "a red circle");
  int orange = -1;
  for (size_t c = 0; c < synth_colours().size(); ++c)
    if (std::string(synth_colours()[c].name) == "orange") orange = (int)c;
  ASSERT_GE(orange, 0);
  EXPECT_EQ(synth_answer(orange, 1), "an orange square");
}

// synth.answer_format changes the answers only: the same pictures and questions as "sentence" (the default).
TEST(Synth, AnswerFormatsChangeOnlyTheAnswer) {
  EXPECT_EQ(synth_answer(0, 0, SynthFormat::Fields), "shape: circle, colour: red");
  EXPECT_EQ(synth_answer(0, 0, SynthFormat::ShapeFirst), "a circle red");
  EXPECT_EQ(synth_format("sentence"), SynthFormat::Sentence);
  EXPECT_EQ(synth_format("shape-first"), SynthFormat::ShapeFirst);
  EXPECT_EQ(synth_format("fields"), SynthFormat::Fields);
  EXPECT_THROW(synth_format("prose"), std::exception);
  for (int i = 0; i < 50; ++i) {
    const SynthSample a = synth_sample(9, 2, i, 64);
    const std::string shape = synth_shapes()[a.shape], colour = synth_colours()[a.colour].name;
    for (auto [f, want] : {std::pair{SynthFormat::Fields, "shape: " + shape + ", colour: " + colour},
                           std::pair{SynthFormat::ShapeFirst, "a " + shape + " " + colour}}) {
      const SynthSample b = synth_sample(9, 2, i, 64, f);
      EXPECT_EQ(a.image.px, b.image.px);
      EXPECT_EQ(a.question, b.question);
      EXPECT_EQ(b.answer, want);
    }
  }
}

// Only the picture tells the answer: within one answer the place, size, background and shade spread, so that
// neither a fixed position nor the background's level nor a single shade carries it. (Place and size spread as far
// as the demo's model learns them in its budget: the centre moves by up to 5% of the side, the radius by 30%.)
TEST(Synth, PicturesVaryInMoreThanTheAnswer) {
  std::map<std::string, std::vector<Reading>> by_answer;
  std::map<int, std::vector<Reading>> by_colour;
  for (int i = 0; i < 3000; ++i) {
    const SynthSample s = synth_sample(11, 0, i, 64);
    by_answer[s.answer].push_back(read_picture(s.image));
    by_colour[s.colour].push_back(by_answer[s.answer].back());
  }
  EXPECT_EQ(by_answer.size(), synth_colours().size() * synth_shapes().size());
  auto spread = [](const std::vector<Reading>& rs, double Reading::*f) {
    double lo = 1e300, hi = -1e300;
    for (const auto& r : rs) lo = std::min(lo, r.*f), hi = std::max(hi, r.*f);
    return hi - lo;
  };
  for (const auto& [answer, rs] : by_answer) {
    ASSERT_GE(rs.size(), 40u) << answer;
    EXPECT_GT(spread(rs, &Reading::cx), 4) << answer << ": the shape stays in one place";
    EXPECT_GT(spread(rs, &Reading::cy), 4) << answer << ": the shape stays in one place";
    EXPECT_GT(spread(rs, &Reading::width), 8) << answer << ": the shape keeps its size";
    EXPECT_GT(spread(rs, &Reading::background), 60) << answer << ": the background keeps its level";
  }
  // Shade: one colour is drawn darker and brighter (the mean level of the shape's pixels; noise averages out).
  for (const auto& [c, rs] : by_colour)
    EXPECT_GT(spread(rs, &Reading::level), 25) << synth_colours()[c].name << " has one shade only";
}

// Clips (synth.kind = video): a reader of the first and last frames gives the answer, "a <colour> <circle|square>
// moving <way>": the colour and shape from each frame as for pictures, the way from where the centroid went.
TEST(Synth, ClipsShowWhatTheAnswerSays) {
  std::map<std::string, int> seen;
  for (int i = 0; i < 200; ++i) {
    const SynthClip s = synth_clip(3, 0, i, 64, 8);
    ASSERT_EQ(s.frames.size(), 8u);
    const Reading a = read_picture(s.frames.front()), b = read_picture(s.frames.back());
    ASSERT_EQ(a.answer, b.answer) << i;
    const double dx = b.cx - a.cx, dy = b.cy - a.cy;
    const char* way = std::fabs(dx) > std::fabs(dy) ? (dx < 0 ? "left" : "right") : (dy < 0 ? "up" : "down");
    EXPECT_GT(std::max(std::fabs(dx), std::fabs(dy)), 0.25 * 64) << i << ": the shape hardly moves";
    EXPECT_LT(std::min(std::fabs(dx), std::fabs(dy)), 2.0) << i << ": the shape moves off its line";
    EXPECT_EQ(s.answer, a.answer + " moving " + way) << i;
    EXPECT_EQ(s.answer, synth_clip_answer(s.colour, s.shape, s.direction));
    ++seen[s.answer];
  }
  EXPECT_EQ(seen.size(), 2 * synth_colours().size() * synth_directions().size()) << "every answer in 200 clips";
  EXPECT_EQ(synth_clip_answer(0, 1, 0), "a red square moving left");
  EXPECT_EQ(synth_clip_answer(0, 0, 3, SynthFormat::Fields), "shape: circle, colour: red, moving: down");
}

// synth.radius_min/max and synth.travel_min/max (SynthMotion): the shape's width and how far it goes, start to end,
// stay in their ranges, and the answers still match the frames; a range that cannot fit in the frame is refused.
TEST(Synth, ClipsFollowTheirMotionRanges) {
  const SynthMotion m{0.20, 0.24, 0.40, 0.48};
  for (int i = 0; i < 60; ++i) {
    const SynthClip s = synth_clip(5, 0, i, 64, 4, SynthFormat::Sentence, m);
    ASSERT_EQ(s.frames.size(), 4u);
    const Reading a = read_picture(s.frames.front()), b = read_picture(s.frames.back());
    ASSERT_EQ(a.answer, b.answer) << i;
    const double dx = b.cx - a.cx, dy = b.cy - a.cy, moved = std::max(std::fabs(dx), std::fabs(dy));
    EXPECT_GT(moved, 0.40 * 64 - 1.5) << i;
    EXPECT_LT(moved, 0.48 * 64 + 1.5) << i;
    EXPECT_LT(std::min(std::fabs(dx), std::fabs(dy)), 2.0) << i;
    EXPECT_GT(a.width, 2 * 0.20 * 64 - 2) << i;  // the bounding box: 2 r, give or take an edge pixel
    EXPECT_LT(a.width, 2 * 0.24 * 64 + 2) << i;
    const char* way = std::fabs(dx) > std::fabs(dy) ? (dx < 0 ? "left" : "right") : (dy < 0 ? "up" : "down");
    EXPECT_EQ(s.answer, a.answer + " moving " + way) << i;
  }
  try {
    synth_clip(1, 0, 0, 64, 4, SynthFormat::Sentence, SynthMotion{0.3, 0.3, 0.5, 0.5});
    ADD_FAILURE() << "a shape of radius 0.3 travelling 0.5 of the side was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("can travel that far"), std::string::npos) << e.what();
  }
  try {
    synth_clip(1, 0, 0, 64, 4, SynthFormat::Sentence, SynthMotion{0.2, 0.1, 0.3, 0.4});
    ADD_FAILURE() << "radius_min > radius_max was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("synth.radius_min"), std::string::npos) << e.what();
  }
}

// synth.step and synth.grid: the shape moves exactly step pixels a frame, and its centre starts on (and, across its
// way, stays on) the centres of a grid of that many pixels, so that upscaled by 16 / grid the processor's 16-px
// patches see it at one phase; a step that cannot fit is refused.
TEST(Synth, ClipsMoveInStepsFromGridCells) {
  const SynthMotion m{0.18, 0.18, 0.3, 0.3, 10, 8};
  auto on_grid = [](double c) {  // read_picture's centroid counts pixel x at x, its centre is at x + 0.5
    const double ph = std::fmod(c + 0.5, 8.0);
    return std::fabs(ph - 4) < 0.3;
  };
  int ways[4] = {0, 0, 0, 0};
  for (int i = 0; i < 60; ++i) {
    const SynthClip s = synth_clip(9, 0, i, 64, 4, SynthFormat::Sentence, m);
    ASSERT_EQ(s.frames.size(), 4u);
    ++ways[s.direction];
    const bool vertical = s.direction >= 2;
    const double sign = s.direction == 0 || s.direction == 2 ? -1 : 1;
    Reading prev;
    for (size_t f = 0; f < s.frames.size(); ++f) {
      const Reading r = read_picture(s.frames[f]);
      EXPECT_TRUE(on_grid(vertical ? r.cx : r.cy)) << i << " frame " << f << ": across " << (vertical ? r.cx : r.cy);
      if (f == 0) {
        EXPECT_TRUE(on_grid(vertical ? r.cy : r.cx)) << i << ": start " << (vertical ? r.cy : r.cx);
      }
      if (f > 0) {
        EXPECT_NEAR(vertical ? r.cy - prev.cy : r.cx - prev.cx, sign * 10, 0.3) << i << " frame " << f;
        EXPECT_NEAR(vertical ? r.cx - prev.cx : r.cy - prev.cy, 0, 0.3) << i << " frame " << f;
      }
      prev = r;
    }
  }
  for (int w = 0; w < 4; ++w) EXPECT_GT(ways[w], 5) << synth_directions()[w];
  try {
    synth_clip(1, 0, 0, 64, 4, SynthFormat::Sentence, SynthMotion{0.18, 0.18, 0.3, 0.3, 14, 8});
    ADD_FAILURE() << "a shape of radius 0.18 moving 14 px a frame for 3 frames on an 8-px grid was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("synth.step"), std::string::npos) << e.what();
  }
}

// synth.from_centre (a control): the shape starts in the middle and moves the way the answer says, whole inside the
// frame, so that its last place alone tells the way.
TEST(Synth, ClipsFromTheCentreEndOnTheirSide) {
  SynthMotion m;
  m.from_centre = true;
  for (int i = 0; i < 40; ++i) {
    const SynthClip s = synth_clip(11, 0, i, 64, 4, SynthFormat::Sentence, m);
    const Reading a = read_picture(s.frames.front()), b = read_picture(s.frames.back());
    ASSERT_EQ(a.answer, b.answer) << i;
    const bool vertical = s.direction >= 2;
    const double start = (vertical ? a.cy : a.cx) + 0.5, end = (vertical ? b.cy : b.cx) + 0.5;
    EXPECT_NEAR(start, 32, 0.03 * 64 + 1) << i;
    const double way = s.direction == 0 || s.direction == 2 ? -1 : 1;
    EXPECT_GT(way * (end - 32), 10) << i << ": ends at " << end;
    EXPECT_GT(b.width, 2 * 0.24 * 64 - 2) << i << ": cut by the frame's edge";
  }
}

TEST(Synth, ClipsAreDeterministicAndRefuseBadSizes) {
  const SynthClip a = synth_clip(3, 2, 7, 32, 4), b = synth_clip(3, 2, 7, 32, 4), c = synth_clip(4, 2, 7, 32, 4);
  ASSERT_EQ(a.frames.size(), 4u);
  for (size_t f = 0; f < 4; ++f) {
    EXPECT_EQ(a.frames[f].px, b.frames[f].px);
    EXPECT_NE(a.frames[f].px, c.frames[f].px);
  }
  EXPECT_NE(a.frames[0].px, a.frames[1].px);
  try {
    synth_clip(1, 0, 0, 33, 8);
    ADD_FAILURE() << "an odd side was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("synth.size"), std::string::npos) << e.what();
  }
  try {
    synth_clip(1, 0, 0, 64, 1);
    ADD_FAILURE() << "a one-frame clip was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("synth.frames"), std::string::npos) << e.what();
  }
}
