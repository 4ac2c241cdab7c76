#include "q3vl/data/synth.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/runtime/runtime.hpp"

namespace q3vl {

namespace fs = std::filesystem;

const std::vector<SynthColour>& synth_colours() {
  // Saturated and far apart, so that the dominant colour of a picture names one of them unambiguously.
  static const std::vector<SynthColour> c = {{"red", {220, 40, 40}},     {"green", {40, 180, 60}},
                                             {"blue", {40, 80, 230}},     {"yellow", {230, 210, 40}},
                                             {"purple", {150, 50, 210}}, {"orange", {245, 140, 25}}};
  return c;
}

const std::vector<std::string>& synth_shapes() {
  static const std::vector<std::string> s = {"circle", "square", "triangle", "star", "cross"};
  return s;
}

namespace {

const char* kQuestions[] = {"What does the picture show?", "What is in this image?", "Describe the picture briefly.",
                            "What shape and colour do you see?"};

// Even-odd rule.
bool in_polygon(const std::vector<std::pair<double, double>>& p, double x, double y) {
  bool in = false;
  for (size_t i = 0, j = p.size() - 1; i < p.size(); j = i++)
    if ((p[i].second > y) != (p[j].second > y) &&
        x < (p[j].first - p[i].first) * (y - p[i].second) / (p[j].second - p[i].second) + p[i].first)
      in = !in;
  return in;
}

// Is (dx, dy), relative to the centre, inside shape s of radius r?
bool inside(int s, double dx, double dy, double r) {
  switch (s) {
    case 0: return dx * dx + dy * dy <= r * r;
    case 1: return std::fabs(dx) <= r && std::fabs(dy) <= r;  // as wide as the circle: its corners tell them apart
    case 2: return in_polygon({{0, -r}, {0.866 * r, 0.5 * r}, {-0.866 * r, 0.5 * r}}, dx, dy);
    case 3: {
      std::vector<std::pair<double, double>> p;
      for (int k = 0; k < 10; ++k) {  // outer and inner points alternating, first one on top
        const double a = -M_PI / 2 + k * M_PI / 5, rr = k % 2 ? 0.38 * r : r;
        p.push_back({rr * std::cos(a), rr * std::sin(a)});
      }
      return in_polygon(p, dx, dy);
    }
    default: {
      const double ax = std::fabs(dx), ay = std::fabs(dy);
      return (ax <= 0.3 * r && ay <= r) || (ay <= 0.3 * r && ax <= r);
    }
  }
}

}  // namespace

SynthFormat synth_format(const std::string& name) {
  if (name == "sentence") return SynthFormat::Sentence;
  if (name == "shape-first") return SynthFormat::ShapeFirst;
  if (name == "fields") return SynthFormat::Fields;
  fail("synth.answer_format: '" + name + "' is not one of sentence, shape-first, fields");
}

std::string synth_answer(int colour, int shape, SynthFormat format) {
  const std::string c = synth_colours()[colour].name;
  if (format == SynthFormat::Fields) return "shape: " + synth_shapes()[shape] + ", colour: " + c;
  if (format == SynthFormat::ShapeFirst) return "a " + synth_shapes()[shape] + " " + c;  // every shape takes "a"
  return std::string(std::strchr("aeiou", c[0]) ? "an " : "a ") + c + " " + synth_shapes()[shape];
}

SynthSample synth_sample(uint64_t seed, int split, int64_t index, int size, SynthFormat format) {
  if (size < 16) fail("synth: pictures need at least 16 pixels a side, got " + std::to_string(size));
  std::seed_seq seq{uint64_t(seed), uint64_t(seed >> 32), uint64_t(split), uint64_t(index)};
  std::mt19937_64 rng(seq);
  // Plain arithmetic on the raw 64-bit stream: the same pictures with every standard library.
  auto uni = [&](double a, double b) { return a + (b - a) * (double(rng() >> 11) * 0x1.0p-53); };
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  SynthSample s;
  s.shape = (int)pick(synth_shapes().size());
  s.colour = (int)pick(synth_colours().size());
  s.question = kQuestions[pick(std::size(kQuestions))];
  s.answer = synth_answer(s.colour, s.shape, format);
  // Everything but the answer varies, so that only looking at the picture gives it: the size, the place, the
  // background (grey level, a slight tint, a gradient, the noise) and the shade of the colour. Size and place vary
  // as much as the demo's model learns within its budget (docs/PERFORMANCE.md: shapes that move twice as far, or
  // shrink further, cost it a fifth of its accuracy); background and shade cost it nothing, so they vary widely.
  // The background stays grey next to the dullest shade (green at 0.78) and every shade is nearest its own colour.
  const double r = uni(0.34, 0.44) * size;
  const double room = std::min(size / 2.0 - r - 1, 0.05 * size);
  const double cx = size / 2.0 + uni(-room, room), cy = size / 2.0 + uni(-room, room);
  const double grey = uni(10, 100), gx = uni(-15, 15) / size, gy = uni(-15, 15) / size;
  const double tint[3] = {uni(-8, 8), uni(-8, 8), uni(-8, 8)};
  const double shade = uni(0.78, 1.05);
  double fg[3];
  for (int c = 0; c < 3; ++c) fg[c] = shade * synth_colours()[s.colour].rgb[c] + uni(-8, 8);
  const int noise = 3 + (int)pick(8);
  s.image.w = s.image.h = size;
  s.image.px.resize((size_t)size * size * 3);
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      const bool in = inside(s.shape, x + 0.5 - cx, y + 0.5 - cy, r);
      const double bg = grey + gx * (x - size / 2.0) + gy * (y - size / 2.0);
      for (int c = 0; c < 3; ++c) {
        const int v = (int)std::lround(in ? fg[c] : bg + tint[c]) + (int)pick(2 * noise + 1) - noise;
        s.image.px[((size_t)y * size + x) * 3 + c] = (uint8_t)std::clamp(v, 0, 255);
      }
    }
  return s;
}

void write_synth(const std::string& dir, const SynthCounts& n, int size, uint64_t seed, uint64_t eval_seed,
                 SynthFormat format) {
  fs::create_directories(fs::path(dir) / "images");
  // Split k draws from stream (seed, k); the held-out split from its own seed, which nothing was tuned on.
  const char* names[] = {"train", "val", "eval"};
  const int64_t counts[] = {n.train, n.val, n.eval};
  for (int split = 0; split < 3; ++split) {
    if (split == 1 && counts[split] == 0) continue;  // no validation split asked for: no empty val.jsonl either
    const std::string path = (fs::path(dir) / (std::string(names[split]) + ".jsonl")).string();
    std::ofstream out(path + ".partial");
    if (!out) fail(path + ": cannot write");
    for (int64_t i = 0; i < counts[split]; ++i) {
      const SynthSample s = synth_sample(split == 2 ? eval_seed : seed, split, i, size, format);
      char img[64];
      std::snprintf(img, sizeof img, "images/%s_%06lld.png", names[split], (long long)i);
      write_png((fs::path(dir) / img).string(), s.image);
      const nlohmann::json rec = {
          {"messages",
           {{{"role", "user"},
             {"content", {{{"type", "image"}, {"image", img}}, {{"type", "text"}, {"text", s.question}}}}},
            {{"role", "assistant"}, {"content", s.answer}}}}};
      out << rec.dump() << "\n";
    }
    out.close();
    if (!out) fail(path + ": write failed");
    fs::rename(path + ".partial", path);
  }
}

int run_synth(const Deck& deck) {
  Runtime& rt = Runtime::get();
  if (rt.where().rank == 0) {
    const std::string dir = deck.str("synth.dir");
    const SynthCounts n{deck.integer("synth.train_samples"), deck.integer("synth.val_samples"),
                        deck.integer("synth.eval_samples")};
    write_synth(dir, n, (int)deck.integer("synth.size"), (uint64_t)deck.integer("synth.seed"),
                (uint64_t)deck.integer("synth.eval_seed"), synth_format(deck.str("synth.answer_format")));
    log_info("synth: " + std::to_string(n.train) + " train, " + std::to_string(n.val) + " validation and " +
             std::to_string(n.eval) + " held-out pictures of " + std::to_string(deck.integer("synth.size")) +
             " px, " + deck.str("synth.answer_format") + " answers -> " + dir + (n.val ? "/{train,val,eval}.jsonl" : "/{train,eval}.jsonl"));
  }
  idle_barrier(rt.world(), "waiting for rank 0 to draw the pictures");
  return 0;
}

}  // namespace q3vl
