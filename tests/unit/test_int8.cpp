// Low-precision weights for inference (Model::lower_weights: int8, and bf16/fp16 on the CPU backend) on the
// transformers-initialised golden models (tests/data/golden, see test_golden.cpp): the logits' relative error
// against transformers' fp32 logits, printed, under a bound derived from the weights' own rounding error; the
// converted model refusing training; the widening product against fp32 on the rounded weights; fp16's overflow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "../compare.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/io/hf_weights.hpp"
#include "q3vl/model/config.hpp"
#include "q3vl/io/h5.hpp"
#include "q3vl/tensor/ops.hpp"
#include "q3vl/train/eval.hpp"
#include "../reference/model_io.hpp"

using namespace q3vl;

namespace {

struct Errors {
  double rel_l2 = 0, rel_max = 0, top1 = 0;
};
// Logits at real (unpadded) positions against the reference: relative L2 error, max|diff| / max|ref| and the share of
// positions whose most likely token agrees.
Errors compare(const Batch& b, int64_t V, const std::vector<float>& got, const std::vector<float>& ref) {
  const std::vector<float> g = test::masked_rows(got, b.attention_mask, V);
  const std::vector<float> r = test::masked_rows(ref, b.attention_mask, V);
  int64_t pos = 0, same = 0;
  for (size_t p = 0; g.size() == r.size() && p + V <= r.size(); p += V, ++pos) {
    const auto top = [&](const std::vector<float>& l) {
      return std::max_element(l.begin() + p, l.begin() + p + V) - l.begin();
    };
    same += top(g) == top(r);
  }
  // NaN or Inf: both errors +inf (compare.hpp)
  return {test::rel_norm_diff(g, r), test::rel_max_diff(g, r), double(same) / double(std::max<int64_t>(pos, 1))};
}

// Element i of a low-precision weight with `cols` columns, as the products see it.
double stored(const LowWeight& w, int64_t i, int64_t cols) {
  double v = 0;
  w.visit([&](const auto* rows) { v = widen(rows[i]); });
  return w.scale ? v * w.scale[i / cols] : v;
}

void check_case(const std::string& name, LowDtype dt = LowDtype::I8) {
  const std::string dir = "tests/data/golden/" + name;
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model fp(cfg), q8(cfg);
  load_hf_weights(fp, dir + "/model");
  load_hf_weights(q8, dir + "/model");
  const Model::WeightBytes wb = q8.lower_weights(dt);
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  const std::vector<float> ref = H5File::open(dir + "/expected.h5").read<float>("logits");

  // The weights' own relative rounding error ||W - stored|| / ||W|| per converted matrix. To first order every
  // matrix perturbs the logits by at most its own relative error times the gain of the path through it; RMSNorm
  // before every linear and the head keeps those gains near 1, so the logits' error stays below the sum over the
  // matrices (errors of independent roundings add in quadrature, so the sum is a generous bound, not a guess).
  double sum_eps = 0;
  int nq = 0;
  int64_t low_bytes = 0;
  const int64_t esize = dt == LowDtype::I8 ? 1 : 2;
  for (size_t id = 0; id < fp.table().params().size(); ++id) {
    const LowWeight* w = q8.low_param((int)id);
    const ParamInfo& p = fp.table().params()[id];
    if (!w) {
      ASSERT_NE(q8.param((int)id), nullptr) << p.name;
      continue;
    }
    EXPECT_EQ(q8.param((int)id), nullptr) << p.name << ": its fp32 copy must be gone";
    EXPECT_EQ(w->dtype, dt) << p.name;
    EXPECT_EQ(w->scale != nullptr, dt == LowDtype::I8) << p.name << ": scales are int8's only";
    const int64_t cols = p.shape.back();
    double num = 0, den = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      const double W = fp.param((int)id)[i], d = W - stored(*w, i, cols);
      num += d * d, den += W * W;
    }
    sum_eps += std::sqrt(num / den), ++nq, low_bytes += p.numel * esize;
  }
  // Every linear of the text decoder (4 attention + 3 MLP or 2 expert tensors per layer) and the LM head.
  EXPECT_EQ(nq, cfg.text.layers * (cfg.moe() ? 6 : 7) + 1) << name;
  EXPECT_EQ(wb.low, low_bytes);
  EXPECT_EQ(wb.fp32, fp.table().total() * 4);
  EXPECT_EQ(wb.scales == 0, dt != LowDtype::I8);
  EXPECT_LT(wb.now(), wb.fp32);

  std::vector<float> l32, l8;
  fp.forward(batch, false, &l32);
  q8.forward(batch, false, &l8);
  const int64_t V = cfg.text.vocab;
  const Errors e8 = compare(batch, V, l8, ref), e32 = compare(batch, V, l32, ref), eq = compare(batch, V, l8, l32);
  std::printf("[ %-8s ] %s: logits rel L2 err %.3e (fp32: %.1e), max|diff|/max|logit| %.3e, top-1 agreement "
              "%.1f%% (with fp32's: %.1f%%); bound (sum of %d weight errors) %.3e; weights %.2f MiB -> %.2f MiB\n",
              low_dtype_name(dt), name.c_str(), e8.rel_l2, e32.rel_l2, e8.rel_max, 100 * e8.top1, 100 * eq.top1, nq,
              sum_eps, wb.fp32 / 1048576.0, wb.now() / 1048576.0);
  EXPECT_LE(e32.rel_l2, 2e-5) << name << ": the unconverted model must match transformers first";
  EXPECT_LE(e8.rel_l2, sum_eps) << name;
  EXPECT_GT(e8.rel_l2, 0.0) << name << ": " << low_dtype_name(dt) << " logits identical to fp32: nothing was converted";
  // 16-bit storage: the greedy token at most positions is fp32's (a random-init model has small logit margins).
  if (dt != LowDtype::I8) {
    EXPECT_GE(eq.top1, 0.9) << name;
  }
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
  m.lower_weights(LowDtype::I8);
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  try {
    m.forward(batch, true);
    FAIL() << "a training forward ran on int8 weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.weight_dtype"), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.backward(), Error);
  EXPECT_THROW(m.set_trainable({}), Error);
  EXPECT_THROW(m.lower_weights(LowDtype::I8), Error);
  EXPECT_EQ(m.grads(), nullptr);
}

TEST(HalfWeights, Bf16DenseTiedLogitsNearTransformers) { check_case("dense_tied", LowDtype::BF16); }
TEST(HalfWeights, Bf16DenseUntiedLogitsNearTransformers) { check_case("dense_untied", LowDtype::BF16); }
TEST(HalfWeights, Bf16MoeLogitsNearTransformers) { check_case("moe", LowDtype::BF16); }
TEST(HalfWeights, Fp16DenseTiedLogitsNearTransformers) { check_case("dense_tied", LowDtype::F16); }
TEST(HalfWeights, Fp16DenseUntiedLogitsNearTransformers) { check_case("dense_untied", LowDtype::F16); }
TEST(HalfWeights, Fp16MoeLogitsNearTransformers) { check_case("moe", LowDtype::F16); }

// f16_to_f32 (branch-free, for the widening loops) is exact: every finite half survives the round trip through fp32
// (f32_to_f16 rounds an exact value to itself), and the boundary values land where IEEE puts them.
TEST(HalfWeights, Fp16WidensExactly) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(uint16_t(h));
    if ((h & 0x7c00u) == 0x7c00u) {
      EXPECT_TRUE((h & 0x3ffu) ? std::isnan(f) : std::isinf(f)) << std::hex << h;
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x8400), -std::ldexp(1.0f, -14));
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);  // below the halfway point to 2^16: still finite
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
}

// The widening product on bf16/fp16 rows against the fp32 (and double) linear on the same rounded weights: shapes of
// one tile, several, and a ragged last one (the tile holds 65536 / in rows).
template <class S> void check_widening_linear() {
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0, 0.05f);
  struct Shape { int64_t N, in, out; };
  for (const Shape sh : {Shape{1, 7, 5}, Shape{5, 64, 300}, Shape{3, 1000, 131}, Shape{2, 70000, 3}}) {
    std::vector<float> W(sh.out * sh.in), x(sh.N * sh.in), b(sh.out);
    for (auto& v : W) v = nd(rng);
    for (auto& v : x) v = nd(rng);
    for (auto& v : b) v = nd(rng);
    std::vector<S> w(W.size());
    ASSERT_EQ(ops::round_to(W.data(), (int64_t)W.size(), w.data()), -1);
    std::vector<float> Wr(W.size());
    for (size_t i = 0; i < W.size(); ++i) Wr[i] = widen(w[i]);
    std::vector<double> xd(x.begin(), x.end()), bd(b.begin(), b.end()), Wd(Wr.begin(), Wr.end());
    for (const bool bias : {false, true}) {
      std::vector<float> want(sh.N * sh.out), got(sh.N * sh.out, 12345.0f);  // got: overwritten, not accumulated
      ops::linear_fwd(x.data(), Wr.data(), bias ? b.data() : nullptr, want.data(), sh.N, sh.in, sh.out);
      ops::linear_lowp_fwd(x.data(), w.data(), nullptr, bias ? b.data() : nullptr, got.data(), sh.N, sh.in, sh.out);
      std::vector<double> wantd(want.size()), gotd(want.size());
      ops::linear_fwd(xd.data(), Wd.data(), bias ? bd.data() : nullptr, wantd.data(), sh.N, sh.in, sh.out);
      ops::linear_lowp_fwd(xd.data(), w.data(), nullptr, bias ? bd.data() : nullptr, gotd.data(), sh.N, sh.in, sh.out);
      const std::string at = "N " + std::to_string(sh.N) + " in " + std::to_string(sh.in) + " out " +
                             std::to_string(sh.out) + " bias " + std::to_string(bias);
      EXPECT_LE(test::rel_max_diff(got, want), 1e-6) << at;  // NaN or Inf: +inf
      EXPECT_LE(test::rel_max_diff(gotd, wantd), 1e-12) << at;
    }
  }
  // The embedding lookup of a tied head: a row widened, exactly.
  const std::vector<float> table{0.1f, -2.5f, 3e-3f, 7.0f, -0.3f, 1e-5f};
  std::vector<S> t(table.size());
  ASSERT_EQ(ops::round_to(table.data(), 6, t.data()), -1);
  const int64_t ids[] = {2, 0}, bad = 3;
  std::vector<float> out(4);
  ops::embedding_lowp_fwd(ids, t.data(), nullptr, out.data(), 2, 2, 3);
  for (int i = 0; i < 2; ++i)
    for (int d = 0; d < 2; ++d) EXPECT_EQ(out[i * 2 + d], widen(t[ids[i] * 2 + d]));
  EXPECT_THROW(ops::embedding_lowp_fwd(&bad, t.data(), nullptr, out.data(), 1, 2, 3), Error);
}
TEST(HalfWeights, Bf16LinearMatchesRoundedWeights) { check_widening_linear<Bf16>(); }
TEST(HalfWeights, Fp16LinearMatchesRoundedWeights) { check_widening_linear<Fp16>(); }

// A weight beyond fp16's range is refused, naming the parameter, and leaves the model as it was (fp32, usable);
// bf16 (fp32's exponent range) takes it. The fp16 model is for inference only, as int8's.
TEST(HalfWeights, Fp16OverflowRefusedByName) {
  const std::string dir = "tests/data/golden/dense_untied";
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model m(cfg);
  load_hf_weights(m, dir + "/model");
  const int id = m.table().layer(1) + tlay::down_proj;
  m.param(id)[5] = 7e4f;
  try {
    m.lower_weights(LowDtype::F16);
    FAIL() << "a weight of 7e4 went to fp16";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(m.table().params()[size_t(id)].name), std::string::npos) << what;
    EXPECT_NE(what.find("fp16"), std::string::npos) << what;
  }
  EXPECT_FALSE(m.lowered());
  ASSERT_NE(m.param(id), nullptr);
  EXPECT_EQ(m.param(id)[5], 7e4f);
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  std::vector<float> l32;
  m.forward(batch, false, &l32);
  m.lower_weights(LowDtype::BF16);
  EXPECT_EQ(widen(m.low_param(id)->as<Bf16>()[5]), 70144.0f);  // 7e4 to bf16's 8 bits of mantissa
  try {
    m.forward(batch, true);
    FAIL() << "a training forward ran on bf16 weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.weight_dtype = \"bf16\""), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.lower_weights(LowDtype::F16), Error);
}
