// Weight-only int8 inference (Model::quantize_int8) on the transformers-initialised golden models
// (tests/data/golden, see test_golden.cpp): the logits' relative error against transformers' fp32 logits, printed,
// under a bound derived from the weights' own quantization error; and the quantized model refusing training.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "q3vl/core/error.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/io/h5.hpp"
#include "q3vl/train/eval.hpp"

using namespace q3vl;

namespace {

struct Errors {
  double rel_l2 = 0, rel_max = 0, top1 = 0;
};
// Logits at real (unpadded) positions against the reference: relative L2 error, max|diff| / max|ref| and the share of
// positions whose most likely token agrees.
Errors compare(const Batch& b, int64_t V, const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0, dmax = 0, rmax = 0;
  int64_t pos = 0, same = 0;
  for (int64_t p = 0; p < int64_t(b.B) * b.S; ++p) {
    if (!b.attention_mask[p]) continue;
    int64_t ag = 0, ar = 0;
    for (int64_t v = 0; v < V; ++v) {
      const double g = got[p * V + v], r = ref[p * V + v];
      num += (g - r) * (g - r), den += r * r;
      dmax = std::max(dmax, std::fabs(g - r)), rmax = std::max(rmax, std::fabs(r));
      if (got[p * V + v] > got[p * V + ag]) ag = v;
      if (ref[p * V + v] > ref[p * V + ar]) ar = v;
    }
    ++pos, same += ag == ar;
  }
  return {std::sqrt(num / den), dmax / rmax, double(same) / double(pos)};
}

void check_case(const std::string& name) {
  const std::string dir = "tests/data/golden/" + name;
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model fp(cfg), q8(cfg);
  load_hf_weights(fp, dir + "/model");
  load_hf_weights(q8, dir + "/model");
  const Model::WeightBytes wb = q8.quantize_int8();
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  const std::vector<float> ref = H5File::open(dir + "/expected.h5").read<float>("logits");

  // The weights' own relative quantization error ||W - q*s|| / ||W|| per quantized matrix. To first order every
  // matrix perturbs the logits by at most its own relative error times the gain of the path through it; RMSNorm
  // before every linear and the head keeps those gains near 1, so the logits' error stays below the sum over the
  // matrices (errors of independent roundings add in quadrature, so the sum is a generous bound, not a guess).
  double sum_eps = 0;
  int nq = 0;
  int64_t int8_bytes = 0;
  for (size_t id = 0; id < fp.table().params().size(); ++id) {
    const Int8Weight* w = q8.int8_param((int)id);
    const ParamInfo& p = fp.table().params()[id];
    if (!w) {
      ASSERT_NE(q8.param((int)id), nullptr) << p.name;
      continue;
    }
    EXPECT_EQ(q8.param((int)id), nullptr) << p.name << ": its fp32 copy must be gone";
    const int64_t cols = p.shape.back();
    double num = 0, den = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      const double W = fp.param((int)id)[i], d = W - double(w->q[i]) * w->scale[i / cols];
      num += d * d, den += W * W;
    }
    sum_eps += std::sqrt(num / den), ++nq, int8_bytes += p.numel;
  }
  // Every linear of the text decoder (4 attention + 3 MLP or 2 expert tensors per layer) and the LM head.
  EXPECT_EQ(nq, cfg.text.layers * (cfg.moe() ? 6 : 7) + 1) << name;
  EXPECT_EQ(wb.int8, int8_bytes);
  EXPECT_EQ(wb.fp32, fp.table().total() * 4);
  EXPECT_LT(wb.now(), wb.fp32);

  std::vector<float> l32, l8;
  fp.forward(batch, false, &l32);
  q8.forward(batch, false, &l8);
  const int64_t V = cfg.text.vocab;
  const Errors e8 = compare(batch, V, l8, ref), e32 = compare(batch, V, l32, ref);
  std::printf("[ int8     ] %s: logits rel L2 err %.3e (fp32: %.1e), max|diff|/max|logit| %.3e, top-1 agreement "
              "%.1f%%; bound (sum of %d weight errors) %.3e; weights %.2f MiB -> %.2f MiB\n",
              name.c_str(), e8.rel_l2, e32.rel_l2, e8.rel_max, 100 * e8.top1, nq, sum_eps, wb.fp32 / 1048576.0,
              wb.now() / 1048576.0);
  EXPECT_LE(e32.rel_l2, 1e-4) << name << ": the unquantized model must match transformers first";
  EXPECT_LE(e8.rel_l2, sum_eps) << name;
  EXPECT_GT(e8.rel_l2, 0.0) << name << ": int8 logits identical to fp32: nothing was quantized";
}

}  // namespace

TEST(Int8, DenseTiedLogitsNearTransformers) { check_case("dense_tied"); }
TEST(Int8, DenseUntiedLogitsNearTransformers) { check_case("dense_untied"); }
TEST(Int8, MoeLogitsNearTransformers) { check_case("moe"); }

// Quantized weights have no master and no gradient: anything of training is refused, naming the setting.
TEST(Int8, QuantizedModelIsForInferenceOnly) {
  const std::string dir = "tests/data/golden/dense_untied";
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model m(cfg);
  load_hf_weights(m, dir + "/model");
  m.quantize_int8();
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  try {
    m.forward(batch, true);
    FAIL() << "a training forward ran on int8 weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.weight_dtype"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.backward(), Error);
  EXPECT_THROW(m.set_trainable({}), Error);
  EXPECT_THROW(m.quantize_int8(), Error);
  EXPECT_EQ(m.grads(), nullptr);
}
