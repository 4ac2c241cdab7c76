// GEMM and linear layers through cuBLASLt. Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so the
// operands are swapped and no data moves. Descriptors and the chosen algorithm are cached per shape (heuristics
// cost far more than the matmul for small shapes). fp32 accumulation always (CUBLAS_COMPUTE_32F, no TF32).
#include <cstdint>
#include <map>
#include <mutex>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr size_t kGemmWs = size_t(32) << 20;  // the head of x.ws that cuBLASLt may use

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

struct Key {
  void* handle;
  bool ta, tb, bias;
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

std::mutex g_mu;
// Never destroyed: descriptors outlive static destruction order games; the map stays small (one entry per shape).
std::map<Key, Plan>& cache() {
  static auto* m = new std::map<Key, Plan>();
  return *m;
}

void destroy_plan(Plan& p) {
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  p = Plan{};
}

// The column-major problem: D'[N x M] = op'(B) [N x K] * op'(A) [K x M], op' = the row-major transposes swapped.
Plan make_plan(const Key& k, const void* bias) {
  Plan p;
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
  cublasLtMatmulHeuristicResult_t res{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(k.handle), p.op, p.a, p.b,
                                                           p.c, p.c, pref, 1, &res, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS &&
      res.workspaceSize <= k.ws) {
    p.algo = res.algo;
    p.ok = true;
  } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED) {
    Q3VL_CUBLAS(st);
  }
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
__global__ void k_colsum_part(const S* dy, int64_t N, int64_t n, int64_t rows_per, float* out, bool direct,
                              bool accumulate) {
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
    if (direct) out[col] = accumulate ? out[col] + s : s;  // single chunk: straight into db
    else out[blockIdx.y * n + col] = s;                      // partial of chunk blockIdx.y
  }
}
__global__ void k_colsum_final(const float* part, int64_t chunks, int64_t n, float* db, bool accumulate) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n; c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t y = 0; y < chunks; ++y) s += part[y * n + c];
    db[c] = accumulate ? db[c] + s : s;
  }
}

// `accumulate` false: db written (one chunk: its sum; more: the final sum), never read.
void colsum(const Exec& x, const void* dy, float* db, int64_t N, int64_t n, bool accumulate, DType dt) {
  if (n <= 0) return;
  if (N <= 0) {
    if (!accumulate) cuda::fill(x, db, DType::F32, n, 0.f);
    return;
  }
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
        static_cast<const S*>(dy), N, n, rows_per, part, direct, accumulate);
    Q3VL_LAUNCHED();
  });
  if (!direct) {
    k_colsum_final<<<grid_for(n), 256, 0, stream_of(x)>>>(part, chunks, n, db, accumulate);
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
  Key k{x.blas, ta, tb, bias != nullptr, M, N, K, lda, ldb, ldc, dt, ct,
        align_of(A), align_of(B), align_of(C), bias ? align_of(bias) : 0u, std::min(kGemmWs, x.ws_bytes)};
  std::lock_guard<std::mutex> lock(g_mu);  // also guards the bias pointer set on the shared descriptor
  auto& m = cache();
  auto it = m.find(k);
  if (it == m.end()) {
    if (m.size() >= 4096) {  // unbounded shape churn: start over rather than grow
      for (auto& [key, plan] : m) destroy_plan(plan);
      m.clear();
    }
    it = m.emplace(k, make_plan(k, bias)).first;
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
                int64_t N, int64_t n_in, int64_t n_out, bool accumulate, bool accumulate_dW, DType dt) {
  if (N <= 0) {  // nothing flows back from zero rows (the CPU reference adds nothing either); written: zeros
    if (dW && !accumulate_dW) cuda::fill(x, dW, DType::F32, n_out * n_in, 0.f);
    if (db) colsum(x, dy, db, 0, n_out, accumulate_dW, dt);
    return;
  }
  const float beta = accumulate ? 1.f : 0.f;  // 0: din = dy W, what a zeroed din accumulated (C not read)
  if (din) gemm_impl(x, false, false, N, n_in, n_out, 1.f, dy, n_out, W, n_in, beta, din, n_in, dt, dt, nullptr);
  if (dW)
    gemm_impl(x, true, false, n_out, n_in, N, 1.f, dy, n_out, in, n_in, accumulate_dW ? 1.f : 0.f, dW, n_in, dt,
              DType::F32, nullptr);
  if (db) colsum(x, dy, db, N, n_out, accumulate_dW, dt);
}

}  // namespace q3vl::dev::cuda
