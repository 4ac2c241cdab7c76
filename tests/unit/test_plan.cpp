// The planner: its bad-input errors name the key, and for one GPU (the DevTrainer, run here on the CPU op layer) its
// predicted bytes are what the trainer allocates, kind by kind. (Several ranks: tests/mpi/test_plan.cpp.)
#include <gtest/gtest.h>

#include "../errors.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/model/dev_model.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/plan/plan.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/train/dev_trainer.hpp"

using namespace q3vl;

namespace {

Deck plan_deck(std::vector<std::string> overrides) {
  overrides.push_back("model.preset=tiny");
  return Deck::parse("", "test", overrides, "plan");
}

}  // namespace

TEST(Plan, MemorySizesNeedAUnit) {
  EXPECT_EQ(parse_bytes("plan.host_mem", "256GiB"), int64_t(256) << 30);
  EXPECT_EQ(parse_bytes("plan.host_mem", "80GB"), int64_t(80e9));
  EXPECT_EQ(parse_bytes("plan.gpu_mem", "1.5TiB"), int64_t(3) << 39);
  for (const char* bad : {"256", "256 gigs", "GiB", "1.2.3GB", ""}) {
    const std::string e = error_of([&] { parse_bytes("plan.host_mem", bad); });
    EXPECT_NE(e.find("plan.host_mem"), std::string::npos) << bad << ": " << e;
  }
  EXPECT_NE(error_of([] { parse_bytes("plan.host_mem", "256"); }).find("needs a unit"), std::string::npos);
}

TEST(Plan, BadHardwareIsNamed) {
  EXPECT_NE(error_of([] { gpu_preset("B200"); }).find("plan.gpu = \"B200\": unknown GPU"), std::string::npos);
  EXPECT_NE(error_of([] { plan_deck({"plan.gpu=B200"}); }).find("plan.gpu"), std::string::npos);
  EXPECT_NE(error_of([] { plan_deck({"plan.nodes=0"}); }).find("plan.nodes"), std::string::npos);
  EXPECT_NE(error_of([] { plan_deck({"plan.gpus_per_node=0"}); }).find("plan.gpus_per_node"), std::string::npos);
  EXPECT_NE(error_of([] { hardware_from_deck(plan_deck({"plan.host_mem=512"})); }).find("plan.host_mem"),
            std::string::npos);
  EXPECT_NE(error_of([] { hardware_from_deck(plan_deck({"plan.gpu_mem=80"})); }).find("plan.gpu_mem"),
            std::string::npos);
  const Hardware h = hardware_from_deck(plan_deck({"plan.gpu=A100-80GB", "plan.nodes=4", "plan.gpus_per_node=2",
                                                   "plan.host_mem=256GiB"}));
  EXPECT_EQ(h.ranks(), 8);
  EXPECT_EQ(h.gpu_mem, int64_t(80) << 30);
  EXPECT_EQ(h.host_mem, int64_t(256) << 30);
  EXPECT_EQ(h.tflops, 312);
}

// The planner's bytes (through sized_layout, as `q3vl plan` reports them) are the DevTrainer's allocation, for one
// rank and for rank 0 of a 2-rank shard group (the largest shard), every ZeRO stage.
TEST(Plan, GpuBytesAreTheTrainersAllocation) {
  Workload w = workload_from_deck(plan_deck({"data.seq_len=64", "train.global_batch=4", "model.dtype=fp32"}));
  for (int ranks : {1, 2})
    for (int stage : {1, 3})
      for (bool rc : {false, true})
        for (int64_t mb : {1, 2}) {
          Hardware hw = gpu_preset("H200-141GB");
          hw.gpus_per_node = ranks;
          const DevBudget b = train_budget(w.cfg, mb, w.seq_len, w.max_patches);
          // Rank 0 of a group of `ranks`: a split of MPI_COMM_SELF cannot make one, so the 2-rank figures come from
          // the sizing function and are checked against the 1-rank allocation by category below.
          const DevTrainerMemory want = DevTrainer::plan(w.cfg, DType::F32, b, rc, w.trainable, ranks, stage, Device::CPU);
          if (ranks == 1) {
            MpiComm self(MPI_COMM_SELF);
            DevTrainer tr(Device::CPU, 0, w.cfg, w.trainable, DType::F32, b, rc, LossScaling{}, self, nullptr, stage);
            const DevTrainerMemory got = tr.memory();
            EXPECT_EQ(got.model.weights, want.model.weights);
            EXPECT_EQ(got.model.grads, want.model.grads);
            EXPECT_EQ(got.model.activations, want.model.activations) << "recompute " << rc << " micro-batch " << mb;
            EXPECT_EQ(got.model.workspace, want.model.workspace);
            EXPECT_EQ(got.zero.total(), want.zero.total());
            EXPECT_EQ(got.optimizer(), want.optimizer());
          } else {  // two ranks hold half of one rank's shards, by category (up to each unit's padding)
            const DevTrainerMemory one = DevTrainer::plan(w.cfg, DType::F32, b, rc, w.trainable, 1, stage, Device::CPU);
            for (auto [a, h] : {std::pair{one.zero.master, want.zero.master}, {one.zero.moments, want.zero.moments},
                                {one.zero.grads, want.zero.grads}}) {
              EXPECT_GE(h * 2, a);
              EXPECT_LE(h * 2, a + int64_t(w.cfg.text.layers + w.cfg.vision.depth + 8) * 4 * 4);
            }
          }
          Layout l;
          l.micro_batch = mb, l.recompute = rc, l.stage = stage;
          const Candidate c = sized_layout(w, hw, l);
          EXPECT_EQ(c.gpu.weights, want.model.weights);
          EXPECT_EQ(c.gpu.grads, want.model.grads + want.zero.grads);
          EXPECT_EQ(c.gpu.activations, want.model.activations);
          EXPECT_EQ(c.gpu.optimizer, want.optimizer());
          EXPECT_EQ(c.gpu.gathered, want.zero.pool);
          EXPECT_EQ(c.gpu.workspace, DevTrainer::kWorkspaceBytes);  // a CUDA Exec's (the CPU's has none)
          EXPECT_TRUE(c.built);
        }
}

// Offloaded layouts (issue 29): the planner's device and host bytes are what a DevTrainer offloaded in place onto a
// host's ZeroShards allocates (its device bytes, its pinned staging; the shards are the masters and moments), for
// the optimizer offloaded and for the parameters too (vision frozen); and offloading moves the masters and moments
// off the device, and the parameter copy with the parameters.
TEST(Plan, OffloadBytesAreTheTrainersAllocation) {
  Workload w = workload_from_deck(
      plan_deck({"data.seq_len=64", "train.global_batch=4", "model.dtype=fp32", "train.tune_vision=false",
                 "parallel.offload_threads=2"}));
  Hardware hw = gpu_preset("H200-141GB");
  hw.gpus_per_node = 1;
  const DevBudget b = train_budget(w.cfg, 1, w.seq_len, w.max_patches);
  MpiComm self(MPI_COMM_SELF);
  Layout none;
  none.micro_batch = 1;
  const Candidate c0 = sized_layout(w, hw, none);
  for (int stage : {1, 3})
    for (bool params : {false, true}) {
      const ParamTable t(w.cfg);
      ZeroShards engine(t, self, w.trainable);
      Offload off;
      off.optimizer = off.in_place = true, off.params = params, off.state = &engine, off.ring = w.offload_ring;
      DevTrainer tr(Device::CPU, 0, w.cfg, w.trainable, DType::F32, b, false, LossScaling{}, self, nullptr, stage,
                    false, nullptr, off);
      const DevTrainerMemory got = tr.memory(), want = DevTrainer::plan(w.cfg, DType::F32, b, false, w.trainable, 1,
                                                                       stage, Device::CPU, false, off);
      const std::string at = "stage " + std::to_string(stage) + (params ? ", parameters on the host" : "");
      EXPECT_EQ(got.zero.total(), want.zero.total()) << at;
      EXPECT_EQ(got.host(), want.host()) << at;
      EXPECT_EQ(got.zero.master + got.zero.moments + got.zero.host_master + got.zero.host_moments, 0) << at;
      EXPECT_GT(got.zero.host_staging, 0) << at;
      Layout l = none;
      l.stage = stage, l.offload = true, l.host_params = params;
      const Candidate c = sized_layout(w, hw, l);
      const ZeroMemory e = engine.memory();
      EXPECT_EQ(c.host.masters, e.master) << at;
      EXPECT_EQ(c.host.moments, e.exp_avg + e.exp_avg_sq) << at;
      EXPECT_EQ(c.host.staging, got.host()) << at;
      EXPECT_EQ(c.host.total() - c.host.staging, c0.host.total()) << at;  // the engine's shards, with or without
      EXPECT_EQ(c.gpu.optimizer, DevTrainer::norm_bytes(int64_t(t.params().size()))) << at;
      EXPECT_EQ(got.norm, want.norm) << at;
      EXPECT_TRUE(c.built) << at;
      if (stage == 3) {
        EXPECT_LT(c.gpu.total(), c0.gpu.total()) << at;
      }
      if (stage == 3 && params) {
        EXPECT_EQ(c.gpu.comm, 0) << at;  // no parameter copy (one rank: no landing buffer)
      }
    }
}

// Partial offload (parallel.offload_ratio): the trainer keeps the device's part of the masters and moments on the
// device, as DevTrainer::plan says, at 1 and 2 ranks (every rank's part about the ratio of its shard); the units split
// alike at any rank count; the planner's layout costs that part's device bytes and hides only the host's part under
// the step; a delayed deck without a ratio gets one sized to what its step hides (fewer seconds than all on the host).
TEST(Plan, PartialOffloadKeepsTheRestOnTheDevice) {
  Workload w = workload_from_deck(plan_deck({"data.seq_len=64", "train.global_batch=4", "model.dtype=fp32",
                                             "parallel.offload_threads=2"}));
  const DevBudget b = train_budget(w.cfg, 1, w.seq_len, w.max_patches);
  MpiComm self(MPI_COMM_SELF);
  const ParamTable t(w.cfg);
  int64_t trained = 0, unit_max = 0;  // the model's trained elements, and the most in one unit
  for (const UnitInfo& u : t.units()) {
    int64_t n = 0;
    for (int p : u.params) n += w.trainable[size_t(p)] ? t.param(p).numel : 0;
    trained += n, unit_max = std::max(unit_max, n);
  }
  double kept_at[2];
  for (double ratio : {0.3, 0.7}) {
    ZeroShards engine(t, self, w.trainable);
    Offload off;
    off.optimizer = off.in_place = true, off.state = &engine, off.ring = w.offload_ring, off.ratio = ratio;
    DevTrainer tr(Device::CPU, 0, w.cfg, w.trainable, DType::F32, b, false, LossScaling{}, self, nullptr, 3, false,
                  nullptr, off);
    const DevTrainerMemory got = tr.memory(), want = DevTrainer::plan(w.cfg, DType::F32, b, false, w.trainable, 1, 3,
                                                                      Device::CPU, false, off);
    EXPECT_EQ(got.zero.total(), want.zero.total()) << ratio;
    EXPECT_EQ(got.zero.moments, 2 * got.zero.master) << ratio;
    const double kept = double(got.zero.master / 4) / double(trained);  // the device's part of the trained elements
    // Whole units on either side, each where its middle falls: off the ratio by at most half the largest unit.
    EXPECT_LE(std::fabs(kept - (1 - ratio)), 0.5 * double(unit_max) / double(trained) + 1e-9) << ratio;
    kept_at[ratio > 0.5] = kept;
    // 2 ranks: each keeps its half of the same units (a group of 2 as the planner sizes rank 0's).
    Offload two = off;
    two.state = nullptr;
    const DevZeroMemory half = DevZero::plan(t, 2, 3, w.trainable, DType::F32, DType::F32, two, true);
    EXPECT_NEAR(double(half.master), double(got.zero.master) / 2, 64.0 * double(t.units().size())) << ratio;
  }
  EXPECT_GT(kept_at[0], kept_at[1]);
  EXPECT_GT(kept_at[1], 0.0);
  w.dt = DType::BF16;
  Hardware hw = gpu_preset("H200-141GB");
  hw.gpus_per_node = 1;
  hw.host_gbs = 1;  // a slow host: its update outlasts the step
  hw.host_mem = int64_t(1) << 40;
  Layout l;
  l.micro_batch = 1, l.stage = 3, l.offload = true, l.delayed = true;
  const Candidate all = sized_layout(w, hw, l);
  l.ratio = 0.5;
  const Candidate half = sized_layout(w, hw, l);
  EXPECT_GT(half.gpu.optimizer, all.gpu.optimizer);
  EXPECT_LT(half.t_opt, all.t_opt);
  EXPECT_DOUBLE_EQ(half.t_host_update, all.t_host_update);
  EXPECT_NE(l.deck_lines(w.dt).find("offload_ratio = 0.50"), std::string::npos);
  w.delayed_update = true;  // no ratio given: sized
  bool seen = false;
  for (const Candidate& c : plan_candidates(w, hw))
    if (c.layout.offload && !c.layout.host_params && c.layout.stage == 3 && c.fits) {
      seen = true;
      EXPECT_LT(c.layout.ratio, 1.0) << c.layout.describe();
      EXPECT_GE(c.layout.ratio, 0.05) << c.layout.describe();
    }
  EXPECT_TRUE(seen);
}

// The base on the host in the compute dtype (LoRA, bf16): the trainer pins a bf16 copy of its shard (here fp32 compute
// with bf16 gathers: the CPU computes fp32), as its own sizing says; the planner (bf16 compute, a GPU's) counts that
// copy and the engine's shards once the base's fp32 masters are released; the base's pieces lose their masters.
TEST(Plan, HostParametersInTheComputeDtype) {
  Workload w = workload_from_deck(
      plan_deck({"data.seq_len=64", "train.global_batch=4", "lora.rank=4", "parallel.offload_threads=2"}));
  const DevBudget b = train_budget(w.cfg, 1, w.seq_len, w.max_patches);
  MpiComm self(MPI_COMM_SELF);
  const ParamTable t(w.cfg);
  ZeroShards engine(t, self, w.trainable);
  const ZeroMemory before = engine.memory();
  Offload off;
  off.optimizer = off.in_place = off.params = true, off.state = &engine, off.ring = w.offload_ring;
  DevTrainer tr(Device::CPU, 0, w.cfg, w.trainable, DType::F32, b, false, LossScaling{}, self, nullptr, 3,
                /*gather_bf16=*/true, nullptr, off);
  ASSERT_TRUE(tr.host_param_copy());
  const DevTrainerMemory got = tr.memory();
  EXPECT_EQ(got.zero.host_params, before.master / 2);  // every element of the shard, in bf16
  EXPECT_EQ(got.host(), DevTrainer::plan(w.cfg, DType::F32, b, false, w.trainable, 1, 3, Device::CPU, true, off).host());

  w.dt = DType::BF16;  // a GPU's compute dtype (a deck on this CPU refuses it); the planner needs no GPU
  Hardware hw = gpu_preset("H200-141GB");
  hw.gpus_per_node = 1;
  Layout l;
  l.micro_batch = 1, l.stage = 3, l.offload = true, l.host_params = true;
  const Candidate c = sized_layout(w, hw, l);
  EXPECT_EQ(c.host.params, got.zero.host_params);
  ASSERT_GT(before.frozen, before.master / 2);  // a LoRA base: nearly all of it
  EXPECT_GE(engine.release_frozen(), before.frozen / 2);  // the pages inside the pieces
  const ZeroMemory after = engine.memory();
  EXPECT_EQ(after.master, before.master - before.frozen);
  EXPECT_EQ(c.host.masters, after.master);
  for (const ShardPiece& p : engine.pieces()) EXPECT_EQ(p.master == nullptr, !p.trainable) << p.param;
}

TEST(Plan, FastestFittingFirstAndMoreMemoryNeverHurts) {
  Workload w = workload_from_deck(plan_deck({"data.seq_len=512", "train.global_batch=16"}));
  Hardware hw = gpu_preset("A100-40GB");
  hw.nodes = 2, hw.gpus_per_node = 4, hw.host_mem = int64_t(256) << 30;
  const auto cs = plan_candidates(w, hw);
  ASSERT_FALSE(cs.empty());
  ASSERT_TRUE(cs.front().fits);
  for (size_t i = 1; i < cs.size(); ++i)
    if (cs[i].fits) {
      EXPECT_LE(cs[0].t_step, cs[i].t_step * 1.001);
    }
  // Sharding more ways shrinks what each GPU holds.
  Layout l;
  Hardware big = hw;
  big.nodes = 4;
  EXPECT_LT(sized_layout(w, big, l).gpu.optimizer, sized_layout(w, hw, l).gpu.optimizer);
}
