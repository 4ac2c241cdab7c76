// The loader's promises, checked by simulating every rank of 1, 2 and 4-rank runs in one process: the same
// global batches whatever the rank count and micro/accumulation split, a resumable cursor, truncation that
// never splits an image, and drop mode. Plus AdamW and the schedule against hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "q3vl/model/config.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/train/loader.hpp"
#include "q3vl/train/optim.hpp"

using namespace q3vl;

namespace {

ModelConfig cfg() { return load_hf_config("tests/data/golden/dense_tied/model/config.json"); }

struct StepView {
  std::vector<size_t> samples;  // over all ranks, sorted
  int64_t tokens = 0, supervised = 0, micro_steps = 0;
};

StepView run_step(const Dataset& d, LoaderOptions o, int nranks, LoaderCursor c, LoaderCursor* after) {
  StepView v;
  for (int r = 0; r < nranks; ++r) {
    Loader l(d, cfg(), o, r, nranks);
    l.set_cursor(c);
    StepData s = l.next();
    v.samples.insert(v.samples.end(), s.samples.begin(), s.samples.end());
    v.tokens += s.tokens;
    v.supervised += s.supervised;
    if (r == 0) v.micro_steps = int64_t(s.micro.size());
    EXPECT_EQ(int64_t(s.micro.size()), v.micro_steps) << "ranks disagree on the number of micro-steps";
    int64_t sup = 0;
    for (size_t i = 0; i < s.micro.size(); ++i) {
      const PackedBatch& b = s.micro[i];
      EXPECT_LE(int64_t(b.input_ids.size()), o.micro_batch * o.seq_len);
      if (!b.input_ids.empty()) {
        EXPECT_EQ(b.cu_seqlens.back(), int64_t(b.input_ids.size()));
      }
      sup += s.micro_supervised[i];
    }
    EXPECT_EQ(sup, s.supervised);
    if (after) *after = l.cursor();
  }
  std::sort(v.samples.begin(), v.samples.end());
  return v;
}

}  // namespace

TEST(TrainLoader, SameGlobalBatchesForAnyRankCountAndSplit) {
  SyntheticDataset d(cfg(), 37, 5, 8, 40);
  const std::pair<int, int> splits[] = {{4, 1}, {2, 2}, {1, 4}};
  LoaderCursor c0;
  for (int step = 0; step < 6; ++step) {  // 6 x 8 samples: crosses an epoch boundary of 37
    LoaderOptions o;
    o.global_batch = 8, o.seq_len = 32, o.seed = 11;
    LoaderCursor next;
    const StepView ref = run_step(d, o, 1, c0, &next);
    EXPECT_EQ(ref.samples.size(), 8u);
    for (int n : {1, 2, 4})
      for (auto [micro, accum] : splits) {
        o.micro_batch = micro, o.grad_accum = accum;
        LoaderCursor after;
        const StepView v = run_step(d, o, n, c0, &after);
        EXPECT_EQ(v.samples, ref.samples) << n << " ranks, micro " << micro << " x accum " << accum;
        EXPECT_EQ(v.tokens, ref.tokens);
        EXPECT_EQ(v.supervised, ref.supervised);
        EXPECT_EQ(after, next);
      }
    c0 = next;
  }
  EXPECT_EQ(c0.epoch, 1);  // 48 samples taken from epochs of 37
}

TEST(TrainLoader, EpochsAreShuffledDifferentlyAndSeeded) {
  SyntheticDataset d(cfg(), 16, 5, 8, 20);
  LoaderOptions o;
  o.global_batch = 16, o.seq_len = 32, o.seed = 3;
  Loader a(d, cfg(), o, 0, 1);
  const auto e0 = a.peek_global();
  a.next();
  const auto e1 = a.peek_global();
  EXPECT_NE(e0, e1);
  auto s0 = e0;
  std::sort(s0.begin(), s0.end());
  for (size_t i = 0; i < s0.size(); ++i) EXPECT_EQ(s0[i], i);  // an epoch is a permutation
  o.seed = 4;
  EXPECT_NE(Loader(d, cfg(), o, 0, 1).peek_global(), e0);
}

TEST(TrainLoader, TruncationKeepsImagesWholeAndDropModeSkipsOverlong) {
  const ModelConfig c = cfg();
  SyntheticDataset d(c, 60, 9, 10, 60);
  for (bool drop : {false, true}) {
    LoaderOptions o;
    o.global_batch = 60, o.seq_len = 24, o.seed = 1, o.drop_overlong = drop, o.micro_batch = 100;
    Loader l(d, c, o, 0, 1);
    StepData s = l.next();
    int64_t overlong = 0;
    for (size_t idx : s.samples) overlong += int64_t(d.length(idx)) > o.seq_len;
    if (drop) EXPECT_EQ(overlong, 0);
    else EXPECT_GT(overlong, 0);
    for (const PackedBatch& b : s.micro) {
      const int64_t img = std::count(b.input_ids.begin(), b.input_ids.end(), int64_t(c.image_token_id));
      int64_t want = 0;
      for (size_t k = 0; k < b.image_grid_thw.size(); k += 3)
        want += b.image_grid_thw[k] * b.image_grid_thw[k + 1] * b.image_grid_thw[k + 2] / 4;
      EXPECT_EQ(img, want) << "image tokens and image grids disagree after truncation";
      EXPECT_EQ(b.pixel_values.size(), size_t(want * 4 * c.vision.patch_dim()));
      for (size_t k = 1; k < b.cu_seqlens.size(); ++k) EXPECT_LE(b.cu_seqlens[k] - b.cu_seqlens[k - 1], o.seq_len);
    }
  }
}

TEST(TrainLoader, TruncationThatWouldCutAnImageDropsTheSample) {
  const ModelConfig c = cfg();
  SyntheticDataset d(c, 30, 9, 20, 30);  // every third sample has an image at tokens 3..8
  LoaderOptions o;
  o.global_batch = 30, o.seq_len = 8, o.seed = 1, o.micro_batch = 100;
  StepData s = Loader(d, c, o, 0, 1).next();
  EXPECT_EQ(s.dropped, 10);
  for (const PackedBatch& b : s.micro) {
    EXPECT_TRUE(b.image_grid_thw.empty());
    EXPECT_EQ(b.input_ids.size(), 20u * 8u);
  }
}

TEST(TrainOptim, AdamWMatchesHandComputedSteps) {
  AdamWConfig c;
  c.beta1 = 0.9, c.beta2 = 0.99, c.eps = 1e-8;
  float p = 1.f, m = 0.f, v = 0.f;
  double P = 1, M = 0, V = 0;
  const double g[3] = {0.5, -0.2, 0.1}, lr = 0.01, wd = 0.1;
  for (int t = 1; t <= 3; ++t) {
    float gf = float(g[t - 1]);
    dev::adamw(dev::Exec{}, &p, &gf, &m, &v, 1, c.beta1, c.beta2, c.eps, lr, wd, 0.5, t);  // the CPU reference
    const double gs = g[t - 1] * 0.5;
    P *= 1 - lr * wd;
    M = 0.9 * M + 0.1 * gs;
    V = 0.99 * V + 0.01 * gs * gs;
    P -= lr * (M / (1 - std::pow(0.9, t))) / (std::sqrt(V / (1 - std::pow(0.99, t))) + 1e-8);
    EXPECT_NEAR(p, P, 1e-6) << "step " << t;
  }
}

TEST(TrainOptim, ScheduleWarmupAndDecay) {
  Schedule s;
  s.lr = 1.0, s.warmup = 4, s.total = 14, s.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(s.at(0), 0.25);
  EXPECT_DOUBLE_EQ(s.at(3), 1.0);
  EXPECT_DOUBLE_EQ(s.at(4), 1.0);
  EXPECT_NEAR(s.at(13), 0.1, 1e-12);
  EXPECT_NEAR(s.at(8), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 4 / 9)), 1e-12);
  s.kind = "linear";
  EXPECT_NEAR(s.at(13), 0.1, 1e-12);
  EXPECT_NEAR(s.at(8), 0.1 + 0.9 * (1 - 4.0 / 9), 1e-12);
  s.kind = "constant";
  EXPECT_DOUBLE_EQ(s.at(13), 1.0);
}

TEST(TrainLoader, OneEpochIsEverySampleOnceForOneToFourRanksAndResumesAcrossRankCounts) {
  const size_t n = 40;
  SyntheticDataset d(cfg(), n, 7, 8, 40);
  LoaderOptions o;
  o.global_batch = 8, o.seq_len = 64, o.seed = 3, o.micro_batch = 1, o.grad_accum = 2;
  // The 1-rank run is the reference global order.
  std::vector<std::vector<size_t>> ref;
  LoaderCursor c;
  for (size_t s = 0; s < n / 8; ++s) ref.push_back(run_step(d, o, 1, c, &c).samples);
  for (int ranks : {1, 2, 3, 4}) {
    std::map<size_t, int> seen;
    LoaderCursor cur;
    for (size_t s = 0; s < n / 8; ++s) {
      StepView v = run_step(d, o, ranks, cur, &cur);
      EXPECT_EQ(v.samples, ref[s]) << ranks << " ranks, step " << s;
      for (size_t i : v.samples) ++seen[i];
    }
    EXPECT_EQ(seen.size(), n) << ranks << " ranks";
    for (auto [i, k] : seen) EXPECT_EQ(k, 1) << "sample " << i << " seen " << k << " times on " << ranks << " ranks";
  }
  // Stop mid-epoch on 4 ranks, resume on 3 (and on 2): the same global order continues.
  for (int resumed : {3, 2}) {
    LoaderCursor cur;
    for (size_t s = 0; s < 2; ++s) EXPECT_EQ(run_step(d, o, 4, cur, &cur).samples, ref[s]);
    for (size_t s = 2; s < n / 8; ++s)
      EXPECT_EQ(run_step(d, o, resumed, cur, &cur).samples, ref[s]) << "resumed on " << resumed << " ranks, step " << s;
  }
}
