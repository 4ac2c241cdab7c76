// The device model's own behaviour beyond golden parity (test_golden.cpp): recomputation per block changes nothing;
// a step's first gradients are written over whatever the buffers held, the later ones add.
#include <gtest/gtest.h>

#include <limits>

#include "../compare.hpp"
#include "../gpu.hpp"
#include "q3vl/train/eval.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;

namespace {
// The golden MoE case (images, DeepStack, MoE + aux): its model with the golden weights and its batch.
struct MoeCase {
  std::string dir = "tests/data/golden/moe";
  ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model host{cfg};
  Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  MoeCase() { load_hf_weights(host, dir + "/model"); }
};

// Loss and every gradient of the golden MoE case (images, DeepStack, MoE + aux) with and without recomputation.
void recompute_case(Device d, double tol) {
  MoeCase mc;
  const ModelConfig& cfg = mc.cfg;
  Model& host = mc.host;
  const Batch& batch = mc.batch;
  dev::Exec ex = dev::make_exec(d);
  std::vector<float> g[2];
  double loss[2];
  int64_t act[2];
  for (int rc = 0; rc < 2; ++rc) {
    DevModel m(cfg, ex, DType::F32);
    m.set_recompute(rc == 1);
    m.reserve(budget_for(batch, cfg.vision.patch_dim()));
    m.set_params(host.params());
    loss[rc] = m.forward(batch, true, nullptr, nullptr, true);
    m.backward();
    g[rc].resize(m.table().total());
    m.grads_to_host(g[rc].data());
    act[rc] = m.memory().activations;
  }
  dev::destroy_exec(ex);
  EXPECT_NEAR(loss[0], loss[1], tol * std::abs(loss[0]));
  const double worst = test::rel_max_diff(g[1], g[0]);  // +inf for NaN or Inf
  EXPECT_LE(worst, tol) << "recomputation changed a gradient";
  EXPECT_LT(act[1], act[0]) << "recomputation must keep fewer activation bytes";
  std::printf("  recompute on %s: loss %.9g vs %.9g, max grad diff / max grad %.2e, activations %lld -> %lld bytes\n",
              d == Device::CUDA ? "cuda" : "cpu", loss[0], loss[1], worst, (long long)act[0], (long long)act[1]);
}

// zero_grads marks the gradients fresh without filling them: over buffers full of NaN, the backward writes every
// gradient the batch reaches and zeroes the rest, so the result is the one over zeroed buffers; a second backward
// without zero_grads adds (2 g up to rounding: a gradient with several contributions sums them in another order).
void fresh_case(Device d, double tol) {
  MoeCase mc;
  const ModelConfig& cfg = mc.cfg;
  Model& host = mc.host;
  const Batch& batch = mc.batch;
  dev::Exec ex = dev::make_exec(d);
  std::vector<float> g[3];
  {  // the model (its device buffers) goes before the exec that owns their stream
    DevModel m(cfg, ex, DType::F32);
    m.reserve(budget_for(batch, cfg.vision.patch_dim()));
    m.set_params(host.params());
    const int64_t n = m.table().total();
    for (int pass = 0; pass < 3; ++pass) {
      if (pass == 1) {  // poisoned, then a new step
        dev::fill(ex, m.grads(), DType::F32, n, std::numeric_limits<float>::quiet_NaN());
        m.zero_grads();
      }
      m.forward(batch, true, nullptr, nullptr, true);
      m.backward();
      g[pass].resize(size_t(n));
      m.grads_to_host(g[pass].data());
    }
  }
  dev::destroy_exec(ex);
  EXPECT_LE(test::rel_max_diff(g[1], g[0]), tol) << "a fresh gradient was not written whole";
  std::vector<float> twice(g[0].size());
  for (size_t i = 0; i < twice.size(); ++i) twice[i] = 2 * g[0][i];
  EXPECT_LE(test::rel_max_diff(g[2], twice), 1e-6) << "the second backward did not add";
}

// take_grad_squares: a step's backward over fresh gradients takes the squares of exactly the experts' weight
// gradients (gate_up and down of every MoE layer), each slot the sum over its gradient (summed in order on the CPU:
// bitwise; the GPU's epilogue in fp32 a tile: within 1e-6); a second backward that adds to them leaves none taken.
void squares_case(Device d, double tol) {
  MoeCase mc;
  const ModelConfig& cfg = mc.cfg;
  dev::Exec ex = dev::make_exec(d);
  std::vector<float> g;
  std::vector<double> sum, want;
  std::vector<int32_t> bad;
  std::vector<int> taken, experts, after;
  {
    DevModel m(cfg, ex, DType::F32);
    m.reserve(budget_for(mc.batch, cfg.vision.patch_dim()));
    m.set_params(mc.host.params());
    const ParamTable& t = m.table();
    const int64_t np = int64_t(t.params().size());
    auto* slots = static_cast<double*>(dev::alloc(ex, size_t(np) * 12));
    dev::fill(ex, slots, DType::F32, np * 3, 0.f);
    m.zero_grads();
    m.take_grad_squares(slots, reinterpret_cast<int32_t*>(slots + np));
    m.forward(mc.batch, true, nullptr, nullptr, true);
    m.backward();
    g.resize(size_t(t.total()));
    m.grads_to_host(g.data());
    sum.resize(size_t(np)), bad.resize(size_t(np));
    dev::to_host(ex, sum.data(), slots, size_t(np) * 8);
    dev::to_host(ex, bad.data(), slots + np, size_t(np) * 4);
    for (int id = 0; id < int(np); ++id) {
      if (m.grad_squares_taken()[size_t(id)]) taken.push_back(id);
      const ParamInfo& p = t.param(id);
      double s = 0;
      for (int64_t i = 0; i < p.held; ++i) {
        const float v = g[size_t(t.units()[size_t(p.unit)].offset + p.offset + i)];
        s += double(v) * v;
      }
      want.push_back(s);
    }
    for (int l = 0; l < cfg.text.layers; ++l)
      if (t.experts(l) >= 0) experts.push_back(t.experts(l)), experts.push_back(t.experts(l) + 1);
    m.forward(mc.batch, true, nullptr, nullptr, true);
    m.backward();  // adds
    for (int id = 0; id < int(np); ++id)
      if (m.grad_squares_taken()[size_t(id)]) after.push_back(id);
    dev::release(ex, slots);
  }
  dev::destroy_exec(ex);
  ASSERT_FALSE(experts.empty());
  EXPECT_EQ(taken, experts);
  for (int id : taken) {
    EXPECT_GT(want[size_t(id)], 0);
    EXPECT_LE(std::abs(sum[size_t(id)] - want[size_t(id)]), tol * want[size_t(id)]) << "parameter " << id;
    EXPECT_EQ(bad[size_t(id)], 0);
  }
  EXPECT_TRUE(after.empty()) << "an added-to gradient kept its squares";
}

// Records the units' forward uses (the model owns its storage: nothing to bind).
struct UseLog : UnitHooks {
  std::vector<int> fwd, bwd;
  void before_forward(int u) override { fwd.push_back(u); }
  void after_forward(int) override {}
  void before_backward(int u) override { bwd.push_back(u); }
  void after_backward(int) override {}
};

// The LM head and the loss in the backward (set_loss_in_backward, as DevTrainer trains): the forward returns NaN and
// uses no head unit, loss() after the backward is the forward's loss of the usual order, and every gradient matches
// (bitwise where the backend is deterministic), also at a loss scale.
void deferred_case(Device d, double tol) {
  MoeCase mc;
  const ModelConfig& cfg = mc.cfg;
  dev::Exec ex = dev::make_exec(d);
  std::vector<float> g[2];
  double loss[2], aux[2], ret[2];
  UseLog log[2];
  for (int k = 0; k < 2; ++k) {
    DevModel m(cfg, ex, DType::F32);
    m.set_loss_in_backward(k == 1);
    m.reserve(budget_for(mc.batch, cfg.vision.patch_dim()));
    m.set_params(mc.host.params());
    m.set_hooks(&log[k]);
    ret[k] = m.forward(mc.batch, true, nullptr, &aux[k], true);
    if (k == 1) {
      EXPECT_ANY_THROW(m.loss());  // the head has not run yet
    }
    m.backward(4.f);
    loss[k] = m.loss(k == 1 ? &aux[k] : nullptr);
    g[k].resize(m.table().total());
    m.grads_to_host(g[k].data());
  }
  dev::destroy_exec(ex);
  EXPECT_EQ(ret[0], loss[0]);
  EXPECT_TRUE(std::isnan(ret[1]));
  EXPECT_TRUE(std::isfinite(loss[0]) && std::isfinite(aux[0]) && aux[0] > 0);
  EXPECT_NEAR(loss[1], loss[0], tol * std::abs(loss[0]));
  EXPECT_NEAR(aux[1], aux[0], tol * std::abs(aux[0]));
  EXPECT_LE(test::rel_max_diff(g[1], g[0]), tol);  // +inf for NaN or Inf
  const ParamTable t(cfg);
  EXPECT_EQ(log[0].fwd, unit_order(t, false));
  EXPECT_EQ(log[1].fwd, unit_order(t, false, false));
  EXPECT_LT(log[1].fwd.size(), log[0].fwd.size());
  EXPECT_EQ(log[0].bwd, unit_order(t, true));
  EXPECT_EQ(log[1].bwd, unit_order(t, true));
}
}  // namespace

TEST(DevModel, LossInBackwardIsBitwiseOnCpu) { deferred_case(Device::CPU, 0.0); }
TEST(DevModel, LossInBackwardMatchesOnCuda) {
  Q3VL_NEED_GPU();
  deferred_case(Device::CUDA, 1e-6);
}

TEST(DevModel, FreshGradientsAreWrittenOnCpu) { fresh_case(Device::CPU, 0.0); }
TEST(DevModel, FreshGradientsAreWrittenOnCuda) {
  Q3VL_NEED_GPU();
  fresh_case(Device::CUDA, 1e-6);
}

TEST(DevModel, GradSquaresAreTakenOnCpu) { squares_case(Device::CPU, 0.0); }
TEST(DevModel, GradSquaresAreTakenOnCuda) {
  Q3VL_NEED_GPU();
  squares_case(Device::CUDA, 1e-6);
}

TEST(DevModel, RecomputeIsBitwiseOnCpu) { recompute_case(Device::CPU, 0.0); }
// On the GPU the embedding and position-embedding backward accumulate with atomics: equal up to summation order.
TEST(DevModel, RecomputeMatchesOnCuda) {
  Q3VL_NEED_GPU();
  recompute_case(Device::CUDA, 1e-6);
}
