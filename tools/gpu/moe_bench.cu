// Micro-benchmark of the grouped expert GEMM (src/tensor/cuda/moe.cu, issue 30): the mma.sync kernel against the old
// WMMA kernel (Q3VL_GROUPED=old) and a dense cuBLASLt GEMM of the same FLOPs (dev::linear_fwd, R x n_in -> n_out), at
// the 30B-A3B training shape: 4096 tokens, top-8 of 128 experts (R = 32768 rows), hidden 2048, expert intermediate
// 768; gate_up [R x 2048] -> 1536 and down [R x 768] -> 2048, each in the three modes (FWD y = xg W^T; DX dxg = dy W,
// written; DW dW += dy^T xg, fp32).
// Build and run (from the repo root, on a GPU machine):
//   make bin/moe_bench && bin/moe_bench [reps]          (reps per timing, default 20)
// Routing: each token picks 8 distinct experts with probability ~ 1 / (e + 4) (skewed: the busiest expert gets about
// 6x the rows of the idlest), so buckets are uneven, as after a real router. Checks: new against old, max|new - old|
// / max|old| per mode (bf16 outputs: bound 2e-2; DW fp32 from zero: 1e-3); exit 1 on a failure. Prints a table:
// median microseconds, TFLOP/s (2 R n_in n_out / time), new/dense time ratio (issue 30's goal: <= 1.5) and old/new.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

constexpr int64_t kTokens = 4096, kE = 128, kTop = 8, kH = 2048, kIm = 768;

__global__ void k_fill(bf16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t z = uint64_t(i) * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 31)) * 0x94D049BB133111EBull;
    p[i] = __float2bfloat16_rn(scale * (float((z >> 40) % 2001u) / 1000.f - 1.f));
  }
}

// start[E + 1] of a skewed top-8 routing of kTokens tokens (rows sorted by expert, as moe_plan leaves them).
std::vector<int32_t> routing() {
  std::mt19937_64 rng(7);
  std::vector<double> w(kE);
  for (int64_t e = 0; e < kE; ++e) w[size_t(e)] = 1.0 / double(e + 4);
  std::shuffle(w.begin(), w.end(), rng);
  std::vector<int32_t> cnt(kE, 0);
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> left = w;
    for (int64_t j = 0; j < kTop; ++j) {
      std::discrete_distribution<int> pick(left.begin(), left.end());
      const int e = pick(rng);
      ++cnt[size_t(e)];
      left[size_t(e)] = 0;
    }
  }
  std::vector<int32_t> start(kE + 1, 0);
  for (int64_t e = 0; e < kE; ++e) start[size_t(e + 1)] = start[size_t(e)] + cnt[size_t(e)];
  return start;
}

// Median microseconds of f() over reps, after 3 warm-up calls.
template <class F> double time_us(cudaStream_t st, int reps, F&& f) {
  for (int i = 0; i < 3; ++i) f();
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) Q3VL_CU(cudaEventCreate(&e));
  for (int i = 0; i < reps; ++i) {
    Q3VL_CU(cudaEventRecord(ev[i], st));
    f();
  }
  Q3VL_CU(cudaEventRecord(ev[reps], st));
  Q3VL_CU(cudaEventSynchronize(ev[reps]));
  std::vector<double> us(reps);
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    Q3VL_CU(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    us[i] = 1e3 * ms;
  }
  for (auto& e : ev) Q3VL_CU(cudaEventDestroy(e));
  std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
  return us[size_t(reps / 2)];
}

float to_f(bf16 v) { return __bfloat162float(v); }
float to_f(float v) { return v; }

// max|a - b| / max|b| over n elements of T (bf16 or float) on the device.
template <class T> double rel_diff(const dev::Exec& x, const void* a, const void* b, int64_t n) {
  std::vector<T> ha(static_cast<size_t>(n)), hb(static_cast<size_t>(n));
  dev::to_host(x, ha.data(), a, size_t(n) * sizeof(T));
  dev::to_host(x, hb.data(), b, size_t(n) * sizeof(T));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double va = to_f(ha[size_t(i)]), vb = to_f(hb[size_t(i)]);
    num = std::max(num, std::fabs(va - vb));
    den = std::max(den, std::fabs(vb));
  }
  return den > 0 ? num / den : num;
}

void set_old(bool old) {
  if (old) setenv("Q3VL_GROUPED", "old", 1);
  else unsetenv("Q3VL_GROUPED");
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(5, argc > 1 ? std::atoi(argv[1]) : 20);
  bool bad = false;
  try {
    dev::Exec x = dev::make_exec(Device::CUDA);
    cudaStream_t st = dev::cuda::stream_of(x);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    const std::vector<int32_t> hstart = routing();
    const int64_t R = hstart[kE];
    int32_t lo = int32_t(R), hi = 0;
    for (int64_t e = 0; e < kE; ++e) {
      lo = std::min(lo, hstart[size_t(e + 1)] - hstart[size_t(e)]);
      hi = std::max(hi, hstart[size_t(e + 1)] - hstart[size_t(e)]);
    }
    std::printf("# moe_bench on %s: R = %lld rows (%lld tokens, top-%lld of %lld experts; %d..%d rows an expert), "
                "median of %d reps\n\n", prop.name, (long long)R, (long long)kTokens, (long long)kTop, (long long)kE,
                lo, hi, reps);
    int32_t* start = nullptr;
    Q3VL_CU(cudaMalloc(&start, sizeof(int32_t) * (kE + 1)));
    dev::to_device(x, start, hstart.data(), sizeof(int32_t) * (kE + 1));
    std::printf("| proj | mode | old us | new us | dense us | old TF/s | new TF/s | dense TF/s | new/dense | old/new "
                "| max rel new-old |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    struct Proj { const char* name; int64_t n_in, n_out; };
    for (const Proj& p : {Proj{"gate_up", kH, 2 * kIm}, Proj{"down", kIm, kH}}) {
      bf16 *in, *W, *out, *dy, *dx[2], *y[2], *dense_out;
      float* dW[2];
      const int64_t ni = p.n_in, no = p.n_out;
      Q3VL_CU(cudaMalloc(&in, sizeof(bf16) * R * ni));
      Q3VL_CU(cudaMalloc(&W, sizeof(bf16) * kE * no * ni));
      Q3VL_CU(cudaMalloc(&out, sizeof(bf16) * R * no));
      Q3VL_CU(cudaMalloc(&dy, sizeof(bf16) * R * no));
      Q3VL_CU(cudaMalloc(&dense_out, sizeof(bf16) * R * no));
      for (int v = 0; v < 2; ++v) {
        Q3VL_CU(cudaMalloc(&dx[v], sizeof(bf16) * R * ni));
        Q3VL_CU(cudaMalloc(&y[v], sizeof(bf16) * R * no));
        Q3VL_CU(cudaMalloc(&dW[v], sizeof(float) * kE * no * ni));
      }
      k_fill<<<1024, 256, 0, st>>>(in, R * ni, 1u, 1.f);
      k_fill<<<1024, 256, 0, st>>>(W, kE * no * ni, 2u, 0.05f);
      k_fill<<<1024, 256, 0, st>>>(dy, R * no, 3u, 1.f);
      Q3VL_LAUNCHED();
      // One call of each mode with variant v (0 old, 1 new) into its own outputs.
      auto fwd = [&](int v) { dev::grouped_linear_fwd(x, in, W, start, y[v], R, kE, ni, no, DType::BF16); };
      auto dxf = [&](int v) {
        dev::grouped_linear_bwd(x, dy, in, W, start, dx[v], nullptr, R, kE, ni, no, false, DType::BF16);
      };
      auto dwf = [&](int v) {
        dev::grouped_linear_bwd(x, dy, in, W, start, nullptr, dW[v], R, kE, ni, no, true, DType::BF16);
      };
      // Correctness: every mode once per variant, dW from zero.
      for (int v = 0; v < 2; ++v) {
        set_old(v == 0);
        Q3VL_CU(cudaMemsetAsync(dW[v], 0, sizeof(float) * kE * no * ni, st));
        fwd(v), dxf(v), dwf(v);
      }
      Q3VL_CU(cudaStreamSynchronize(st));
      const double diff[3] = {rel_diff<bf16>(x, y[1], y[0], R * no), rel_diff<bf16>(x, dx[1], dx[0], R * ni),
                              rel_diff<float>(x, dW[1], dW[0], kE * no * ni)};
      const double bound[3] = {2e-2, 2e-2, 1e-3};
      const double dense = time_us(st, reps, [&] {
        dev::linear_fwd(x, in, W, nullptr, dense_out, R, ni, no, DType::BF16);
      });
      const double flops = 2.0 * double(R) * double(ni) * double(no);
      const char* names[3] = {"FWD", "DX", "DW"};
      for (int m = 0; m < 3; ++m) {
        double us[2];
        for (int v = 0; v < 2; ++v) {
          set_old(v == 0);
          us[v] = time_us(st, reps, [&] { m == 0 ? fwd(v) : m == 1 ? dxf(v) : dwf(v); });
        }
        const bool ok = diff[m] <= bound[m] && std::isfinite(diff[m]);
        bad |= !ok;
        std::printf("| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.1e%s |\n", p.name, names[m],
                    us[0], us[1], dense, flops / us[0] * 1e-6, flops / us[1] * 1e-6, flops / dense * 1e-6,
                    us[1] / dense, us[0] / us[1], diff[m], ok ? "" : " FAIL");
      }
      set_old(false);
      for (void* q : {(void*)in, (void*)W, (void*)out, (void*)dy, (void*)dense_out, (void*)dx[0], (void*)dx[1],
                      (void*)y[0], (void*)y[1], (void*)dW[0], (void*)dW[1]})
        Q3VL_CU(cudaFree(q));
    }
    Q3VL_CU(cudaFree(start));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 2;
  }
  if (bad) std::fprintf(stderr, "moe_bench: the new kernel differs from the old beyond the bound (rows marked FAIL)\n");
  return bad ? 1 : 0;
}
