// Micro-benchmark: does our weight-streaming GEMV (src/tensor/cuda/gemv.cuh) beat cuBLASLt (dev::linear_fwd) on the
// decode-sized linears of Qwen3-VL, y[N, n_out] = x[N, n_in] W^T, N = 1..32, bf16?
// Build and run (from the repo root, on a GPU machine):
//   make bin/gemv_bench && bin/gemv_bench [reps]        (reps per timing, default 100, at least 50)
// For each shape and N it times (a) dev::linear_fwd bf16 (cuBLASLt), (b) wgemv::gemv<bf16, bf16> (N <= 16, its
// kMaxN), (c) dev::linear_q8_fwd on int8 weights (int8 GEMV for N <= 16, dequant + GEMM above), and prints a
// markdown table: microseconds (median), weight bandwidth (bytes of W / time, TB/s), the winners, and the max
// relative difference of (b) and (c) from (a) (max|y - y_a| / max|y_a|; bf16 tolerance ~1e-2, over it is flagged FAIL, exit 1).
// Method: every rep reads a different copy of W (the copies together are >= 4 and >= 256 MB, past the 50 MB L2),
// so no timed W is cache-resident; x (<= 32 rows) may stay in L2, as in a real decode step. The reps are queued
// behind a spinning kernel so that the host's launch time never shows between the per-rep CUDA events; a row
// flagged "host-bound" means the spin ended before everything was queued (tools/gpu/timing.cuh).
// The bf16 W is the int8 weights dequantized exactly (scales are powers of two: q * 2^-k fits in bf16), so all
// three paths compute the same product and (c) is checked against (a) too.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv.cuh"
#include "timing.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

constexpr size_t kMinPoolBytes = size_t(256) << 20;  // the W copies together (bf16), >> the 50 MB L2
constexpr int kMaxRows = 32;

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}
// q: random int8 in [-127, 127]; scale[o] = 2^-(6 + o % 4); w = q * scale[row] exactly in bf16. n elements, rows of n_in.
__global__ void k_init_weights(int8_t* q, float* scale, bf16* w, int64_t n, int64_t n_in, int64_t n_out, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n_in;  // row of the pool (copies stacked): o = row % n_out
    const float s = ldexpf(1.f, -(6 + int(row % n_out % 4)));
    const int8_t v = int8_t(int(hash(i, seed) % 255u) - 127);
    q[i] = v;
    w[i] = __float2bfloat16_rn(float(v) * s);
    if (i % n_in == 0) scale[row] = s;
  }
}
__global__ void k_init_x(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(float(hash(i, seed) % 2001u) / 1000.f - 1.f);
}

struct Shape { const char* name; int64_t n_in, n_out; };
using gpu_bench::Timing;

// Median time of one call of f(copy), copy rotating over nbuf weight copies; warm-up first.
template <class F> Timing time_it(const dev::Exec& x, int reps, int nbuf, F&& f) {
  return gpu_bench::time_median(dev::cuda::stream_of(x), reps, std::max(nbuf, 5), [&](int i) { f(i % nbuf); });
}

std::string fmt(double v, const char* f) {
  if (std::isnan(v)) return "-";
  char s[32];
  std::snprintf(s, sizeof s, f, v);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(50, argc > 1 ? std::atoi(argv[1]) : 100);
  const Shape shapes[] = {
      {"8B q/o_proj", 4096, 4096},     {"8B k/v_proj", 4096, 1024},    {"8B gate_up", 4096, 24576},
      {"8B down", 12288, 4096},        {"8B lm_head", 4096, 151936},   {"30B-A3B q_proj", 2048, 4096},
      {"30B-A3B k/v_proj", 2048, 512}, {"30B-A3B o_proj", 4096, 2048},
  };
  const int Ns[] = {1, 2, 4, 8, 16, 32};
  bool bad = false;
  try {
    dev::Exec x = dev::make_exec(Device::CUDA);
    cudaStream_t st = dev::cuda::stream_of(x);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    std::printf("# gemv_bench on %s (L2 %d MB), median of %d reps, bf16 activations\n\n", prop.name,
                prop.l2CacheSize >> 20, reps);
    std::printf("| shape | n_in->n_out | N | cuBLASLt us | GEMV us | int8 us | cuBLASLt TB/s | GEMV TB/s | int8 TB/s "
                "| GEMV/cuBLASLt | bf16 winner | fastest | rel diff GEMV | rel diff int8 |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Shape& s : shapes) {
      const int64_t nw = s.n_in * s.n_out;
      const size_t wbytes = size_t(nw) * sizeof(bf16), qbytes = size_t(nw) + size_t(s.n_out) * sizeof(float);
      const int nbuf = int(std::max<size_t>(4, (kMinPoolBytes + wbytes - 1) / wbytes));
      bf16 *W, *in, *ya, *yb, *yc;
      int8_t* Q;
      float* scale;
      Q3VL_CU(cudaMalloc(&W, wbytes * nbuf));
      Q3VL_CU(cudaMalloc(&Q, size_t(nw) * nbuf));
      Q3VL_CU(cudaMalloc(&scale, sizeof(float) * s.n_out * nbuf));
      Q3VL_CU(cudaMalloc(&in, sizeof(bf16) * kMaxRows * s.n_in));
      for (bf16** y : {&ya, &yb, &yc}) Q3VL_CU(cudaMalloc(y, sizeof(bf16) * kMaxRows * s.n_out));
      k_init_weights<<<4096, 256, 0, st>>>(Q, scale, W, nw * nbuf, s.n_in, s.n_out, 1234u);
      Q3VL_LAUNCHED();
      k_init_x<<<256, 256, 0, st>>>(in, kMaxRows * s.n_in, 99u);
      Q3VL_LAUNCHED();
      auto Wk = [&](int k) { return W + int64_t(k) * nw; };
      auto Qk = [&](int k) { return Q + int64_t(k) * nw; };
      auto Sk = [&](int k) { return scale + int64_t(k) * s.n_out; };
      for (int N : Ns) {
        auto run_a = [&](int k) { dev::linear_fwd(x, in, Wk(k), nullptr, ya, N, s.n_in, s.n_out, DType::BF16); };
        auto run_b = [&](int k) {
          dev::cuda::wgemv::gemv<bf16, bf16>(x, in, Wk(k), nullptr, nullptr, yb, N, s.n_in, s.n_out);
        };
        auto run_c = [&](int k) {
          dev::linear_q8_fwd(x, in, Qk(k), Sk(k), nullptr, yc, N, s.n_in, s.n_out, QFormat::Int8, DType::BF16);
        };
        const bool has_b = N <= dev::cuda::wgemv::kMaxN;
        // Correctness on copy 0: the three paths compute the same product (W is q * scale exactly).
        run_a(0);
        if (has_b) run_b(0);
        run_c(0);
        const int64_t ny = int64_t(N) * s.n_out;
        const double db = has_b ? gpu_bench::rel_diff<bf16>(x, yb, ya, ny) : NAN,
                     dc = gpu_bench::rel_diff<bf16>(x, yc, ya, ny);
        const bool fail = (has_b && !(db <= 1e-2)) || !(dc <= 1e-2);
        bad |= fail;

        const Timing ta = time_it(x, reps, nbuf, run_a);
        const Timing tb = has_b ? time_it(x, reps, nbuf, run_b) : Timing{};
        const Timing tc = time_it(x, reps, nbuf, run_c);
        auto tbs = [](double bytes, double us) { return bytes / us / 1e6; };
        const char* bf16_win = !has_b ? "cuBLASLt" : tb.us < ta.us ? "GEMV" : "cuBLASLt";
        const double best = std::min({ta.us, has_b ? tb.us : INFINITY, tc.us});
        const char* fastest = best == tc.us ? "int8" : best == ta.us ? "cuBLASLt" : "GEMV";
        std::printf("| %s | %lld->%lld | %d | %s%s | %s%s | %s%s | %s | %s | %s | %s | %s | %s | %s | %s%s |\n",
                    s.name, (long long)s.n_in, (long long)s.n_out, N, fmt(ta.us, "%.1f").c_str(),
                    ta.host_bound ? " (host-bound)" : "", fmt(tb.us, "%.1f").c_str(),
                    tb.host_bound ? " (host-bound)" : "", fmt(tc.us, "%.1f").c_str(),
                    tc.host_bound ? " (host-bound)" : "", fmt(tbs(wbytes, ta.us), "%.2f").c_str(),
                    fmt(tbs(wbytes, tb.us), "%.2f").c_str(), fmt(tbs(qbytes, tc.us), "%.2f").c_str(),
                    fmt(tb.us / ta.us, "%.2f").c_str(), bf16_win, fastest, fmt(db, "%.1e").c_str(),
                    fmt(dc, "%.1e").c_str(), fail ? " FAIL" : "");
        std::fflush(stdout);
      }
      for (void* p : {(void*)W, (void*)Q, (void*)scale, (void*)in, (void*)ya, (void*)yb, (void*)yc}) Q3VL_CU(cudaFree(p));
    }
    dev::destroy_exec(x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemv_bench: %s\n", e.what());
    return 2;
  }
  if (bad) std::fprintf(stderr, "gemv_bench: a path differs from cuBLASLt by more than 1e-2 (rows marked FAIL)\n");
  return bad ? 1 : 0;
}
