// Timing and checks shared by the GPU micro-benchmarks (tools/gpu/*_bench.cu): the median of per-call CUDA event
// intervals, the calls queued behind a spinning kernel so that the host's launch time never shows between the
// events; the max relative difference of two device arrays, infinite where either holds a NaN or an infinity.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"

namespace q3vl::gpu_bench {

constexpr double kSpinMs = 30;  // head start of the host over the GPU before each timed batch

__global__ void k_spin(double ms) {
  const unsigned long long t0 = dev::cuda::global_ns();
  while (double(dev::cuda::global_ns() - t0) < ms * 1e6) {}
}

// us: the median microseconds of a call; host_bound: the GPU finished the spin before the host had queued every
// call, so some intervals may include launch gaps (raise kSpinMs or lower reps).
struct Timing { double us = NAN; bool host_bound = false; };

// Times f(i), i = 0 .. reps-1 (the callee may rotate buffers by i), after `warmup` untimed calls f(0 .. warmup-1).
template <class F> Timing time_median(cudaStream_t st, int reps, int warmup, F&& f) {
  for (int i = 0; i < warmup; ++i) f(i);
  Q3VL_CU(cudaStreamSynchronize(st));
  std::vector<cudaEvent_t> ev(size_t(reps) + 1);
  for (auto& e : ev) Q3VL_CU(cudaEventCreate(&e));
  k_spin<<<1, 1, 0, st>>>(kSpinMs);
  Q3VL_LAUNCHED();
  for (int i = 0; i < reps; ++i) {
    Q3VL_CU(cudaEventRecord(ev[size_t(i)], st));
    f(i);
  }
  Q3VL_CU(cudaEventRecord(ev[size_t(reps)], st));
  Timing t;
  t.host_bound = cudaEventQuery(ev[0]) != cudaErrorNotReady;  // the GPU was already past the spin
  Q3VL_CU(cudaEventSynchronize(ev[size_t(reps)]));
  std::vector<double> us(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    Q3VL_CU(cudaEventElapsedTime(&ms, ev[size_t(i)], ev[size_t(i) + 1]));
    us[size_t(i)] = 1e3 * ms;
  }
  for (auto& e : ev) Q3VL_CU(cudaEventDestroy(e));
  std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
  t.us = us[size_t(reps / 2)];
  return t;
}

inline double to_double(__nv_bfloat16 v) { return double(__bfloat162float(v)); }
inline double to_double(float v) { return double(v); }

// max|a - scale b| / max|scale b| over n elements of T (bf16 or float) on the device; +inf if a or b holds a
// non-finite value, so that a NaN fails every bound.
template <class T>
double rel_diff(const dev::Exec& x, const void* a, const void* b, int64_t n, double scale = 1.0) {
  std::vector<T> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  dev::cuda::to_host(x, ha.data(), a, size_t(n) * sizeof(T));
  dev::cuda::to_host(x, hb.data(), b, size_t(n) * sizeof(T));
  double num = 0, den = 0;
  for (size_t i = 0; i < size_t(n); ++i) {
    const double va = to_double(ha[i]), vb = scale * to_double(hb[i]);
    if (!std::isfinite(va) || !std::isfinite(vb)) return INFINITY;
    num = std::max(num, std::fabs(va - vb));
    den = std::max(den, std::fabs(vb));
  }
  return den > 0 ? num / den : num;
}

}  // namespace q3vl::gpu_bench
