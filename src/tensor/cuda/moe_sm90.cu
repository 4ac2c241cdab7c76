// Grouped expert GEMM for Hopper (sm_90a): wgmma, called by moe.cu's grouped<FWD> and grouped<DX> for bf16/fp16 on
// a compute-capability 9.0 device, with moe.cu's k_grouped semantics:
//   FWD: y[s+m, n]  = sum_k xg[s+m, k] W[e][n, k]       (K = n_in, N = n_out; B = W[e] K-major)
//   DX:  dxg[s+m, n] (+)= sum_k dy[s+m, k] W[e][k, n]   (K = n_out, N = n_in; B = W[e] N-major: the transpose bit)
// A block is 2 warpgroups and a 128 x 256 output tile of one expert: blockIdx.y walks the M tiles of all experts back
// to back (moe.cu's tile_prefix, in tiles of 128 rows), blockIdx.x the N tiles. Warpgroup w owns rows [64w, 64w+64)
// as two m64n128 accumulators (the N halves). K goes in tiles of 64: one swizzled 128-byte panel of A, and of B
// when K-major (256 rows); N-major B is 4 panels of 64 k-rows (wgmma.cuh's layout, as attention_sm90.cu's V).
// cp.async keeps 3 tiles in flight, the next one's copies issued while a tile's 8 wgmmas a warpgroup run; those are
// waited for before the next barrier, which then frees their stage.
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/wgmma.cuh"

namespace q3vl::dev::cuda {
namespace {

using namespace sm90;

constexpr int kThreads = 256, kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr uint32_t kTA = kBM * kBK * 2, kTB = kBN * kBK * 2;    // bytes a stage of A and of B (16-bit elements)
constexpr size_t kSmem = size_t(kStages) * (kTA + kTB) + 1024;  // + slack to align the stages to 1024
static_assert((kTA + kTB) % 1024 == 0, "every panel 1024-aligned");

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

template <class S, bool B_KC>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgmma(const S* __restrict__ A, const S* __restrict__ B, S* __restrict__ C,
                  const int32_t* __restrict__ start, const int32_t* __restrict__ tile_prefix, int E, int64_t n_in,
                  int64_t n_out, bool accumulate) {
#ifdef Q3VL_WGMMA
  extern __shared__ __align__(16) unsigned char smraw[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smraw)) + 1023u) & ~1023u;
  const int32_t t = int32_t(blockIdx.y);
  if (t >= tile_prefix[E]) return;
  int e = 0;  // the last expert with tile_prefix[e] <= t (empty experts share their successor's prefix)
  for (int hi = E - 1; e < hi;) {
    const int mid = (e + hi + 1) / 2;
    if (tile_prefix[mid] <= t) e = mid;
    else hi = mid - 1;
  }
  const int64_t K = B_KC ? n_in : n_out, N = B_KC ? n_out : n_in;
  const int64_t s = start[e], M = start[e + 1] - s;
  const int64_t m0 = int64_t(t - tile_prefix[e]) * kBM, n0 = int64_t(blockIdx.x) * kBN;
  if (m0 >= M || n0 >= N) return;
  const S* a0 = A + s * K;                      // [M, K]
  const S* b0 = B + int64_t(e) * n_out * n_in;  // FWD [N, K], DX [K, N]
  const int tid = threadIdx.x, wg = tid >> 7;

  auto stage = [&](int kt) { return base + uint32_t(kt % kStages) * (kTA + kTB); };
  auto load = [&](int kt) {
    const uint32_t sa = stage(kt), sb = sa + kTA;
    const int64_t k0 = int64_t(kt) * kBK;
    load_panel<S, kBM>(sa, a0, K, m0, k0, M, K, tid);
    if constexpr (B_KC) {
      load_panel<S, kBN>(sb, b0, K, n0, k0, N, K, tid);
    } else {
#pragma unroll
      for (int p = 0; p < kBN / 64; ++p) load_panel<S, kBK>(sb + p * (kBK * 128), b0, N, k0, n0 + 64 * p, K, N, tid);
    }
  };

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
    const uint32_t sa = stage(kt) + wg * (64 * 128), sb = stage(kt) + kTA;  // the warpgroup's 64 rows of A
    pin(acc[0]);
    pin(acc[1]);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk)  // k16 steps: 32 bytes along K-major rows, 16 rows (2048 B) of N-major
#pragma unroll
      for (int h = 0; h < 2; ++h)  // N half h: B rows 128h.. (K-major), panels 2h and 2h+1 (N-major)
        wg_ss128<S, !B_KC>(acc[h], sdesc(sa + kk * 32, 16),
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
  // 128 h + 8 j + 2 t + (q & 1). Pairs of adjacent columns go out as one 4-byte store where aligned.
  const int lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t rw = m0 + wg * 64 + ((tid >> 5) & 3) * 16 + g;
  S* c0 = C + s * N;
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

// moe.cu's grouped FWD (dx false: A = xg, C = y) or DX (A = dy, C = dxg, accumulate: added to) on wgmma; false where
// it does not apply (not a 9.0 device: the sm_90a cubin runs there only; rows not whole 16-byte chunks, operands not
// 16-byte aligned): the caller runs k_grouped. tile_prefix: moe.cu's, in M tiles of 128 rows (kBM).
bool grouped_sm90(cudaStream_t st, bool bf16, bool dx, const void* A, const void* B, void* C, const int32_t* start,
                  const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate) {
  if (n_in % 8 || n_out % 8 || !aligned16(A) || !aligned16(B)) return false;
  int dev = 0, major = 0, minor = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  Q3VL_CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return false;
  const int64_t tiles = (R + kBM - 1) / kBM + E;  // >= sum over experts of ceil(rows / kBM)
  Q3VL_CHECK(tiles <= 65535, "grouped_linear: too many rows for one launch");
  const dim3 grid(unsigned(((dx ? n_in : n_out) + kBN - 1) / kBN), unsigned(tiles));
  auto go = [&]<class S>() {
    auto a = static_cast<const S*>(A), b = static_cast<const S*>(B);
    if (dx)
      launch(grouped_wgmma<S, false>, grid, kThreads, kSmem, st, a, b, static_cast<S*>(C), start, tile_prefix, int(E),
             n_in, n_out, accumulate);
    else
      launch(grouped_wgmma<S, true>, grid, kThreads, kSmem, st, a, b, static_cast<S*>(C), start, tile_prefix, int(E),
             n_in, n_out, accumulate);
  };
  bf16 ? go.template operator()<__nv_bfloat16>() : go.template operator()<__half>();
  return true;
}

}  // namespace q3vl::dev::cuda
