// Micro-benchmark of the grouped expert GEMM (src/tensor/cuda/moe.cu, moe_sm90.cu; issue 30), in one process through
// dev::cuda::grouped_linear_path: new (wgmma, every mode, on an H100/H200) against mma (the mma.sync fallback,
// k_grouped, every mode) and a dense cuBLASLt GEMM of the same FLOPs (dev::linear_fwd, R x n_in -> n_out), at the
// 30B-A3B training shape: 4096 tokens, top-8 of 128 experts (R = 32768 rows), hidden 2048, expert intermediate
// 768; gate_up [R x 2048] -> 1536 and down [R x 768] -> 2048, each in four modes: FWD y = xg W^T; DX dxg = dy W
// (written); DW= dW = dy^T xg (fp32, written: the first micro-step); DW+ dW += dy^T xg (accumulated: the later
// micro-steps); DW=sq as DW= with dW's sum of squares taken (dev::SumSq: the training step's gradient norm, in the
// epilogue; checked against sum_squares over the reference dW, bound 1e-5). A mode wgmma does not take (not a 9.0 device) is reported on stderr; its "new" column is then the
// mma.sync kernel again.
// Build and run (from the repo root, on a GPU machine):
//   make bin/moe_bench && bin/moe_bench [reps]          (reps per timing, default 20)
// Routing: each token picks 8 distinct experts with probability ~ 1 / (e + 4) (skewed: the busiest expert gets about
// 25x the rows of the idlest), so buckets are uneven, as after a real router. Checks, per path, against cuBLASLt
// run expert by expert (dev::linear_fwd / linear_bwd on each bucket): max|got - ref| / max|ref| (bf16 outputs: bound
// 1e-2; fp32 dW: 1e-3), any NaN or infinity fails. DW= runs on a dW filled with NaN (a read of the prior fails the
// check), DW+ then adds a second time onto it (checked against 2 ref). Exit 1 on a failure. Prints a table: median
// microseconds, TFLOP/s (2 R n_in n_out / time), new/dense time ratio (issue 30's goal: <= 1.5), mma/new, and each
// mode's DRAM floor: its bytes, every operand read once and the output written once (all 128 experts' weights, bf16;
// DW's fp32 dW written, and read too for DW+), at the device's peak bandwidth (memory clock x bus width). Unlike the
// dense GEMM, whose one weight matrix is small, FWD and DX read E weight matrices: 0.81 GB for gate_up.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "timing.cuh"

namespace q3vl::dev::cuda {
bool grouped_linear_path(const Exec& x, int mode, bool wgmma, const void* A, const void* B, void* C,
                         const int32_t* start, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                         DType dt, const dev::SumSq& sq);
}

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

constexpr int64_t kTokens = 4096, kE = 128, kTop = 8, kH = 2048, kIm = 768;
constexpr int kNModes = 5;
const char* const kModes[kNModes] = {"FWD", "DX", "DW=", "DW+", "DW=sq"};

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

// One path's result for (projection, mode): median us and the max relative error against the reference.
struct Result { double us = NAN, err = NAN; };
using Results = std::map<std::string, Result>;  // key "proj mode"

// Runs the grouped GEMM down both paths (res[0] mma, res[1] wgmma), checks and times every (projection, mode); dense:
// the cuBLASLt us of each projection (key "proj"). False on a failed check.
bool measure(int reps, Results (&res)[2], std::map<std::string, double>& dense) {
  using gpu_bench::rel_diff;
  dev::Exec x = dev::make_exec(Device::CUDA);
  cudaStream_t st = dev::cuda::stream_of(x);
  const std::vector<int32_t> hstart = routing();
  const int64_t R = hstart[kE];
  int32_t* start = nullptr;
  Q3VL_CU(cudaMalloc(&start, sizeof(int32_t) * (kE + 1)));
  dev::to_device(x, start, hstart.data(), sizeof(int32_t) * (kE + 1));
  double* sq_acc = nullptr;  // DW=sq's sum of squares, then its non-finite count
  Q3VL_CU(cudaMalloc(&sq_acc, sizeof(double) + sizeof(int32_t)));
  int32_t* sq_bad = reinterpret_cast<int32_t*>(sq_acc + 1);
  bool ok = true;
  struct Proj { const char* name; int64_t n_in, n_out; };
  for (const Proj& p : {Proj{"gate_up", kH, 2 * kIm}, Proj{"down", kIm, kH}}) {
    const int64_t ni = p.n_in, no = p.n_out;
    bf16 *in, *W, *dy, *y, *dx, *y_ref, *dx_ref;
    float *dW, *dW_ref;
    for (auto [ptr, bytes] : {std::pair<bf16**, int64_t>{&in, R * ni}, {&W, kE * no * ni}, {&dy, R * no},
                              {&y, R * no}, {&dx, R * ni}, {&y_ref, R * no}, {&dx_ref, R * ni}})
      Q3VL_CU(cudaMalloc(ptr, sizeof(bf16) * bytes));
    Q3VL_CU(cudaMalloc(&dW, sizeof(float) * kE * no * ni));
    Q3VL_CU(cudaMalloc(&dW_ref, sizeof(float) * kE * no * ni));
    k_fill<<<1024, 256, 0, st>>>(in, R * ni, 1u, 1.f);
    k_fill<<<1024, 256, 0, st>>>(W, kE * no * ni, 2u, 0.05f);
    k_fill<<<1024, 256, 0, st>>>(dy, R * no, 3u, 1.f);
    Q3VL_LAUNCHED();
    // The reference: cuBLASLt on each expert's bucket.
    Q3VL_CU(cudaMemsetAsync(dW_ref, 0, sizeof(float) * kE * no * ni, st));
    for (int64_t e = 0; e < kE; ++e) {
      const int64_t s = hstart[size_t(e)], rows = hstart[size_t(e + 1)] - s;
      if (rows == 0) continue;
      dev::linear_fwd(x, in + s * ni, W + e * no * ni, nullptr, y_ref + s * no, rows, ni, no, DType::BF16);
      dev::linear_bwd(x, dy + s * no, in + s * ni, W + e * no * ni, dx_ref + s * ni, dW_ref + e * no * ni, nullptr,
                      rows, ni, no, false, false, DType::BF16);
    }
    // Mode m (kModes) down the wgmma path or not; grouped_linear_path's modes are FWD 0, DX 1, DW 2.
    auto run = [&](int m, bool wgmma) {
      const void* A = m == 0 ? (const void*)in : (const void*)dy;
      const void* B = m >= 2 ? (const void*)in : (const void*)W;
      void* C = m == 0 ? (void*)y : m == 1 ? (void*)dx : (void*)dW;
      const dev::SumSq sq = m == 4 ? dev::SumSq{sq_acc, sq_bad} : dev::SumSq{};
      return dev::cuda::grouped_linear_path(x, std::min(m, 2), wgmma, A, B, C, start, R, kE, ni, no, m == 3,
                                            DType::BF16, sq);
    };
    // The reference's sum of squares (sum_squares over dW_ref), the fused one's bound against it.
    Q3VL_CU(cudaMemsetAsync(sq_acc, 0, sizeof(double) + sizeof(int32_t), st));
    dev::sum_squares(x, dW_ref, kE * no * ni, DType::F32, sq_acc, sq_bad);
    double ref_sq = 0;
    dev::to_host(x, &ref_sq, sq_acc, sizeof ref_sq);
    for (int path = 0; path < 2; ++path) {
      // Correctness: outputs full of NaN first (0xff bytes), so an element left unwritten, or a prior read where
      // there should be none, fails.
      Q3VL_CU(cudaMemsetAsync(y, 0xff, sizeof(bf16) * R * no, st));
      Q3VL_CU(cudaMemsetAsync(dx, 0xff, sizeof(bf16) * R * ni, st));
      Q3VL_CU(cudaMemsetAsync(dW, 0xff, sizeof(float) * kE * no * ni, st));
      double err[kNModes];
      for (int m = 0; m < kNModes; ++m) {
        if (m == 4) Q3VL_CU(cudaMemsetAsync(sq_acc, 0, sizeof(double) + sizeof(int32_t), st));
        const bool took = run(m, path == 1);
        if (path == 1 && !took) std::fprintf(stderr, "moe_bench: %s %s: no wgmma here (mma.sync ran)\n", p.name,
                                             kModes[m]);
        Q3VL_CU(cudaStreamSynchronize(st));
        err[m] = m == 0 ? rel_diff<bf16>(x, y, y_ref, R * no)
                 : m == 1 ? rel_diff<bf16>(x, dx, dx_ref, R * ni)
                          : rel_diff<float>(x, dW, dW_ref, kE * no * ni, m == 3 ? 2.0 : 1.0);  // DW+ onto DW='s dW
        if (m == 4) {  // DW=sq wrote dW afresh (checked above); its squares and non-finite count
          double got = 0;
          int32_t bad = -1;
          dev::to_host(x, &got, sq_acc, sizeof got);
          dev::to_host(x, &bad, sq_bad, sizeof bad);
          const double e = std::fabs(got - ref_sq) / ref_sq;
          err[m] = bad != 0 || !(e <= 1e-5) ? INFINITY : err[m];
          std::printf("# %s DW=sq (%s): sum of squares %.9e, sum_squares over the reference %.9e (rel %.1e), "
                      "non-finite %d\n", p.name, path ? "new" : "mma", got, ref_sq, e, bad);
        }
      }
      for (int m = 0; m < kNModes; ++m) {
        const double bound = m < 2 ? 1e-2 : 1e-3;
        ok &= err[m] <= bound;  // false for NaN
        Result& r = res[path][std::string(p.name) + " " + kModes[m]];
        r.err = err[m];
        r.us = gpu_bench::time_median(st, reps, 3, [&](int) { run(m, path == 1); }).us;
      }
    }
    bf16* out = y_ref;  // the reference is checked: reuse its buffer
    dense[p.name] = gpu_bench::time_median(st, reps, 3, [&](int) {
                      dev::linear_fwd(x, in, W, nullptr, out, R, ni, no, DType::BF16);
                    }).us;
    for (void* q : {(void*)in, (void*)W, (void*)dy, (void*)y, (void*)dx, (void*)y_ref, (void*)dx_ref, (void*)dW,
                    (void*)dW_ref})
      Q3VL_CU(cudaFree(q));
  }
  Q3VL_CU(cudaFree(start));
  Q3VL_CU(cudaFree(sq_acc));
  dev::destroy_exec(x);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(5, argc > 1 ? std::atoi(argv[1]) : 20);
  try {
    Results res[2];  // mma, new
    std::map<std::string, double> dense;
    const bool ok = measure(reps, res, dense);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    const std::vector<int32_t> hstart = routing();
    int32_t lo = hstart[kE], hi = 0;
    for (int64_t e = 0; e < kE; ++e) {
      lo = std::min(lo, hstart[size_t(e + 1)] - hstart[size_t(e)]);
      hi = std::max(hi, hstart[size_t(e + 1)] - hstart[size_t(e)]);
    }
    const int64_t R = hstart[kE];
    int clock_khz = 0, bus_bits = 0;
    Q3VL_CU(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, 0));
    Q3VL_CU(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
    const double hbm_bytes_per_us = 2.0 * clock_khz * 1e3 * (bus_bits / 8) * 1e-6;  // double data rate
    std::printf("# moe_bench on %s: R = %lld rows (%lld tokens, top-%lld of %lld experts; %d..%d rows an expert), "
                "median of %d reps; mma: the mma.sync kernel, new: wgmma; DRAM floors at %.2f TB/s\n\n", prop.name,
                (long long)R, (long long)kTokens, (long long)kTop, (long long)kE, lo, hi, reps, hbm_bytes_per_us * 1e-6);
    std::printf("| proj | mode | mma us | new us | dense us | DRAM floor us | mma TF/s | new TF/s | dense TF/s "
                "| new/dense | mma/new | err mma | err new |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (auto [name, ni, no] : {std::tuple<const char*, int64_t, int64_t>{"gate_up", kH, 2 * kIm}, {"down", kIm, kH}})
      for (int m = 0; m < kNModes; ++m) {
        const std::string key = std::string(name) + " " + kModes[m];
        const Result q = res[0][key], c = res[1][key];
        const double d = dense[name], flops = 2.0 * double(R) * double(ni) * double(no);
        const double w = double(kE * no * ni), rows = double(R) * double(ni + no) * 2;  // elements; bf16 rows bytes
        const double floor_us = (rows + (m < 2 ? 2 * w : 4 * w * (m == 3 ? 2 : 1))) / hbm_bytes_per_us;
        const double bound = m < 2 ? 1e-2 : 1e-3;
        const bool bad = !(c.err <= bound) || !(q.err <= bound);
        std::printf("| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.1e | %.1e%s |\n",
                    name, kModes[m], q.us, c.us, d, floor_us, flops / q.us * 1e-6, flops / c.us * 1e-6,
                    flops / d * 1e-6, c.us / d, q.us / c.us, q.err, c.err, bad ? " FAIL" : "");
      }
    if (!ok) {
      std::fprintf(stderr, "moe_bench: a check failed (rows marked FAIL)\n");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
