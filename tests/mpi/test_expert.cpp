// Expert parallelism on 1, 2 and 4 ranks (EP groups of min(2, ranks) consecutive ranks): the golden MoE model's
// logits, loss, aux loss and every gradient equal transformers' when its experts are split over the group (the
// group's first rank runs the batch, the others only serve its tokens); bad layouts are refused naming the key;
// the engine's EP sizing (the planner's) is what it allocates; the all-to-alls are under the watchdog.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <cmath>
#include <span>
#include <thread>

#include "../compare.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/h5.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/model/qwen3vl.hpp"
#include "q3vl/parallel/expert.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/train/eval.hpp"

using namespace q3vl;

namespace {
const std::string kDir = "tests/data/golden/moe";
int ep_size(const Comm& world) { return world.size() >= 2 ? 2 : 1; }
}  // namespace

TEST(Expert, GoldenGradientsThroughExpertParallelism) {
  MpiComm world(MPI_COMM_WORLD);
  const ModelConfig cfg = load_hf_config(kDir + "/model/config.json");
  ExpertParallel ep(world, ep_size(world));
  Model model(cfg, true, ep.split());
  model.set_experts(&ep);
  const ParamTable& t = model.table();
  ASSERT_EQ(t.experts_per_rank(), cfg.text.num_experts / ep.size());
  std::vector<ParamSlice> slices;
  for (size_t i = 0; i < t.params().size(); ++i)
    slices.push_back({int(i), t.param(int(i)).held_begin, t.param(int(i)).held, model.param(int(i))});
  load_hf_slices(t, kDir + "/model", slices);
  const Batch batch = read_batch_h5(kDir + "/batch.h5", cfg.vision.patch_dim());
  const bool runs = ep.rank() == 0;
  double loss = 0, aux = 0;
  std::vector<float> logits;
  if (runs) loss = model.forward(batch, true, &logits, &aux, true);
  else model.idle_pass(false);
  ep.set_scale(1.0);
  if (runs) model.backward();
  else model.idle_pass(true);
  EXPECT_GT(ep.received(), 0) << "this rank's experts served no token";

  H5File want = H5File::open(kDir + "/expected.h5");
  if (runs) {
    const double wl = want.read_scalar<double>("loss"), wa = want.read_scalar<double>("aux_loss");
    EXPECT_LE(std::fabs(loss - wl), 2e-6 * std::fabs(wl)) << loss << " vs " << wl;  // test_golden.cpp's fp32 bounds
    EXPECT_LE(std::fabs(aux - wa), 2e-6 * std::fabs(wa)) << aux << " vs " << wa;
    const std::vector<float> ref = want.read<float>("logits");
    ASSERT_EQ(ref.size(), logits.size());
    const int64_t V = cfg.text.vocab;
    const std::vector<float> ref_real = test::masked_rows(ref, batch.attention_mask, V);
    EXPECT_GT(test::max_abs(ref_real), 0.1);
    EXPECT_LE(test::rel_max_diff(test::masked_rows(logits, batch.attention_mask, V), ref_real), 2e-5);
  }
  // Gradients this rank computed: every one on the running rank; the experts it holds on every rank (the
  // golden file is in the compute layout, transformers 5).
  int checked = 0;
  for (size_t i = 0; i < t.params().size(); ++i) {
    const ParamInfo& p = t.param(int(i));
    const bool expert = t.units()[size_t(p.unit)].experts;
    if (!runs && !expert) continue;
    const std::vector<float> ref = want.read<float>("grads/" + p.name);
    ASSERT_EQ(int64_t(ref.size()), p.numel) << p.name;
    const std::span<const float> got(model.grad(int(i)), size_t(p.held)), held(ref.data() + p.held_begin, got.size());
    EXPECT_LE(test::rel_norm_diff(got, held), 2e-5) << p.name << " (rank " << world.rank() << ")";  // NaN: +inf
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(Expert, BadLayoutsAreRefusedNamingTheKey) {
  const ModelConfig moe = load_hf_config(kDir + "/model/config.json");  // 4 experts
  const ModelConfig dense = load_hf_config("tests/data/golden/dense_tied/model/config.json");
  EXPECT_EQ(expert_layout_error(moe, 4, 1), "");
  EXPECT_EQ(expert_layout_error(moe, 4, 4), "");
  EXPECT_NE(expert_layout_error(moe, 4, 3).find("parallel.ep = 3 does not divide the 4 ranks"), std::string::npos);
  EXPECT_NE(expert_layout_error(moe, 8, 8).find("parallel.ep = 8 does not divide the model's 4 experts"),
            std::string::npos);
  EXPECT_NE(expert_layout_error(dense, 2, 2).find("dense"), std::string::npos);
  EXPECT_ANY_THROW(ParamTable(moe, ExpertSplit{3, 0}));
  // The decks' layouts: 235B-A22B at EP 8 on 8 ranks, 30B-A3B at EP 2 on 2 (input/); 128 experts never split by 3.
  EXPECT_EQ(expert_layout_error(preset_config("235B-A22B"), 8, 8), "");
  EXPECT_EQ(expert_layout_error(preset_config("30B-A3B"), 2, 2), "");
  EXPECT_NE(expert_layout_error(preset_config("30B-A3B"), 6, 3), "");
}

// The planner's figures for the 30B-A3B deck's layout: EP 2 on 2 ranks holds the experts' state once per expert,
// as ZeRO-3 over 2 ranks does, but gathers only its 64 experts of a layer.
TEST(Expert, EstimateForThe30bDeck) {
  const ModelConfig cfg = preset_config("30B-A3B");
  const ParamTable t(cfg);
  const std::vector<bool> all(t.params().size(), true);
  const ZeroMemory ep2 = ZeroEngine::estimate(cfg, {2, 2, 3}, all), ep1 = ZeroEngine::estimate(cfg, {2, 1, 3}, all);
  EXPECT_NEAR(double(ep2.master), double(ep1.master), 1e-6 * double(ep1.master));
  EXPECT_NEAR(double(ep1.master), 2.0 * double(t.total()), 64.0 * double(t.units().size()));  // 4 bytes / 2 ranks
  const ZeroMemory s1 = ZeroEngine::estimate(cfg, {2, 2, 1}, all);
  EXPECT_LT(double(s1.working), 0.55 * 8.0 * double(t.total()));  // stage 1 holds half the experts in full
}

TEST(Expert, EstimateIsWhatTheEngineAllocates) {
  MpiComm world(MPI_COMM_WORLD);
  const ModelConfig cfg = load_hf_config(kDir + "/model/config.json");
  ExpertParallel ep(world, ep_size(world));
  for (int stage : {1, 2, 3}) {
    Model model(cfg, stage != 3, ep.split());
    model.set_experts(&ep);
    const std::vector<bool> all(model.table().params().size(), true);
    ZeroEngine e(model, world, nullptr, stage, all, &ep);
    const ZeroMemory m = e.memory();
    const ZeroMemory est = ZeroEngine::estimate(cfg, {world.size(), ep.size(), stage}, all);
    if (world.rank() == 0) {  // rank 0 holds the largest shard of every unit
      EXPECT_EQ(est.master, m.master) << "stage " << stage;
      EXPECT_EQ(est.exp_avg, m.exp_avg) << "stage " << stage;
      EXPECT_EQ(est.grads, m.grads) << "stage " << stage;
      EXPECT_EQ(est.comm, m.comm) << "stage " << stage;
      if (stage != 3) {
        EXPECT_EQ(est.working, m.working) << "stage " << stage;
      }
    }
    // Each expert element is held by exactly one rank: the sharded experts add up to the whole tensors.
    int64_t mine = 0, whole = 0;
    for (const ShardPiece& p : e.pieces())
      if (model.table().units()[size_t(model.table().param(p.param).unit)].experts) mine += p.count;
    for (const ParamInfo& p : model.table().params())
      if (model.table().units()[size_t(p.unit)].experts) whole += p.numel;
    EXPECT_EQ(int64_t(world.sum(double(mine))), whole);
  }
}

// The dispatch's all-to-alls wait under the watchdog like every collective: a rank that does not arrive is named.
TEST(Expert, AllToAllIsWatched) {
  MpiComm world(MPI_COMM_WORLD);
  const int n = world.size(), late = n - 1;
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  world.set_timeout(0.3);
  ExpertParallel ep(world, n);  // its communicators keep the timeout
  std::vector<int64_t> send(size_t(n), 1), recv(size_t(n), 0);
  if (world.rank() == late) {
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
    ep.group().set_timeout(0);
    ep.counts(send.data(), recv.data(), 1);
  } else {
    try {
      ep.counts(send.data(), recv.data(), 1);
      ADD_FAILURE() << "expected the watchdog to fire";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("collective all_to_all"), std::string::npos) << m;
      EXPECT_NE(m.find("ranks that did not arrive: " + std::to_string(late)), std::string::npos) << m;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
