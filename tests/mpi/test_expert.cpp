// Expert parallelism on 1, 2 and 4 ranks (EP groups of min(2, ranks) consecutive ranks): the golden MoE model's
// logits, loss, aux loss and every gradient equal transformers' when its experts are split over the group (the
// group's first rank runs the batch, the others only serve its tokens); bad layouts are refused naming the key;
// the ZeRO shards' EP sizing (the planner's) is what they allocate; the all-to-alls are under the watchdog. The device model
// (CPU op layer) with its experts split equals it with every expert local, busy and idle ranks alike.
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
#include "q3vl/model/dev_model.hpp"
#include "../reference/qwen3vl.hpp"
#include "q3vl/parallel/expert.hpp"
#include "q3vl/parallel/zero.hpp"
#include "q3vl/runtime/mpi_comm.hpp"
#include "q3vl/train/eval.hpp"
#include "../reference/model_io.hpp"

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
// as ZeRO-3 over 2 ranks does.
TEST(Expert, EstimateForThe30bDeck) {
  const ModelConfig cfg = preset_config("30B-A3B");
  const ParamTable t(cfg);
  const std::vector<bool> all(t.params().size(), true);
  const ZeroMemory ep2 = ZeroShards::estimate(cfg, {2, 2, 3}, all), ep1 = ZeroShards::estimate(cfg, {2, 1, 3}, all);
  EXPECT_NEAR(double(ep2.master), double(ep1.master), 1e-6 * double(ep1.master));
  EXPECT_NEAR(double(ep1.master), 2.0 * double(t.total()), 64.0 * double(t.units().size()));  // 4 bytes / 2 ranks
}

TEST(Expert, EstimateIsWhatTheShardsAllocate) {
  MpiComm world(MPI_COMM_WORLD);
  const ModelConfig cfg = load_hf_config(kDir + "/model/config.json");
  ExpertParallel ep(world, ep_size(world));
  const ParamTable t(cfg, ep.split());
  const std::vector<bool> all(t.params().size(), true);
  ZeroShards e(t, world, all, &ep);
  const ZeroMemory m = e.memory();
  const ZeroMemory est = ZeroShards::estimate(cfg, {world.size(), ep.size(), 3}, all);
  if (world.rank() == 0) {  // rank 0 holds the largest shard of every unit
    EXPECT_EQ(est.master, m.master);
    EXPECT_EQ(est.exp_avg, m.exp_avg);
    EXPECT_EQ(est.exp_avg_sq, m.exp_avg_sq);
  }
  // Each expert element is held by exactly one rank: the sharded experts add up to the whole tensors.
  int64_t mine = 0, whole = 0;
  for (const ShardPiece& p : e.pieces())
    if (t.units()[size_t(t.param(p.param).unit)].experts) mine += p.count;
  for (const ParamInfo& p : t.params())
    if (t.units()[size_t(p.unit)].experts) whole += p.numel;
  EXPECT_EQ(int64_t(world.sum(double(mine))), whole);
}

namespace {
// Another batch of the same shapes: the text tokens (not the vision ones, 250..253) and their labels remapped.
Batch remapped(Batch b) {
  for (auto* v : {&b.input_ids, &b.labels})
    for (int64_t& id : *v)
      if (id >= 0 && id < 250) id = (id * 7 + 11) % 250;
  return b;
}
double rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) num += double(a[i] - b[i]) * double(a[i] - b[i]), den += double(b[i]) * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}
}  // namespace

// The device model on the CPU op layer with its experts split over EP groups of 2 equals the same model with every
// expert local, on each rank's own batch: the group's second rank runs another batch at another micro-step weight
// (its rows reach the first rank's experts already weighted), or no batch at all (it only serves the first rank's
// rows: idle_pass), with and without recomputation. Loss, aux loss and logits per rank, every non-expert gradient per
// rank, and each expert's gradient on its owner against the sum over the group of the all-local gradients.
TEST(Expert, DeviceModelEqualsEveryExpertLocal) {
  MpiComm world(MPI_COMM_WORLD);
  const ModelConfig cfg = load_hf_config(kDir + "/model/config.json");
  ExpertParallel ep(world, ep_size(world));
  Model host(cfg);
  load_hf_weights(host, kDir + "/model");
  const Batch golden = read_batch_h5(kDir + "/batch.h5", cfg.vision.patch_dim());
  const Batch batch = ep.rank() == 0 ? golden : remapped(golden);
  const double weight = ep.rank() == 0 ? 1.0 : 0.37;
  const ParamTable& full = host.table();
  dev::Exec ex = dev::make_exec(Device::CPU);
  for (int idle = 0; idle < 2; ++idle)
    for (int rc = 0; rc < 2; ++rc) {
      SCOPED_TRACE(std::string(idle ? "idle second rank" : "busy ranks") + (rc ? ", recomputation" : ""));
      const bool runs = !(idle && ep.rank() == 1);
      DevModel ref(cfg, ex, DType::F32);
      ref.set_recompute(rc == 1);
      ref.reserve(budget_for(batch, cfg.vision.patch_dim()));
      ref.set_params(host.params());
      std::vector<float> ref_logits, logits, g(size_t(full.total()), 0.f);
      double ref_loss = 0, ref_aux = 0, loss = 0, aux = 0;
      if (runs) {
        ref_loss = ref.forward(batch, true, &ref_logits, &ref_aux, true);
        ref.backward(float(weight));
        ref.grads_to_host(g.data());
      }
      std::vector<float> gsum(g);  // the experts' gradients summed over the group
      ep.group().all_reduce(gsum.data(), gsum.size(), DType::F32);

      DevModel m(cfg, ex, DType::F32, true, {}, QFormat::None, {}, ep.split());
      const ParamTable& t = m.table();
      m.set_recompute(rc == 1);
      m.set_experts(&ep);
      DevBudget b = budget_for(batch, cfg.vision.patch_dim());
      b.ep = ep.size();
      m.reserve(b);
      for (size_t i = 0; i < t.params().size(); ++i) {  // this rank's part of every tensor
        const ParamInfo& p = t.param(int(i));
        dev::to_device(ex, at(m.params(), m.unit_base(p.unit) + p.offset, DType::F32),
                       host.param(int(i)) + p.held_begin, size_t(p.held) * 4);
      }
      const int64_t received = ep.received();
      if (runs) {
        loss = m.forward(batch, true, &logits, &aux, true);
        m.backward(float(weight));
      } else {
        m.idle_pass(false);
        m.idle_pass(true);
      }
      if (ep.size() > 1) {
        EXPECT_GT(ep.received(), received) << "this rank's experts served no row";
      }
      if (runs) {
        EXPECT_NEAR(loss, ref_loss, 1e-6 * std::fabs(ref_loss));
        EXPECT_NEAR(aux, ref_aux, 1e-6 * std::fabs(ref_aux));
        ASSERT_EQ(logits.size(), ref_logits.size());
        EXPECT_LE(rel_l2(logits.data(), ref_logits.data(), int64_t(logits.size())), 1e-6);
      }
      int checked = 0;
      for (size_t i = 0; i < t.params().size(); ++i) {
        const ParamInfo& p = t.param(int(i));
        const bool expert = t.units()[size_t(p.unit)].experts;
        if (!runs && !expert) continue;
        const float* want =
            (expert ? gsum : g).data() + full.units()[size_t(p.unit)].offset + full.param(int(i)).offset + p.held_begin;
        const double e = rel_l2(m.grads() + m.unit_base(p.unit) + p.offset, want, p.held);
        EXPECT_LE(e, 1e-5) << p.name << " (rank " << world.rank() << ")";
        ++checked;
      }
      EXPECT_GT(checked, 0);
    }
  dev::destroy_exec(ex);
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
