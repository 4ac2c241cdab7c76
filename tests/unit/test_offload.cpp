// Optimizer offload's host parts (issue 29): the CPU op layer's AdamW, four lanes at a time, gives the scalar
// formula's bits for every length and tail, and its parameter copy is convert's of the updated masters; the thread
// pool covers a range exactly once, whatever its thread count, and passes a worker's exception on; the host buffers
// the device pins are zeroed.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "q3vl/core/thread_pool.hpp"
#include "q3vl/tensor/dev.hpp"
#include "q3vl/tensor/dev_host.hpp"

using namespace q3vl;

namespace {

// The scalar loop as dev::adamw's CPU side wrote it before it was vectorised (PyTorch's AdamW in fp32).
void adamw_scalar(float* p, const float* g, float* m, float* v, int64_t n, double beta1, double beta2, double eps,
                  double lr, double wd, double gscale, int64_t t) {
  const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
  const float b1 = float(beta1), b2 = float(beta2), gs = float(gscale);
  const float step = float(lr / bc1), sqrt_bc2 = float(std::sqrt(bc2)), e = float(eps);
  const float decay = float(1.0 - lr * wd);
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * gs;
    m[i] = b1 * m[i] + (1.f - b1) * gi;
    v[i] = b2 * v[i] + (1.f - b2) * gi * gi;
    p[i] = p[i] * decay - step * m[i] / (std::sqrt(v[i]) / sqrt_bc2 + e);
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

}  // namespace

TEST(Offload, AdamWLanesAreTheScalarBits) {
  std::mt19937 rng(29);
  std::normal_distribution<float> d(0.f, 1.f);
  const dev::Exec cpu{};
  for (int64_t n : {1, 3, 4, 5, 7, 8, 17, 64, 1001}) {
    const size_t N = static_cast<size_t>(n);
    std::vector<float> p(N), g(N), m(N), v(N);
    for (int64_t i = 0; i < n; ++i) {
      p[size_t(i)] = d(rng), g[size_t(i)] = d(rng) * (i % 5 == 0 ? 1e-6f : 1.f), m[size_t(i)] = 0.1f * d(rng);
      v[size_t(i)] = std::abs(0.01f * d(rng)) * (i % 7 == 0 ? 0.f : 1.f);  // some zero second moments
    }
    auto P = p, M = m, V = v;
    for (int64_t t : {1, 2, 9})
      for (double wd : {0.0, 0.1}) {
        dev::adamw(cpu, p.data(), g.data(), m.data(), v.data(), n, 0.9, 0.95, 1e-8, 3e-4, wd, 0.7, t);
        adamw_scalar(P.data(), g.data(), M.data(), V.data(), n, 0.9, 0.95, 1e-8, 3e-4, wd, 0.7, t);
        ASSERT_TRUE(same_bits(p, P) && same_bits(m, M) && same_bits(v, V)) << "n " << n << " t " << t << " wd " << wd;
      }
  }
}

// The copy written in the same pass (what the trainer's gathers read) is, bit for bit, AdamW and then convert; the
// masters and moments are the update without a copy. Values past fp16's range, and a NaN, round as convert rounds them.
TEST(Offload, AdamWCopyIsTheConvertedUpdate) {
  std::mt19937 rng(31);
  std::normal_distribution<float> d(0.f, 1.f);
  const dev::Exec cpu{};
  for (DType ct : {DType::BF16, DType::F16, DType::F32})
    for (int64_t n : {1, 5, 8, 1001}) {
      const size_t N = static_cast<size_t>(n);
      std::vector<float> p(N), g(N), m(N), v(N);
      for (size_t i = 0; i < N; ++i)
        p[i] = d(rng) * (i % 3 ? 1.f : 7e4f), g[i] = d(rng), m[i] = 0.1f * d(rng), v[i] = std::abs(0.01f * d(rng));
      p[N / 2] = NAN;
      auto P = p, M = m, V = v;
      const size_t bytes = N * dtype_size(ct);
      std::vector<char> fused(bytes), want(bytes);
      dev::adamw(cpu, p.data(), g.data(), m.data(), v.data(), n, 0.9, 0.95, 1e-8, 3e-4, 0.1, 0.7, 3, fused.data(), ct);
      dev::adamw(cpu, P.data(), g.data(), M.data(), V.data(), n, 0.9, 0.95, 1e-8, 3e-4, 0.1, 0.7, 3);
      dev::convert(cpu, want.data(), ct, P.data(), DType::F32, n);
      EXPECT_TRUE(same_bits(p, P) && same_bits(m, M) && same_bits(v, V)) << dtype_name(ct) << " n " << n;
      EXPECT_EQ(std::memcmp(fused.data(), want.data(), bytes), 0) << dtype_name(ct) << " n " << n;
    }
}

TEST(Offload, ThreadPoolCoversEachElementOnce) {
  for (int threads : {1, 2, 3, 5})
    for (int64_t n : {0, 1, 63, 64, 65, 1000, 4097}) {
      ThreadPool pool(threads);
      ASSERT_EQ(pool.size(), threads);
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      for (int rep = 0; rep < 3; ++rep)  // the same workers, run after run
        pool.run(n, [&](int64_t lo, int64_t hi) {
          ASSERT_TRUE(lo % 64 == 0 && lo < hi && hi <= n);
          for (int64_t i = lo; i < hi; ++i) ++hits[size_t(i)];
        });
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[size_t(i)].load(), 3) << threads << " threads, n " << n << ", i " << i;
    }
}

TEST(Offload, ThreadPoolPassesAnExceptionOn) {
  ThreadPool pool(3);
  EXPECT_THROW(pool.run(1000, [](int64_t lo, int64_t) {
    if (lo > 0) throw std::runtime_error("worker");
  }), std::runtime_error);
  int64_t sum = 0;  // and it still runs afterwards
  std::atomic<int64_t> s{0};
  pool.run(1000, [&](int64_t lo, int64_t hi) { s += hi - lo; });
  sum = s;
  EXPECT_EQ(sum, 1000);
  EXPECT_GE(rank_cores(1), 1);
}

TEST(Offload, HostBuffersAreZeroedAndAligned) {
  const dev::Exec cpu{};
  for (size_t bytes : {size_t(0), size_t(3), size_t(4096 + 4)}) {
    auto* p = static_cast<unsigned char*>(dev::host_alloc(cpu, bytes));
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(p[i], 0);
    dev::host_register(cpu, p, bytes);  // the CPU backend pins nothing
    dev::host_unregister(cpu, p);
    dev::host_release(cpu, p);
  }
}
