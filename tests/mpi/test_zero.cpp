// The host ZeRO shards (ZeroShards) on 1, 2 and 4 ranks: each rank holds 1/N of the state, and frozen tensors get no
// optimizer state. The device trainer's gathers and reduce-scatters over this layout are checked end to end by
// tests/cli/test_train.sh (N ranks against 1, stages 1/2/3, hybrid, bf16 gathers) and test_ep.sh.
#include <gtest/gtest.h>
#include <mpi.h>

#include "q3vl/model/config.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

using namespace q3vl;

namespace {
ModelConfig small_config() { return load_hf_config("tests/data/golden/dense_tied/model/config.json"); }
}  // namespace

TEST(Zero, StateIsOneNthOfUnsharded) {
  MpiComm world(MPI_COMM_WORLD);
  const ParamTable t(small_config());
  const ZeroMemory mine = ZeroShards(t, world, std::vector<bool>(t.params().size(), true)).memory();
  const int n = world.size();
  const int64_t units = int64_t(t.units().size()), full = 4 * t.total();
  // Master shards: padded units split evenly; the moments exactly partition the tensors.
  EXPECT_LE(mine.master * n, full + 4 * units * (n - 1));
  EXPECT_GE(mine.master * n, full);
  for (int64_t kind : {mine.exp_avg, mine.exp_avg_sq}) {
    EXPECT_EQ(int64_t(world.sum(double(kind))), full);
    EXPECT_LE(kind * n, full + 4 * units * (n - 1));
  }
}

TEST(Zero, FrozenTensorsHaveNoOptimizerState) {
  MpiComm world(MPI_COMM_WORLD);
  const ParamTable t(small_config());
  std::vector<bool> trainable;
  for (const auto& p : t.params()) trainable.push_back(p.part == Part::LLM);
  ZeroShards e(t, world, trainable);
  int64_t frozen_pieces = 0;
  for (const ShardPiece& p : e.pieces()) {
    EXPECT_EQ(p.trainable, trainable[size_t(p.param)]);
    if (!p.trainable) {
      ++frozen_pieces;
      EXPECT_EQ(p.exp_avg, nullptr);
      EXPECT_EQ(p.exp_avg_sq, nullptr);
    }
  }
  int64_t llm = 0;
  for (const auto& p : t.params()) llm += p.part == Part::LLM ? p.numel : 0;
  EXPECT_EQ(int64_t(world.sum(double(e.memory().exp_avg))), llm * 4);
  EXPECT_GT(world.sum(double(frozen_pieces)), 0);
}
