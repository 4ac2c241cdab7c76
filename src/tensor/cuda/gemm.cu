// GEMM and linear layers through cuBLASLt. Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so the
// operands are swapped and no data moves. Descriptors and the chosen algorithm are cached per shape (heuristics
// cost far more than the matmul for small shapes). fp32 accumulation always (CUBLAS_COMPUTE_32F, no TF32).
//
// Autotuning (set_gemm_tune: deck run.gemm_tune, Q3VL_GEMM_TUNE=1/0): a shape's first call asks the heuristic for up
// to Q3VL_GEMM_TUNE_ALGOS (default 8) algorithms, times each on the call's own operands and stream (CUDA events: warm-
// ups, then the median of runs, each after an L2 flush, since a layer's weights arrive from HBM) and keeps the
// fastest; within 2% the heuristic's earlier rank wins, so timing noise rarely moves a pick. Timing never changes
// results: with beta = 0 the candidates write the caller's C, which the real GEMM then overwrites whole; with
// beta != 0 they write a zeroed scratch with the caller's beta (C's traffic is part of the cost: the LM head's fp32
// dW reads and writes 1.2 GB) and the caller's C is not touched. A shape first seen while its stream captures a graph
// cannot be timed and keeps the heuristic's first pick (DevModel runs a new decode bucket eagerly before recording
// it, so decode shapes are timed first). A shape's algorithm never changes once chosen. Picks are per process: ranks
// may pick differently and differ in the last bits, so serve turns tuning off where a tensor-parallel group must
// agree bit for bit (the MoE router, replicated on every rank).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr size_t kGemmWs = size_t(32) << 20;  // the head of x.ws that cuBLASLt may use
constexpr int kTuneWarm = 2, kTuneRuns = 5;    // per candidate: untimed runs (lazy module loads), then timed ones
constexpr float kTuneTie = 1.02f;              // within this of the fastest, the heuristic's earlier rank wins
constexpr int kMaxCandidates = 32;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: fail(std::string("gemm: unsupported dtype ") + dtype_name(t));
  }
}

// Largest power of two dividing the address, capped at 256 (cuBLASLt's default assumption).
uint32_t align_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a == 0) return 256;
  uint32_t al = 1;
  while (al < 256 && (a % (al * 2)) == 0) al *= 2;
  return al;
}

// Not beta: one algorithm for a shape whether it accumulates or not keeps dev.hpp's promise that a written gradient
// is bit for bit the accumulated one into zeros. tune: the plan was made with tuning on (a process that switches
// keeps both kinds apart, and tools/gpu/gemm_tune_bench compares them).
struct Key {
  void* handle;
  bool ta, tb, bias, tune;
  int64_t M, N, K, lda, ldb, ldc;
  DType dt, ct;
  uint32_t alA, alB, alC, alBias;
  size_t ws;
  auto operator<=>(const Key&) const = default;
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;  // false: no cuBLASLt algorithm; the fallback kernel runs
};

// The call a plan is first made for: tuning times the candidates on its operands.
struct Call {
  const Exec& x;
  float alpha, beta;
  const void *A, *B, *bias;
  void* C;
};

std::mutex g_mu;
// Never destroyed: descriptors outlive static destruction order games; the map stays small (one entry per shape).
std::map<Key, Plan>& cache() {
  static auto* m = new std::map<Key, Plan>();
  return *m;
}

// Q3VL_GEMM_TUNE: -1 unset, else 0 ("0") or 1 (anything else).
int env_tune() {
  static const int v = [] {
    const char* e = std::getenv("Q3VL_GEMM_TUNE");
    return e && *e ? (std::strcmp(e, "0") ? 1 : 0) : -1;
  }();
  return v;
}
// Candidates a tuned shape times: Q3VL_GEMM_TUNE_ALGOS, 1..kMaxCandidates, default 8.
int tune_algos() {
  static const int n = [] {
    const char* e = std::getenv("Q3VL_GEMM_TUNE_ALGOS");
    const int v = e ? std::atoi(e) : 0;
    return v > 0 ? std::min(v, kMaxCandidates) : 8;
  }();
  return n;
}
std::atomic<bool> g_tune{env_tune() == 1};
std::mutex g_stats_mu;
GemmTuneStats g_stats;

void destroy_plan(Plan& p) {
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  p = Plan{};
}

// The column-major problem: D'[N x M] = op'(B) [N x K] * op'(A) [K x M], op' = the row-major transposes swapped.
void describe(const Key& k, const void* bias, Plan& p) {
  Q3VL_CUBLAS(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opA = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's A is our B
  const cublasOperation_t opB = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's B is our A
  Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &opA, sizeof(opA)));
  Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &opB, sizeof(opB)));
  if (k.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const int32_t bt = int32_t(cuda_type(k.dt));
    Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
    // The heuristic reads the pointer's alignment.
    Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  const cudaDataType_t t = cuda_type(k.dt), tc = cuda_type(k.ct);
  // Stored (pre-transpose) shapes in column-major terms: a row-major [r, c] matrix is column-major [c, r].
  // Our B: row-major [K, N] (tb = false) or [N, K] (tb = true).
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, t, k.tb ? k.K : k.N, k.tb ? k.N : k.K, k.ldb));
  // Our A: row-major [M, K] (ta = false) or [K, M] (ta = true).
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, t, k.ta ? k.M : k.K, k.ta ? k.K : k.M, k.lda));
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, tc, k.N, k.M, k.ldc));
}

// The candidates: the heuristic's algorithms, best first. Not std::vector<cublasLtMatmulHeuristicResult_t>: a vector of
// that anonymous struct crashes nvcc 13.0's front end.
struct Candidate {
  cublasLtMatmulAlgo_t algo;
};
// Up to `count` (<= kMaxCandidates) algorithms for the plan's problem, the heuristic's best first, each within the
// workspace.
std::vector<Candidate> heuristics(const Key& k, const Plan& p, int count) {
  cublasLtMatmulPreference_t pref = nullptr;
  Q3VL_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = k.ws;
  Q3VL_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  Q3VL_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.alB, sizeof(k.alB)));
  Q3VL_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.alA, sizeof(k.alA)));
  Q3VL_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.alC, sizeof(k.alC)));
  Q3VL_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.alC, sizeof(k.alC)));
  cublasLtMatmulHeuristicResult_t res[kMaxCandidates] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(k.handle), p.op, p.a, p.b,
                                                           p.c, p.c, pref, std::min(count, kMaxCandidates), res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) Q3VL_CUBLAS(st);
  std::vector<Candidate> ok;
  for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < std::min(found, kMaxCandidates); ++i)
    if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= k.ws) ok.push_back({res[i].algo});
  return ok;
}

// Whether [p, p + n) and the operand at q (m bytes) share a byte.
bool overlaps(const char* p, size_t n, const void* q, size_t m) {
  const char* c = static_cast<const char*>(q);
  return q && p < c + m && c < p + n;
}

// Device memory for the timing: the part of Exec::ws past cuBLASLt's share when it is large enough and holds none of
// the call's operands (no op keeps anything in ws between ops; q8.cu's tiles sit past the smaller ws_bytes it hands
// the GEMM), else a stream-ordered allocation, freed behind the timing. Null when neither is to be had.
class TuneMemory {
 public:
  TuneMemory(const Call& c, const Key& k, size_t bytes) : s_(stream_of(c.x)) {
    const size_t head = (k.ws + 255) / 256 * 256, es = dtype_size(k.dt);
    char* tail = static_cast<char*>(c.x.ws) + head;
    const bool clear = c.x.ws && c.x.ws_bytes >= head + bytes &&
                       !overlaps(tail, bytes, c.A, size_t((k.ta ? k.K : k.M) * k.lda) * es) &&
                       !overlaps(tail, bytes, c.B, size_t((k.tb ? k.N : k.K) * k.ldb) * es) &&
                       !overlaps(tail, bytes, c.C, size_t(k.M * k.ldc) * dtype_size(k.ct)) &&
                       !overlaps(tail, bytes, c.bias, size_t(k.N) * es);
    if (clear) {
      p_ = tail;
      return;
    }
    if (cudaMallocAsync(&p_, bytes, s_) == cudaSuccess) {
      owned_ = true;
      return;
    }
    (void)cudaGetLastError();  // out of memory is not sticky: this shape does without timing
    p_ = nullptr;
  }
  ~TuneMemory() {
    if (owned_) (void)cudaFreeAsync(p_, s_);
  }
  TuneMemory(const TuneMemory&) = delete;
  TuneMemory& operator=(const TuneMemory&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  cudaStream_t s_;
  void* p_ = nullptr;
  bool owned_ = false;
};

struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(size_t n) : e(n, nullptr) {
    for (auto& v : e) Q3VL_CU(cudaEventCreate(&v));
  }
  ~Events() {
    for (auto v : e)
      if (v) cudaEventDestroy(v);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
};

// Times every candidate on the call's operands (the file's comment says how) and returns the index of the fastest,
// or of the heuristic's earliest within kTuneTie of it; -1 when it cannot time (a capturing stream, no memory).
int fastest(const Key& k, const Plan& p, const std::vector<Candidate>& cand, const Call& c) {
  const cudaStream_t s = stream_of(c.x);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  Q3VL_CU(cudaStreamIsCapturing(s, &cs));
  if (cs != cudaStreamCaptureStatusNone) return -1;  // nothing runs while capturing (nor after an invalidated one)
  int l2 = 0;
  Q3VL_CU(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, c.x.gpu));
  const size_t flush = 2 * size_t(std::max(l2, 0));
  const size_t c_bytes =
      c.beta == 0.f ? 0 : (size_t((k.M - 1) * k.ldc + k.N) * dtype_size(k.ct) + 255) / 256 * 256;  // C's rows at ldc
  TuneMemory mem(c, k, c_bytes + flush);
  if (!mem.get()) return -1;
  void* C = c_bytes ? mem.get() : c.C;
  if (c_bytes) Q3VL_CU(cudaMemsetAsync(C, 0, c_bytes, s));
  auto matmul = [&](size_t i) {
    return cublasLtMatmul(static_cast<cublasLtHandle_t>(k.handle), p.op, &c.alpha, c.B, p.a, c.A, p.b, &c.beta, C,
                          p.c, C, p.c, &cand[i].algo, c.x.ws, k.ws, s);
  };
  const size_t n = cand.size();
  Events ev(2 * kTuneRuns * n);
  std::vector<bool> ran(n, false);
  for (size_t i = 0; i < n; ++i) {
    bool ok = true;
    for (int w = 0; w < kTuneWarm && ok; ++w) ok = matmul(i) == CUBLAS_STATUS_SUCCESS;  // a refusal: not a candidate
    if (!ok) continue;
    for (int r = 0; r < kTuneRuns; ++r) {
      // The flush also keeps the GPU busy while the host enqueues the next run: no launch gap between the events.
      if (flush) Q3VL_CU(cudaMemsetAsync(mem.get() + c_bytes, r, flush, s));
      Q3VL_CU(cudaEventRecord(ev.e[2 * (i * kTuneRuns + r)], s));
      Q3VL_CUBLAS(matmul(i));
      Q3VL_CU(cudaEventRecord(ev.e[2 * (i * kTuneRuns + r) + 1], s));
    }
    ran[i] = true;
  }
  Q3VL_CU(cudaStreamSynchronize(s));
  std::vector<float> med(n, INFINITY);
  float best = INFINITY;
  for (size_t i = 0; i < n; ++i) {
    if (!ran[i]) continue;
    float t[kTuneRuns];
    for (int r = 0; r < kTuneRuns; ++r)
      Q3VL_CU(cudaEventElapsedTime(&t[r], ev.e[2 * (i * kTuneRuns + r)], ev.e[2 * (i * kTuneRuns + r) + 1]));
    std::nth_element(t, t + kTuneRuns / 2, t + kTuneRuns);
    med[i] = t[kTuneRuns / 2];
    best = std::min(best, med[i]);
  }
  for (size_t i = 0; i < n; ++i)
    if (ran[i] && med[i] <= best * kTuneTie) return int(i);
  return -1;
}

// The plan for k: its descriptors and algorithm, the heuristic's first or, with k.tune, the fastest on the call.
Plan make_plan(const Key& k, const Call& c) {
  Plan p;
  describe(k, c.bias, p);
  const auto t0 = std::chrono::steady_clock::now();
  const auto cand = heuristics(k, p, k.tune ? tune_algos() : 1);
  if (cand.empty()) return p;
  int pick = 0;
  if (k.tune && cand.size() > 1) {
    const int f = fastest(k, p, cand, c);
    pick = std::max(f, 0);
    std::lock_guard<std::mutex> lock(g_stats_mu);
    if (f < 0) {
      ++g_stats.untimed;
    } else {
      ++g_stats.timed;
      g_stats.changed += f > 0;
      g_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      g_stats.last_pick = f;
      g_stats.last_candidates = int(cand.size());
    }
  }
  p.algo = cand[size_t(pick)].algo;
  p.ok = true;
  return p;
}

// Fallback for shapes cuBLASLt declines (odd strides/alignments) and K = 0: 16x16 tiles, fp32 accumulation.
constexpr int kT = 16;
template <class S, class SC>
__global__ void k_gemm_simple(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const S* A, int64_t lda,
                              const S* B, int64_t ldb, float beta, SC* C, int64_t ldc) {
  __shared__ float As[kT][kT + 1], Bs[kT][kT + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t tilesM = (M + kT - 1) / kT, tilesN = (N + kT - 1) / kT;
  for (int64_t tm = blockIdx.y; tm < tilesM; tm += gridDim.y)
    for (int64_t tn = blockIdx.x; tn < tilesN; tn += gridDim.x) {
      const int64_t i = tm * kT + ty, j = tn * kT + tx;
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < K; k0 += kT) {
        {  // As[ty][tx] = op(A)(tm*kT + ty, k0 + tx)
          const int64_t r = tm * kT + ty, c = k0 + tx;
          As[ty][tx] = (r < M && c < K) ? ld(A, ta ? c * lda + r : r * lda + c) : 0.f;
        }
        {  // Bs[ty][tx] = op(B)(k0 + ty, tn*kT + tx)
          const int64_t r = k0 + ty, c = tn * kT + tx;
          Bs[ty][tx] = (r < K && c < N) ? ld(B, tb ? c * ldb + r : r * ldb + c) : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kT; ++kk) acc += As[ty][kk] * Bs[kk][tx];
        __syncthreads();
      }
      if (i < M && j < N) {
        const float old = beta == 0.f ? 0.f : beta * ld(C, i * ldc + j);  // beta = 0: C is not read (BLAS)
        st(C, i * ldc + j, alpha * acc + old);
      }
    }
}

// y[r, :] = b for every row (the bias when the epilogue is not used; the GEMM then runs with beta = 1).
template <class S>
__global__ void k_bias_rows(S* y, const S* b, int64_t N, int64_t n_out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < N * n_out; i += int64_t(gridDim.x) * blockDim.x)
    y[i] = b[i % n_out];
}

// Column sums of dy[N, n] into db (F32, +=), deterministic: block (32 columns x 8 row lanes) over a row chunk,
// per-chunk partials in the workspace, then a fixed-order sum over chunks.
template <class S>
__global__ void k_colsum_part(const S* dy, int64_t N, int64_t n, int64_t rows_per, float* out, bool accumulate) {
  __shared__ float sh[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per, r1 = min(N, r0 + rows_per);
  float acc = 0.f;
  if (col < n)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += ld(dy, r * n + col);
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float s = 0.f;
    for (int y = 0; y < 8; ++y) s += sh[y][threadIdx.x];
    if (accumulate) out[col] += s;           // single chunk: straight into db
    else out[blockIdx.y * n + col] = s;      // partial of chunk blockIdx.y
  }
}
__global__ void k_colsum_final(const float* part, int64_t chunks, int64_t n, float* db) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n; c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t y = 0; y < chunks; ++y) s += part[y * n + c];
    db[c] += s;
  }
}

void colsum(const Exec& x, const void* dy, float* db, int64_t N, int64_t n, DType dt) {
  if (N <= 0 || n <= 0) return;
  const int64_t tiles = (n + 31) / 32;
  int64_t chunks = std::max<int64_t>(1, 1024 / tiles);
  chunks = std::min<int64_t>(chunks, (N + 63) / 64);  // at least 64 rows a chunk
  chunks = std::min<int64_t>(chunks, int64_t(x.ws_bytes / (sizeof(float) * size_t(n))));
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per = (N + chunks - 1) / chunks;
  chunks = (N + rows_per - 1) / rows_per;
  const bool direct = chunks == 1;
  float* part = direct ? db : static_cast<float*>(x.ws);
  by_dtype(dt, [&]<class S>() {
    k_colsum_part<S><<<dim3(unsigned(tiles), unsigned(chunks)), dim3(32, 8), 0, stream_of(x)>>>(
        static_cast<const S*>(dy), N, n, rows_per, part, direct);
    Q3VL_LAUNCHED();
  });
  if (!direct) {
    k_colsum_final<<<grid_for(n), 256, 0, stream_of(x)>>>(part, chunks, n, db);
    Q3VL_LAUNCHED();
  }
}

void gemm_fallback(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
                   int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct) {
  const int64_t tm = (M + kT - 1) / kT, tn = (N + kT - 1) / kT;
  const dim3 grid(unsigned(std::min<int64_t>(tn, 65535)), unsigned(std::min<int64_t>(tm, 65535)));
  by_dtype(dt, [&]<class S>() {
    if (ct == DType::F32) {
      k_gemm_simple<S, float><<<grid, dim3(kT, kT), 0, stream_of(x)>>>(
          ta, tb, M, N, K, alpha, static_cast<const S*>(A), lda, static_cast<const S*>(B), ldb, beta,
          static_cast<float*>(C), ldc);
    } else {
      k_gemm_simple<S, S><<<grid, dim3(kT, kT), 0, stream_of(x)>>>(ta, tb, M, N, K, alpha, static_cast<const S*>(A),
                                                                   lda, static_cast<const S*>(B), ldb, beta,
                                                                   static_cast<S*>(C), ldc);
    }
    Q3VL_LAUNCHED();
  });
}

// One GEMM, optionally with the bias epilogue (bias in dt, length N, broadcast over the M rows of row-major C).
// Returns false when a bias was asked for and no epilogue algorithm exists (the caller then adds it otherwise).
bool gemm_impl(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
               int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct,
               const void* bias) {
  if (M <= 0 || N <= 0) return true;
  if (ct != dt && ct != DType::F32)
    fail(std::string("gemm: C must be in the operands' dtype or F32, not ") + dtype_name(ct));
  cuda_type(dt);
  if (K <= 0) {
    if (bias) return false;
    gemm_fallback(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct);  // C = beta * C
    return true;
  }
  const bool tune = g_tune.load(std::memory_order_relaxed);
  Key k{x.blas, ta, tb, bias != nullptr, tune, M, N, K, lda, ldb, ldc, dt, ct,
        align_of(A), align_of(B), align_of(C), bias ? align_of(bias) : 0u, std::min(kGemmWs, x.ws_bytes)};
  std::unique_lock<std::mutex> lock(g_mu);  // also guards the bias pointer set on the shared descriptor
  auto& m = cache();
  auto it = m.find(k);
  if (it == m.end()) {
    // Tuning waits for the stream: not under the lock, so other threads' GEMMs (other GPUs') go on meanwhile.
    if (tune) lock.unlock();
    Plan fresh = make_plan(k, Call{x, alpha, beta, A, B, bias, C});
    if (tune) lock.lock();
    it = m.find(k);
    if (it != m.end()) {  // another thread made it meanwhile
      destroy_plan(fresh);
    } else {
      if (m.size() >= 4096) {  // unbounded shape churn: start over rather than grow
        for (auto& [key, plan] : m) destroy_plan(plan);
        m.clear();
      }
      it = m.emplace(k, fresh).first;
    }
  }
  Plan& p = it->second;
  if (!p.ok) {
    if (bias) return false;
    gemm_fallback(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct);
    return true;
  }
  if (bias)
    Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  Q3VL_CUBLAS(cublasLtMatmul(static_cast<cublasLtHandle_t>(x.blas), p.op, &alpha, B, p.a, A, p.b, &beta, C, p.c, C,
                             p.c, &p.algo, x.ws, k.ws, stream_of(x)));
  return true;
}

}  // namespace

void gemm(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct) {
  gemm_impl(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct, nullptr);
}

void linear_fwd(const Exec& x, const void* in, const void* W, const void* b, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt) {
  if (N <= 0 || n_out <= 0) return;
  // The bias epilogue needs a 16-byte aligned bias; otherwise (or if no algorithm) broadcast b and use beta = 1.
  if (b && align_of(b) >= 16 &&
      gemm_impl(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, 0.f, y, n_out, dt, dt, b))
    return;
  if (b) {
    by_dtype(dt, [&]<class S>() {
      k_bias_rows<S><<<grid_for(N * n_out), 256, 0, stream_of(x)>>>(static_cast<S*>(y), static_cast<const S*>(b), N,
                                                                    n_out);
      Q3VL_LAUNCHED();
    });
  }
  gemm_impl(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, b ? 1.f : 0.f, y, n_out, dt, dt, nullptr);
}

void linear_bwd(const Exec& x, const void* dy, const void* in, const void* W, void* din, float* dW, float* db,
                int64_t N, int64_t n_in, int64_t n_out, bool accumulate, DType dt) {
  if (N <= 0) return;  // nothing flows back from zero rows (the CPU reference adds nothing either)
  const float beta = accumulate ? 1.f : 0.f;  // 0: din = dy W, what a zeroed din accumulated (C not read)
  if (din) gemm_impl(x, false, false, N, n_in, n_out, 1.f, dy, n_out, W, n_in, beta, din, n_in, dt, dt, nullptr);
  if (dW) gemm_impl(x, true, false, n_out, n_in, N, 1.f, dy, n_out, in, n_in, 1.f, dW, n_in, dt, DType::F32, nullptr);
  if (db) colsum(x, dy, db, N, n_out, dt);
}

void set_gemm_tune(bool on, bool env_wins) {
  const int e = env_tune();
  g_tune.store(env_wins && e >= 0 ? e == 1 : on);
}

bool gemm_tune() { return g_tune.load(); }

GemmTuneStats gemm_tune_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mu);
  return g_stats;
}

}  // namespace q3vl::dev::cuda
