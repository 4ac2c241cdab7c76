// ZeRO engine on 1, 2 and 4 ranks: shards hold 1/N of the state, gathers rebuild the full weights, gradient
// reduction sums over ranks with the micro-step scale, hybrid (shard within "nodes", all-reduce across them)
// matches flat sharding, and frozen tensors get no optimizer state.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <random>

#include "q3vl/model/config.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

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
    if (stage == 3) EXPECT_LE(mine.state() * n, full.state() + 16 * units * (n - 1));
  }
}

TEST(Zero, GatherRebuildsTheFullWeights) {
  MpiComm world(MPI_COMM_WORLD);
  Model m(small_config());
  m.init_random(7);
  const std::vector<float> want(m.params(), m.params() + m.table().total());
  ZeroEngine e(m, world, nullptr, 3, all_trainable(m));
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
    e.before_backward();
    for (int64_t i = 0; i < m.table().total(); ++i) m.grads()[i] = pattern(world_rank, i + micro);
    e.after_backward(scales[micro]);
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
  for (int stage : {1, 2, 3}) check_reduction(world, nullptr, world.rank(), world.size(), stage);
}

TEST(Zero, HybridMatchesFlat) {
  MpiComm world(MPI_COMM_WORLD);
  if (world.size() % 2) GTEST_SKIP() << "needs an even rank count to fake two nodes";
  // Ranks [0, n/2) are "node 0", the rest "node 1": shard within a node, replicate across.
  const int half = world.size() / 2, node = world.rank() / half, local = world.rank() % half;
  auto shard = world.split(node, local);
  auto replica = world.split(local, node);
  for (int stage : {2, 3}) check_reduction(*shard, replica.get(), world.rank(), world.size(), stage);
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
