// Micro-benchmark and check of cuBLASLt autotuning (run.gemm_tune, src/tensor/cuda/gemm.cu): the heuristic's first
// algorithm (tuning off, the old path) against the timed pick (tuning on), on the GEMMs the trainer and the decode
// steps run, through the same ops and leading dimensions (dev::linear_fwd / dev::linear_bwd, bf16, fp32 accumulation):
//   training (Qwen3-VL 2B, 4 x 4096 tokens): Y = X W^T, dX = dY W (+= where the trainer accumulates: k/v), dW += dY^T X
//   (fp32, beta = 1) for q/o, k/v, the fused gate_up, down, and the LM head in its 1024-row chunks (dev_model.cpp);
//   decode (8B): Y = X W^T for the fused qkv, o, gate_up, down and the LM head at 1, 4, 8, 16, 32 and 64 rows.
// Build and run (from the repo root, on a GPU machine):
//   make bin/gemm_tune_bench && bin/gemm_tune_bench [reps]     (timed reps per mode, default 20)
// Each row: microseconds (median of reps, each after a 2 x L2 flush so that weights come from HBM as in a model),
// TFLOP/s (training) or weight TB/s (decode), the speedup off/on, the tuned pick as the heuristic's rank out of the
// candidates timed, the tuning's own time, and both modes' errors against an independent fp32 reference
// (max|y - ref| / max|ref|; bf16 outputs 1e-2, fp32 dW 1e-3; NaN or Inf fails). The accumulating GEMMs start from the
// same non-zero C in both modes, so a timing that touched the caller's C would fail the check. Exit 1 on any failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;

namespace {

enum class Op { Fwd, Dx, Dw };
struct Case {
  std::string name;
  Op op;
  int64_t rows, n_in, n_out;
  bool acc = false;  // Dx: din += dY W (the trainer's k/v); Dw always accumulates (fp32 gradients)
};

__device__ uint32_t hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}
// Uniform in [-s, s], stored as T (bf16 or float).
template <class T> __global__ void k_init(T* p, int64_t n, float s, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = T(s * (float(hash(uint64_t(i), seed) % 20001u) / 10000.f - 1.f));
}
__device__ __forceinline__ float f32(float v) { return v; }
__device__ __forceinline__ float f32(bf16 v) { return __bfloat162float(v); }

// The reference, independent of cuBLASLt: R[M, N] = op(A) op(B) + beta C0 (row-major, ldc = N as in every call here),
// fp32 accumulation over 16 x 16 shared-memory tiles.
constexpr int kT = 16;
template <class SC>
__global__ void k_ref(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const bf16* A, int64_t lda, const bf16* B,
                      int64_t ldb, float beta, const SC* C0, float* R) {
  __shared__ float As[kT][kT + 1], Bs[kT][kT + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tilesM = (M + kT - 1) / kT, tilesN = (N + kT - 1) / kT;
  for (int64_t tm = blockIdx.y; tm < tilesM; tm += gridDim.y)
    for (int64_t tn = blockIdx.x; tn < tilesN; tn += gridDim.x) {
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += kT) {
        {  // As[ty][tx] = op(A)(tm*kT + ty, k0 + tx)
          const int64_t r = tm * kT + ty, c = k0 + tx;
          As[ty][tx] = (r < M && c < K) ? __bfloat162float(A[ta ? c * lda + r : r * lda + c]) : 0.f;
        }
        {  // Bs[ty][tx] = op(B)(k0 + ty, tn*kT + tx)
          const int64_t r = k0 + ty, c = tn * kT + tx;
          Bs[ty][tx] = (r < K && c < N) ? __bfloat162float(B[tb ? c * ldb + r : r * ldb + c]) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kT; ++kk) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();
      }
      const int64_t i = tm * kT + ty, j = tn * kT + tx;
      if (i < M && j < N) R[i * N + j] = acc + (beta != 0.f ? beta * f32(C0[i * N + j]) : 0.f);
    }
}

// out[0] = max|got - ref|, out[1] = max|ref| (as float bits: non-negative floats order as unsigned ints),
// out[2] = 1 if any element of either is NaN or Inf.
template <class T> __global__ void k_diff(const T* got, const float* ref, int64_t n, unsigned* out) {
  float md = 0.f, mr = 0.f;
  bool bad = false;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = f32(got[i]), r = ref[i];
    if (!isfinite(g) || !isfinite(r)) bad = true;
    else md = fmaxf(md, fabsf(g - r)), mr = fmaxf(mr, fabsf(r));
  }
  const unsigned a = __reduce_max_sync(0xffffffffu, __float_as_uint(md));
  const unsigned b = __reduce_max_sync(0xffffffffu, __float_as_uint(mr));
  const bool any = __any_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0) {
    atomicMax(&out[0], a);
    atomicMax(&out[1], b);
    if (any) atomicOr(&out[2], 1u);
  }
}

// The GEMM a case runs, as gemm.cu's gemm_impl receives it (linear_fwd / linear_bwd's arguments).
struct Gemm {
  bool ta, tb;
  int64_t M, N, K, lda, ldb;
  float beta;
  bool f32_out;
};
Gemm gemm_of(const Case& c) {
  switch (c.op) {
    case Op::Fwd: return {false, true, c.rows, c.n_out, c.n_in, c.n_in, c.n_in, 0.f, false};
    case Op::Dx: return {false, false, c.rows, c.n_in, c.n_out, c.n_out, c.n_in, c.acc ? 1.f : 0.f, false};
    default: return {true, false, c.n_out, c.n_in, c.rows, c.n_out, c.n_in, 1.f, true};
  }
}

std::string fmt(double v, const char* f) {
  if (std::isnan(v)) return "-";
  char s[48];
  std::snprintf(s, sizeof s, f, v);
  return s;
}

struct Bench {
  dev::Exec x;
  cudaStream_t st;
  void* flush = nullptr;
  size_t flush_bytes = 0;
  unsigned* dbuf = nullptr;
  int reps;

  // Median microseconds of one call of f, each after the L2 flush (which also keeps the GPU ahead of the host).
  template <class F> double time_it(F&& f) {
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) Q3VL_CU(cudaEventCreate(&e));
    for (int r = 0; r < reps; ++r) {
      Q3VL_CU(cudaMemsetAsync(flush, r, flush_bytes, st));
      Q3VL_CU(cudaEventRecord(ev[2 * r], st));
      f();
      Q3VL_CU(cudaEventRecord(ev[2 * r + 1], st));
    }
    Q3VL_CU(cudaStreamSynchronize(st));
    std::vector<double> us(reps);
    for (int r = 0; r < reps; ++r) {
      float ms = 0;
      Q3VL_CU(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]));
      us[r] = 1e3 * ms;
    }
    for (auto& e : ev) Q3VL_CU(cudaEventDestroy(e));
    std::nth_element(us.begin(), us.begin() + reps / 2, us.end());
    return us[reps / 2];
  }

  // max|got - ref| / max|ref| over n elements; +inf for NaN or Inf.
  template <class T> double rel_err(const T* got, const float* ref, int64_t n) {
    Q3VL_CU(cudaMemsetAsync(dbuf, 0, 3 * sizeof(unsigned), st));
    k_diff<T><<<1024, 256, 0, st>>>(got, ref, n, dbuf);
    Q3VL_LAUNCHED();
    unsigned h[3];
    dev::to_host(x, h, dbuf, sizeof h);
    float md, mr;
    std::memcpy(&md, &h[0], 4), std::memcpy(&mr, &h[1], 4);
    return h[2] ? INFINITY : md == 0.f ? 0.0 : double(md) / std::max(double(mr), 1e-30);
  }

  // One case: both modes checked against the reference, then timed. False on a failed check.
  bool run(const Case& c) {
    const Gemm g = gemm_of(c);
    const int64_t nC = g.M * g.N;
    const size_t esC = g.f32_out ? 4 : 2;
    bf16 *in, *W, *dy;
    void *C, *C0 = nullptr;
    float* ref;
    Q3VL_CU(cudaMalloc(&in, sizeof(bf16) * c.rows * c.n_in));
    Q3VL_CU(cudaMalloc(&W, sizeof(bf16) * c.n_out * c.n_in));
    Q3VL_CU(cudaMalloc(&dy, sizeof(bf16) * c.rows * c.n_out));
    Q3VL_CU(cudaMalloc(&C, esC * nC));
    Q3VL_CU(cudaMalloc(&ref, sizeof(float) * nC));
    k_init<bf16><<<4096, 256, 0, st>>>(in, c.rows * c.n_in, 1.f, 11u);
    k_init<bf16><<<4096, 256, 0, st>>>(W, c.n_out * c.n_in, 0.05f, 12u);
    k_init<bf16><<<4096, 256, 0, st>>>(dy, c.rows * c.n_out, 1.f, 13u);
    Q3VL_LAUNCHED();
    if (g.beta != 0.f) {
      Q3VL_CU(cudaMalloc(&C0, esC * nC));
      if (g.f32_out) k_init<float><<<4096, 256, 0, st>>>(static_cast<float*>(C0), nC, 4.f, 14u);
      else k_init<bf16><<<4096, 256, 0, st>>>(static_cast<bf16*>(C0), nC, 4.f, 14u);
      Q3VL_LAUNCHED();
    }
    const bf16* A = c.op == Op::Fwd ? in : dy;
    const bf16* B = c.op == Op::Dw ? in : W;
    const dim3 grid(unsigned(std::min<int64_t>((g.N + kT - 1) / kT, 65535)),
                    unsigned(std::min<int64_t>((g.M + kT - 1) / kT, 65535)));
    if (g.f32_out)
      k_ref<float><<<grid, dim3(kT, kT), 0, st>>>(g.ta, g.tb, g.M, g.N, g.K, A, g.lda, B, g.ldb, g.beta,
                                                  static_cast<const float*>(C0), ref);
    else
      k_ref<bf16><<<grid, dim3(kT, kT), 0, st>>>(g.ta, g.tb, g.M, g.N, g.K, A, g.lda, B, g.ldb, g.beta,
                                                 static_cast<const bf16*>(C0), ref);
    Q3VL_LAUNCHED();
    auto call = [&] {
      switch (c.op) {
        case Op::Fwd: dev::linear_fwd(x, in, W, nullptr, C, c.rows, c.n_in, c.n_out, DType::BF16); break;
        case Op::Dx: dev::linear_bwd(x, dy, in, W, C, nullptr, nullptr, c.rows, c.n_in, c.n_out, c.acc, DType::BF16); break;
        case Op::Dw:
          dev::linear_bwd(x, dy, in, W, nullptr, static_cast<float*>(C), nullptr, c.rows, c.n_in, c.n_out, false,
                          DType::BF16);
          break;
      }
    };
    double us[2], err[2];
    std::string pick = "-";
    double tune_ms = NAN;
    for (int on = 0; on < 2; ++on) {
      dev::set_gemm_tune(on == 1, /*env_wins=*/false);
      if (C0) Q3VL_CU(cudaMemcpyAsync(C, C0, esC * nC, cudaMemcpyDeviceToDevice, st));
      else Q3VL_CU(cudaMemsetAsync(C, 0xff, esC * nC, st));  // NaN everywhere: a missed element fails
      const dev::GemmTuneStats s0 = dev::gemm_tune_stats();
      call();  // the shape's first call in this mode: the plan is made (and timed when on), then the GEMM runs once
      const dev::GemmTuneStats s1 = dev::gemm_tune_stats();
      if (on && s1.timed > s0.timed) {
        pick = std::to_string(s1.last_pick) + "/" + std::to_string(s1.last_candidates);
        tune_ms = 1e3 * (s1.seconds - s0.seconds);
      } else if (on) {
        pick = s1.untimed > s0.untimed ? "untimed" : "0/1";
      }
      err[on] = g.f32_out ? rel_err(static_cast<float*>(C), ref, nC) : rel_err(static_cast<bf16*>(C), ref, nC);
      us[on] = time_it(call);
    }
    const double tol = g.f32_out ? 1e-3 : 1e-2;
    const bool ok = err[0] <= tol && err[1] <= tol;  // false for NaN
    const double flop = 2.0 * double(g.M) * double(g.N) * double(g.K);
    const bool decode = c.op == Op::Fwd && c.rows <= 64;
    const double wbytes = 2.0 * double(c.n_in) * double(c.n_out);
    auto rate = [&](double t) { return decode ? wbytes / t / 1e6 : flop / t / 1e6; };  // TB/s or TFLOP/s
    std::printf("| %s | %lldx%lldx%lld%s | %s | %s | %s %s | %s %s | %s | %s | %s | %s | %s |%s\n", c.name.c_str(),
                (long long)g.M, (long long)g.N, (long long)g.K, g.beta != 0.f ? " +=" : "", fmt(us[0], "%.1f").c_str(),
                fmt(us[1], "%.1f").c_str(), fmt(rate(us[0]), "%.2f").c_str(), decode ? "TB/s" : "TFLOP/s",
                fmt(rate(us[1]), "%.2f").c_str(), decode ? "TB/s" : "TFLOP/s", fmt(us[0] / us[1], "%.3f").c_str(),
                pick.c_str(), fmt(tune_ms, "%.1f").c_str(), fmt(err[0], "%.1e").c_str(), fmt(err[1], "%.1e").c_str(),
                ok ? "" : " FAIL");
    std::fflush(stdout);
    for (void* p : {(void*)in, (void*)W, (void*)dy, C, C0, (void*)ref})
      if (p) Q3VL_CU(cudaFree(p));
    return ok;
  }
};

std::vector<Case> cases() {
  std::vector<Case> cs;
  // Training, 2B: hidden 2048, 16 q heads and 8 kv heads of 128, intermediate 6144, vocabulary 151936, 4 x 4096 tokens.
  const int64_t T = 4 * 4096, H = 2048;
  struct L { const char* name; int64_t n_in, n_out; bool dx_acc; };
  for (const L& l : {L{"2B q_proj / o_proj", H, 2048, false}, L{"2B k_proj / v_proj", H, 1024, true},
                     L{"2B gate_up", H, 2 * 6144, false}, L{"2B down", 6144, H, false}}) {
    cs.push_back({std::string(l.name) + " fwd", Op::Fwd, T, l.n_in, l.n_out});
    cs.push_back({std::string(l.name) + " dX", Op::Dx, T, l.n_in, l.n_out, l.dx_acc});
    cs.push_back({std::string(l.name) + " dW", Op::Dw, T, l.n_in, l.n_out});
  }
  const int64_t head_rows = 1024;  // dev_model.cpp's kHeadRows: the LM head runs in chunks of rows
  cs.push_back({"2B lm_head fwd (1024-row chunk)", Op::Fwd, head_rows, H, 151936});
  cs.push_back({"2B lm_head dX (1024-row chunk)", Op::Dx, head_rows, H, 151936});
  cs.push_back({"2B lm_head dW (1024-row chunk)", Op::Dw, head_rows, H, 151936});
  // Decode, 8B: hidden 4096, 32 q heads and 8 kv heads of 128 (qkv fused), intermediate 12288.
  struct D { const char* name; int64_t n_in, n_out; };
  for (const D& d : {D{"8B qkv", 4096, 6144}, D{"8B o_proj", 4096, 4096}, D{"8B gate_up", 4096, 24576},
                     D{"8B down", 12288, 4096}, D{"8B lm_head", 4096, 151936}})
    for (int64_t n : {1, 4, 8, 16, 32, 64}) cs.push_back({std::string(d.name) + " decode", Op::Fwd, n, d.n_in, d.n_out});
  return cs;
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = std::max(5, argc > 1 ? std::atoi(argv[1]) : 20);
  int failed = 0, n = 0;
  try {
    Bench b;
    b.reps = reps;
    b.x = dev::make_exec(Device::CUDA);  // 256 MiB of workspace, as the trainer's and serve's Execs
    b.st = dev::cuda::stream_of(b.x);
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    b.flush_bytes = 2 * size_t(prop.l2CacheSize);
    Q3VL_CU(cudaMalloc(&b.flush, b.flush_bytes));
    Q3VL_CU(cudaMalloc(&b.dbuf, 3 * sizeof(unsigned)));
    std::printf("# gemm_tune_bench on %s (L2 %d MB), bf16, median of %d reps after a %zu MB flush; off = the heuristic's "
                "first algorithm (the old path), on = run.gemm_tune's timed pick (rank/candidates)\n\n",
                prop.name, prop.l2CacheSize >> 20, reps, b.flush_bytes >> 20);
    std::printf("| case | M x N x K | off us | on us | off rate | on rate | speedup | pick | tune ms | err off | err on |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Case& c : cases()) {
      failed += !b.run(c);
      ++n;
    }
    const dev::GemmTuneStats s = dev::gemm_tune_stats();
    std::printf("\n%d of %d cases within bounds; tuning: %lld shapes timed in %.2f s, %lld won by another algorithm "
                "than the heuristic's first, %lld untimed\n",
                n - failed, n, (long long)s.timed, s.seconds, (long long)s.changed, (long long)s.untimed);
    Q3VL_CU(cudaFree(b.flush));
    Q3VL_CU(cudaFree(b.dbuf));
    dev::destroy_exec(b.x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gemm_tune_bench: %s\n", e.what());
    return 2;
  }
  if (failed) std::fprintf(stderr, "gemm_tune_bench: %d case(s) off the reference (rows marked FAIL)\n", failed);
  return failed ? 1 : 0;
}
