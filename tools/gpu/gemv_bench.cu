// Micro-benchmark of the decode GEMV (src/tensor/cuda/gemv.cuh) on Qwen3-VL's decode-sized linears,
// y[N, n_out] = x[N, n_in] W^T, bf16 activations, N = 1, 2, 4, 8, 16: for fp8 and bf16 weights (int8 runs fp8's
// code but for the conversion) it times the tensor-core GEMV's register ring (wgemv::gemv_tc) with the knobs by shape
// and the TMA-fed GEMV (wgemv::gemv_tma, one matrix) at five settings, with and without programmatic dependent
// launch, and cuBLASLt bf16 (dev::cuda::gemm, what linear_fwd takes for more than 8 rows), and checks every path
// against cuBLASLt on the same product.
// Build and run (from the repo root, on a GPU machine):
//   make FFMPEG=0 bin/gemv_bench && bin/gemv_bench [reps]     (reps per timing, default 100, at least 20)
// Output: a markdown table, one row per shape, weight type and N: microseconds (median), weight bandwidth (bytes of
// W read / time, TB/s; 8-bit rows count their scales), the best path's speedups over the ring and over cuBLASLt
// bf16, and the max relative difference of any path from cuBLASLt (max|y - y_ref| / max|y_ref|; over 1e-2 is flagged
// FAIL, exit 1).
// Weights: int8 q random in [-127, 127], fp8 E4M3 codes random (NaN codes skipped), row scales 2^-(6 + row % 4);
// the bf16 matrices are their exact dequantizations (q * 2^-k fits bf16), so every path computes the same product;
// "bf16" rows use the int8 matrix's dequantization. Every rep reads a different copy of W (copies together >= 4 and
// >= 256 MB of bf16, past the 50 MB L2); x may stay in L2, as in a decode step. Reps are queued behind a spinning
// kernel (tools/gpu/timing.cuh); "(host-bound)" marks a timing whose spin ended before everything was queued.
// Experts ("30B-A3B experts", E = 128): R = 8 N rows (top-8 routing) over the experts (8 k + (5 r) % 96) % 128 of
// rep k, k rotating over 16 tables so that consecutive reps read mostly other experts; W bytes are those of the
// experts with rows. cuBLASLt is not timed there (a launch per expert); the reference is its product per expert.
// Last, a second table: serving's greedy argmax (dev::argmax_rows) over 1, 8 and 64 rows of 151,936 fp32 logits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv.cuh"
#include "timing.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;
namespace wg = dev::cuda::wgemv;

namespace {

constexpr size_t kMinPoolBytes = size_t(256) << 20;  // the bf16 W copies together, >> the 50 MB L2
constexpr int kMaxRows = 16;
constexpr int kExperts = 128, kTopK = 8, kRot = 16;
constexpr double kTol = 1e-2;

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}
// n elements of rows of n_in (copies or experts stacked, row o = row % n_out): int8 q8, fp8 f8, scale[row] =
// 2^-(6 + o % 4) and the exact bf16 dequantizations wq (of q8) and wf (of f8; null: not wanted).
__global__ void k_init_weights(int8_t* q8, fp8* f8, float* scale, bf16* wq, bf16* wf, int64_t n, int64_t n_in,
                               int64_t n_out, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / n_in;
    const float s = ldexpf(1.f, -(6 + int(row % n_out % 4)));
    const int8_t v = int8_t(int(hash(i, seed) % 255u) - 127);
    uint8_t c = uint8_t(hash(i, seed + 1));
    if ((c & 0x7f) == 0x7f) c ^= 1;  // not NaN
    q8[i] = v;
    f8[i].__x = c;
    wq[i] = __float2bfloat16_rn(float(v) * s);
    if (wf) wf[i] = __float2bfloat16_rn(__half2float(__half(__nv_cvt_fp8_to_halfraw(c, __NV_E4M3))) * s);
    if (i % n_in == 0) scale[row] = s;
  }
}
__global__ void k_init_x(bf16* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = __float2bfloat16_rn(float(hash(i, seed) % 2001u) / 1000.f - 1.f);
}

using gpu_bench::Timing;
std::string fmt(double v, const char* f) {
  if (std::isnan(v)) return "-";
  char s[32];
  std::snprintf(s, sizeof s, f, v);
  return s;
}
std::string us_cell(const Timing& t) { return fmt(t.us, "%.1f") + (t.host_bound ? " (host-bound)" : ""); }

// The paths: gemv_tc's register ring (knobs by shape) with and without programmatic dependent launch (PDL: a rep's
// first weights are fetched while the rep before finishes, as in a decode step after its RMSNorm), and the TMA-fed
// GEMV (gemv_tma.cuh, what gemv() and linear_fwd take where they can: "-" for experts, N > 8, x over 48 KiB) likewise,
// then at four other settings TmaKnobs<consumer warps, 2 KiB panels a stage, stages>.
using Tm0 = wg::TmaKnobs<4, 4, 12>;
using Tm1 = wg::TmaKnobs<4, 8, 6>;
using Tm2 = wg::TmaKnobs<4, 8, 10>;
using Tm3 = wg::TmaKnobs<2, 16, 3>;
constexpr int kPaths = 8;
constexpr int kRing = 1;
constexpr const char* kTcNames[kPaths] = {"ring noPDL", "ring",        "tma noPDL",   "tma",
                                          "tma 4w4p12s", "tma 4w8p6s", "tma 4w8p10s", "tma 2w16p4s"};

// One problem: the weights of one type W (pool of copies, or the experts), x, the reference output.
struct Problem {
  const char* shape;
  int64_t n_in, n_out, N;
  const bf16* x;
  const int32_t* const* start;  // null: dense; else kRot start tables (device), E experts, R rows
  int64_t E, R;
};

// Times and checks the tensor-core settings on W; prints one row. wbytes: bytes of W read per
// call; wk(k), sk(k): copy k's weights and scales (scales null for bf16).
template <class W, class WK, class SK>
bool bench_row(const dev::Exec& x, const Problem& p, const char* wname, double wbytes, int reps, int nbuf, WK wk,
               SK sk, bf16* y, const bf16* yref, const Timing& tcublas, double cublas_bytes) {
  const int64_t ny = (p.start ? p.R : p.N) * p.n_out;
  const int64_t n = p.start ? std::min<int64_t>(p.R, kMaxRows) : p.N;
  auto st = [&](int k) { return p.start ? p.start[k % kRot] : nullptr; };
  auto tc = [&]<class K>(int k) {
    wg::gemv_tc<bf16, W, K>(x, p.x, wk(k), sk(k), nullptr, y, n, p.n_in, p.n_out, st(k), p.E, p.R);
    return true;
  };
  auto tma = [&]<class K>(int k) {  // false: declined (experts, a product it does not take, a driver without maps)
    return !p.start && wg::gemv_tma<bf16, W, K>(x, p.x, wk(k), sk(k), nullptr, y, n, p.n_in, p.n_out);
  };
  double worst = 0;
  int path = 0;  // stderr names the path about to run: a fault's last line says which one it was
  auto check = [&](auto&& f) {  // false: the path declined the product
    std::fprintf(stderr, "gemv_bench: %s %s N=%lld path %d\n", p.shape, wname, (long long)p.N, path++);
    std::fflush(stderr);
    if (!f(0)) return false;
    worst = std::max(worst, gpu_bench::rel_diff<bf16>(x, y, yref, ny));
    return true;
  };
  auto time_it = [&](auto&& f) {
    return gpu_bench::time_median(dev::cuda::stream_of(x), reps, std::max(nbuf, 5), [&](int i) { f(i % nbuf); });
  };
  Timing t[kPaths];  // not run: Timing{}, "-"
  int i = 0;
  auto run = [&](auto&& f, bool pdl) {
    dev::cuda::pdl_on() = pdl;
    if (check(f)) t[i] = time_it(f);
    ++i;
    dev::cuda::pdl_on() = true;
  };
  run([&](int k) { return tc.template operator()<wg::TcAuto>(k); }, false);
  run([&](int k) { return tc.template operator()<wg::TcAuto>(k); }, true);
  auto run_tma = [&]<class K>(bool pdl) { run([&](int k) { return tma.template operator()<K>(k); }, pdl); };
  run_tma.template operator()<wg::TmaAuto>(false);
  run_tma.template operator()<wg::TmaAuto>(true);
  [&]<class... K>() { (run_tma.template operator()<K>(true), ...); }.template operator()<Tm0, Tm1, Tm2, Tm3>();

  auto tbs = [](double bytes, double us) { return bytes / us / 1e6; };
  int best = kRing;
  for (int j = 2; j < kPaths; ++j)
    if (j != 2 && t[j].us < t[best].us) best = j;  // NaN (not run) never wins
  const bool fail = !(worst <= kTol);
  std::printf("| %s | %lld->%lld | %s | %lld | %s | %s |", p.shape, (long long)p.n_in, (long long)p.n_out, wname,
              (long long)p.N, us_cell(tcublas).c_str(), fmt(tbs(cublas_bytes, tcublas.us), "%.2f").c_str());
  for (int j = 0; j < kPaths; ++j)
    std::printf(" %s | %s |", us_cell(t[j]).c_str(), fmt(tbs(wbytes, t[j].us), "%.2f").c_str());
  std::printf(" %s | %s | %s | %s%s |\n", kTcNames[best], fmt(t[kRing].us / t[best].us, "%.2f").c_str(),
              fmt(tcublas.us / t[best].us, "%.2f").c_str(), fmt(worst, "%.1e").c_str(), fail ? " FAIL" : "");
  std::fflush(stdout);
  return fail;
}

struct Dense { const char* name; int64_t n_in, n_out; };

// cuBLASLt's y[N, n_out] = in W^T in bf16 (linear_fwd without its TMA GEMV).
void cublas_rows(const dev::Exec& x, const bf16* in, const bf16* W, bf16* y, int64_t N, int64_t n_in, int64_t n_out) {
  dev::cuda::gemm(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, 0.f, y, n_out, DType::BF16, DType::BF16);
}

bool bench_dense(const dev::Exec& x, const Dense& s, const bf16* in, int reps) {
  cudaStream_t st = dev::cuda::stream_of(x);
  const int64_t nw = s.n_in * s.n_out;
  const size_t wbytes = size_t(nw) * sizeof(bf16);
  const int nbuf = int(std::max<size_t>(4, (kMinPoolBytes + wbytes - 1) / wbytes));
  int8_t* Q;
  fp8* F;
  float* scale;
  bf16 *Wq, *Wf, *y, *yref;
  Q3VL_CU(cudaMalloc(&Q, size_t(nw) * nbuf));
  Q3VL_CU(cudaMalloc(&F, size_t(nw) * nbuf));
  Q3VL_CU(cudaMalloc(&scale, sizeof(float) * s.n_out * nbuf));
  Q3VL_CU(cudaMalloc(&Wq, wbytes * nbuf));
  Q3VL_CU(cudaMalloc(&Wf, wbytes));  // copy 0's fp8 dequantization: the fp8 reference
  Q3VL_CU(cudaMalloc(&y, sizeof(bf16) * kMaxRows * s.n_out));
  Q3VL_CU(cudaMalloc(&yref, sizeof(bf16) * kMaxRows * s.n_out));
  k_init_weights<<<4096, 256, 0, st>>>(Q, F, scale, Wq, Wf, nw, s.n_in, s.n_out, 1234u);  // copy 0 with Wf
  Q3VL_LAUNCHED();
  k_init_weights<<<4096, 256, 0, st>>>(Q + nw, F + nw, scale + s.n_out, Wq + nw, nullptr, nw * (nbuf - 1), s.n_in,
                                       s.n_out, 777u);
  Q3VL_LAUNCHED();
  auto Fk = [&](int k) { return F + int64_t(k) * nw; };
  auto Sk = [&](int k) { return scale + int64_t(k) * s.n_out; };
  auto Wk = [&](int k) { return Wq + int64_t(k) * nw; };
  auto none = [](int) { return static_cast<const float*>(nullptr); };
  const double b8 = double(nw) + 4.0 * double(s.n_out), b16 = 2.0 * double(nw);
  bool bad = false;
  for (int64_t N : {1, 2, 4, 8, 16}) {
    const Problem p{s.name, s.n_in, s.n_out, N, in, nullptr, 0, 0};
    auto cublas = [&](int k) { cublas_rows(x, in, Wk(k), y, N, s.n_in, s.n_out); };
    const Timing tcub = gpu_bench::time_median(st, reps, std::max(nbuf, 5), [&](int i) { cublas(i % nbuf); });
    cublas_rows(x, in, Wf, yref, N, s.n_in, s.n_out);
    bad |= bench_row<fp8>(x, p, "fp8", b8, reps, nbuf, Fk, Sk, y, yref, tcub, b16);
    cublas_rows(x, in, Wq, yref, N, s.n_in, s.n_out);  // the bf16 rows' reference
    bad |= bench_row<bf16>(x, p, "bf16", b16, reps, nbuf, Wk, none, y, yref, tcub, b16);
  }
  for (void* v : {(void*)Q, (void*)F, (void*)scale, (void*)Wq, (void*)Wf, (void*)y, (void*)yref}) Q3VL_CU(cudaFree(v));
  return bad;
}

// Start tables of kRot rotations for R rows (host copies in hs).
std::vector<std::vector<int32_t>> expert_starts(int64_t R) {
  std::vector<std::vector<int32_t>> hs;
  for (int k = 0; k < kRot; ++k) {
    std::vector<int32_t> s(kExperts + 1, 0);
    for (int64_t r = 0; r < R; ++r) s[size_t((8 * k + (5 * r) % 96) % kExperts) + 1]++;
    for (int e = 0; e < kExperts; ++e) s[size_t(e) + 1] += s[size_t(e)];
    hs.push_back(std::move(s));
  }
  return hs;
}

bool bench_experts(const dev::Exec& x, const Dense& s, const bf16* in, int reps) {
  cudaStream_t st = dev::cuda::stream_of(x);
  const int64_t E = kExperts, per = s.n_in * s.n_out, nw = E * per;
  int8_t* Q;
  fp8* F;
  float* scale;
  bf16 *Wq, *Wf, *y, *yref;
  int32_t* dstart;
  const int64_t maxR = kTopK * kMaxRows;
  Q3VL_CU(cudaMalloc(&Q, size_t(nw)));
  Q3VL_CU(cudaMalloc(&F, size_t(nw)));
  Q3VL_CU(cudaMalloc(&scale, sizeof(float) * E * s.n_out));
  Q3VL_CU(cudaMalloc(&Wq, sizeof(bf16) * nw));
  Q3VL_CU(cudaMalloc(&Wf, sizeof(bf16) * nw));
  Q3VL_CU(cudaMalloc(&y, sizeof(bf16) * maxR * s.n_out));
  Q3VL_CU(cudaMalloc(&yref, sizeof(bf16) * maxR * s.n_out));
  Q3VL_CU(cudaMalloc(&dstart, sizeof(int32_t) * (E + 1) * kRot));
  k_init_weights<<<4096, 256, 0, st>>>(Q, F, scale, Wq, Wf, nw, s.n_in, s.n_out, 4321u);
  Q3VL_LAUNCHED();
  bool bad = false;
  for (int64_t N : {1, 2, 4, 8, 16}) {
    const int64_t R = kTopK * N;
    const auto hs = expert_starts(R);
    const int32_t* starts[kRot];
    for (int k = 0; k < kRot; ++k) {
      dev::cuda::to_device(x, dstart + k * (E + 1), hs[size_t(k)].data(), sizeof(int32_t) * size_t(E + 1));
      starts[k] = dstart + k * (E + 1);
    }
    int64_t busy = 0;
    for (int64_t e = 0; e < E; ++e) busy += hs[0][size_t(e) + 1] > hs[0][size_t(e)];
    // The reference: cuBLASLt per expert with rows (rotation 0) on the bf16 dequantization Wb.
    auto reference = [&](const bf16* Wb) {
      for (int64_t e = 0; e < E; ++e) {
        const int64_t r0 = hs[0][size_t(e)], m = hs[0][size_t(e) + 1] - r0;
        if (m > 0)
          cublas_rows(x, in + r0 * s.n_in, Wb + e * per, yref + r0 * s.n_out, m, s.n_in, s.n_out);
      }
    };
    const Problem p{s.name, s.n_in, s.n_out, N, in, starts, E, R};
    const double b8 = double(busy) * (double(per) + 4.0 * double(s.n_out)), b16 = 2.0 * double(busy) * double(per);
    auto Fk = [&](int) { return static_cast<const fp8*>(F); };
    auto Sk = [&](int) { return static_cast<const float*>(scale); };
    auto Wk = [&](int) { return static_cast<const bf16*>(Wq); };
    auto none = [](int) { return static_cast<const float*>(nullptr); };
    const Timing no_cublas{};
    reference(Wf);
    bad |= bench_row<fp8>(x, p, "fp8", b8, reps, kRot, Fk, Sk, y, yref, no_cublas, b16);
    reference(Wq);
    bad |= bench_row<bf16>(x, p, "bf16", b16, reps, kRot, Wk, none, y, yref, no_cublas, b16);
  }
  for (void* v : {(void*)Q, (void*)F, (void*)scale, (void*)Wq, (void*)Wf, (void*)y, (void*)yref, (void*)dstart})
    Q3VL_CU(cudaFree(v));
  return bad;
}

// Serving's greedy pick after the LM head (dev::argmax_rows, checked by the op table): S rows of the 8B's fp32
// logits, one line per S.
void bench_argmax(const dev::Exec& x, int reps) {
  constexpr int64_t V = 151936;
  float* lg;
  int32_t* idx;
  float* val;
  Q3VL_CU(cudaMalloc(&lg, sizeof(float) * 64 * V));
  Q3VL_CU(cudaMalloc(&idx, sizeof(int32_t) * 64));
  Q3VL_CU(cudaMalloc(&val, sizeof(float) * 64));
  Q3VL_CU(cudaMemsetAsync(lg, 0, sizeof(float) * 64 * V, dev::cuda::stream_of(x)));
  std::printf("\n| argmax_rows | rows x %lld | us | GB/s |\n|---|---|---|---|\n", (long long)V);
  for (int64_t S : {1, 8, 64}) {
    const Timing tm = gpu_bench::time_median(dev::cuda::stream_of(x), reps, 5, [&](int) {
      dev::cuda::argmax_rows(x, lg, S, V, 0, V, nullptr, 0, idx, val);
    });
    std::printf("| argmax_rows | %lld | %s | %s |\n", (long long)S, us_cell(tm).c_str(),
                fmt(4.0 * double(S * V) / tm.us / 1e3, "%.0f").c_str());
  }
  for (void* v : {(void*)lg, (void*)idx, (void*)val}) Q3VL_CU(cudaFree(v));
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(20, argc > 1 ? std::atoi(argv[1]) : 100);
  const Dense dense[] = {{"8B qkv", 4096, 6144},       {"8B o_proj", 4096, 4096}, {"8B gate_up", 4096, 24576},
                         {"8B down", 12288, 4096},     {"8B lm_head", 4096, 151936}};
  const Dense experts[] = {{"30B-A3B experts gate_up", 2048, 1536}, {"30B-A3B experts down", 768, 2048}};
  bool bad = false;
  try {
    dev::Exec x = dev::cuda::make_exec(size_t(256) << 20, 0);
    cudaStream_t st = dev::cuda::stream_of(x);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    std::printf("# gemv_bench on %s (L2 %d MB), median of %d reps, bf16 activations\n\n", prop.name,
                prop.l2CacheSize >> 20, reps);
    std::printf("| shape | n_in->n_out | W | N | cuBLASLt bf16 us | TB/s |");
    for (const char* t : kTcNames) std::printf(" %s us | TB/s |", t);
    std::printf(" best | x ring | x cuBLASLt | max rel diff |\n|");
    for (int i = 0; i < 10 + 2 * kPaths; ++i) std::printf("---|");
    std::printf("\n");
    bf16* in;
    const int64_t max_in = 12288;
    Q3VL_CU(cudaMalloc(&in, sizeof(bf16) * kTopK * kMaxRows * max_in));
    k_init_x<<<256, 256, 0, st>>>(in, kTopK * kMaxRows * max_in, 99u);
    Q3VL_LAUNCHED();
    for (const Dense& s : dense) bad |= bench_dense(x, s, in, reps);
    for (const Dense& s : experts) bad |= bench_experts(x, s, in, reps);
    bench_argmax(x, reps);
    Q3VL_CU(cudaFree(in));
    dev::cuda::destroy_exec(x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemv_bench: %s\n", e.what());
    return 2;
  }
  if (bad) std::fprintf(stderr, "gemv_bench: a path differs from cuBLASLt by more than 1e-2 (rows marked FAIL)\n");
  return bad ? 1 : 0;
}
