// The planner's ZeRO bytes equal what the engine allocates, kind by kind, on every rank (run at 1, 2 and 4 ranks):
// master shards, both AdamW moments, gradient shards (stage 1: + the full accumulator), the reduce-scatter buffer,
// the Model's full weights (stages 1/2) and the stage-3 pool bound, with flat and hybrid groups and frozen parts.
#include <gtest/gtest.h>
#include <mpi.h>

#include "q3vl/core/deck.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/plan/plan.hpp"
#include "q3vl/runtime/mpi_comm.hpp"

using namespace q3vl;

namespace {

Workload workload(bool tune_vision) {
  return workload_from_deck(Deck::parse("", "test",
                                        {"model.hf=tests/data/golden/dense_tied/model",
                                         std::string("train.tune_vision=") + (tune_vision ? "true" : "false")},
                                        "plan"));
}

void check(Comm& shard, Comm& world, const Workload& w, int stage, const std::string& what) {
  Model m(w.cfg, /*with_storage=*/stage != 3);
  ZeroEngine e(m, shard, nullptr, stage, w.trainable);
  const ZeroMemory got = e.memory();
  const ZeroMemory want = host_zero_bytes(w, shard.size(), shard.rank(), stage);
  const std::string at = what + ", stage " + std::to_string(stage) + ", rank " + std::to_string(shard.rank()) +
                         " of " + std::to_string(shard.size());
  EXPECT_EQ(got.master, want.master) << at;
  EXPECT_EQ(got.exp_avg, want.exp_avg) << at;
  EXPECT_EQ(got.exp_avg_sq, want.exp_avg_sq) << at;
  EXPECT_EQ(got.grads, want.grads) << at;
  EXPECT_EQ(got.comm, want.comm) << at;
  if (stage == 3) {
    EXPECT_EQ(got.pool_bound, want.pool_bound) << at;
  } else {
    EXPECT_EQ(got.working, want.working) << at;
  }
  // And through the planner's report (sized_layout: the largest rank of the group) for the multi-rank layout.
  if (shard.size() > 1) {
    Hardware hw = gpu_preset("H200-141GB");
    hw.nodes = world.size() / shard.size(), hw.gpus_per_node = shard.size();
    Layout l;
    l.stage = stage, l.hybrid = hw.nodes > 1;
    const Candidate c = sized_layout(w, hw, l);
    EXPECT_EQ(c.gpu.optimizer, int64_t(world.max(double(got.master + got.exp_avg + got.exp_avg_sq))) + 16) << at;
    EXPECT_EQ(c.gpu.comm, int64_t(world.max(double(got.comm)))) << at;
    if (stage == 3) {
      EXPECT_EQ(c.host.grads, int64_t(world.max(double(got.grads)))) << at;
    }
  }
}

}  // namespace

TEST(PlanBytes, EqualTheEnginesAllocation) {
  MpiComm world(MPI_COMM_WORLD);
  for (bool tune_vision : {true, false}) {
    const Workload w = workload(tune_vision);
    for (int stage : {1, 2, 3}) check(world, world, w, stage, tune_vision ? "all trained" : "vision frozen");
  }
}

TEST(PlanBytes, HybridGroups) {
  MpiComm world(MPI_COMM_WORLD);
  if (world.size() < 4) GTEST_SKIP() << "hybrid groups need 4 ranks (2 'nodes' of 2)";
  auto node = world.split(world.rank() / 2, world.rank());
  const Workload w = workload(true);
  for (int stage : {1, 2, 3}) check(*node, world, w, stage, "hybrid");
}
