// Parity with Hugging Face transformers 5.17 (fp32, eager): tools/make_goldens.py built small random
// Qwen3-VL models and ran them on a batch with two images of different grids in one sequence, a padded
// text-only sample and (MoE) the router aux loss; tests/data/golden/<case>/ holds the model, the batch
// and transformers' logits, loss and every parameter's gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>

#include "q3vl/io/h5.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/config.hpp"
#include "../gpu.hpp"
#include "q3vl/train/eval.hpp"

using namespace q3vl;

namespace {

// Bounds: logits max|diff| / max|logit|, loss and aux relative error, each gradient's relative L2 error.
struct Bounds {
  double logits, loss, grad;
};
constexpr Bounds kFp32{1e-4, 1e-5, 1e-4};

// The templated CPU model (dev == nullptr) or the device model on `dev` in `dt`.
void check_case(const std::string& name, const Device* dev = nullptr, DType dt = DType::F32, Bounds tol = kFp32) {
  const std::string dir = "tests/data/golden/" + name;
  ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model model(cfg);
  load_hf_weights(model, dir + "/model");
  Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  EvalResult r;
  std::string how = "cpu model";
  if (!dev) {  // the host model (until it leaves the product: issue 28)
    model.zero_grads();
    r.loss = model.forward(batch, true, &r.logits, &r.aux, cfg.moe());
    model.backward();
    r.grads = grads_hf(model);
  } else {
    dev::Exec ex = dev::make_exec(*dev);
    {
      DevModel dm(cfg, ex, dt);
      dm.reserve(budget_for(batch, cfg.vision.patch_dim()));
      dm.set_params(model.params());
      r = evaluate(dm, model, batch, true, cfg.moe());
    }
    dev::destroy_exec(ex);
    how = std::string(*dev == Device::CUDA ? "cuda" : "cpu") + " device model " + dtype_name(dt);
  }
  H5File want = H5File::open(dir + "/expected.h5");

  // Logits at real (unpadded) positions; q3vl drops padded positions before the model runs.
  std::vector<int64_t> lshape;
  std::vector<float> ref = want.read<float>("logits", &lshape);
  ASSERT_EQ(lshape, (std::vector<int64_t>{batch.B, batch.S, cfg.text.vocab}));
  ASSERT_EQ(r.logits.size(), ref.size());
  const int64_t V = cfg.text.vocab;
  double max_ref = 0, max_diff = 0;
  for (int64_t p = 0; p < int64_t(batch.B) * batch.S; ++p) {
    if (!batch.attention_mask[p]) continue;
    for (int64_t v = 0; v < V; ++v) {
      max_ref = std::max(max_ref, std::fabs(double(ref[p * V + v])));
      max_diff = std::max(max_diff, std::fabs(double(ref[p * V + v]) - r.logits[p * V + v]));
    }
  }
  EXPECT_GT(max_ref, 0.1) << "reference logits are degenerate";
  EXPECT_LE(max_diff, tol.logits * max_ref) << name << ": logits max |diff| " << max_diff << ", max |logit| " << max_ref;

  double loss = want.read_scalar<double>("loss");
  EXPECT_LE(std::fabs(r.loss - loss), tol.loss * std::fabs(loss)) << name << ": loss " << r.loss << " vs " << loss;
  if (cfg.moe()) {
    double aux = want.read_scalar<double>("aux_loss");
    EXPECT_LE(std::fabs(r.aux - aux), tol.loss * std::fabs(aux)) << name << ": aux " << r.aux << " vs " << aux;
  }

  // Every parameter's gradient, by HF name, in the layout of the file the weights came from.
  std::set<std::string> ours;
  double worst = 0;
  std::string worst_name;
  for (const auto& g : r.grads) {
    ours.insert(g.name);
    const std::string ds = "grads/" + g.name;
    ASSERT_TRUE(want.exists(ds)) << name << ": transformers has no gradient for " << g.name;
    std::vector<int64_t> gshape;
    std::vector<float> gr = want.read<float>(ds, &gshape);
    ASSERT_EQ(gshape, g.shape) << g.name;
    double num = 0, den = 0;
    for (size_t i = 0; i < gr.size(); ++i) {
      num += (double(g.data[i]) - gr[i]) * (double(g.data[i]) - gr[i]);
      den += double(gr[i]) * gr[i];
    }
    if (den == 0) {
      EXPECT_LE(num, dt == DType::F32 ? 0.0 : 1e-12) << name << ": " << g.name << " has zero reference gradient but ours is not";
      continue;
    }
    if (std::sqrt(num / den) > worst) worst = std::sqrt(num / den), worst_name = g.name;
    EXPECT_LE(std::sqrt(num / den), tol.grad) << name << ": " << g.name << " relative gradient error " << std::sqrt(num / den);
  }
  std::printf("[ golden   ] %s (%s): logits max|diff|/max|logit| = %.2e, loss rel err = %.2e, worst grad rel err = %.2e (%s)\n",
              name.c_str(), how.c_str(), max_diff / max_ref, std::fabs(r.loss - loss) / std::fabs(loss), worst, worst_name.c_str());
  for (const auto& ds : want.list("grads")) EXPECT_TRUE(ours.count(ds)) << name << ": q3vl has no gradient for " << ds;
}

}  // namespace

TEST(Golden, DenseTiedMatchesTransformers) { check_case("dense_tied"); }
TEST(Golden, DenseUntiedMatchesTransformers) { check_case("dense_untied"); }
TEST(Golden, MoeWithAuxLossMatchesTransformers) { check_case("moe"); }

// The device model (tensor/dev.hpp's op layer) on the CPU: the GPU model's layer code, proven in CI.
constexpr Device kCpu = Device::CPU, kCuda = Device::CUDA;
TEST(Golden, DeviceModelOnCpuMatchesTransformers) {
  for (const char* c : {"dense_tied", "dense_untied", "moe"}) check_case(c, &kCpu);
}
// On the GPU: fp32 at the CPU's bounds; bf16 and fp16 within their rounding (activations and weights stored in
// 8 or 11 bits of mantissa through every layer, fp32 accumulation).
TEST(Golden, CudaFp32MatchesTransformers) {
  Q3VL_NEED_GPU();
  for (const char* c : {"dense_tied", "dense_untied", "moe"}) check_case(c, &kCuda);
}
TEST(Golden, CudaBf16MatchesTransformers) {
  Q3VL_NEED_GPU();
  for (const char* c : {"dense_tied", "dense_untied", "moe"}) check_case(c, &kCuda, DType::BF16, {3e-2, 1e-2, 1.5e-1});
}
TEST(Golden, CudaFp16MatchesTransformers) {
  Q3VL_NEED_GPU();
  for (const char* c : {"dense_tied", "dense_untied", "moe"}) check_case(c, &kCuda, DType::F16, {1e-2, 3e-3, 5e-2});
}
