// The planner's host ZeRO bytes equal what the host shards (ZeroShards) allocate, kind by kind, on every rank (run at
// 1, 2 and 4 ranks): master shards, both AdamW moments, gradient shards and the reduce-scatter buffer, with flat and
// hybrid groups and frozen parts.
#include <gtest/gtest.h>
#include <mpi.h>

#include "q3vl/core/deck.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/plan/plan.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/train/dev_trainer.hpp"

using namespace q3vl;

namespace {

Workload workload(bool tune_vision) {
  return workload_from_deck(Deck::parse("", "test",
                                        {"model.hf=tests/data/golden/dense_tied/model",
                                         std::string("train.tune_vision=") + (tune_vision ? "true" : "false")},
                                        "plan"));
}

void check(Comm& shard, Comm& world, const Workload& w, const std::string& what) {
  const ParamTable t(w.cfg);
  ZeroShards e(t, shard, w.trainable);
  const ZeroMemory got = e.memory();
  const ZeroMemory want = host_zero_bytes(w, shard.size(), shard.rank());
  const std::string at = what + ", rank " + std::to_string(shard.rank()) + " of " + std::to_string(shard.size());
  EXPECT_EQ(got.master, want.master) << at;
  EXPECT_EQ(got.exp_avg, want.exp_avg) << at;
  EXPECT_EQ(got.exp_avg_sq, want.exp_avg_sq) << at;
  // And through the planner's report (sized_layout: the largest rank of the group) for the multi-rank layout.
  if (shard.size() > 1) {
    Hardware hw = gpu_preset("H200-141GB");
    hw.nodes = world.size() / shard.size(), hw.gpus_per_node = shard.size();
    Layout l;
    l.stage = 3, l.hybrid = hw.nodes > 1;
    const Candidate c = sized_layout(w, hw, l);
    EXPECT_EQ(c.host.masters, int64_t(world.max(double(got.master)))) << at;
    // The device trainer's ZeRO has the same layout: its optimizer state is the same bytes, and the gradient norm's.
    EXPECT_EQ(c.gpu.optimizer, int64_t(world.max(double(got.master + got.exp_avg + got.exp_avg_sq))) +
                                   DevTrainer::norm_bytes(int64_t(t.params().size())))
        << at;
  }
}

}  // namespace

TEST(PlanBytes, EqualTheShardsAllocation) {
  MpiComm world(MPI_COMM_WORLD);
  for (bool tune_vision : {true, false}) {
    const Workload w = workload(tune_vision);
    check(world, world, w, tune_vision ? "all trained" : "vision frozen");
  }
}

TEST(PlanBytes, HybridGroups) {
  MpiComm world(MPI_COMM_WORLD);
  if (world.size() < 4) GTEST_SKIP() << "hybrid groups need 4 ranks (2 'nodes' of 2)";
  auto node = world.split(world.rank() / 2, world.rank());
  const Workload w = workload(true);
  check(*node, world, w, "hybrid");
}
