#include "q3vl/train/loader.hpp"

#include <algorithm>
#include <system_error>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"

namespace q3vl {

namespace {

// splitmix64: a portable, seedable generator (std::shuffle and the distributions are implementation-defined,
// and the order must be the same on every machine that resumes the run).
struct Mix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return next() % n; }
};

}  // namespace

int64_t supervised_targets(const std::vector<int64_t>& labels) {
  int64_t n = 0;
  for (size_t s = 1; s < labels.size(); ++s) n += labels[s] != -100;
  return n;
}

Loader::Loader(const Dataset& data, const ModelConfig& cfg, const LoaderOptions& opt, int rank, int nranks)
    : data_(data), cfg_(cfg), opt_(opt), rank_(rank), nranks_(nranks) {
  if (data.size() == 0) fail_all("loader: the dataset is empty");
}

Loader::~Loader() { drop(); }

const std::vector<size_t>& Loader::order(int64_t epoch) const {
  if (epoch != order_epoch_) {
    order_.resize(data_.size());
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
    Mix rng{opt_.seed * 0x2545f4914f6cdd1dull + uint64_t(epoch) + 1};
    for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);
    order_epoch_ = epoch;
  }
  return order_;
}

int64_t Loader::planned_length(size_t index) const {
  return std::min<int64_t>(int64_t(data_.length(index)), opt_.seq_len);
}

std::vector<size_t> Loader::take_global(LoaderCursor& c) const {
  std::vector<size_t> out;
  size_t skipped_in_row = 0;
  while (int64_t(out.size()) < opt_.global_batch) {
    if (c.position >= int64_t(data_.size())) ++c.epoch, c.position = 0;
    const size_t idx = order(c.epoch)[size_t(c.position++)];
    if (opt_.drop_overlong && int64_t(data_.length(idx)) > opt_.seq_len) {
      if (++skipped_in_row > data_.size())
        fail_all("loader: every sample is longer than data.seq_len = " + std::to_string(opt_.seq_len) +
                 " and data.overlong = \"drop\"");
      continue;
    }
    skipped_in_row = 0;
    out.push_back(idx);
  }
  return out;
}

std::vector<size_t> Loader::peek_global() const {
  quiesce();  // the order cache is the build's
  LoaderCursor c = cur_;
  return take_global(c);
}

bool Loader::load(size_t index, Sample& s) const {
  s = data_.get(index);
  const int64_t n = int64_t(s.input_ids.size()), L = opt_.seq_len;
  if (s.labels.size() != s.input_ids.size())
    fail(data_.describe(index) + ": labels and input_ids differ in length");
  if (n <= L) return true;
  // Cut at L only between images and videos: not inside a <|vision_start|> ... <|vision_end|> span and after a
  // whole number of images' and of videos' tokens (a video cut between its temporal patches is not kept).
  bool inside = false;
  int64_t img_tokens = 0, vid_tokens = 0;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = s.input_ids[i];
    if (t == cfg_.vision_start_token_id) inside = true;
    else if (t == cfg_.vision_end_token_id) inside = false;
    img_tokens += t == cfg_.image_token_id;
    vid_tokens += t == cfg_.video_token_id;
  }
  const int64_t m2 = int64_t(cfg_.vision.merge) * cfg_.vision.merge;
  // The leading grids whose tokens make up `want`: their count and pixel rows, or -1 when a grid is cut.
  const auto whole = [&](const std::vector<int64_t>& grid, int64_t want, int64_t& rows) -> int64_t {
    int64_t tokens = 0;
    size_t keep = 0;
    rows = 0;
    for (; keep * 3 + 2 < grid.size(); ++keep) {
      const int64_t patches = grid[keep * 3] * grid[keep * 3 + 1] * grid[keep * 3 + 2];
      if (tokens + patches / m2 > want) break;
      tokens += patches / m2, rows += patches;
    }
    return tokens == want ? int64_t(keep) : -1;
  };
  int64_t irows = 0, vrows = 0;
  const int64_t ikeep = whole(s.image_grid_thw, img_tokens, irows), vkeep = whole(s.video_grid_thw, vid_tokens, vrows);
  if (inside || ikeep < 0 || vkeep < 0) return false;
  s.input_ids.resize(L);
  s.labels.resize(L);
  s.image_grid_thw.resize(size_t(ikeep) * 3);
  s.pixel_values.resize(size_t(irows) * cfg_.vision.patch_dim());
  s.video_grid_thw.resize(size_t(vkeep) * 3);
  s.pixel_values_videos.resize(size_t(vrows) * cfg_.vision.patch_dim());
  return true;
}

StepData Loader::next() {
  if (!pending_.valid()) return build(cur_);
  Built b = pending_.get();  // rethrows the build's error
  cur_ = b.after;
  return std::move(b.data);
}

void Loader::prefetch() {
  if (pending_.valid()) return;
  try {
    pending_ = std::async(std::launch::async, [this, c = cur_]() mutable {
      StepData d = build(c);
      return Built{std::move(d), c};
    });
  } catch (const std::system_error& e) {  // no thread to be had: next() builds the batch itself
    static bool said = false;
    if (!said) log_warn(std::string("data.prefetch: cannot start the prefetch thread (") + e.what() +
                        "): batches are built when needed");
    said = true;
  }
}

void Loader::quiesce() const {
  if (pending_.valid()) pending_.wait();
}

void Loader::drop() {
  if (!pending_.valid()) return;
  abandon_ = true;
  pending_.wait();
  pending_ = {};  // its batch, or its error, is nobody's
  abandon_ = false;
}

void Loader::set_cursor(const LoaderCursor& c) {
  drop();
  cur_ = c;
}

StepData Loader::build(LoaderCursor& c) const {
  const double t0 = wall_seconds();
  const std::vector<size_t> global = take_global(c);
  const int64_t cap = opt_.micro_batch * opt_.seq_len;
  // Packing of rank q: lists of dataset indices, one per micro-batch.
  auto plan = [&](int q) {
    std::vector<size_t> mine;
    for (size_t k = size_t(q); k < global.size(); k += size_t(nranks_)) mine.push_back(global[k]);
    std::vector<std::vector<size_t>> bins;
    const int64_t A = opt_.grad_accum, m = int64_t(mine.size());
    for (int64_t g = 0; g < A; ++g) {
      std::vector<size_t> bin;
      int64_t used = 0;
      for (int64_t k = g * m / A; k < (g + 1) * m / A; ++k) {
        const int64_t len = planned_length(mine[size_t(k)]);
        if (!bin.empty() && used + len > cap) bins.push_back(std::move(bin)), bin.clear(), used = 0;
        bin.push_back(mine[size_t(k)]);
        used += len;
      }
      if (!bin.empty()) bins.push_back(std::move(bin));
    }
    return bins;
  };
  size_t steps = 0;
  for (int q = 0; q < nranks_; ++q) steps = std::max(steps, plan(q).size());
  const auto bins = plan(rank_);

  StepData out;
  out.micro.resize(std::max<size_t>(steps, 1));
  out.micro_supervised.assign(out.micro.size(), 0);
  for (size_t b = 0; b < bins.size(); ++b) {
    PackedBatch& pb = out.micro[b];
    pb.cu_seqlens.push_back(0);
    for (size_t idx : bins[b]) {
      if (abandon_.load(std::memory_order_relaxed)) return out;  // dropped unread: stop reading samples
      out.samples.push_back(idx);
      Sample s;
      if (!load(idx, s)) {
        ++out.dropped;
        continue;
      }
      out.micro_supervised[b] += supervised_targets(s.labels);
      pb.input_ids.insert(pb.input_ids.end(), s.input_ids.begin(), s.input_ids.end());
      pb.labels.insert(pb.labels.end(), s.labels.begin(), s.labels.end());
      pb.cu_seqlens.push_back(int64_t(pb.input_ids.size()));
      pb.pixel_values.insert(pb.pixel_values.end(), s.pixel_values.begin(), s.pixel_values.end());
      pb.image_grid_thw.insert(pb.image_grid_thw.end(), s.image_grid_thw.begin(), s.image_grid_thw.end());
      pb.pixel_values_videos.insert(pb.pixel_values_videos.end(), s.pixel_values_videos.begin(),
                                    s.pixel_values_videos.end());
      pb.video_grid_thw.insert(pb.video_grid_thw.end(), s.video_grid_thw.begin(), s.video_grid_thw.end());
    }
    out.tokens += int64_t(pb.input_ids.size());
    out.supervised += out.micro_supervised[b];
    if (pb.input_ids.empty()) pb = PackedBatch{};
  }
  out.build_seconds = wall_seconds() - t0;
  return out;
}

SyntheticDataset::SyntheticDataset(const ModelConfig& cfg, size_t size, uint64_t seed, int min_len, int max_len,
                                   int image_px, int image_every)
    : cfg_(cfg), size_(size), seed_(seed), min_len_(min_len), max_len_(std::max(min_len, max_len)),
      grid_(image_px / cfg.vision.patch), image_every_(image_every) {
  Q3VL_CHECK(min_len >= 2, "synthetic samples need at least 2 tokens");
  if (image_every > 0 && (image_px % (cfg.vision.patch * cfg.vision.merge) || grid_ <= 0))
    fail_all("train.synthetic_image_px = " + std::to_string(image_px) + " must be a positive multiple of " +
             std::to_string(cfg.vision.patch * cfg.vision.merge) + " (patch x merge)");
}

size_t SyntheticDataset::length(size_t index) const {
  Mix rng{seed_ * 0x9e3779b97f4a7c15ull ^ (uint64_t(index) * 0xd1b54a32d192ed03ull)};
  return size_t(min_len_) + rng.below(uint64_t(max_len_ - min_len_ + 1));
}

Sample SyntheticDataset::get(size_t index) const {
  Q3VL_CHECK(index < size_, "synthetic sample index out of range");
  Mix rng{seed_ * 0x9e3779b97f4a7c15ull ^ (uint64_t(index) * 0xd1b54a32d192ed03ull)};
  const int64_t n = int64_t(min_len_) + int64_t(rng.below(uint64_t(max_len_ - min_len_ + 1)));
  // Plain text ids stay below every special token id.
  int64_t text_vocab = std::min<int64_t>(1000, cfg_.text.vocab);
  for (int id : {cfg_.image_token_id, cfg_.video_token_id, cfg_.vision_start_token_id, cfg_.vision_end_token_id,
                 cfg_.eos_token_id, cfg_.pad_token_id})
    text_vocab = std::min<int64_t>(text_vocab, id);
  Sample s;
  s.input_ids.resize(size_t(n));
  s.labels.assign(size_t(n), -100);
  for (auto& t : s.input_ids) t = int64_t(rng.below(uint64_t(text_vocab)));
  const int64_t m = cfg_.vision.merge, g = grid_, img_tokens = (g / m) * (g / m);
  if (image_every_ > 0 && index % size_t(image_every_) == 0 && n >= 2 * (img_tokens + 5)) {
    s.input_ids[3] = cfg_.vision_start_token_id;
    for (int64_t k = 0; k < img_tokens; ++k) s.input_ids[size_t(4 + k)] = cfg_.image_token_id;
    s.input_ids[size_t(4 + img_tokens)] = cfg_.vision_end_token_id;
    s.image_grid_thw = {1, g, g};
    s.pixel_values.resize(size_t(g * g) * cfg_.vision.patch_dim());
    for (auto& p : s.pixel_values) p = float(int64_t(rng.below(2001)) - 1000) / 1000.f;
  }
  // The answer: an affine sequence modulo the text vocabulary, starting from the prompt's last token.
  for (int64_t j = n / 2; j < n; ++j) {
    s.input_ids[size_t(j)] = (s.input_ids[size_t(j - 1)] * 7 + 3) % text_vocab;
    s.labels[size_t(j)] = s.input_ids[size_t(j)];
  }
  return s;
}

}  // namespace q3vl
