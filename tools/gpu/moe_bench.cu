// Micro-benchmark of the grouped expert GEMM (src/tensor/cuda/moe.cu, moe_sm90.cu; issue 30): the current kernels
// (new: wgmma, every mode, on an H100/H200) against Q3VL_GROUPED=mma (the mma.sync kernel, every mode) and
// Q3VL_GROUPED=prev (the previous configuration), each run in a child process of this binary (moe.cu reads the
// variable once), and a dense cuBLASLt GEMM of the same FLOPs (dev::linear_fwd, R x n_in -> n_out), at the 30B-A3B
// training shape: 4096 tokens, top-8 of 128 experts (R = 32768 rows), hidden 2048, expert intermediate 768; gate_up [R x 2048] ->
// 1536 and down [R x 768] -> 2048, each in four modes: FWD y = xg W^T; DX dxg = dy W (written); DW= dW = dy^T xg
// (fp32, written: the first micro-step); DW+ dW += dy^T xg (accumulated: the later micro-steps).
// Build and run (from the repo root, on a GPU machine):
//   make bin/moe_bench && bin/moe_bench [reps]          (reps per timing, default 20)
// Routing: each token picks 8 distinct experts with probability ~ 1 / (e + 4) (skewed: the busiest expert gets about
// 25x the rows of the idlest), so buckets are uneven, as after a real router. Checks, per variant, against cuBLASLt
// run expert by expert (dev::linear_fwd / linear_bwd on each bucket): max|got - ref| / max|ref| (bf16 outputs: bound
// 1e-2; fp32 dW: 1e-3), any NaN or infinity fails. DW= runs on a dW filled with NaN (a read of the prior fails the
// check), DW+ then adds a second time onto it (checked against 2 ref). Exit 1 on a failure. Prints a table: median
// microseconds, TFLOP/s (2 R n_in n_out / time), new/dense time ratio (issue 30's goal: <= 1.5), prev/new, and DW's
// DRAM floor (the fp32 dW written, and read for DW+, at 4.8 TB/s; the bf16 operands are small beside it).
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "timing.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

constexpr int64_t kTokens = 4096, kE = 128, kTop = 8, kH = 2048, kIm = 768;
constexpr double kHbmBytesPerUs = 4.8e6;  // H200 HBM3e, 4.8 TB/s
const char* const kModes[4] = {"FWD", "DX", "DW=", "DW+"};

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

// One variant's result for (projection, mode): median us and the max relative error against the reference.
struct Result { double us = NAN, err = NAN; };
using Results = std::map<std::string, Result>;  // key "proj mode"

// Runs the grouped GEMM in the variant this process's moe.cu selected, checks and times every (projection, mode).
// dense: the cuBLASLt us of each projection (key "proj"), when asked for.
bool measure(int reps, Results& res, std::map<std::string, double>* dense) {
  using gpu_bench::rel_diff;
  dev::Exec x = dev::make_exec(Device::CUDA);
  cudaStream_t st = dev::cuda::stream_of(x);
  const std::vector<int32_t> hstart = routing();
  const int64_t R = hstart[kE];
  int32_t* start = nullptr;
  Q3VL_CU(cudaMalloc(&start, sizeof(int32_t) * (kE + 1)));
  dev::to_device(x, start, hstart.data(), sizeof(int32_t) * (kE + 1));
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
                      rows, ni, no, false, DType::BF16);
    }
    auto run = [&](int m) {
      if (m == 0) return dev::grouped_linear_fwd(x, in, W, start, y, R, kE, ni, no, DType::BF16);
      dev::grouped_linear_bwd(x, dy, in, W, start, m == 1 ? dx : nullptr, m >= 2 ? dW : nullptr, R, kE, ni, no, false,
                              m == 3, DType::BF16);
    };
    // Correctness: outputs full of NaN first (0xff bytes), so an element left unwritten, or a prior read where
    // there should be none, fails.
    Q3VL_CU(cudaMemsetAsync(y, 0xff, sizeof(bf16) * R * no, st));
    Q3VL_CU(cudaMemsetAsync(dx, 0xff, sizeof(bf16) * R * ni, st));
    Q3VL_CU(cudaMemsetAsync(dW, 0xff, sizeof(float) * kE * no * ni, st));
    double err[4];
    for (int m = 0; m < 4; ++m) {
      run(m);
      Q3VL_CU(cudaStreamSynchronize(st));
      err[m] = m == 0 ? rel_diff<bf16>(x, y, y_ref, R * no)
               : m == 1 ? rel_diff<bf16>(x, dx, dx_ref, R * ni)
                        : rel_diff<float>(x, dW, dW_ref, kE * no * ni, m == 3 ? 2.0 : 1.0);  // DW+ onto DW='s dW
    }
    for (int m = 0; m < 4; ++m) {
      const double bound = m < 2 ? 1e-2 : 1e-3;
      ok &= err[m] <= bound;  // false for NaN
      Result& r = res[std::string(p.name) + " " + kModes[m]];
      r.err = err[m];
      r.us = gpu_bench::time_median(st, reps, 3, [&](int) { run(m); }).us;
    }
    if (dense) {
      bf16* out = y_ref;  // the reference is checked: reuse its buffer
      (*dense)[p.name] = gpu_bench::time_median(st, reps, 3, [&](int) {
                           dev::linear_fwd(x, in, W, nullptr, out, R, ni, no, DType::BF16);
                         }).us;
    }
    for (void* q : {(void*)in, (void*)W, (void*)dy, (void*)y, (void*)dx, (void*)y_ref, (void*)dx_ref, (void*)dW,
                    (void*)dW_ref})
      Q3VL_CU(cudaFree(q));
  }
  Q3VL_CU(cudaFree(start));
  dev::destroy_exec(x);
  return ok;
}

// A variant's results, from `self --child reps` under Q3VL_GROUPED=variant (lines "@ proj mode us err").
bool measure_variant(const char* self, const char* variant, int reps, Results& res) {
  const std::string cmd =
      "Q3VL_GROUPED=" + std::string(variant) + " '" + std::string(self) + "' --child " + std::to_string(reps);
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return false;
  char line[512], proj[64], mode[16];
  double us, err;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "@ %63s %15s %lf %lf", proj, mode, &us, &err) == 4)
      res[std::string(proj) + " " + mode] = Result{us, err};
    else std::fputs(line, stderr);
  const int st = pclose(f);
  return st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool child = argc > 1 && std::strcmp(argv[1], "--child") == 0;
  const int reps = std::max(5, argc > 1 + child ? std::atoi(argv[1 + child]) : 20);
  try {
    if (child) {
      Results res;
      const bool ok = measure(reps, res, nullptr);
      for (const auto& [k, r] : res) std::printf("@ %s %.3f %.3e\n", k.c_str(), r.us, r.err);
      return ok ? 0 : 1;
    }
    Results prev, mma, cur;  // the children first: two processes never share the GPU
    const bool prev_ok = measure_variant(argv[0], "prev", reps, prev);
    const bool mma_ok = measure_variant(argv[0], "mma", reps, mma);
    std::map<std::string, double> dense;
    const bool cur_ok = measure(reps, cur, &dense);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    const std::vector<int32_t> hstart = routing();
    int32_t lo = hstart[kE], hi = 0;
    for (int64_t e = 0; e < kE; ++e) {
      lo = std::min(lo, hstart[size_t(e + 1)] - hstart[size_t(e)]);
      hi = std::max(hi, hstart[size_t(e + 1)] - hstart[size_t(e)]);
    }
    const int64_t R = hstart[kE];
    std::printf("# moe_bench on %s: R = %lld rows (%lld tokens, top-%lld of %lld experts; %d..%d rows an expert), "
                "median of %d reps; prev, mma: Q3VL_GROUPED=prev, mma\n\n", prop.name, (long long)R, (long long)kTokens,
                (long long)kTop, (long long)kE, lo, hi, reps);
    std::printf("| proj | mode | prev us | mma us | new us | dense us | DRAM floor us | prev TF/s | mma TF/s | new TF/s "
                "| dense TF/s | new/dense | prev/new | err prev | err mma | err new |\n"
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (auto [name, ni, no] : {std::tuple<const char*, int64_t, int64_t>{"gate_up", kH, 2 * kIm}, {"down", kIm, kH}})
      for (int m = 0; m < 4; ++m) {
        const std::string key = std::string(name) + " " + kModes[m];
        const Result p = prev.count(key) ? prev[key] : Result{}, q = mma.count(key) ? mma[key] : Result{};
        const Result c = cur[key];
        const double d = dense[name], flops = 2.0 * double(R) * double(ni) * double(no);
        const double floor_us = m < 2 ? NAN : double(kE * no * ni) * 4 * (m == 3 ? 2 : 1) / kHbmBytesPerUs;
        const double bound = m < 2 ? 1e-2 : 1e-3;
        const bool bad = !(c.err <= bound) || !(p.err <= bound) || !(q.err <= bound);
        std::printf("| %s | %s | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.2f | %.2f | %.1e "
                    "| %.1e | %.1e%s |\n", name, kModes[m], p.us, q.us, c.us, d, floor_us, flops / p.us * 1e-6,
                    flops / q.us * 1e-6, flops / c.us * 1e-6, flops / d * 1e-6, c.us / d, p.us / c.us, p.err, q.err,
                    c.err, bad ? " FAIL" : "");
      }
    if (!prev_ok || !mma_ok || !cur_ok) {
      std::fprintf(stderr, "moe_bench: a check failed (%s%s%s; rows marked FAIL, nan: not measured)\n",
                   prev_ok ? "" : "prev ", mma_ok ? "" : "mma ", cur_ok ? "" : "new");
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_bench: %s\n", e.what());
    return 2;
  }
  return 0;
}
