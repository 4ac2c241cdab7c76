// GEMM and linear layers through cuBLASLt. Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so the
// operands are swapped and no data moves. Descriptors and the chosen algorithm are cached per shape (heuristics
// cost far more than the matmul for small shapes). fp32 accumulation always (CUBLAS_COMPUTE_32F, no TF32).
// Batched linears (linear_fwd_batched / linear_bwd_batched) are cuBLASLt strided batches: every layout of the plan
// carries the batch count and its stride (0: one matrix read by every problem), the bias epilogue its bias stride.
#include <cstdint>
#include <map>
#include <mutex>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv.cuh"

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
// The alignment every matrix of a strided batch has: the first one's, and the stride's in bytes (0: all one matrix).
uint32_t align_of(const void* p, int64_t stride, DType t) {
  const uint32_t a = align_of(p);
  if (stride == 0) return a;
  const uint32_t s = align_of(reinterpret_cast<const void*>(uintptr_t(stride) * dtype_size(t)));
  return a < s ? a : s;
}
const void* off(const void* p, int64_t n, DType t) { return static_cast<const char*>(p) + n * int64_t(dtype_size(t)); }
void* off(void* p, int64_t n, DType t) { return static_cast<char*>(p) + n * int64_t(dtype_size(t)); }

// A strided batch of `count` GEMMs of one shape: matrix j of A at A + j*a elements, of B, C and the bias likewise
// (0: one matrix shared by every problem; C's must keep the problems apart). count 1: one GEMM, strides unused.
struct Strided {
  int64_t count = 1, a = 0, b = 0, c = 0, bias = 0;
};

struct Key {
  void* handle;
  bool ta, tb, bias;
  int64_t M, N, K, lda, ldb, ldc;
  DType dt, ct;
  uint32_t alA, alB, alC, alBias;  // of every matrix of a batch (align_of with the stride)
  size_t ws;
  int64_t count, sA, sB, sC, sBias;  // the batch (1, 0, 0, 0, 0 for one GEMM)
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
    // A batch's bias vectors, one per problem (elements apart; 0: one bias for all).
    if (k.count > 1)
      Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, &k.sBias,
                                                 sizeof(k.sBias)));
  }
  const cudaDataType_t t = cuda_type(k.dt), tc = cuda_type(k.ct);
  // Stored (pre-transpose) shapes in column-major terms: a row-major [r, c] matrix is column-major [c, r].
  // Our B: row-major [K, N] (tb = false) or [N, K] (tb = true).
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.a, t, k.tb ? k.K : k.N, k.tb ? k.N : k.K, k.ldb));
  // Our A: row-major [M, K] (ta = false) or [K, M] (ta = true).
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.b, t, k.ta ? k.M : k.K, k.ta ? k.K : k.M, k.lda));
  Q3VL_CUBLAS(cublasLtMatrixLayoutCreate(&p.c, tc, k.N, k.M, k.ldc));
  if (k.count > 1) {  // every layout the same count, each its own stride (cuBLAS's A is our B, its B our A)
    const int32_t n = int32_t(k.count);
    auto batch = [&](cublasLtMatrixLayout_t l, int64_t stride) {
      Q3VL_CUBLAS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof(n)));
      Q3VL_CUBLAS(
          cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    };
    batch(p.a, k.sB);
    batch(p.b, k.sA);
    batch(p.c, k.sC);  // C and D: the same layout
  }

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
// per-chunk partials in the workspace, then a fixed-order sum over chunks. A batch: blockIdx.z is the problem, its dy
// sdy elements on, its output sout (db's stride, or its own partials' region).
template <class S>
__global__ void k_colsum_part(const S* dy, int64_t N, int64_t n, int64_t rows_per, float* out, bool direct,
                              bool accumulate, int64_t sdy, int64_t sout) {
  __shared__ float sh[8][33];
  dy += blockIdx.z * sdy;
  out += blockIdx.z * sout;
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
__global__ void k_colsum_final(const float* part, int64_t chunks, int64_t n, float* db, bool accumulate, int64_t sdb) {
  part += blockIdx.y * chunks * n;  // problem blockIdx.y's partials, and its db
  db += blockIdx.y * sdb;
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n; c += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.f;
    for (int64_t y = 0; y < chunks; ++y) s += part[y * n + c];
    db[c] = accumulate ? db[c] + s : s;
  }
}

// db (+)= the column sums of dy (`accumulate` false: db written, never read; no rows: zeros); a batch of `count`
// (dy_j at j*sdy elements, db_j at j*sdb, sdb > 0) in one launch each, the problems' partials side by side in the
// workspace.
void colsum(const Exec& x, const void* dy, float* db, int64_t N, int64_t n, bool accumulate, DType dt,
            int64_t count = 1, int64_t sdy = 0, int64_t sdb = 0) {
  if (n <= 0 || count <= 0) return;
  if (N <= 0 || count > 65535) {  // no rows (zeros unless accumulated), or past gridDim.z: the problems one by one
    for (int64_t j = 0; j < count; ++j) {
      if (N <= 0 && !accumulate) cuda::fill(x, db + j * sdb, DType::F32, n, 0.f);
      if (N > 0) colsum(x, off(dy, j * sdy, dt), db + j * sdb, N, n, accumulate, dt);
    }
    return;
  }
  const int64_t tiles = (n + 31) / 32;
  int64_t chunks = std::max<int64_t>(1, 1024 / (tiles * count));
  chunks = std::min<int64_t>(chunks, (N + 63) / 64);  // at least 64 rows a chunk
  chunks = std::min<int64_t>(chunks, int64_t(x.ws_bytes / (sizeof(float) * size_t(n) * size_t(count))));
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per = (N + chunks - 1) / chunks;
  chunks = (N + rows_per - 1) / rows_per;
  const bool direct = chunks == 1;
  float* part = direct ? db : static_cast<float*>(x.ws);
  by_dtype(dt, [&]<class S>() {
    k_colsum_part<S><<<dim3(unsigned(tiles), unsigned(chunks), unsigned(count)), dim3(32, 8), 0, stream_of(x)>>>(
        static_cast<const S*>(dy), N, n, rows_per, part, direct, accumulate, sdy, direct ? sdb : chunks * n);
    Q3VL_LAUNCHED();
  });
  if (!direct) {
    k_colsum_final<<<dim3(unsigned(grid_for(n)), unsigned(count)), 256, 0, stream_of(x)>>>(part, chunks, n, db,
                                                                                           accumulate, sdb);
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

// One GEMM, or a strided batch of them (sb), optionally with the bias epilogue (bias in dt, length N, broadcast over
// the M rows of row-major C; a batch's at sb.bias apart). Returns false when a bias was asked for and no epilogue
// algorithm exists (the caller then adds it otherwise; nothing was computed). A batch cuBLASLt has no algorithm for
// (or K = 0) runs problem by problem.
bool gemm_impl(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A,
               int64_t lda, const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct,
               const void* bias, Strided sb = {}) {
  if (M <= 0 || N <= 0 || sb.count <= 0) return true;
  if (ct != dt && ct != DType::F32)
    fail(std::string("gemm: C must be in the operands' dtype or F32, not ") + dtype_name(ct));
  cuda_type(dt);
  if (sb.count == 1) sb = Strided{};  // one GEMM: one key whatever strides came along
  if (sb.count > 1 && sb.c == 0) fail("gemm: a batch's problems cannot write one C");
  auto one_by_one = [&] {
    for (int64_t j = 0; j < sb.count; ++j)
      gemm_impl(x, ta, tb, M, N, K, alpha, off(A, j * sb.a, dt), lda, off(B, j * sb.b, dt), ldb, beta,
                off(C, j * sb.c, ct), ldc, dt, ct, nullptr);
  };
  if (K <= 0) {
    if (bias) return false;
    if (sb.count > 1) one_by_one();
    else gemm_fallback(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct);  // C = beta * C
    return true;
  }
  if (sb.count > INT32_MAX) fail("gemm: a batch of more than 2^31 - 1 problems");
  Key k{x.blas, ta, tb, bias != nullptr, M, N, K, lda, ldb, ldc, dt, ct,
        align_of(A, sb.a, dt), align_of(B, sb.b, dt), align_of(C, sb.c, ct),
        bias ? align_of(bias, sb.bias, dt) : 0u, std::min(kGemmWs, x.ws_bytes),
        sb.count, sb.a, sb.b, sb.c, bias ? sb.bias : 0};
  {
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
    if (p.ok) {
      if (bias)
        Q3VL_CUBLAS(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
      Q3VL_CUBLAS(cublasLtMatmul(static_cast<cublasLtHandle_t>(x.blas), p.op, &alpha, B, p.a, A, p.b, &beta, C, p.c,
                                 C, p.c, &p.algo, x.ws, k.ws, stream_of(x)));
      return true;
    }
  }
  if (bias) return false;
  if (sb.count > 1) one_by_one();  // each problem its own plan (or the fallback kernel); outside the lock
  else gemm_fallback(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct);
  return true;
}

}  // namespace

void gemm(const Exec& x, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
          const void* B, int64_t ldb, float beta, void* C, int64_t ldc, DType dt, DType ct) {
  gemm_impl(x, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, dt, ct, nullptr);
}

void linear_fwd(const Exec& x, const void* in, const void* W, const void* b, void* y, int64_t N, int64_t n_in,
                int64_t n_out, DType dt, const RowsIn& rin, bool add) {
  if (N <= 0 || n_out <= 0) return;
  // Up to 8 rows of 16-bit x (decode steps): the TMA-fed GEMV only when Q3VL_GEMV_TMA=1 (an H100 stream's bf16 step
  // 6.73 -> 6.38 ms; the H200's 5.02 -> 5.24: cuBLASLt by default, gemv_tma.cuh's tma_wanted).
  if (N <= wgemv::kTmaNb && (dt == DType::BF16 || dt == DType::F16) &&
      wgemv::tma_wanted(N, n_in, n_out, dtype_size(dt), true)) {
    bool taken = false;
    by_dtype(dt, [&]<class S>() {
      if constexpr (!std::is_same_v<S, float>)
        taken = wgemv::gemv_tma<S, S>(x, static_cast<const S*>(in), static_cast<const S*>(W), nullptr,
                                      static_cast<const S*>(b), static_cast<S*>(y), N, n_in, n_out,
                                      wgemv::x_rows(rin), add);
    });
    if (taken) return;
  }
  in = rows_in(x, in, rin, N, n_in, dt);  // cuBLASLt reads the rows written out
  if (add) {  // the residual add in the epilogue (one rounding), as linear_q8_fwd's GEMM path
    Q3VL_CHECK(!b, "dev::linear_fwd: add with a bias");
    return void(gemm_impl(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, 1.f, y, n_out, dt, dt, nullptr));
  }
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

// y_j = in_j W_j^T (+ b_j): one strided-batched GEMM, in_j = in + j*bt.in etc. (the public op checked the strides).
void linear_fwd_batched(const Exec& x, const void* in, const void* W, const void* b, void* y, int64_t N, int64_t n_in,
                        int64_t n_out, const LinearBatch& bt, DType dt) {
  if (N <= 0 || n_out <= 0 || bt.count <= 0) return;
  // Row-major y[N, n_out] = in[N, n_in] W[n_out, n_in]^T: A = in, B = W, C = y, the bias one per problem.
  const Strided sb{bt.count, bt.in, bt.W, bt.y, bt.b};
  // As linear_fwd: the bias epilogue when every problem's bias is 16-byte aligned and an algorithm takes it.
  if (b && align_of(b, bt.count > 1 ? bt.b : 0, dt) >= 16 &&
      gemm_impl(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, 0.f, y, n_out, dt, dt, b, sb))
    return;
  if (b) {
    by_dtype(dt, [&]<class S>() {
      for (int64_t j = 0; j < bt.count; ++j) {
        k_bias_rows<S><<<grid_for(N * n_out), 256, 0, stream_of(x)>>>(
            static_cast<S*>(off(y, j * bt.y, dt)), static_cast<const S*>(off(b, j * bt.b, dt)), N, n_out);
        Q3VL_LAUNCHED();
      }
    });
  }
  gemm_impl(x, false, true, N, n_out, n_in, 1.f, in, n_in, W, n_in, b ? 1.f : 0.f, y, n_out, dt, dt, nullptr, sb);
}

// linear_bwd over the batch. dW and db, one batched GEMM and one column-sum launch each unless shared (stride 0: each
// problem adds to the one gradient). din: one batched GEMM when each problem has its own; when shared (the qkv case,
// in = 0) it is the sum of the problems' dy_j W_j, which no batched GEMM writes (its problems write disjoint
// outputs), so the problems' GEMMs accumulate into it in turn, the first one writing it unless `accumulate`.
void linear_bwd_batched(const Exec& x, const void* dy, const void* in, const void* W, void* din, float* dW, float* db,
                        int64_t N, int64_t n_in, int64_t n_out, const LinearBatch& bt, bool accumulate,
                        bool accumulate_dW, DType dt) {
  if (bt.count <= 0) return;
  const int64_t n = bt.count;
  if (N <= 0) {  // nothing flows back from zero rows (as linear_bwd); written gradients: zeros
    if (dW && !accumulate_dW)
      for (int64_t j = 0; j < (bt.W == 0 ? 1 : n); ++j) cuda::fill(x, dW + j * bt.W, DType::F32, n_out * n_in, 0.f);
    if (db) colsum(x, dy, db, 0, n_out, accumulate_dW, dt, bt.b == 0 ? 1 : n, 0, bt.b);
    return;
  }
  const float beta = accumulate ? 1.f : 0.f, beta_w = accumulate_dW ? 1.f : 0.f;
  if (din) {  // row-major din[N, n_in] (+)= dy[N, n_out] W[n_out, n_in]
    if (bt.in == 0 && n > 1) {
      for (int64_t j = 0; j < n; ++j)
        gemm_impl(x, false, false, N, n_in, n_out, 1.f, off(dy, j * bt.y, dt), n_out, off(W, j * bt.W, dt), n_in,
                  j > 0 ? 1.f : beta, din, n_in, dt, dt, nullptr);
    } else {
      gemm_impl(x, false, false, N, n_in, n_out, 1.f, dy, n_out, W, n_in, beta, din, n_in, dt, dt, nullptr,
                Strided{n, bt.y, bt.W, bt.in, 0});
    }
  }
  if (dW) {  // row-major dW[n_out, n_in] (+)= dy[N, n_out]^T in[N, n_in] (F32); in shared (stride 0) or not
    if (bt.W == 0 && n > 1) {
      for (int64_t j = 0; j < n; ++j)
        gemm_impl(x, true, false, n_out, n_in, N, 1.f, off(dy, j * bt.y, dt), n_out, off(in, j * bt.in, dt), n_in,
                  j > 0 ? 1.f : beta_w, dW, n_in, dt, DType::F32, nullptr);
    } else {
      gemm_impl(x, true, false, n_out, n_in, N, 1.f, dy, n_out, in, n_in, beta_w, dW, n_in, dt, DType::F32, nullptr,
                Strided{n, bt.y, bt.in, bt.W, 0});
    }
  }
  if (db) {
    if (bt.b == 0 && n > 1) {
      for (int64_t j = 0; j < n; ++j) colsum(x, off(dy, j * bt.y, dt), db, N, n_out, j > 0 || accumulate_dW, dt);
    } else {
      colsum(x, dy, db, N, n_out, accumulate_dW, dt, n, bt.y, bt.b);
    }
  }
}

}  // namespace q3vl::dev::cuda
