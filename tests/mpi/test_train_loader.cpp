// The loader's promises, checked by simulating every rank of 1, 2 and 4-rank runs in one process: the same
// global batches whatever the rank count and micro/accumulation split, a resumable cursor, truncation that
// never splits an image, and drop mode; prefetching (data.prefetch) changes no batch, no cursor and no error. Plus
// AdamW and the schedule against hand-computed values.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <thread>

#include "q3vl/core/error.hpp"
#include "q3vl/core/log.hpp"

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

// Every field of two batches, bit for bit (the pixels too: == on floats that are never NaN).
void expect_same(const StepData& a, const StepData& b, const std::string& where) {
  EXPECT_EQ(a.samples, b.samples) << where;
  EXPECT_EQ(a.micro_supervised, b.micro_supervised) << where;
  EXPECT_EQ(a.tokens, b.tokens) << where;
  EXPECT_EQ(a.supervised, b.supervised) << where;
  EXPECT_EQ(a.dropped, b.dropped) << where;
  ASSERT_EQ(a.micro.size(), b.micro.size()) << where;
  for (size_t i = 0; i < a.micro.size(); ++i) {
    const PackedBatch &x = a.micro[i], &y = b.micro[i];
    EXPECT_TRUE(x.input_ids == y.input_ids && x.labels == y.labels && x.cu_seqlens == y.cu_seqlens &&
                x.pixel_values == y.pixel_values && x.image_grid_thw == y.image_grid_thw &&
                x.pixel_values_videos == y.pixel_values_videos && x.video_grid_thw == y.video_grid_thw)
        << where << ", micro-batch " << i;
  }
}

// The synthetic samples, through a dataset that can fail on one sample (as a damaged shard's does, naming it) and
// take its time over each (a slow file system).
class ProbeDataset : public Dataset {
 public:
  ProbeDataset(const Dataset& inner, size_t bad = size_t(-1), int ms = 0) : in_(inner), bad_(bad), ms_(ms) {}
  size_t size() const override { return in_.size(); }
  size_t length(size_t i) const override { return in_.length(i); }
  std::string describe(size_t i) const override { return in_.describe(i); }
  Sample get(size_t i) const override {
    ++gets;
    if (ms_) std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    if (i == bad_) fail(describe(i) + ": unreadable (test)");
    return in_.get(i);
  }
  mutable std::atomic<int> gets{0};

 private:
  const Dataset& in_;
  size_t bad_;
  int ms_;
};

}  // namespace

// A prefetching loader hands out the plain loader's batches, and its cursor is the consumed batches' position while
// the next one is in flight (what a checkpoint keeps): over epoch boundaries, on 1 and 2 ranks, and after a resume
// (a new loader set to a saved cursor) or a cursor set with a batch in flight.
TEST(TrainLoader, PrefetchGivesTheSameBatchesAndTheConsumedCursor) {
  SyntheticDataset d(cfg(), 37, 5, 8, 40);
  LoaderOptions o;
  o.global_batch = 8, o.seq_len = 32, o.seed = 11, o.micro_batch = 2, o.grad_accum = 2;
  for (int n : {1, 2})
    for (int r = 0; r < n; ++r) {
      Loader plain(d, cfg(), o, r, n), pre(d, cfg(), o, r, n);
      std::unique_ptr<Loader> resumed;
      for (int step = 0; step < 12; ++step) {  // 96 samples: epochs of 37 end in steps 5 and 10
        const std::string where = std::to_string(n) + " ranks, rank " + std::to_string(r) + ", step " +
                                  std::to_string(step);
        const StepData want = plain.next();
        expect_same(pre.next(), want, where);
        pre.prefetch();
        EXPECT_EQ(pre.cursor(), plain.cursor()) << where;
        if (resumed) {
          expect_same(resumed->next(), want, where + " (resumed)");
          resumed->prefetch();
        }
        if (step == 3) {  // a checkpoint of step 4, resumed by a new loader that prefetches from the start
          resumed = std::make_unique<Loader>(d, cfg(), o, r, n);
          resumed->set_cursor(pre.cursor());
          resumed->prefetch();
        }
      }
      EXPECT_EQ(plain.cursor().epoch, 2);
      pre.set_cursor(LoaderCursor{});  // drops the batch in flight
      expect_same(pre.next(), Loader(d, cfg(), o, r, n).next(), "set_cursor with a batch in flight");
    }
}

// A sample that fails in the prefetched build fails the step that consumes it, with the synchronous loader's
// message and kind, on the caller's thread; the steps before it are unaffected. A failing batch that nobody
// consumes (the run ends, or the cursor moves) raises nothing.
TEST(TrainLoader, PrefetchErrorsSurfaceInTheStepThatReadsThem) {
  SyntheticDataset syn(cfg(), 37, 5, 8, 40);
  LoaderOptions o;
  o.global_batch = 8, o.seq_len = 32, o.seed = 11;
  Loader probe(syn, cfg(), o, 0, 1);
  probe.next(), probe.next();
  const size_t bad = probe.peek_global().front();  // the first sample of step 3
  ProbeDataset d(syn, bad);
  std::string want;
  try {
    Loader plain(d, cfg(), o, 0, 1);
    plain.next(), plain.next(), plain.next();
  } catch (const Error& e) {
    want = e.what();
    EXPECT_FALSE(e.collective());
  }
  ASSERT_NE(want.find("synthetic sample " + std::to_string(bad) + ": unreadable (test)"), std::string::npos) << want;
  Loader pre(d, cfg(), o, 0, 1);
  for (int step = 0; step < 2; ++step) {
    EXPECT_NO_THROW(pre.next());
    pre.prefetch();
  }
  const std::thread::id me = std::this_thread::get_id();
  try {
    pre.next();
    ADD_FAILURE() << "step 3 read the bad sample without an error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), want);
    EXPECT_FALSE(e.collective());
    EXPECT_EQ(std::this_thread::get_id(), me);
  }
  {
    Loader unread(d, cfg(), o, 0, 1);
    unread.next(), unread.next();
    unread.prefetch();  // step 3's batch fails in flight; the loader goes away unread
    unread.quiesce();
  }
  Loader moved(d, cfg(), o, 0, 1);
  moved.next(), moved.next();
  moved.prefetch();
  moved.quiesce();
  moved.set_cursor(LoaderCursor{});
  EXPECT_NO_THROW(moved.next());
}

// A loader that goes away (the run stopped, or failed elsewhere) with a slow batch in flight waits for one sample,
// not for the whole batch: no hang at exit.
TEST(TrainLoader, AnAbandonedPrefetchStopsAtItsNextSample) {
  SyntheticDataset syn(cfg(), 64, 5, 8, 40);
  ProbeDataset d(syn, size_t(-1), 50);  // 64 samples of 50 ms: 3.2 s a batch
  LoaderOptions o;
  o.global_batch = 64, o.seq_len = 32, o.seed = 1;
  const double t0 = wall_seconds();
  {
    Loader l(d, cfg(), o, 0, 1);
    l.prefetch();
    std::this_thread::sleep_for(std::chrono::milliseconds(120));
  }
  EXPECT_LT(wall_seconds() - t0, 1.5);
  EXPECT_LT(d.gets.load(), 20);
}

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
