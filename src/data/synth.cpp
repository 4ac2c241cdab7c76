#include "q3vl/data/synth.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"
#include "q3vl/data/video.hpp"
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
const char* kClipQuestions[] = {"What does the video show?", "What moves in this clip, and which way?",
                                "Describe the video briefly.", "What shape and colour do you see, and where is it going?"};
// Clips show the first two shapes only: a circle or a square (see synth.hpp).
constexpr int kClipShapes = 2;

// One sample's random stream: split k of seed s, sample i. Plain arithmetic on the raw 64-bit stream: the same
// pictures with every standard library.
struct Draw {
  std::mt19937_64 rng;
  Draw(uint64_t seed, int split, int64_t index) {
    std::seed_seq seq{uint64_t(seed), uint64_t(seed >> 32), uint64_t(split), uint64_t(index)};
    rng.seed(seq);
  }
  double uni(double a, double b) { return a + (b - a) * (double(rng() >> 11) * 0x1.0p-53); }
  size_t pick(size_t n) { return size_t(rng() % n); }
};

// Everything of a picture but the shape and its place: the background (grey level, a slight tint, a gradient, the
// noise) and the shade of the colour.
struct Look {
  double grey, gx, gy, tint[3], fg[3];
  int noise;
};

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

namespace {

// The background stays grey next to the dullest shade (green at 0.78) and every shade is nearest its own colour.
Look draw_look(Draw& d, int colour, int size) {
  Look l;
  l.grey = d.uni(10, 100), l.gx = d.uni(-15, 15) / size, l.gy = d.uni(-15, 15) / size;
  for (double& t : l.tint) t = d.uni(-8, 8);
  const double shade = d.uni(0.78, 1.05);
  for (int c = 0; c < 3; ++c) l.fg[c] = shade * synth_colours()[colour].rgb[c] + d.uni(-8, 8);
  l.noise = 3 + (int)d.pick(8);
  return l;
}

// Shape `shape` of radius r centred at (cx, cy) on the look's background, with fresh noise from d.
RgbImage paint(Draw& d, const Look& l, int size, int shape, double r, double cx, double cy) {
  RgbImage im;
  im.w = im.h = size;
  im.px.resize((size_t)size * size * 3);
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      const bool in = inside(shape, x + 0.5 - cx, y + 0.5 - cy, r);
      const double bg = l.grey + l.gx * (x - size / 2.0) + l.gy * (y - size / 2.0);
      for (int c = 0; c < 3; ++c) {
        const int v = (int)std::lround(in ? l.fg[c] : bg + l.tint[c]) + (int)d.pick(2 * l.noise + 1) - l.noise;
        im.px[((size_t)y * size + x) * 3 + c] = (uint8_t)std::clamp(v, 0, 255);
      }
    }
  return im;
}

}  // namespace

SynthSample synth_sample(uint64_t seed, int split, int64_t index, int size, SynthFormat format) {
  if (size < 16) fail("synth: pictures need at least 16 pixels a side, got " + std::to_string(size));
  Draw d(seed, split, index);
  SynthSample s;
  s.shape = (int)d.pick(synth_shapes().size());
  s.colour = (int)d.pick(synth_colours().size());
  s.question = kQuestions[d.pick(std::size(kQuestions))];
  s.answer = synth_answer(s.colour, s.shape, format);
  // Everything but the answer varies, so that only looking at the picture gives it: the size, the place, the
  // background and the shade of the colour (draw_look). Size and place vary as much as the demo's model learns
  // within its budget (docs/PERFORMANCE.md: shapes that move twice as far, or shrink further, cost it a fifth of
  // its accuracy); background and shade cost it nothing, so they vary widely.
  const double r = d.uni(0.34, 0.44) * size;
  const double room = std::min(size / 2.0 - r - 1, 0.05 * size);
  const double cx = size / 2.0 + d.uni(-room, room), cy = size / 2.0 + d.uni(-room, room);
  const Look look = draw_look(d, s.colour, size);
  s.image = paint(d, look, size, s.shape, r, cx, cy);
  return s;
}

const std::vector<std::string>& synth_directions() {
  static const std::vector<std::string> d = {"left", "right", "up", "down"};
  return d;
}

std::string synth_clip_answer(int colour, int shape, int direction, SynthFormat format) {
  return synth_answer(colour, shape, format) + (format == SynthFormat::Fields ? ", moving: " : " moving ") +
         synth_directions()[direction];
}

namespace {
void check_clip_size(int size, int frames, const SynthMotion& m) {
  if (size < 32 || size % 2)
    fail("synth.size: video frames need an even side of at least 32 pixels, got " + std::to_string(size));
  if (frames < 2) fail("synth.frames: a clip needs at least 2 frames, got " + std::to_string(frames));
  auto range = [](const char* what, double lo, double hi) {
    if (!(lo > 0 && lo <= hi))
      fail(std::string("synth.") + what + "_min .. synth." + what + "_max: " + std::to_string(lo) + " .. " +
           std::to_string(hi) + " is not a range of positive fractions of the side");
  };
  range("radius", m.radius_min, m.radius_max);
  range("travel", m.travel_min, m.travel_max);
  if (m.step < 0 || m.grid < 0 || m.grid > size / 4)
    fail("synth.step " + std::to_string(m.step) + ", synth.grid " + std::to_string(m.grid) +
         ": pixels, at least 0 (grid at most a quarter of the side)");
  // The smallest shape on the shortest path must fit whole, with a pixel to spare at each end (and a grid cell
  // of room for its start).
  const double travel = m.step > 0 ? double(m.step) * (frames - 1) : m.travel_min * size;
  if (2 * m.radius_min * size + travel + 2 + m.grid >= size)
    fail("synth.radius_min " + std::to_string(m.radius_min) + " and " +
         (m.step > 0 ? "synth.step " + std::to_string(m.step) : "synth.travel_min " + std::to_string(m.travel_min)) +
         ": no shape of that size can travel that far inside a frame of " + std::to_string(size) +
         " pixels (2 x radius + travel must stay under the side)");
}
}  // namespace

SynthClip synth_clip(uint64_t seed, int split, int64_t index, int size, int frames, SynthFormat format,
                     const SynthMotion& m) {
  check_clip_size(size, frames, m);
  Draw d(seed, split, index);
  SynthClip s;
  s.shape = (int)d.pick(kClipShapes);
  s.colour = (int)d.pick(synth_colours().size());
  s.direction = (int)d.pick(synth_directions().size());
  s.question = kClipQuestions[d.pick(std::size(kClipQuestions))];
  s.answer = synth_clip_answer(s.colour, s.shape, s.direction, format);
  // The shape moves synth.travel_min..max of the frame, start to end, along its direction, near the middle across
  // it; it stays whole inside the frame. Its size, start, speed and everything of the look vary.
  const double r = d.uni(m.radius_min, m.radius_max) * size;
  const double travel = m.step > 0 ? double(m.step) * (frames - 1) : d.uni(m.travel_min, m.travel_max) * size;
  double start = d.uni(r + 1, size - r - 1 - travel);
  if (m.from_centre) start = size / 2.0 + d.uni(-0.03, 0.03) * size;
  double across = size / 2.0 + d.uni(-0.1, 0.1) * size;
  if (m.grid > 0) {  // the nearest cell centre that keeps the shape whole (check_clip_size left a cell of room)
    const double g = m.grid, lo = r + 1, hi = size - r - 1 - travel;
    auto snap = [&](double v, double a, double b) {
      double c = std::floor(v / g) * g + g / 2;
      if (c < a) c += g;
      if (c > b) c -= g;
      return c;
    };
    start = snap(start, lo, hi);
    across = snap(across, r + 1, size - r - 1);
  }
  const double go = m.from_centre ? std::min(travel, size - r - 1 - start) : travel;
  const Look look = draw_look(d, s.colour, size);
  const bool backwards = s.direction == 0 || s.direction == 2, vertical = s.direction >= 2;
  for (int f = 0; f < frames; ++f) {
    double along = start + go * f / (frames - 1);
    if (backwards) along = size - along;
    s.frames.push_back(paint(d, look, size, s.shape, r, vertical ? across : along, vertical ? along : across));
  }
  return s;
}

namespace {

// One record of a split: its media part ({"type": "image", ...}), the question and the answer.
struct SynthRecord {
  nlohmann::json media;
  std::string question, answer;
};

// Writes dir/{train,val,eval}.jsonl (val.jsonl only if counts.val > 0), each split's records made by make(seed,
// split, index, stem) with stem "train_000012" (make writes the media file it names). Split k draws from stream
// (seed, k); the held-out split from its own seed, which nothing was tuned on.
void write_splits(const std::string& dir, const SynthCounts& n, uint64_t seed, uint64_t eval_seed,
                  const std::function<SynthRecord(uint64_t, int, int64_t, const std::string&)>& make) {
  const char* names[] = {"train", "val", "eval"};
  const int64_t counts[] = {n.train, n.val, n.eval};
  for (int split = 0; split < 3; ++split) {
    if (split == 1 && counts[split] == 0) continue;  // no validation split asked for: no empty val.jsonl either
    const std::string path = (fs::path(dir) / (std::string(names[split]) + ".jsonl")).string();
    std::ofstream out(path + ".partial");
    if (!out) fail(path + ": cannot write");
    try {
      for (int64_t i = 0; i < counts[split]; ++i) {
        char stem[64];
        std::snprintf(stem, sizeof stem, "%s_%06lld", names[split], (long long)i);
        const SynthRecord r = make(split == 2 ? eval_seed : seed, split, i, stem);
        const nlohmann::json rec = {
            {"messages",
             {{{"role", "user"}, {"content", {r.media, {{"type", "text"}, {"text", r.question}}}}},
              {{"role", "assistant"}, {"content", r.answer}}}}};
        out << rec.dump() << "\n";
      }
    } catch (...) {  // no half-written records file: the error names what failed
      out.close();
      fs::remove(path + ".partial");
      throw;
    }
    out.close();
    if (!out) fail(path + ": write failed");
    fs::rename(path + ".partial", path);
  }
}

}  // namespace

void write_synth(const std::string& dir, const SynthCounts& n, int size, uint64_t seed, uint64_t eval_seed,
                 SynthFormat format) {
  fs::create_directories(fs::path(dir) / "images");
  write_splits(dir, n, seed, eval_seed, [&](uint64_t sd, int split, int64_t i, const std::string& stem) {
    SynthSample s = synth_sample(sd, split, i, size, format);
    const std::string img = "images/" + stem + ".png";
    write_png((fs::path(dir) / img).string(), s.image);
    return SynthRecord{{{"type", "image"}, {"image", img}}, std::move(s.question), std::move(s.answer)};
  });
}

std::string write_synth_video(const std::string& dir, const SynthCounts& n, const SynthVideo& v, uint64_t seed,
                              uint64_t eval_seed, SynthFormat format) {
  check_clip_size(v.size, v.frames, v.motion);
  const std::string encoder = v.encoder.empty() ? default_video_encoder() : v.encoder;
  if (encoder.empty())
    fail("synth.kind = video: this q3vl was built without FFmpeg (make FFMPEG=0), so it cannot encode clips; build "
         "it with FFmpeg's libraries (make deps; make), or write the clips as frame lists (synth.encoder = frames)");
  const bool frames = encoder == "frames";  // PNG frames, given as a list with the clip's fps
  fs::create_directories(fs::path(dir) / "clips");
  write_splits(dir, n, seed, eval_seed, [&](uint64_t sd, int split, int64_t i, const std::string& stem) {
    SynthMotion m = v.motion;
    // Training clip i starts in the middle when i * centre_starts passes a whole number: that fraction, spread evenly.
    m.from_centre = split == 0 && std::floor((i + 1) * v.centre_starts) > std::floor(i * v.centre_starts);
    SynthClip s = synth_clip(sd, split, i, v.size, v.frames, format, m);
    nlohmann::json part{{"type", "video"}};
    if (frames) {
      nlohmann::json list = nlohmann::json::array();
      fs::create_directories(fs::path(dir) / "clips" / stem);
      for (size_t k = 0; k < s.frames.size(); ++k) {
        const std::string f = "clips/" + stem + "/" + std::to_string(k) + ".png";
        write_png((fs::path(dir) / f).string(), s.frames[k]);
        list.push_back(f);
      }
      part["video"] = std::move(list), part["fps"] = v.fps;
    } else {
      part["video"] = "clips/" + stem + ".mp4";
      encode_video((fs::path(dir) / part["video"].get<std::string>()).string(), s.frames, v.fps, encoder);
    }
    return SynthRecord{std::move(part), std::move(s.question), std::move(s.answer)};
  });
  return encoder;
}

int run_synth(const Deck& deck) {
  Runtime& rt = Runtime::get();
  const bool video = deck.str("synth.kind") == "video";
  if (rt.where().rank == 0) {
    const std::string dir = deck.str("synth.dir");
    const SynthCounts n{deck.integer("synth.train_samples"), deck.integer("synth.val_samples"),
                        deck.integer("synth.eval_samples")};
    const int size = (int)deck.integer("synth.size");
    const uint64_t seed = (uint64_t)deck.integer("synth.seed"), eval_seed = (uint64_t)deck.integer("synth.eval_seed");
    const SynthFormat format = synth_format(deck.str("synth.answer_format"));
    std::string what = "pictures of " + std::to_string(size) + " px";
    if (video) {
      const SynthMotion m{deck.real("synth.radius_min"), deck.real("synth.radius_max"), deck.real("synth.travel_min"),
                          deck.real("synth.travel_max"), (int)deck.integer("synth.step"),
                          (int)deck.integer("synth.grid")};
      const SynthVideo v{size, (int)deck.integer("synth.frames"), deck.real("synth.fps"), deck.str("synth.encoder"), m,
                         deck.real("synth.centre_starts")};
      const std::string enc = write_synth_video(dir, n, v, seed, eval_seed, format);
      char fps[32];
      std::snprintf(fps, sizeof fps, "%g", v.fps);
      what = "clips of " + std::to_string(v.frames) + " frames of " + std::to_string(size) + " px at " + fps +
             " fps, " + (enc == "frames" ? "as lists of PNG frames" : "encoded with " + enc) + (enc == "libx264" ? " (H.264)" : "") +
             (deck.given("synth.encoder") || enc == "libx264" ? "" : " (this libavcodec has no H.264 encoder)");
    } else {
      write_synth(dir, n, size, seed, eval_seed, format);
    }
    log_info("synth: " + std::to_string(n.train) + " train, " + std::to_string(n.val) + " validation and " +
             std::to_string(n.eval) + " held-out " + what + ", " + deck.str("synth.answer_format") + " answers -> " +
             dir + (n.val ? "/{train,val,eval}.jsonl" : "/{train,eval}.jsonl"));
  }
  idle_barrier(rt.world(), video ? "waiting for rank 0 to make the clips" : "waiting for rank 0 to draw the pictures");
  return 0;
}

}  // namespace q3vl
