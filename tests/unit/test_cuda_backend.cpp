// The CUDA backend against the CPU reference. Runs on the GPU machine; skipped where no GPU is visible (a
// failure there under Q3VL_REQUIRE_GPU=1: make test-gpu).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "q3vl/core/error.hpp"
#include "q3vl/tensor/backend.hpp"
#include "../gpu.hpp"

using namespace q3vl;

namespace {
Tensor host_random(std::vector<int64_t> shape, unsigned seed) {
  Tensor t = Tensor::zeros(std::move(shape), DType::F32);
  std::mt19937 g(seed);
  std::normal_distribution<float> n;
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = n(g);
  return t;
}
}  // namespace

TEST(CudaBackend, MatchesCpuBackend) {
  Q3VL_NEED_GPU();
  auto cpu = make_backend("cpu");
  auto gpu = make_backend("cuda");
  auto up = [&](const Tensor& h) {
    Tensor d = gpu->alloc(h.shape(), h.dtype());
    gpu->copy(d, h);
    return d;
  };
  auto down = [&](const Tensor& d) {
    Tensor h = Tensor::zeros(d.shape(), d.dtype());
    gpu->copy(h, d);
    return h;
  };
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Tensor a = host_random(ta ? std::vector<int64_t>{37, 65} : std::vector<int64_t>{65, 37}, 1);
      Tensor b = host_random(tb ? std::vector<int64_t>{19, 37} : std::vector<int64_t>{37, 19}, 2);
      Tensor c = host_random({65, 19}, 3);
      Tensor dc = up(c);
      Tensor da = up(a), db = up(b);
      cpu->matmul(a, ta, b, tb, c, 0.5f, 1.5f);
      gpu->matmul(da, ta, db, tb, dc, 0.5f, 1.5f);
      Tensor r = down(dc);
      for (int64_t i = 0; i < r.numel(); ++i) ASSERT_NEAR(r.ptr<float>()[i], c.ptr<float>()[i], 1e-3) << ta << tb << i;
    }
  Tensor x = host_random({1000}, 4), y = host_random({1000}, 5), out = Tensor::zeros({1000}, DType::F32);
  Tensor dx = up(x), dy = up(y), dout = up(out);
  gpu->add(dx, dy, dout);
  cpu->add(x, y, out);
  Tensor r = down(dout);
  for (int i = 0; i < 1000; ++i) ASSERT_FLOAT_EQ(r.ptr<float>()[i], out.ptr<float>()[i]);
  gpu->axpy(0.25f, dx, dy);
  cpu->axpy(0.25f, x, y);
  r = down(dy);
  for (int i = 0; i < 1000; ++i) ASSERT_FLOAT_EQ(r.ptr<float>()[i], y.ptr<float>()[i]);
  EXPECT_NEAR(gpu->sum(dx), cpu->sum(x), 1e-6);
  EXPECT_NEAR(gpu->sum_squares(dx), cpu->sum_squares(x), 1e-6);
  EXPECT_EQ(gpu->max_abs(dx), cpu->max_abs(x));
  EXPECT_TRUE(gpu->all_finite(dx));
  // bf16 round trip matches the host conversion bit for bit.
  Tensor dh = gpu->alloc({1000}, DType::BF16), back = gpu->alloc({1000}, DType::F32);
  gpu->copy(dh, dx);
  gpu->copy(back, dh);
  r = down(back);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(r.ptr<float>()[i], bf16_to_f32(f32_to_bf16(x.ptr<float>()[i])));
}
