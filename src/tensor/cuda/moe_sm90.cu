// Grouped expert GEMM for Hopper (sm_90a): wgmma, called by moe.cu's grouped<MODE> for bf16/fp16 on a
// compute-capability 9.0 device, with moe.cu's k_grouped semantics:
//   FWD: y[s+m, n]  = sum_k xg[s+m, k] W[e][n, k]      (M rows, K = n_in, N = n_out; A, B K-major)
//   DX:  dxg[s+m, n] (+)= sum_k dy[s+m, k] W[e][k, n]  (M rows, K = n_out, N = n_in; B N-major: the transpose bit)
//   DW:  dW[e][m, n] (+)= sum_k dy[s+k, m] xg[s+k, n]  (M = n_out, N = n_in, K rows; A M-major, B N-major; F32)
// A block is 2 warpgroups and a 128 x 256 output tile of one expert: FWD/DX's blockIdx.y walks the M tiles of all
// experts back to back (moe.cu's tile_prefix, in tiles of 128 rows), DW's blockIdx.z is the expert; blockIdx.x the
// N tiles. Warpgroup w owns rows [64w, 64w+64) as two m64n128 accumulators (the N halves). K goes in tiles of 64:
// a K-major operand is one swizzled 128-byte panel of its 128 or 256 rows, an MN-major one 2 or 4 panels of 64
// k-rows (wgmma.cuh's layout, as attention_sm90.cu's V). DW's tile leaves through shared memory (grouped_dw.cuh).
// cp.async keeps 3 tiles in flight, the next one's copies issued while a tile's 8 wgmmas a warpgroup run; those are
// waited for before the next barrier, which then frees their stage.
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/grouped_dw.cuh"
#include "tensor/cuda/wgmma.cuh"

namespace q3vl::dev::cuda {
namespace {


enum Mode { FWD = 0, DX = 1, DW = 2 };  // as moe.cu's
constexpr int kThreads = 256, kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kLdc = kBN + 8;  // floats: DW's staged tile row stride, 8 mod 32 banks (conflict-free float2 writes)
constexpr uint32_t kTA = kBM * kBK * 2, kTB = kBN * kBK * 2;    // bytes a stage of A and of B (16-bit elements)
constexpr size_t kSmem = size_t(kStages) * (kTA + kTB) + 1024;  // + slack to align the stages to 1024
static_assert((kTA + kTB) % 1024 == 0, "every panel 1024-aligned");
static_assert(size_t(kBM) * kLdc * 4 <= kSmem, "DW's staged tile fits the pipeline buffers");

// Rows [r0, r0 + ROWS) x columns [c0, c0 + 64) of a row-major operand (row stride ld) into the swizzled panel at s,
// zero outside rows < rmax and columns < cmax (cmax % 8 == 0: whole 16-byte chunks). Consecutive threads copy
// consecutive chunks of a row (coalesced reads; the XOR keeps the 8 chunks of a row a permutation of its 128 bytes).
template <class S, int ROWS>
__device__ __forceinline__ void load_panel(uint32_t s, const S* g, int64_t ld, int64_t r0, int64_t c0, int64_t rmax,
                                           int64_t cmax, int tid) {
#pragma unroll
  for (int c = tid; c < ROWS * 8; c += kThreads) {
    const int r = c >> 3, ch = c & 7;
    const bool ok = r0 + r < rmax && c0 + 8 * ch < cmax;
    cp16(s + r * 128 + ((ch ^ (r & 7)) << 4), ok ? g + (r0 + r) * ld + c0 + 8 * ch : g, ok);
  }
}

// C: S for FWD/DX, float for DW.
template <class S, int MODE>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgmma(const S* __restrict__ A, const S* __restrict__ B, void* __restrict__ C,
                  const int32_t* __restrict__ start, const int32_t* __restrict__ tile_prefix, int E, int64_t n_in,
                  int64_t n_out, bool accumulate) {
#ifdef Q3VL_WGMMA
  constexpr bool A_KC = MODE != DW, B_KC = MODE == FWD;  // the operand's contiguous dimension is k
  extern __shared__ __align__(16) unsigned char smraw[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smraw)) + 1023u) & ~1023u;
  int e = 0;
  int64_t m0;
  if constexpr (MODE == DW) {
    e = blockIdx.z;
    m0 = int64_t(blockIdx.y) * kBM;
  } else {
    const int32_t t = int32_t(blockIdx.y);
    if (t >= tile_prefix[E]) return;
    for (int hi = E - 1; e < hi;) {  // the last expert with tile_prefix[e] <= t (empty ones share their successor's)
      const int mid = (e + hi + 1) / 2;
      if (tile_prefix[mid] <= t) e = mid;
      else hi = mid - 1;
    }
    m0 = int64_t(t - tile_prefix[e]) * kBM;
  }
  const int64_t s = start[e], rows = start[e + 1] - s;
  const int64_t M = MODE == DW ? n_out : rows, N = MODE == FWD ? n_out : n_in, K = MODE == FWD ? n_in
                                                                                : MODE == DX ? n_out : rows;
  const int64_t n0 = int64_t(blockIdx.x) * kBN;
  if (m0 >= M || n0 >= N) return;
  if (K <= 0 && accumulate) return;  // DW of an expert without rows adds nothing (written: zeros, below)
  // A: FWD xg, DX dy [M, K]; DW dy [K, M]. B: FWD W[e] [N, K], DX W[e] [K, N], DW xg [K, N].
  const S* a0 = A + s * (MODE == FWD ? n_in : n_out);
  const S* b0 = MODE == DW ? B + s * n_in : B + int64_t(e) * n_out * n_in;
  const int64_t lda = MODE == FWD ? n_in : n_out, ldb = n_in;
  const int tid = threadIdx.x, wg = tid >> 7;

  auto stage = [&](int kt) { return base + uint32_t(kt % kStages) * (kTA + kTB); };
  auto load = [&](int kt) {
    const uint32_t sa = stage(kt), sb = sa + kTA;
    const int64_t k0 = int64_t(kt) * kBK;
    if constexpr (A_KC) {
      load_panel<S, kBM>(sa, a0, lda, m0, k0, M, K, tid);
    } else {
#pragma unroll
      for (int p = 0; p < kBM / 64; ++p) load_panel<S, kBK>(sa + p * (kBK * 128), a0, lda, k0, m0 + 64 * p, K, M, tid);
    }
    if constexpr (B_KC) {
      load_panel<S, kBN>(sb, b0, ldb, n0, k0, N, K, tid);
    } else {
#pragma unroll
      for (int p = 0; p < kBN / 64; ++p) load_panel<S, kBK>(sb + p * (kBK * 128), b0, ldb, k0, n0 + 64 * p, K, N, tid);
    }
  };
  if (MODE == DW && accumulate)  // the prior dW tile into L2 while the main loop runs
    grouped_dw::prefetch_tile<kBM, kBN>(static_cast<const float*>(C) + int64_t(e) * n_out * n_in, n_in, m0, n0, M, N);

  const int nk = int((K + kBK - 1) / kBK);
#pragma unroll
  for (int kt = 0; kt < kStages - 1; ++kt) {  // one commit group per tile, empty past the end
    if (kt < nk) load(kt);
    cp_commit();
  }
  float acc[2][64];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
  for (int kt = 0; kt < nk; ++kt) {
    // Tile kt landed: this thread's copies (groups 0..kt of kt + 3 committed), fenced for wgmma's async proxy, then
    // everyone's through the barrier. The load issued below, while the wgmmas run, overwrites the stage of tile
    // kt-1, whose wgmmas every thread waited for before arriving.
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 2) : "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    // The warpgroup's 64 rows of A: rows 64 wg.. of the K-major panel, or panel wg of the M-major ones.
    const uint32_t sa = stage(kt) + wg * (A_KC ? 64 * 128 : kBK * 128), sb = stage(kt) + kTA;
    pin(acc[0]);
    pin(acc[1]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)  // k16 steps: 32 bytes along K-major rows, 16 rows (2048 B) of MN-major
#pragma unroll
      for (int h = 0; h < 2; ++h)  // N half h: B rows 128h.. (K-major), panels 2h and 2h+1 (N-major)
        wg_ss<S, 128, !A_KC, !B_KC>(acc[h], A_KC ? sdesc(sa + kk * 32, 16) : sdesc(sa + kk * 2048, kBK * 128),
                                  B_KC ? sdesc(sb + h * (128 * 128) + kk * 32, 16)
                                       : sdesc(sb + h * (2 * kBK * 128) + kk * 2048, kBK * 128),
                                  1);
    wg_commit();
    if (kt + kStages - 1 < nk) load(kt + kStages - 1);
    cp_commit();
    wg_wait<0>();
    pin(acc[0]);
    pin(acc[1]);
  }

  // Accumulator element 4j + q of N half h: row 16 (warp % 4) + g + 8 (q >> 1) of the warpgroup's 64, column
  // 128 h + 8 j + 2 t + (q & 1).
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int rt = wg * 64 + ((tid >> 5) & 3) * 16 + g;  // the thread's first row in the tile
  if constexpr (MODE == DW) {
    // Every warpgroup's wgmmas are done and no copy is in flight before the stages become the staging tile.
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    __syncthreads();
    float* sc = reinterpret_cast<float*>(smraw);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float* p = sc + rt * kLdc + 128 * h + 8 * j + 2 * t4;
        *reinterpret_cast<float2*>(p) = make_float2(acc[h][4 * j], acc[h][4 * j + 1]);
        *reinterpret_cast<float2*>(p + 8 * kLdc) = make_float2(acc[h][4 * j + 2], acc[h][4 * j + 3]);
      }
    __syncthreads();
    grouped_dw::rows_out<kBM, kBN, kLdc>(sc, static_cast<float*>(C) + int64_t(e) * n_out * n_in, n_in, m0, n0, M, N,
                                         accumulate);
    return;
  }
  // FWD/DX: pairs of adjacent columns go out as one 4-byte store where aligned.
  const int64_t rw = m0 + rt;
  S* c0 = static_cast<S*>(C) + s * N;
  const bool pairs = (N & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & 3) == 0;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t m = rw + 8 * r;
    if (m >= M) continue;
    S* row = c0 + m * N;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int64_t n = n0 + 128 * h + 8 * j + 2 * t4;
        if (n >= N) continue;
        float v0 = acc[h][4 * j + 2 * r], v1 = acc[h][4 * j + 2 * r + 1];
        if (accumulate) {
          v0 = ld(row, n) + v0;
          if (n + 1 < N) v1 = ld(row, n + 1) + v1;
        }
        if (pairs && n + 1 < N) {
          *reinterpret_cast<uint32_t*>(row + n) = pack2<S>(v0, v1);
        } else {
          st(row, n, v0);
          if (n + 1 < N) st(row, n + 1, v1);
        }
      }
  }
#else
  __trap();
#endif
}

}  // namespace

// moe.cu's grouped<MODE> on wgmma (mode FWD: A = xg, B = W, C = y; DX: A = dy, B = W, C = dxg; DW: A = dy, B = xg,
// C = dW; accumulate: DX/DW add to C); false where it does not apply (not a 9.0 device: the sm_90a cubin runs there
// only; rows not whole 16-byte chunks, operands not 16-byte aligned): the caller runs k_grouped. tile_prefix (FWD,
// DX): moe.cu's, in M tiles of 128 rows (kBM).
bool grouped_sm90(cudaStream_t st, bool bf16, int mode, const void* A, const void* B, void* C, const int32_t* start,
                  const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate) {
  if (n_in % 8 || n_out % 8 || !aligned16(A) || !aligned16(B)) return false;
  int dev = 0, major = 0, minor = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  Q3VL_CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return false;
  dim3 grid(unsigned(((mode == FWD ? n_out : n_in) + kBN - 1) / kBN));
  if (mode == DW) {
    grid.y = unsigned((n_out + kBM - 1) / kBM);
    grid.z = unsigned(E);
  } else {
    const int64_t tiles = (R + kBM - 1) / kBM + E;  // >= sum over experts of ceil(rows / kBM)
    Q3VL_CHECK(tiles <= 65535, "grouped_linear: too many rows for one launch");
    grid.y = unsigned(tiles);
  }
  auto go = [&]<class S>() {
    auto a = static_cast<const S*>(A), b = static_cast<const S*>(B);
    auto run = [&](auto kern) {
      launch(kern, grid, kThreads, kSmem, st, a, b, C, start, tile_prefix, int(E), n_in, n_out, accumulate);
    };
    mode == FWD ? run(grouped_wgmma<S, FWD>) : mode == DX ? run(grouped_wgmma<S, DX>) : run(grouped_wgmma<S, DW>);
  };
  bf16 ? go.template operator()<__nv_bfloat16>() : go.template operator()<__half>();
  return true;
}

}  // namespace q3vl::dev::cuda
