// Micro-benchmark: the weight-streaming GEMV (src/tensor/cuda/gemv.cuh), new and old (tools/gpu/gemv_old.cuh, the
// version before the persistent, deeper-pipelined one), against cuBLASLt (dev::linear_fwd) on the decode-sized
// linears of Qwen3-VL, y[N, n_out] = x[N, n_in] W^T, N = 1..32, bf16 activations.
// Build and run (from the repo root, on a GPU machine):
//   make bin/gemv_bench && bin/gemv_bench [reps]        (reps per timing, default 100, at least 50)
// For each shape and N it times (a) dev::linear_fwd bf16 (cuBLASLt), (b) the GEMV on bf16 W, old and new (N <= 16,
// kMaxN), (c) int8 and (d) fp8 E4M3 weights: the old GEMV (N <= 16) and dev::linear_q8_fwd (the new GEMV for
// N <= 16, dequant + GEMM above), and prints a markdown table: microseconds (median), weight bandwidth (bytes of W and
// scales / time, TB/s, and % of the H200's 4.8 TB/s), and the max relative difference of every path from (a)
// (max|y - y_a| / max|y_a|; over 1e-2 is flagged FAIL, exit 1). Then the weights-only time of one 8B decode token
// (36 layers of q, k, v, o, gate_up, down, and lm_head) per path at N = 1, and the largest N at which the new bf16
// GEMV beats cuBLASLt on every shape (the threshold for routing dev::linear_fwd's small N to the GEMV; not done yet).
// Method: every rep reads a different copy of W (the copies together are >= 4 and >= 256 MB, past the 50 MB L2),
// so no timed W is cache-resident; x (<= 32 rows) may stay in L2, as in a real decode step. The reps are queued
// behind a spinning kernel so that the host's launch time never shows between the per-rep CUDA events; a time
// marked "h" means the spin ended before everything was queued (host-bound: raise kSpinMs).
// The int8 weights have at most 4 significant bits (exact in E4M3: the fp8 weights are the same values) and the
// scales are powers of two, so the bf16 W (q * scale) is exact and every path computes the same product.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv.cuh"
#include "gemv_old.cuh"  // the old GEMV (namespace wgemv_old), for the A/B

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

constexpr double kSpinMs = 30;                    // head start of the host over the GPU before each timed batch
constexpr size_t kMinPoolBytes = size_t(256) << 20;  // the W copies together (bf16), >> the 50 MB L2
constexpr int kMaxRows = 32;

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}
// q: random int8 in [-120, 120] with at most 4 significant bits (so exact in E4M3: f8 = q); scale[o] = 2^-(6 + o % 4);
// w = q * scale[row] exactly in bf16. n elements, rows of n_in.
__global__ void k_init_weights(int8_t* q, __nv_fp8_e4m3* f8, float* scale, bf16* w, int64_t n, int64_t n_in,
                               int64_t n_out, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n_in;  // row of the pool (copies stacked): o = row % n_out
    const float s = ldexpf(1.f, -(6 + int(row % n_out % 4)));
    const uint32_t h = hash(i, seed);
    int m = int(h % 128u);                                   // |q| < 128, then its top 4 significant bits
    const int top = m ? 31 - __clz(m) : 0;
    if (top > 3) m &= ~((1 << (top - 3)) - 1);
    const int8_t v = int8_t((h >> 16) & 1 ? -m : m);
    q[i] = v;
    f8[i] = __nv_fp8_e4m3(float(v));
    w[i] = __float2bfloat16_rn(float(v) * s);
    if (i % n_in == 0) scale[row] = s;
  }
}
__global__ void k_init_x(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(float(hash(i, seed) % 2001u) / 1000.f - 1.f);
}
__global__ void k_spin(double ms) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (double(t - t0) < ms * 1e6);
}

struct Shape { const char* name; int64_t n_in, n_out; };
struct Timing { double us = NAN; bool host_bound = false; };

// Median time of one call of f(copy), copy rotating over nbuf weight copies; warm-up first.
template <class F> Timing time_it(const dev::Exec& x, int reps, int nbuf, F&& f) {
  cudaStream_t st = dev::cuda::stream_of(x);
  for (int i = 0; i < std::max(nbuf, 5); ++i) f(i % nbuf);
  Q3VL_CU(cudaStreamSynchronize(st));
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) Q3VL_CU(cudaEventCreate(&e));
  k_spin<<<1, 1, 0, st>>>(kSpinMs);
  Q3VL_LAUNCHED();
  for (int i = 0; i < reps; ++i) {
    Q3VL_CU(cudaEventRecord(ev[i], st));
    f(i % nbuf);
  }
  Q3VL_CU(cudaEventRecord(ev[reps], st));
  Timing t;
  t.host_bound = cudaEventQuery(ev[0]) != cudaErrorNotReady;  // the GPU was already past the spin
  Q3VL_CU(cudaEventSynchronize(ev[reps]));
  std::vector<double> us(reps);
  for (int i = 0; i < reps; ++i) {
    float ms = 0;
    Q3VL_CU(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
    us[i] = 1e3 * ms;
  }
  for (auto& e : ev) Q3VL_CU(cudaEventDestroy(e));
  std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
  t.us = us[reps / 2];
  return t;
}

// max|y - ref| / max|ref| over N rows.
double rel_diff(const dev::Exec& x, const bf16* y, const bf16* ref, int64_t n) {
  std::vector<bf16> a(n), b(n);
  dev::to_host(x, a.data(), y, n * sizeof(bf16));
  dev::to_host(x, b.data(), ref, n * sizeof(bf16));
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = __bfloat162float(b[i]), v = __bfloat162float(a[i]);
    num = std::max(num, std::fabs(v - r));
    den = std::max(den, std::fabs(r));
  }
  return den > 0 ? num / den : num;
}

std::string fmt(double v, const char* f) {
  if (std::isnan(v)) return "-";
  char s[32];
  std::snprintf(s, sizeof s, f, v);
  return s;
}

// The paths timed, in table order.
enum Path { kBlas, kBf16Old, kBf16, kI8Old, kI8, kF8Old, kF8, kPaths };
const char* const kPathName[kPaths] = {"cuBLASLt", "bf16 old", "bf16 new", "int8 old", "int8 new", "fp8 old", "fp8 new"};
constexpr double kHbmTBs = 4.8;  // H200

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(50, argc > 1 ? std::atoi(argv[1]) : 100);
  struct Layer { Shape s; int per_token; };  // per_token: uses in one 8B decode token (36 layers; lm_head once)
  const Layer shapes[] = {
      {{"8B q/o_proj", 4096, 4096}, 72},     {{"8B k/v_proj", 4096, 1024}, 72},    {{"8B gate_up", 4096, 24576}, 36},
      {{"8B down", 12288, 4096}, 36},        {{"8B lm_head", 4096, 151936}, 1},    {{"30B-A3B q_proj", 2048, 4096}, 0},
      {{"30B-A3B k/v_proj", 2048, 512}, 0}, {{"30B-A3B o_proj", 4096, 2048}, 0},
  };
  const int Ns[] = {1, 2, 4, 8, 16, 32};
  constexpr int kNs = 6;
  constexpr int kMaxGemvN = dev::cuda::wgemv::kMaxN;
  bool bad = false;
  double token_us[kPaths] = {};           // 8B decode token at N = 1, weights only
  bool bf16_wins[kNs];                    // the new bf16 GEMV beat cuBLASLt on every shape at Ns[i]
  std::fill(bf16_wins, bf16_wins + kNs, true);
  try {
    dev::Exec x = dev::make_exec(Device::CUDA);
    cudaStream_t st = dev::cuda::stream_of(x);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    std::printf("# gemv_bench on %s (%d SMs, L2 %d MB), median of %d reps, bf16 activations; us (TB/s, %% of %.1f)\n\n",
                prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, reps, kHbmTBs);
    std::printf("| shape | n_in->n_out | N |");
    for (const char* name : kPathName) std::printf(" %s |", name);
    std::printf(" new/old bf16 | new/old int8 | new/old fp8 | bf16 new/cuBLASLt | max rel diff |\n|---|---|---|");
    for (int p = 0; p < kPaths + 5; ++p) std::printf("---|");
    std::printf("\n");
    for (const Layer& L : shapes) {
      const Shape& s = L.s;
      const int64_t nw = s.n_in * s.n_out;
      const size_t wbytes = size_t(nw) * sizeof(bf16), qbytes = size_t(nw) + size_t(s.n_out) * sizeof(float);
      const int nbuf = int(std::max<size_t>(4, (kMinPoolBytes + wbytes - 1) / wbytes));
      bf16 *W, *in, *y[kPaths];
      int8_t* Q;
      __nv_fp8_e4m3* F;
      float* scale;
      Q3VL_CU(cudaMalloc(&W, wbytes * nbuf));
      Q3VL_CU(cudaMalloc(&Q, size_t(nw) * nbuf));
      Q3VL_CU(cudaMalloc(&F, size_t(nw) * nbuf));
      Q3VL_CU(cudaMalloc(&scale, sizeof(float) * s.n_out * nbuf));
      Q3VL_CU(cudaMalloc(&in, sizeof(bf16) * kMaxRows * s.n_in));
      for (bf16*& yp : y) Q3VL_CU(cudaMalloc(&yp, sizeof(bf16) * kMaxRows * s.n_out));
      k_init_weights<<<4096, 256, 0, st>>>(Q, F, scale, W, nw * nbuf, s.n_in, s.n_out, 1234u);
      Q3VL_LAUNCHED();
      k_init_x<<<256, 256, 0, st>>>(in, kMaxRows * s.n_in, 99u);
      Q3VL_LAUNCHED();
      for (int ni = 0; ni < kNs; ++ni) {
        const int N = Ns[ni];
        const bool gemv = N <= kMaxGemvN;
        namespace nw_ = dev::cuda::wgemv;
        namespace old = dev::cuda::wgemv_old;
        // Path p on weight copy k; false: not run at this N (the old GEMV and bf16 GEMV stop at kMaxN).
        auto run = [&](int p, int k) {
          const int64_t o = int64_t(k) * nw;
          const float* sc = scale + int64_t(k) * s.n_out;
          switch (p) {
            case kBlas: dev::linear_fwd(x, in, W + o, nullptr, y[p], N, s.n_in, s.n_out, DType::BF16); break;
            case kBf16Old: old::gemv<bf16, bf16>(x, in, W + o, nullptr, nullptr, y[p], N, s.n_in, s.n_out); break;
            case kBf16: nw_::gemv<bf16, bf16>(x, in, W + o, nullptr, nullptr, y[p], N, s.n_in, s.n_out); break;
            case kI8Old: old::gemv<bf16, int8_t>(x, in, Q + o, sc, nullptr, y[p], N, s.n_in, s.n_out); break;
            case kI8:
              dev::linear_q8_fwd(x, in, Q + o, sc, nullptr, y[p], N, s.n_in, s.n_out, QFormat::Int8, DType::BF16);
              break;
            case kF8Old: old::gemv<bf16, __nv_fp8_e4m3>(x, in, F + o, sc, nullptr, y[p], N, s.n_in, s.n_out); break;
            case kF8:
              dev::linear_q8_fwd(x, in, F + o, sc, nullptr, y[p], N, s.n_in, s.n_out, QFormat::Fp8, DType::BF16);
              break;
          }
        };
        auto runs = [&](int p) { return gemv || p == kBlas || p == kI8 || p == kF8; };
        // Correctness on copy 0: every path computes the same product (W is q * scale exactly).
        const int64_t ny = int64_t(N) * s.n_out;
        double diff = 0;
        for (int p = 0; p < kPaths; ++p)
          if (runs(p)) run(p, 0);
        for (int p = 1; p < kPaths; ++p)
          if (runs(p)) diff = std::max(diff, rel_diff(x, y[p], y[kBlas], ny));
        const bool fail = !(diff <= 1e-2);
        bad |= fail;

        Timing t[kPaths];
        for (int p = 0; p < kPaths; ++p)
          if (runs(p)) t[p] = time_it(x, reps, nbuf, [&](int k) { run(p, k); });
        auto cell = [&](int p) {
          if (std::isnan(t[p].us)) return std::string("-");
          const double bytes = p == kBlas || p == kBf16Old || p == kBf16 ? double(wbytes) : double(qbytes);
          const double tbs = bytes / t[p].us / 1e6;
          return fmt(t[p].us, "%.1f") + (t[p].host_bound ? "h" : "") + " (" + fmt(tbs, "%.2f") + ", " +
                 fmt(100 * tbs / kHbmTBs, "%.0f%%") + ")";
        };
        std::printf("| %s | %lld->%lld | %d |", s.name, (long long)s.n_in, (long long)s.n_out, N);
        for (int p = 0; p < kPaths; ++p) std::printf(" %s |", cell(p).c_str());
        std::printf(" %s | %s | %s | %s | %s%s |\n", fmt(t[kBf16].us / t[kBf16Old].us, "%.2f").c_str(),
                    fmt(t[kI8].us / t[kI8Old].us, "%.2f").c_str(), fmt(t[kF8].us / t[kF8Old].us, "%.2f").c_str(),
                    fmt(t[kBf16].us / t[kBlas].us, "%.2f").c_str(), fmt(diff, "%.1e").c_str(), fail ? " FAIL" : "");
        std::fflush(stdout);
        if (!(t[kBf16].us < t[kBlas].us)) bf16_wins[ni] = false;
        if (N == 1)
          for (int p = 0; p < kPaths; ++p) token_us[p] += L.per_token * t[p].us;
      }
      for (void* p : {(void*)W, (void*)Q, (void*)F, (void*)scale, (void*)in}) Q3VL_CU(cudaFree(p));
      for (bf16* yp : y) Q3VL_CU(cudaFree(yp));
    }
    dev::destroy_exec(x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemv_bench: %s\n", e.what());
    return 2;
  }
  std::printf("\n8B decode token, weights only (36 x (2 q/o + 2 k/v + gate_up + down) + lm_head) at N = 1, ms:\n\n|");
  for (const char* name : kPathName) std::printf(" %s |", name);
  std::printf("\n|");
  for (int p = 0; p < kPaths; ++p) std::printf("---|");
  std::printf("\n|");
  for (int p = 0; p < kPaths; ++p) std::printf(" %.3f |", token_us[p] / 1e3);
  int dense_max = 0;  // the largest N (of Ns, all smaller ones too) where the new bf16 GEMV won on every shape
  for (int ni = 0; ni < kNs && Ns[ni] <= dev::cuda::wgemv::kMaxN && bf16_wins[ni]; ++ni) dense_max = Ns[ni];
  std::printf("\n\nbf16 dense: the new GEMV beats cuBLASLt on every shape up to N = %d (0: never): route "
              "dev::linear_fwd's N <= %d to it\n", dense_max, dense_max);
  if (bad) std::fprintf(stderr, "gemv_bench: a path differs from cuBLASLt by more than 1e-2 (rows marked FAIL)\n");
  return bad ? 1 : 0;
}
