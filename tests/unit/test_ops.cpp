// CPU reference kernels: every backward against central differences in double precision, and the blockwise
// attention against a naive full-softmax reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "../compare.hpp"
#include "gradcheck.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/tensor/ops.hpp"

using namespace q3vl;
using q3vl::test::dot;
using q3vl::test::expect_grad;
using q3vl::test::randn;
using V = std::vector<double>;

TEST(Ops, LinearGrad) {
  std::mt19937 rng(1);
  const int N = 5, in = 7, out = 4;
  V x = randn(N * in, rng), W = randn(out * in, rng), b = randn(out, rng), R = randn(N * out, rng);
  auto f = [&] {
    V y(N * out);
    ops::linear_fwd(x.data(), W.data(), b.data(), y.data(), N, in, out);
    return dot(y, R);
  };
  V dx(x.size()), dW(W.size()), db(b.size());
  ops::linear_bwd(R.data(), x.data(), W.data(), dx.data(), dW.data(), db.data(), N, in, out);
  expect_grad("dx", x, dx, f);
  expect_grad("dW", W, dW, f);
  expect_grad("db", b, db, f);
}

TEST(Ops, LayerNormGrad) {
  std::mt19937 rng(2);
  const int N = 4, D = 6;
  V x = randn(N * D, rng), w = randn(D, rng), b = randn(D, rng), R = randn(N * D, rng);
  auto f = [&] {
    V y(N * D), m(N), r(N);
    ops::layernorm_fwd(x.data(), w.data(), b.data(), y.data(), m.data(), r.data(), N, D, 1e-6);
    return dot(y, R);
  };
  V y(N * D), m(N), r(N), dx(x.size()), dw(D), db(D);
  ops::layernorm_fwd(x.data(), w.data(), b.data(), y.data(), m.data(), r.data(), N, D, 1e-6);
  ops::layernorm_bwd(R.data(), x.data(), w.data(), m.data(), r.data(), dx.data(), dw.data(), db.data(), N, D);
  expect_grad("dx", x, dx, f);
  expect_grad("dw", w, dw, f);
  expect_grad("db", b, db, f);
}

TEST(Ops, RmsNormGrad) {
  std::mt19937 rng(3);
  const int N = 6, D = 5;  // e.g. 3 tokens x 2 heads sharing one weight
  V x = randn(N * D, rng), w = randn(D, rng), R = randn(N * D, rng);
  auto f = [&] {
    V y(N * D), r(N);
    ops::rmsnorm_fwd(x.data(), w.data(), y.data(), r.data(), N, D, 1e-6);
    return dot(y, R);
  };
  V y(N * D), r(N), dx(x.size()), dw(D);
  ops::rmsnorm_fwd(x.data(), w.data(), y.data(), r.data(), N, D, 1e-6);
  ops::rmsnorm_bwd(R.data(), x.data(), w.data(), r.data(), dx.data(), dw.data(), N, D);
  expect_grad("dx", x, dx, f);
  expect_grad("dw", w, dw, f);
}

TEST(Ops, ActivationGrads) {
  std::mt19937 rng(4);
  const int n = 20;
  V x = randn(n, rng, 2.0), R = randn(n, rng);
  for (int which = 0; which < 2; ++which) {
    auto f = [&] {
      V y(n);
      which ? ops::gelu_erf_fwd(x.data(), y.data(), n) : ops::gelu_tanh_fwd(x.data(), y.data(), n);
      return dot(y, R);
    };
    V dx(n);
    which ? ops::gelu_erf_bwd(R.data(), x.data(), dx.data(), n) : ops::gelu_tanh_bwd(R.data(), x.data(), dx.data(), n);
    expect_grad(which ? "gelu_erf" : "gelu_tanh", x, dx, f);
  }
  // Known values: gelu_erf(1) = 0.841344746, gelu_tanh(1) = 0.841191990.
  double one = 1, y;
  ops::gelu_erf_fwd(&one, &y, 1);
  EXPECT_NEAR(y, 0.8413447460685429, 1e-12);
  ops::gelu_tanh_fwd(&one, &y, 1);
  EXPECT_NEAR(y, 0.8411919906082768, 1e-12);
}

TEST(Ops, SwigluGrad) {
  std::mt19937 rng(5);
  const int N = 3, I = 4;
  V gu = randn(N * 2 * I, rng, 2.0), R = randn(N * I, rng);
  auto f = [&] {
    V y(N * I);
    ops::swiglu_fwd(gu.data(), y.data(), N, I);
    return dot(y, R);
  };
  V dgu(gu.size());
  ops::swiglu_bwd(R.data(), gu.data(), dgu.data(), N, I);
  expect_grad("dgu", gu, dgu, f);
}

TEST(Ops, RotaryGradAndTables) {
  std::mt19937 rng(6);
  const int N = 5, H = 2, hd = 8;
  // Vision table: rows/cols; text M-RoPE table: three position rows.
  std::vector<int64_t> row = {0, 0, 1, 1, 7}, col = {0, 1, 0, 1, 3};
  V vc(N * hd / 2), vs(N * hd / 2);
  ops::vision_rope_table(row.data(), col.data(), N, hd, vc.data(), vs.data());
  // hd 8 -> 2 freqs per axis: inv = [1, 1/100]; entry (i, j<2) is row*inv[j], (i, 2+j) is col*inv[j].
  EXPECT_NEAR(vc[4 * 4 + 0], std::cos(7.0), 1e-6);
  EXPECT_NEAR(vs[4 * 4 + 1], std::sin(0.07), 1e-6);
  EXPECT_NEAR(vs[4 * 4 + 2], std::sin(3.0), 1e-6);
  std::vector<int64_t> pos3 = {0, 1, 2, 3, 4, /*H*/ 0, 5, 6, 7, 8, /*W*/ 0, 9, 10, 11, 12};
  const int sec[3] = {2, 1, 1};
  V tc(N * hd / 2), ts(N * hd / 2);
  ops::mrope_table(pos3.data(), N, hd, 10000.0, sec, tc.data(), ts.data());
  // hd 8: inv = 10000^(-j/4), j<4; j=1 -> H, j=2 -> W, j=0,3 -> T.
  EXPECT_NEAR(ts[1 * 4 + 0], std::sin(1.0), 1e-6);
  EXPECT_NEAR(ts[1 * 4 + 1], std::sin(5.0 * 0.1), 1e-6);
  EXPECT_NEAR(ts[1 * 4 + 2], std::sin(9.0 * 0.01), 1e-6);
  EXPECT_NEAR(ts[1 * 4 + 3], std::sin(1.0 * 0.001), 1e-6);
  for (int t = 0; t < 2; ++t) {
    const V& c = t ? tc : vc;
    const V& s = t ? ts : vs;
    V x = randn(N * H * hd, rng), R = randn(N * H * hd, rng);
    auto f = [&] {
      V y = x;
      ops::rope_fwd(y.data(), c.data(), s.data(), N, H, hd);
      return dot(y, R);
    };
    V dx = R;
    ops::rope_bwd(dx.data(), c.data(), s.data(), N, H, hd);
    expect_grad("rope", x, dx, f);
    // rotate_half pairing: d with d + hd/2.
    V e(N * H * hd, 0.0);
    e[0] = 1;
    ops::rope_fwd(e.data(), c.data(), s.data(), N, H, hd);
    EXPECT_NEAR(e[hd / 2], s[0], 1e-12);
  }
}

namespace {
struct AttnCase {
  std::vector<int64_t> cu;
  int nh, nkv, hd;
  bool causal;
};

void check_attention(const AttnCase& c, unsigned seed) {
  std::mt19937 rng(seed);
  const int64_t N = c.cu.back(), nseg = (int64_t)c.cu.size() - 1;
  V q = randn(N * c.nh * c.hd, rng), k = randn(N * c.nkv * c.hd, rng), v = randn(N * c.nkv * c.hd, rng);
  V R = randn(N * c.nh * c.hd, rng);
  const double scale = 1.0 / std::sqrt((double)c.hd);
  V out(q.size()), lse(N * c.nh), ref(q.size());
  ops::attention_fwd(q.data(), k.data(), v.data(), out.data(), lse.data(), c.cu.data(), nseg, c.nh, c.nkv, c.hd,
                     c.causal, scale);
  ops::attention_ref(q.data(), k.data(), v.data(), ref.data(), c.cu.data(), nseg, c.nh, c.nkv, c.hd, c.causal, scale);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-12) << "attention output " << i;
  auto f = [&] {
    V o(q.size());
    ops::attention_ref(q.data(), k.data(), v.data(), o.data(), c.cu.data(), nseg, c.nh, c.nkv, c.hd, c.causal, scale);
    return dot(o, R);
  };
  V dq(q.size()), dk(k.size()), dv(v.size());
  ops::attention_bwd(R.data(), q.data(), k.data(), v.data(), out.data(), lse.data(), dq.data(), dk.data(), dv.data(),
                     c.cu.data(), nseg, c.nh, c.nkv, c.hd, c.causal, scale);
  std::vector<size_t> sub;  // a spread subset keeps the test fast
  for (size_t i = 0; i < q.size(); i += std::max<size_t>(7, q.size() / 40)) sub.push_back(i);
  std::vector<size_t> subk;
  for (size_t i = 0; i < k.size(); i += std::max<size_t>(5, k.size() / 40)) subk.push_back(i);
  expect_grad("dq", q, dq, f, sub);
  expect_grad("dk", k, dk, f, subk);
  expect_grad("dv", v, dv, f, subk);
}
}  // namespace

TEST(Ops, AttentionSmall) {
  check_attention({{0, 5}, 2, 2, 4, false}, 10);
  check_attention({{0, 5}, 2, 2, 4, true}, 11);
  check_attention({{0, 3, 7, 8}, 4, 2, 4, true}, 12);   // varlen + GQA
  check_attention({{0, 3, 7, 8}, 4, 1, 4, false}, 13);  // varlen + MQA, non-causal (vision style)
}

TEST(Ops, AttentionBlockBoundaries) {
  // Segments shorter than, equal to, just over and several times the block size.
  const int64_t B = ops::kAttnBlock;
  check_attention({{0, B - 1, 2 * B - 1, 3 * B, 3 * B + 2 * B + 3}, 2, 1, 4, true}, 20);
  check_attention({{0, B + 1, 3 * B + 6}, 2, 2, 3, false}, 21);
}

TEST(Ops, EmbeddingGrad) {
  std::mt19937 rng(7);
  const int Vv = 6, D = 3, N = 5;
  std::vector<int64_t> ids = {1, 4, 1, 0, 5};
  V tab = randn(Vv * D, rng), R = randn(N * D, rng);
  auto f = [&] {
    V y(N * D);
    ops::embedding_fwd(ids.data(), tab.data(), y.data(), N, D, Vv);
    return dot(y, R);
  };
  V dt(tab.size());
  ops::embedding_bwd(ids.data(), R.data(), dt.data(), N, D);
  expect_grad("dtable", tab, dt, f);
  std::vector<int64_t> bad = {6};
  V y(D);
  EXPECT_THROW(ops::embedding_fwd(bad.data(), tab.data(), y.data(), 1, D, Vv), std::exception);
}

TEST(Ops, CrossEntropyGrad) {
  std::mt19937 rng(8);
  const int N = 4, Vv = 7;
  std::vector<int64_t> tgt = {3, -100, 0, 6};
  V x = randn(N * Vv, rng, 2.0);
  auto f = [&] {
    V l(N);
    return ops::cross_entropy<double>(x.data(), tgt.data(), l.data(), nullptr, N, Vv, 1.0) / 3;
  };
  V dx(x.size()), l(N);
  double tot = ops::cross_entropy<double>(x.data(), tgt.data(), l.data(), dx.data(), N, Vv, 1.0 / 3);
  EXPECT_EQ(l[1], 0.0);
  double mx = -1e300, s = 0;
  for (int j = 0; j < Vv; ++j) mx = std::max(mx, x[j]);
  for (int j = 0; j < Vv; ++j) s += std::exp(x[j] - mx);
  EXPECT_NEAR(l[0], mx + std::log(s) - x[3], 1e-12);
  EXPECT_NEAR(tot, l[0] + l[2] + l[3], 1e-12);
  expect_grad("dlogits", x, dx, f);
}

TEST(Ops, RouterTopkTiesAndGrad) {
  // Ties: equal logits -> lower index first (torch.topk).
  V z = {1.0, 2.0, 2.0, 0.5, 2.0};
  V p(5), w(2);
  std::vector<int64_t> idx(2);
  ops::router_fwd(z.data(), p.data(), idx.data(), w.data(), 1, 5, 2);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 2);
  EXPECT_NEAR(w[0], 0.5, 1e-15);

  std::mt19937 rng(9);
  const int N = 4, E = 6, k = 3;
  V lg = randn(N * E, rng), R = randn(N * k, rng);
  V probs(N * E), ww(N * k);
  std::vector<int64_t> id(N * k);
  ops::router_fwd(lg.data(), probs.data(), id.data(), ww.data(), N, E, k);
  const auto id0 = id;
  auto f = [&] {
    V pp(N * E), w2(N * k);
    std::vector<int64_t> i2(N * k);
    ops::router_fwd(lg.data(), pp.data(), i2.data(), w2.data(), N, E, k);
    EXPECT_EQ(i2, id0);  // the perturbation must not change the selection
    return dot(w2, R);
  };
  V dl(lg.size());
  ops::router_bwd(R.data(), probs.data(), id.data(), dl.data(), N, E, k);
  expect_grad("router dlogits", lg, dl, f);
}

TEST(Ops, AuxLossGrad) {
  std::mt19937 rng(10);
  const int N = 6, E = 5, k = 2;
  V lg = randn(N * E, rng);
  auto run = [&](V* dl) {
    V pp(N * E), w(N * k), fv(E);
    std::vector<int64_t> id(N * k);
    ops::router_fwd(lg.data(), pp.data(), id.data(), w.data(), N, E, k);
    double aux = ops::aux_loss_fwd(pp.data(), id.data(), N, E, k, fv.data());
    if (dl) ops::aux_loss_bwd(pp.data(), fv.data(), 1.0, dl->data(), N, E);
    return aux;
  };
  // Equal logits: p_e = 1/E, so aux = E * sum_e f_e / E = sum_e f_e = k.
  V keep = lg;
  std::fill(lg.begin(), lg.end(), 0.0);
  EXPECT_NEAR(run(nullptr), (double)k, 1e-12);
  lg = keep;
  V dl(lg.size());
  run(&dl);
  expect_grad("aux dlogits", lg, dl, [&] { return run(nullptr); });
}

TEST(Ops, PosEmbedInterpolation) {
  std::mt19937 rng(11);
  const int G = 4, D = 3, t = 2, h = 4, w = 6, m = 2;
  V tab = randn(G * G * D, rng), R = randn(t * h * w * D, rng);
  V out(t * h * w * D);
  ops::pos_embed_fwd(tab.data(), G, D, t, h, w, m, out.data());
  // h == G: rows hit table rows exactly; patch 1 of block (0,0) is (row 0, col 1): col src = 1*3/5 = 0.6.
  for (int d = 0; d < D; ++d) {
    double want = 0.4 * tab[(0 * G + 0) * D + d] + 0.6 * tab[(0 * G + 1) * D + d];
    EXPECT_NEAR(out[1 * D + d], want, 1e-6);
    // Patch 2 of block (0,0) is (row 1, col 0) -> table row 1*G + 0.
    EXPECT_NEAR(out[2 * D + d], tab[(1 * G + 0) * D + d], 1e-6);
    // Second frame repeats the first.
    EXPECT_NEAR(out[(h * w + 5) * D + d], out[5 * D + d], 1e-12);
  }
  auto f = [&] {
    V o(t * h * w * D);
    ops::pos_embed_fwd(tab.data(), G, D, t, h, w, m, o.data());
    return dot(o, R);
  };
  V dt(tab.size());
  ops::pos_embed_bwd(R.data(), G, D, t, h, w, m, dt.data());
  expect_grad("dtable", tab, dt, f);
}

// ---- weight-only int8 -------------------------------------------------------------------------------------------
// Quantization: symmetric per row (absmax/127), so every weight is within half a step of its row's grid and the
// row's largest weight is exact; an all-zero row stays zero.
// rows x cols weights drawn N(0, 0.05) from `seed`, row 4 all zero, and `outlier` at row 2, column 5.
static std::vector<float> quant_test_rows(unsigned seed, int64_t rows, int64_t cols, float outlier) {
  std::mt19937 rng(seed);
  std::vector<float> W(rows * cols);
  std::normal_distribution<float> nd(0, 0.05f);
  for (auto& w : W) w = nd(rng);
  for (int64_t c = 0; c < cols; ++c) W[4 * cols + c] = 0;
  W[2 * cols + 5] = outlier;
  return W;
}

TEST(Ops, QuantizeInt8RowsRoundTrip) {
  const int64_t rows = 9, cols = 37;
  const std::vector<float> W = quant_test_rows(21, rows, cols, -3.0f);  // the outlier sets its row's scale only
  std::vector<int8_t> q(W.size());
  std::vector<float> s(rows);
  ops::quantize_int8_rows(W.data(), rows, cols, q.data(), s.data());
  EXPECT_EQ(s[4], 0.0f);
  EXPECT_FLOAT_EQ(s[2], 3.0f / 127);
  EXPECT_EQ(q[2 * cols + 5], -127);
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(W[r * cols + c]));
    EXPECT_FLOAT_EQ(s[r], amax / 127) << "row " << r;
    for (int64_t c = 0; c < cols; ++c) {
      EXPECT_LE(std::abs(int(q[r * cols + c])), 127);
      EXPECT_LE(std::fabs(q[r * cols + c] * s[r] - W[r * cols + c]), 0.5f * s[r] * (1 + 1e-5f) + 1e-12f)
          << "row " << r << " col " << c;
    }
  }
}

// fp8 (E4M3): per row absmax/448, so the row's largest weight is +-448 (exact but for the fp32 rounding of the
// scale), every weight within half a step of E4M3's grid (2^-4 of itself, or 2^-10 of the scale among the
// subnormals); an all-zero row stays zero; a non-finite weight is refused, naming the format.
TEST(Ops, QuantizeFp8RowsRoundTrip) {
  const int64_t rows = 9, cols = 37;
  // The outlier: its row's smaller weights (below 2^-6 of 448 scales) go subnormal.
  std::vector<float> W = quant_test_rows(24, rows, cols, -300.0f);
  std::vector<uint8_t> q(W.size());
  std::vector<float> s(rows);
  ops::quantize_rows(QFormat::Fp8, W.data(), rows, cols, q.data(), s.data());
  EXPECT_EQ(s[4], 0.0f);
  EXPECT_FLOAT_EQ(s[2], 300.0f / 448);
  EXPECT_EQ(q[2 * cols + 5], 0xfe);  // -448
  int subnormal = 0;
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(W[r * cols + c]));
    EXPECT_FLOAT_EQ(s[r], amax / 448) << "row " << r;
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t b = q[r * cols + c];
      const float w = W[r * cols + c], back = fp8_e4m3_to_f32(b) * s[r];
      EXPECT_NE(b & 0x7f, 0x7f) << "NaN code at row " << r << " col " << c;
      EXPECT_LE(std::fabs(back - w), (0x1p-4f * std::fabs(w) + 0x1p-10f * s[r]) * (1 + 1e-6f) + 1e-30f)
          << "row " << r << " col " << c;
      subnormal += (b & 0x78) == 0 && b != 0 && b != 0x80;
    }
  }
  EXPECT_GT(subnormal, 0) << "the outlier's row should reach E4M3's subnormals";
  W[7] = NAN;
  try {
    ops::quantize_rows(QFormat::Fp8, W.data(), rows, cols, q.data(), s.data());
    FAIL() << "a NaN weight was quantized";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
  }
}

// The fp8 linear against the fp32 linear on the dequantized weights (every finite code, random scales), in double:
// only the op's own arithmetic differs (the widening is exact).
TEST(Ops, LinearFp8MatchesDequantizedLinear) {
  std::mt19937 rng(25);
  std::uniform_int_distribution<int> cd(0, 255);
  std::uniform_real_distribution<float> sd(1e-4f, 2e-2f);
  struct Shape { int64_t N, in, out; };
  for (const Shape sh : {Shape{1, 7, 5}, Shape{5, 64, 300}, Shape{3, 1000, 131}, Shape{2, 70000, 3}}) {
    std::vector<Fp8E4M3> q(sh.out * sh.in);
    for (auto& v : q)
      do v.bits = uint8_t(cd(rng));
      while ((v.bits & 0x7f) == 0x7f);  // not NaN
    std::vector<float> s(sh.out);
    for (auto& v : s) v = sd(rng);
    s[0] = 0;  // a zero row
    V x = randn(sh.N * sh.in, rng), b = randn(sh.out, rng), W(q.size());
    for (int64_t o = 0; o < sh.out; ++o)
      for (int64_t i = 0; i < sh.in; ++i) W[o * sh.in + i] = double(widen(q[o * sh.in + i])) * double(s[o]);
    for (const bool bias : {false, true}) {
      V want(sh.N * sh.out), got(sh.N * sh.out, 12345.0);  // got: overwritten, not accumulated
      ops::linear_fwd(x.data(), W.data(), bias ? b.data() : nullptr, want.data(), sh.N, sh.in, sh.out);
      ops::linear_lowp_fwd(x.data(), q.data(), s.data(), bias ? b.data() : nullptr, got.data(), sh.N, sh.in, sh.out);
      EXPECT_LE(test::rel_max_diff(got, want), 1e-12)
          << "N " << sh.N << " in " << sh.in << " out " << sh.out << " bias " << bias;
    }
  }
}

// The int8 linear against the fp32 linear on the dequantized weights (q * scale), in double so that only the op's
// own arithmetic differs: shapes that take one tile, several, and a ragged last one (the tile holds 65536 / in rows).
TEST(Ops, LinearInt8MatchesDequantizedLinear) {
  std::mt19937 rng(22);
  std::uniform_int_distribution<int> qd(-127, 127);
  std::uniform_real_distribution<float> sd(1e-4f, 2e-2f);
  struct Shape { int64_t N, in, out; };
  for (const Shape sh : {Shape{1, 7, 5}, Shape{5, 64, 300}, Shape{3, 1000, 131}, Shape{2, 70000, 3}}) {
    std::vector<int8_t> q(sh.out * sh.in);
    for (auto& v : q) v = (int8_t)qd(rng);
    std::vector<float> s(sh.out);
    for (auto& v : s) v = sd(rng);
    s[0] = 0;  // a zero row
    V x = randn(sh.N * sh.in, rng), b = randn(sh.out, rng), W(q.size());
    for (int64_t o = 0; o < sh.out; ++o)
      for (int64_t i = 0; i < sh.in; ++i) W[o * sh.in + i] = double(q[o * sh.in + i]) * double(s[o]);
    for (const bool bias : {false, true}) {
      V want(sh.N * sh.out), got(sh.N * sh.out, 12345.0);  // got: overwritten, not accumulated
      ops::linear_fwd(x.data(), W.data(), bias ? b.data() : nullptr, want.data(), sh.N, sh.in, sh.out);
      ops::linear_lowp_fwd(x.data(), q.data(), s.data(), bias ? b.data() : nullptr, got.data(), sh.N, sh.in, sh.out);
      EXPECT_LE(test::rel_max_diff(got, want), 1e-12) << "N " << sh.N << " in " << sh.in << " out " << sh.out << " bias " << bias;
    }
  }
  // fp32: the same within float rounding of the sums.
  const int64_t N = 4, in = 96, out = 2000;
  std::vector<int8_t> q(out * in);
  for (auto& v : q) v = (int8_t)qd(rng);
  std::vector<float> s(out), x(N * in), W(out * in), want(N * out), got(N * out);
  for (auto& v : s) v = sd(rng);
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) W[o * in + i] = float(q[o * in + i]) * s[o];
  ops::linear_fwd(x.data(), W.data(), (const float*)nullptr, want.data(), N, in, out);
  ops::linear_lowp_fwd(x.data(), q.data(), s.data(), (const float*)nullptr, got.data(), N, in, out);
  EXPECT_LE(test::rel_max_diff(got, want), 1e-5);  // NaN or Inf: +inf
}

TEST(Ops, EmbeddingInt8IsTheDequantizedRow) {
  std::mt19937 rng(23);
  const int64_t Vn = 11, D = 6;
  std::vector<float> table(Vn * D), s(Vn);
  std::normal_distribution<float> nd;
  for (auto& v : table) v = nd(rng);
  std::vector<int8_t> q(table.size());
  ops::quantize_int8_rows(table.data(), Vn, D, q.data(), s.data());
  const std::vector<int64_t> ids{3, 0, 10, 3};
  std::vector<float> out(ids.size() * D);
  ops::embedding_lowp_fwd(ids.data(), q.data(), s.data(), out.data(), (int64_t)ids.size(), D, Vn);
  for (size_t i = 0; i < ids.size(); ++i)
    for (int64_t d = 0; d < D; ++d) EXPECT_EQ(out[i * D + d], float(q[ids[i] * D + d]) * s[ids[i]]);
  const int64_t bad = Vn;
  EXPECT_THROW(ops::embedding_lowp_fwd(&bad, q.data(), s.data(), out.data(), 1, D, Vn), Error);
}
