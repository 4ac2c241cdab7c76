#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "q3vl/core/dtype.hpp"
#include "q3vl/core/error.hpp"
#include "q3vl/tensor/backend.hpp"

using namespace q3vl;

namespace {
Tensor random_tensor(Backend& be, std::vector<int64_t> shape, unsigned seed) {
  Tensor t = be.alloc(std::move(shape), DType::F32);
  std::mt19937 g(seed);
  std::normal_distribution<float> n;
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = n(g);
  return t;
}
}  // namespace

TEST(Tensor, ViewsShareStorage) {
  Tensor t = Tensor::zeros({4, 3}, DType::F32);
  Tensor rows = t.slice(1, 3);
  EXPECT_EQ(rows.shape(), (std::vector<int64_t>{2, 3}));
  rows.ptr<float>()[0] = 5.f;
  EXPECT_EQ(t.ptr<float>()[3], 5.f);
  Tensor v = t.view({-1});
  EXPECT_EQ(v.numel(), 12);
  Tensor w = t.flat(5, 4);
  w.ptr<float>()[0] = 7.f;
  EXPECT_EQ(t.ptr<float>()[5], 7.f);
  EXPECT_THROW(t.view({5, 3}), Error);
  EXPECT_THROW(t.slice(2, 5), Error);
  EXPECT_THROW(t.ptr<int64_t>(), Error);
  EXPECT_EQ(t.describe(), "fp32[4,3] cpu");
}

TEST(Tensor, Bf16AndF16Conversions) {
  // bf16: round to nearest even on the 16 dropped bits.
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  float halfway = bf16_to_f32(0x3f80) + std::ldexp(1.0f, -8);  // exactly between 0x3f80 and 0x3f81
  EXPECT_EQ(f32_to_bf16(halfway), 0x3f80);                       // ties to even
  EXPECT_EQ(f32_to_bf16(std::nextafter(halfway, 2.f)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  // fp16 round trips every finite half value.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf/nan
    EXPECT_EQ(f32_to_f16(f16_to_f32(uint16_t(h))), h) << h;
  }
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);
}

TEST(CpuBackend, MatmulAgainstNaiveLoops) {
  auto be = make_backend("cpu");
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      const int m = 5, k = 7, n = 3;
      Tensor a = random_tensor(*be, ta ? std::vector<int64_t>{k, m} : std::vector<int64_t>{m, k}, 1);
      Tensor b = random_tensor(*be, tb ? std::vector<int64_t>{n, k} : std::vector<int64_t>{k, n}, 2);
      Tensor c = random_tensor(*be, {m, n}, 3);
      Tensor c0 = be->alloc({m, n}, DType::F32);
      be->copy(c0, c);
      be->matmul(a, ta, b, tb, c, 0.5f, 2.0f);
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          double acc = 0;
          for (int p = 0; p < k; ++p) {
            float av = ta ? a.ptr<float>()[p * m + i] : a.ptr<float>()[i * k + p];
            float bv = tb ? b.ptr<float>()[j * k + p] : b.ptr<float>()[p * n + j];
            acc += double(av) * bv;
          }
          double want = 0.5 * acc + 2.0 * c0.ptr<float>()[i * n + j];
          EXPECT_NEAR(c.ptr<float>()[i * n + j], want, 1e-5) << ta << tb << i << j;
        }
    }
  Tensor a = be->alloc({2, 3}, DType::F32), b = be->alloc({4, 2}, DType::F32), c = be->alloc({2, 2}, DType::F32);
  EXPECT_THROW(be->matmul(a, false, b, false, c), Error);
}

TEST(CpuBackend, ElementwiseAndReductions) {
  auto be = make_backend("cpu");
  Tensor a = random_tensor(*be, {17}, 4), b = random_tensor(*be, {17}, 5), out = be->alloc({17}, DType::F32);
  be->add(a, b, out);
  for (int i = 0; i < 17; ++i) EXPECT_FLOAT_EQ(out.ptr<float>()[i], a.ptr<float>()[i] + b.ptr<float>()[i]);
  be->mul(a, b, out);
  for (int i = 0; i < 17; ++i) EXPECT_FLOAT_EQ(out.ptr<float>()[i], a.ptr<float>()[i] * b.ptr<float>()[i]);
  be->copy(out, a);
  be->axpy(-2.f, b, out);
  for (int i = 0; i < 17; ++i) EXPECT_FLOAT_EQ(out.ptr<float>()[i], a.ptr<float>()[i] - 2.f * b.ptr<float>()[i]);
  be->scale(out, 0.f);
  EXPECT_EQ(be->max_abs(out), 0.0);
  double s = 0, ss = 0, mx = 0;
  for (int i = 0; i < 17; ++i) {
    float v = a.ptr<float>()[i];
    s += v, ss += double(v) * v, mx = std::max(mx, std::fabs(double(v)));
  }
  EXPECT_NEAR(be->sum(a), s, 1e-9);
  EXPECT_NEAR(be->sum_squares(a), ss, 1e-9);
  EXPECT_EQ(be->max_abs(a), mx);
  EXPECT_TRUE(be->all_finite(a));
  a.ptr<float>()[3] = INFINITY;
  EXPECT_FALSE(be->all_finite(a));
  be->fill(out, 2.5);
  EXPECT_EQ(be->sum(out), 2.5 * 17);
}

TEST(CpuBackend, CopyConvertsDtypes) {
  auto be = make_backend("cpu");
  Tensor a = random_tensor(*be, {33}, 6);
  Tensor h = be->alloc({33}, DType::BF16), back = be->alloc({33}, DType::F32);
  be->copy(h, a);
  be->copy(back, h);
  for (int i = 0; i < 33; ++i) {
    float v = a.ptr<float>()[i];
    EXPECT_EQ(back.ptr<float>()[i], bf16_to_f32(f32_to_bf16(v)));
    EXPECT_NEAR(back.ptr<float>()[i], v, std::fabs(v) * (1.0 / 256));
  }
  EXPECT_THROW(make_backend("tpu"), Error);
}
