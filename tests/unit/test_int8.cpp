// Low-precision weights for inference (Model::lower_weights: int8, fp8 (E4M3), and bf16/fp16 on the CPU backend) on
// the transformers-initialised golden models (tests/data/golden, see test_golden.cpp): the logits' relative error
// against transformers' fp32 logits, printed, under a bound derived from the weights' own rounding error; the
// converted model refusing training; the widening product against fp32 on the rounded weights; fp16's overflow; the
// host's E4M3 encoding and decoding, exhaustively (and against CUDA's own host conversion where CUDA is built in).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
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
#ifdef Q3VL_CUDA
#include <cuda_fp8.h>
#endif

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
  const int64_t esize = low_scaled(dt) ? 1 : 2;
  int64_t over = 0;  // fp8 weights beyond E4M3's own rounding bound
  for (size_t id = 0; id < fp.table().params().size(); ++id) {
    const LowWeight* w = q8.low_param((int)id);
    const ParamInfo& p = fp.table().params()[id];
    if (!w) {
      ASSERT_NE(q8.param((int)id), nullptr) << p.name;
      continue;
    }
    EXPECT_EQ(q8.param((int)id), nullptr) << p.name << ": its fp32 copy must be gone";
    EXPECT_EQ(w->dtype, dt) << p.name;
    EXPECT_EQ(w->scale != nullptr, low_scaled(dt)) << p.name << ": scales are int8's and fp8's only";
    const int64_t cols = p.shape.back();
    double num = 0, den = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      const double W = fp.param((int)id)[i], d = W - stored(*w, i, cols);
      num += d * d, den += W * W;
      // E4M3 keeps 3 mantissa bits: a weight within half a step, 2^-4 of itself, or of the subnormals' step of 2^-9
      // (in units of its row's scale) below 2^-6; 1e-6 for the fp32 roundings of W / scale and q * scale.
      if (dt == LowDtype::FP8)
        over += std::fabs(d) > (0x1p-4 * std::fabs(W) + 0x1p-10 * w->scale[i / cols]) * (1 + 1e-6) + 1e-30;
    }
    sum_eps += std::sqrt(num / den), ++nq, low_bytes += p.numel * esize;
  }
  // Every linear of the text decoder (4 attention + 3 MLP or 2 expert tensors per layer) and the LM head.
  EXPECT_EQ(nq, cfg.text.layers * (cfg.moe() ? 6 : 7) + 1) << name;
  EXPECT_EQ(wb.low, low_bytes);
  EXPECT_EQ(wb.fp32, fp.table().total() * 4);
  EXPECT_EQ(wb.scales == 0, !low_scaled(dt));
  EXPECT_EQ(over, 0) << name << ": fp8 weights off by more than E4M3's rounding";
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
  if (!low_scaled(dt)) {
    EXPECT_GE(eq.top1, 0.9) << name;
  }
}

}  // namespace

TEST(Int8, DenseTiedLogitsNearTransformers) { check_case("dense_tied"); }
TEST(Int8, DenseUntiedLogitsNearTransformers) { check_case("dense_untied"); }
TEST(Int8, MoeLogitsNearTransformers) { check_case("moe"); }
TEST(Fp8, DenseTiedLogitsNearTransformers) { check_case("dense_tied", LowDtype::FP8); }
TEST(Fp8, DenseUntiedLogitsNearTransformers) { check_case("dense_untied", LowDtype::FP8); }
TEST(Fp8, MoeLogitsNearTransformers) { check_case("moe", LowDtype::FP8); }

// Quantized weights have no master and no gradient: anything of training is refused, naming the setting.
void check_inference_only(LowDtype dt) {
  const std::string dir = "tests/data/golden/dense_untied";
  const ModelConfig cfg = load_hf_config(dir + "/model/config.json");
  Model m(cfg);
  load_hf_weights(m, dir + "/model");
  m.lower_weights(dt);
  const Batch batch = read_batch_h5(dir + "/batch.h5", cfg.vision.patch_dim());
  const std::string key = std::string("model.weight_dtype = \"") + low_dtype_name(dt) + "\"";
  try {
    m.forward(batch, true);
    FAIL() << "a training forward ran on " << low_dtype_name(dt) << " weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
  }
  EXPECT_THROW(m.backward(), Error);
  EXPECT_THROW(m.set_trainable({}), Error);
  EXPECT_THROW(m.lower_weights(dt), Error);
  EXPECT_EQ(m.grads(), nullptr);
}
TEST(Int8, QuantizedModelIsForInferenceOnly) { check_inference_only(LowDtype::I8); }
TEST(Fp8, QuantizedModelIsForInferenceOnly) { check_inference_only(LowDtype::FP8); }

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

// ---- FP8 E4M3 on the host (model.weight_dtype = "fp8") -------------------------------------------------------------
// Every code decodes to (1 + m/8) 2^(e-7), subnormals m 2^-9, 0x7f/0xff NaN; the table the products widen through is
// the same.
TEST(Fp8, E4M3DecodesEveryCode) {
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const float f = fp8_e4m3_to_f32(uint8_t(c));
    EXPECT_EQ(std::bit_cast<uint32_t>(kFp8E4M3[size_t(c)]), std::bit_cast<uint32_t>(f)) << c;
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    const float want = (c & 0x80 ? -1.0f : 1.0f) * (e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(float(m), -9));
    EXPECT_EQ(f, want) << c;
    EXPECT_EQ(std::signbit(f), (c & 0x80) != 0) << c;  // -0 too
    EXPECT_EQ(widen(Fp8E4M3{uint8_t(c)}), f) << c;
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0x1p-6f);  // the smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1p-9f);  // the smallest subnormal
}

// Encoding: every finite code round-trips; a value halfway between two neighbours goes to the even code, a hair off
// it to the nearer one; beyond 464 (448 + half a step) and infinities saturate to +-448; NaN is 0x7f, either sign;
// below half the smallest subnormal is zero (half exactly: zero, the even neighbour).
TEST(Fp8, E4M3EncodeRoundsToNearestEven) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) != 0x7f) {
      ASSERT_EQ(f32_to_fp8_e4m3(fp8_e4m3_to_f32(uint8_t(c))), c) << c;
    }
  }
  for (int c = 0; c < 0x7e; ++c)
    for (const float s : {1.0f, -1.0f}) {
      const int sign = s < 0 ? 0x80 : 0;
      const float lo = fp8_e4m3_to_f32(uint8_t(c)), hi = fp8_e4m3_to_f32(uint8_t(c + 1)), mid = (lo + hi) / 2;
      ASSERT_EQ(mid - lo, hi - mid) << c;  // exact in fp32
      EXPECT_EQ(f32_to_fp8_e4m3(s * mid), sign | (c % 2 == 0 ? c : c + 1)) << c;
      EXPECT_EQ(f32_to_fp8_e4m3(s * std::nextafter(mid, 0.0f)), sign | c) << c;
      EXPECT_EQ(f32_to_fp8_e4m3(s * std::nextafter(mid, 1e9f)), sign | (c + 1)) << c;
    }
  EXPECT_EQ(f32_to_fp8_e4m3(464.0f), 0x7e);  // the midpoint to 512 (not a code): down to even 448
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(464.0f, 1e9f)), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_fp8_e4m3(NAN), 0x7f);
  EXPECT_EQ(f32_to_fp8_e4m3(-NAN), 0x7f);
  EXPECT_EQ(f32_to_fp8_e4m3(0x1p-10f), 0x00);
  EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(f32_to_fp8_e4m3(-1e-30f), 0x80);
}

#ifdef Q3VL_CUDA
// Bit-exact with CUDA's conversions (cuda_fp8.h's host path, what the device's cvt instructions compute): every
// exponent, every top 11 mantissa bits, and low bits at and around the rounding points, both signs; every code back.
TEST(Fp8, E4M3MatchesCudaConversions) {
  int64_t n = 0, bad = 0;
  for (uint32_t hi = 0; hi < (1u << 20); ++hi)  // sign, exponent, top 11 mantissa bits
    for (const uint32_t lo : {0x000u, 0x001u, 0x7ffu, 0x800u, 0x801u, 0xfffu}) {
      const float f = std::bit_cast<float>(hi << 12 | lo);
      const uint8_t want = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3);
      bad += f32_to_fp8_e4m3(f) != want, ++n;
      if (bad == 1 && f32_to_fp8_e4m3(f) != want)
        ADD_FAILURE() << "f = " << f << " (bits " << std::hex << (hi << 12 | lo) << "): " << int(f32_to_fp8_e4m3(f))
                      << " against CUDA's " << int(want);
    }
  EXPECT_EQ(bad, 0) << "of " << n;
  for (int c = 0; c < 256; ++c) {
    const float want = __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(c), __NV_E4M3)));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(uint8_t(c)))) << c;
    else EXPECT_EQ(std::bit_cast<uint32_t>(fp8_e4m3_to_f32(uint8_t(c))), std::bit_cast<uint32_t>(want)) << c;
  }
}
#endif
