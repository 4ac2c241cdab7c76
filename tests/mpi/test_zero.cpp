// ZeRO engine on 1, 2 and 4 ranks: shards hold 1/N of the state, gathers rebuild the full weights, gradient
// reduction sums over ranks with the micro-step scale, hybrid (shard within "nodes", all-reduce across them)
// matches flat sharding, and frozen tensors get no optimizer state.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <random>

#include "../compare.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/train/loader.hpp"

using namespace q3vl;

namespace {

ModelConfig small_config() { return load_hf_config("tests/data/golden/dense_tied/model/config.json"); }

std::vector<bool> all_trainable(const Model& m) { return std::vector<bool>(m.table().params().size(), true); }

// A gradient pattern that differs by rank and element.
float pattern(int rank, int64_t i) { return float((i * 7 + 3 * rank) % 13) - 6.f + 0.25f * float(rank); }

}  // namespace

TEST(Zero, StateIsOneNthOfUnsharded) {
  MpiComm world(MPI_COMM_WORLD);
  Model m(small_config());
  for (int stage : {1, 2, 3}) {
    ZeroEngine e(m, world, nullptr, stage, all_trainable(m));
    const ZeroMemory mine = e.memory(), full = e.unsharded();
    const int n = world.size();
    const int64_t units = int64_t(m.table().units().size());
    // Master shards: padded units split evenly; moments exactly partition the tensors.
    EXPECT_LE(mine.master * n, full.master + 4 * units * (n - 1));
    EXPECT_GE(mine.master * n, full.master);
    EXPECT_EQ(int64_t(world.sum(double(mine.exp_avg))), full.exp_avg);
    EXPECT_EQ(int64_t(world.sum(double(mine.exp_avg_sq))), full.exp_avg_sq);
    EXPECT_LE(mine.exp_avg * n, full.exp_avg + 4 * units * (n - 1));
    if (stage == 1) {
      EXPECT_GE(mine.grads, full.grads);  // stage 1 keeps full gradients
    } else {
      EXPECT_EQ(int64_t(world.sum(double(mine.grads))), full.grads);
      EXPECT_LE(mine.grads * n, full.grads + 4 * units * (n - 1));
    }
    if (stage == 3) {
      EXPECT_LE(mine.state() * n, full.state() + 16 * units * (n - 1));
    }
  }
}

TEST(Zero, GatherRebuildsTheFullWeights) {
  MpiComm world(MPI_COMM_WORLD);
  Model m(small_config());
  m.init_random(7);
  const std::vector<float> want(m.params(), m.params() + m.table().total());
  ZeroEngine e(m, world, nullptr, 2, all_trainable(m));
  e.load_from_model();
  std::fill(m.params(), m.params() + m.table().total(), -1.f);
  e.gather_params();
  for (int64_t i = 0; i < m.table().total(); ++i) ASSERT_EQ(m.params()[i], want[size_t(i)]) << "element " << i;
}

// Two micro-steps with scales 0.25 and 0.5: each shard gradient must be the scaled sum over ranks.
void check_reduction(Comm& shard, Comm* replica, int world_rank, int world_size, int stage) {
  Model m(small_config());
  ZeroEngine e(m, shard, replica, stage, all_trainable(m));
  e.begin_step();
  const double scales[2] = {0.25, 0.5};
  for (int micro = 0; micro < 2; ++micro) {
    e.before_forward();
    e.before_backward(scales[micro]);
    for (int64_t i = 0; i < m.table().total(); ++i) m.grads()[i] = pattern(world_rank, i + micro);
    e.after_backward();
  }
  e.finish_grads();
  double norm_sq = 0;
  for (const ShardPiece& p : e.pieces()) {
    const int64_t base = m.table().units()[size_t(m.table().param(p.param).unit)].offset +
                         m.table().param(p.param).offset + p.begin;
    for (int64_t j = 0; j < p.count; ++j) {
      double want = 0;
      for (int micro = 0; micro < 2; ++micro)
        for (int r = 0; r < world_size; ++r) want += scales[micro] * pattern(r, base + j + micro);
      ASSERT_NEAR(p.grad[j], want, 1e-5 * (1 + std::fabs(want))) << m.table().param(p.param).name << "[" << p.begin + j << "]";
      norm_sq += want * want;
    }
  }
  const double got = e.grad_norm_sq();
  EXPECT_NEAR(got, shard.sum(norm_sq), 1e-6 * got);
}

TEST(Zero, ReduceScatterSumsScaledMicroSteps) {
  MpiComm world(MPI_COMM_WORLD);
  for (int stage : {1, 2}) check_reduction(world, nullptr, world.rank(), world.size(), stage);
}

TEST(Zero, HybridMatchesFlat) {
  MpiComm world(MPI_COMM_WORLD);
  if (world.size() % 2) GTEST_SKIP() << "needs an even rank count to fake two nodes";
  // Ranks [0, n/2) are "node 0", the rest "node 1": shard within a node, replicate across.
  const int half = world.size() / 2, node = world.rank() / half, local = world.rank() % half;
  auto shard = world.split(node, local);
  auto replica = world.split(local, node);
  check_reduction(*shard, replica.get(), world.rank(), world.size(), 2);
}

// One optimizer step of the real model (2 micro-steps, with images; ranks get different samples, and on 4
// ranks some micro-batches are text-only or empty) the way `q3vl train` runs it. Returns the loss sum and each
// piece's shard gradient; `mem` gets the engine's memory after the step.
struct StepResult {
  double loss = 0;
  std::vector<std::vector<float>> grads;
  ZeroMemory mem, full;
  int64_t gathered = 0;
};
StepResult real_step(Comm& shard, Comm* replica, Comm& world, int stage, bool bf16 = false) {
  const ModelConfig cfg = small_config();
  Model m(cfg);
  m.init_random(11);
  ZeroEngine e(m, shard, replica, stage, all_trainable(m));
  e.set_gather_bf16(bf16);
  e.load_from_model();
  e.gather_params();  // stages 1/2: the model computes on what the gathers deliver (bf16: rounded)
  if (stage == 3) {
    EXPECT_EQ(m.params(), nullptr) << "stage 3 must not keep the full weights";
  }
  SyntheticDataset data(cfg, 64, 5, 8, 40);
  LoaderOptions lo;
  lo.global_batch = 8, lo.micro_batch = 4 / world.size() > 0 ? 4 / world.size() : 1, lo.seq_len = 32, lo.seed = 3;
  lo.grad_accum = 8 / (lo.micro_batch * world.size());
  Loader loader(data, cfg, lo, world.rank(), world.size());
  const StepData sd = loader.next();
  const double n_global = world.sum(double(sd.supervised));
  StepResult r;
  e.begin_step();
  for (size_t i = 0; i < sd.micro.size(); ++i) {
    const int64_t n = sd.micro_supervised[i];
    e.before_forward();
    if (n > 0) r.loss += m.forward(sd.micro[i], true) * double(n);
    e.before_backward(double(n) / n_global);
    if (n > 0) m.backward();
    e.after_backward();
  }
  e.finish_grads();
  r.loss = world.sum(r.loss);
  for (const ShardPiece& p : e.pieces()) r.grads.emplace_back(p.grad, p.grad + p.count);
  r.mem = e.memory();
  r.full = e.unsharded();
  r.gathered = e.gathered_bytes();
  return r;
}

// Same loss and shard gradients (to 1e-6 in norm over the shard group).
void expect_same_step(const StepResult& a, const StepResult& b, Comm& shard) {
  EXPECT_NEAR(a.loss, b.loss, 1e-6 * std::fabs(b.loss));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < b.grads.size(); ++i)
    for (size_t j = 0; j < b.grads[i].size(); ++j) {
      diff += std::pow(test::abs_diff(a.grads[i][j], b.grads[i][j]), 2);  // NaN or Inf on either side: +inf
      norm += std::pow(double(b.grads[i][j]), 2);
    }
  diff = shard.sum(diff), norm = shard.sum(norm);
  EXPECT_GT(norm, 0);
  EXPECT_LE(std::isfinite(diff) ? std::sqrt(diff / norm) : test::kNonFinite, 1e-6);
}

// bf16 gathers: stages 2 and 3 round the same weights the same way (same loss and gradients as each other), the
// rounding is really applied (not the fp32 loss) and stage 3 moves half the bytes.
TEST(Zero, Bf16GathersAgreeAcrossStagesAndHalveTheBytes) {
  MpiComm world(MPI_COMM_WORLD);
  const StepResult s2 = real_step(world, nullptr, world, 2, true), s3 = real_step(world, nullptr, world, 3, true);
  const StepResult f3 = real_step(world, nullptr, world, 3, false);
  expect_same_step(s3, s2, world);
  EXPECT_NE(s3.loss, f3.loss) << "bf16 gathers computed with unrounded weights";
  EXPECT_NEAR(s3.loss, f3.loss, 1e-2 * std::fabs(f3.loss));
  EXPECT_EQ(2 * s3.gathered, f3.gathered);
}

TEST(Zero, Bf16GatherRoundsEveryWeight) {
  MpiComm world(MPI_COMM_WORLD);
  Model m(small_config());
  m.init_random(7);
  std::vector<float> want(m.params(), m.params() + m.table().total());
  for (float& w : want) w = bf16_to_f32(f32_to_bf16(w));
  ZeroEngine e(m, world, nullptr, 1, all_trainable(m));
  e.set_gather_bf16(true);
  e.load_from_model();
  e.gather_params();
  for (int64_t i = 0; i < m.table().total(); ++i) ASSERT_EQ(m.params()[i], want[size_t(i)]) << "element " << i;
}

void check_stage3_streams(Comm& shard, Comm* replica, Comm& world) {
  const StepResult s2 = real_step(shard, replica, world, 2), s3 = real_step(shard, replica, world, 3);
  expect_same_step(s3, s2, shard);

  // Memory: 1/N of the state plus a pool that held only a few units at a time.
  Model m(small_config());
  int64_t biggest = 0;
  for (const auto& u : m.table().units()) biggest = std::max(biggest, u.numel * 4);
  const int n = shard.size();
  const int64_t units = int64_t(m.table().units().size());
  EXPECT_GT(s3.mem.working, 0);
  EXPECT_LE(s3.mem.working, s3.mem.pool_bound);
  // Buffers in use plus released ones cached for reuse (never more buffers than were once in use together).
  EXPECT_LE(s3.mem.working, 6 * biggest) << "the pool held more than a few units";
  EXPECT_LE(s3.mem.state() * n, s3.full.state() + 16 * units * (n - 1));
  // params + grads + optimizer of this rank, against one rank holding everything
  const int64_t mine = s3.mem.state() + s3.mem.comm + s3.mem.working;
  EXPECT_LE(mine, (s3.full.state() + 16 * units * (n - 1)) / n + s3.mem.comm + 6 * biggest);
  EXPECT_EQ(s2.mem.working, s2.full.working);  // stage 2 holds the full model
}

TEST(Zero, Stage3StreamsUnitsAndMatchesStage2) {
  MpiComm world(MPI_COMM_WORLD);
  check_stage3_streams(world, nullptr, world);
}

TEST(Zero, Stage3HybridMatchesStage2Hybrid) {
  MpiComm world(MPI_COMM_WORLD);
  if (world.size() % 2) GTEST_SKIP() << "needs an even rank count to fake two nodes";
  const int half = world.size() / 2, node = world.rank() / half, local = world.rank() % half;
  auto shard = world.split(node, local);
  auto replica = world.split(local, node);
  check_stage3_streams(*shard, replica.get(), world);
}

TEST(Zero, FrozenTensorsHaveNoOptimizerState) {
  MpiComm world(MPI_COMM_WORLD);
  Model m(small_config());
  std::vector<bool> trainable;
  for (const auto& p : m.table().params()) trainable.push_back(p.part == Part::LLM);
  ZeroEngine e(m, world, nullptr, 3, trainable);
  int64_t frozen_pieces = 0;
  for (const ShardPiece& p : e.pieces()) {
    EXPECT_EQ(p.trainable, trainable[size_t(p.param)]);
    if (!p.trainable) {
      ++frozen_pieces;
      EXPECT_EQ(p.exp_avg, nullptr);
      EXPECT_EQ(p.grad, nullptr);
    }
  }
  int64_t llm = 0;
  for (const auto& p : m.table().params()) llm += p.part == Part::LLM ? p.numel : 0;
  EXPECT_EQ(int64_t(world.sum(double(e.memory().exp_avg))), llm * 4);
  EXPECT_GT(world.sum(double(frozen_pieces)), 0);
}
