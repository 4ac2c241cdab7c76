// Grouped expert GEMM for Hopper (sm_90a): wgmma fed by TMA, called by moe.cu's grouped<MODE> for bf16/fp16 on a
// compute-capability 9.0 device, with moe.cu's k_grouped semantics:
//   FWD: y[s+m, n]  = sum_k xg[s+m, k] W[e][n, k]      (M rows, K = n_in, N = n_out; A, B K-major)
//   DX:  dxg[s+m, n] (+)= sum_k dy[s+m, k] W[e][k, n]  (M rows, K = n_out, N = n_in; B N-major: the transpose bit)
//   DW:  dW[e][m, n] (+)= sum_k dy[s+k, m] xg[s+k, n]  (M = n_out, N = n_in, K rows; A M-major, B N-major; F32)
// Output tiles are 128 rows by 256 (FWD, DX) or 128 (DW) columns of one expert; K goes in tiles of 64: a K-major
// operand is one swizzled 128-byte panel of its 128 or 256 rows, an MN-major one 2 or 4 panels of 64 k-rows
// (wgmma.cuh's layout, as attention_sm90.cu's V). (A cp.async kernel with two warpgroups, grouped_wgmma, ran before
// this one: 1.5-1.8x slower in FWD and DX, 1.2-1.3x in DW, moe_bench on 2026-12-05; deleted.)
#include <algorithm>

#include "q3vl/core/env.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/tma.cuh"
#include "tensor/cuda/wgmma.cuh"

namespace q3vl::dev::cuda {
namespace {

// As moe.cu's. Measured and dropped (moe_bench, H100, 2026-12-05, docs/PERFORMANCE.md): DW written from the
// accumulators in 128 x 256 tiles (1008 us against the epilogue below's 961 for the 30B-A3B's gate_up), and
// FWD/DX's consumer 1 idle on an expert's last M tile of <= 64 rows (597 against 578 us).
enum Mode { FWD = 0, DX = 1, DW = 2 };
constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr uint32_t kTA = kBM * kBK * 2;  // bytes a stage of A (16-bit elements); B's: ws_stage_bytes below

// ---- warp-specialized and persistent (grouped_ws) ----------------------------------------------------------------
// FA3's division of labour (attention_sm90.cu's fwd_ws): warpgroup 0, the producer, hands its registers back and its
// first thread streams every K tile of every output tile the block owns by TMA into a ring of kStages stages (a full mbarrier per stage, completed by the copies'
// bytes, and an empty one, an arrival from each of the 8 consumer warps once its wgmmas reading the stage are done);
// warpgroups 1 and 2, the consumers, own rows [0, 64) and [64, 128) of the tile (m64n128 accumulators, one per 128
// columns), keep one K tile's wgmmas in flight behind the next and store (FWD/DX from registers, DW below). The grid
// is persistent (a block an SM, tiles t = blockIdx.x + i gridDim.x), so the producer loads the next tile while the
// consumers store this one.
// Tile order: FWD/DX walk the N tiles of an M tile (of all experts back to back, tile_prefix) fastest, so the blocks
// running together share the rows of A and an expert's weights in L2; DW walks expert, M tile, N tile.
// Boxes (tma.cuh's tmap_16bit, 64 columns wide, swizzled as wgmma reads them): K-major operands are boxes of 128 (A)
// or 256 (B) rows at column k0; MN-major ones (DX's W[e], DW's dy and xg, rows along K) 2 or 4 boxes of 64 k-rows.
// Rows a box reads past an expert's end belong to the next expert (or are the TMA's zeros past the tensor): past M or
// N they only reach outputs that are never stored; past K (the last K tile of DX at n_out % 64 != 0, of every DW
// tile at a bucket's end) the consumers zero those rows in shared memory before their wgmmas read them. Columns past
// a tensor's width (K-major K tails) are the TMA's zeros.
constexpr int kWsThreads = 384;
// DW's tiles are 128 x 128 (n_out x n_in), FWD/DX's 128 x 256: DW's fp32 tile leaves through shared memory (64 rows a
// consumer, kEpLd floats apart: 16 bytes past a row, so the float2 writes of a warp meet each bank twice, the least
// for 256 bytes) by bulk copies a row, written or added (cp.reduce.async.bulk ... add.f32, in L2: no read of the
// prior dW by the SM), which run while the consumers start the next tile.
template <int MODE> constexpr int ws_bn() { return MODE == DW ? 128 : kBN; }
template <int MODE> constexpr uint32_t ws_stage_bytes() { return kTA + uint32_t(ws_bn<MODE>()) * kBK * 2; }
constexpr int kEpLd = 132;
constexpr uint32_t kEpBytes = 64 * kEpLd * 4;
template <int MODE> constexpr size_t ws_smem() {
  return size_t(kStages) * ws_stage_bytes<MODE>() + (MODE == DW ? 2 * kEpBytes : 0) + 1024;
}
static_assert(ws_smem<FWD>() <= 227 * 1024 && ws_smem<DW>() <= 227 * 1024,
              "an sm_90 block's shared memory");

struct WsTile {
  int e;
  int64_t s, rows, m0, n0;
};

// Output tile t of the launch: false past the last.
template <int MODE>
__device__ __forceinline__ bool ws_tile(int64_t t, const int32_t* start, const int32_t* tile_prefix, int E,
                                        int64_t n_in, int64_t n_out, WsTile& o) {
  constexpr int BN = ws_bn<MODE>();
  const int64_t nN = ((MODE == FWD ? n_out : n_in) + BN - 1) / BN;
  int e = 0;
  if constexpr (MODE == DW) {
    const int64_t nM = (n_out + kBM - 1) / kBM;
    if (t >= int64_t(E) * nM * nN) return false;
    e = int(t / (nM * nN));
    const int64_t r = t % (nM * nN);
    o.m0 = r / nN * kBM;
    o.n0 = r % nN * BN;
  } else {
    const int64_t mt = t / nN;
    if (mt >= tile_prefix[E]) return false;
    for (int hi = E - 1; e < hi;) {  // the last expert with tile_prefix[e] <= mt (empty ones share their successor's)
      const int mid = (e + hi + 1) / 2;
      if (tile_prefix[mid] <= mt) e = mid;
      else hi = mid - 1;
    }
    o.m0 = (mt - tile_prefix[e]) * kBM;
    o.n0 = t % nN * BN;
  }
  o.e = e;
  o.s = start[e];
  o.rows = start[e + 1] - o.s;
  return true;
}
template <int MODE> __device__ __forceinline__ int64_t ws_k(const WsTile& w, int64_t n_in, int64_t n_out) {
  return MODE == FWD ? n_in : MODE == DX ? n_out : w.rows;
}

// The producer's thread. ta: A (FWD xg, DX dy: 128-row boxes; DW dy: 64-row boxes); tb: B (FWD W as [E n_out, n_in]
// in 256-row boxes; DX W likewise in 64-row boxes; DW xg in 64-row boxes).
template <int MODE>
__device__ __forceinline__ void ws_produce(const CUtensorMap* ta, const CUtensorMap* tb, uint32_t stages,
                                           uint32_t bars, const int32_t* start, const int32_t* tile_prefix, int E,
                                           int64_t n_in, int64_t n_out) {
  tmap_prefetch(ta);
  tmap_prefetch(tb);
  const uint64_t pol = l2_evict_normal();
  uint32_t it = 0;
  WsTile w;
  for (int64_t t = blockIdx.x; ws_tile<MODE>(t, start, tile_prefix, E, n_in, n_out, w); t += gridDim.x) {
    const int nk = int((ws_k<MODE>(w, n_in, n_out) + kBK - 1) / kBK);
    for (int kt = 0; kt < nk; ++kt, ++it) {
      constexpr uint32_t SB = ws_stage_bytes<MODE>();
      const uint32_t st = it % kStages, full = bars + 8 * st, sa = stages + st * SB, sb = sa + kTA;
      mbar_wait(bars + 8 * (kStages + st), ((it / kStages) & 1) ^ 1);
      mbar_expect_tx(full, SB);
      const int k0 = kt * kBK;
      if constexpr (MODE == DW) {
#pragma unroll
        for (int p = 0; p < kBM / 64; ++p) tma_load_2d(sa + p * (kBK * 128), ta, int(w.m0) + 64 * p, int(w.s) + k0, full, pol);
#pragma unroll
        for (int p = 0; p < ws_bn<MODE>() / 64; ++p)
          tma_load_2d(sb + p * (kBK * 128), tb, int(w.n0) + 64 * p, int(w.s) + k0, full, pol);
      } else {
        tma_load_2d(sa, ta, k0, int(w.s + w.m0), full, pol);
        if constexpr (MODE == FWD) {
          tma_load_2d(sb, tb, k0, int(w.e * n_out + w.n0), full, pol);
        } else {
#pragma unroll
          for (int p = 0; p < kBN / 64; ++p)
            tma_load_2d(sb + p * (kBK * 128), tb, int(w.n0) + 64 * p, int(w.e * n_out) + k0, full, pol);
        }
      }
    }
  }
}

// Rows [r0, 64) of the n 64-row panels at p (8 KiB apart) to zero, by a warpgroup's 128 threads (whole 128-byte rows:
// the swizzle permutes chunks within a row).
__device__ __forceinline__ void ws_zero_rows(uint32_t p, int n, int r0, int ct) {
  for (int c = r0 * 8 + ct; c < kBK * 8; c += 128)
    for (int q = 0; q < n; ++q)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(p + q * (kBK * 128) + c * 16), "r"(0) : "memory");
}

// DW's gradient norm in the epilogue (grouped_sm90's psum): a consumer thread adds the squares of the 64 fp32
// elements it holds of each tile it writes (a tile's accumulators: element 4j + q at row r0 + 8 (q >> 1), column
// c0 + 8j + (q & 1)), summed in fp32 a tile and in double across tiles. Elements past M or N are zeros (the TMA
// fills what lies past the tensors, and rows past K are zeroed) unless an operand holds an Inf or NaN; so only a
// non-finite fp32 sum takes the slow path, which skips them and counts the non-finite elements one by one (a square
// that overflows fp32 is summed there in double).
__device__ __forceinline__ void ws_square(const float (&a)[64], int64_t r0, int64_t c0, int64_t M, int64_t N,
                                          double& sq, int32_t& bad) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s = fmaf(a[i], a[i], s);
  if (isfinite(s)) {
    sq += double(s);
    return;
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int64_t r = r0 + 8 * ((i & 3) >> 1), col = c0 + 8 * (i >> 2) + (i & 1);
    if (r >= M || col >= N) continue;
    if (isfinite(a[i])) sq += double(a[i]) * double(a[i]);
    else ++bad;
  }
}
// The block's sums into psum[blockIdx.x] and pbad[blockIdx.x], in a fixed order (the grid is persistent and its
// tiles fixed by blockIdx.x, so the whole sum is deterministic): each warp by shuffles, then the 8 consumer warps.
__device__ __forceinline__ void ws_squares_out(double sq, int32_t bad, int c, int ct, double* psum, int32_t* pbad) {
  __shared__ double ws_sq[8];
  __shared__ int32_t ws_bad[8];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    sq += __shfl_xor_sync(0xffffffffu, sq, o);
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
  const int wi = c * 4 + (ct >> 5);
  if ((ct & 31) == 0) ws_sq[wi] = sq, ws_bad[wi] = bad;
  bar_sync(5, 256);
  if (c == 0 && ct == 0) {
    double s = 0;
    int32_t b = 0;
    for (int i = 0; i < 8; ++i) s += ws_sq[i], b += ws_bad[i];
    psum[blockIdx.x] = s;
    pbad[blockIdx.x] = b;
  }
}

// Consumer c (0 or 1) of the block's tiles; ct: the thread's index in its warpgroup.
// DW with psum: the squares of the dW this consumer writes (ws_square, summed by ws_squares_out).
template <class S, int MODE>
__device__ __forceinline__ void ws_consume(uint32_t stages, uint32_t bars, void* C, const int32_t* start,
                                           const int32_t* tile_prefix, int E, int64_t n_in, int64_t n_out,
                                           bool accumulate, int c, int ct, double* psum, int32_t* pbad) {
  constexpr bool A_KC = MODE < DW, B_KC = MODE == FWD;
  constexpr int BN = ws_bn<MODE>(), NH = BN / 128;
  constexpr uint32_t SB = ws_stage_bytes<MODE>();
  const int lane = ct & 31, g = lane >> 2, t4 = lane & 3, warp = ct >> 5;
  const int rt = c * 64 + warp * 16 + g;  // the thread's first row in the tile
  const bool lead = lane == 0;
  const uint32_t ep = stages + kStages * SB + c * kEpBytes;  // DW: the consumer's staged rows
  uint32_t it = 0;
  WsTile w;
  float acc[NH][64];
  double sq = 0;  // DW with psum: this thread's squares over its tiles, and its non-finite elements
  int32_t bad = 0;
  for (int64_t t = blockIdx.x; ws_tile<MODE>(t, start, tile_prefix, E, n_in, n_out, w); t += gridDim.x) {
    const int64_t K = ws_k<MODE>(w, n_in, n_out);
    const int nk = int((K + kBK - 1) / kBK);
    const int64_t M = MODE == DW ? n_out : w.rows, N = MODE == FWD ? n_out : n_in;
    if (nk == 0 && accumulate) continue;  // DW of an expert without rows adds nothing (written: zeros, below)
#pragma unroll
    for (int h = 0; h < NH; ++h)
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[h][i] = 0.f;
    uint32_t prev = 0;
    for (int kt = 0; kt < nk; ++kt, ++it) {
      const uint32_t st = it % kStages, sa0 = stages + st * SB, sb = sa0 + kTA;
      mbar_wait(bars + 8 * st, (it / kStages) & 1);
      const int kv = int(K - int64_t(kt) * kBK);
      if (MODE != FWD && kv < kBK) {  // rows past K: the next expert's (see above)
        if constexpr (MODE == DW) ws_zero_rows(sa0 + c * (kBK * 128), 1, kv, ct);
        ws_zero_rows(sb, BN / 64, kv, ct);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        bar_sync(1 + c, 128);
      }
      const uint32_t sa = sa0 + c * (A_KC ? 64 * 128 : kBK * 128);
#pragma unroll
      for (int h = 0; h < NH; ++h) pin(acc[h]);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk)
#pragma unroll
        for (int h = 0; h < NH; ++h)
          wg_ss<S, 128, !A_KC, !B_KC>(acc[h], A_KC ? sdesc(sa + kk * 32, 16) : sdesc(sa + kk * 2048, kBK * 128),
                                      B_KC ? sdesc(sb + h * (128 * 128) + kk * 32, 16)
                                           : sdesc(sb + h * (2 * kBK * 128) + kk * 2048, kBK * 128),
                                      1);
      wg_commit();
      wg_wait<1>();  // tile kt-1's wgmmas are done: its stage goes back to the producer
      if (kt > 0) mbar_arrive(bars + 8 * (kStages + prev), lead);
      prev = st;
    }
    wg_wait<0>();  // unconditional: ptxas sees every path to the stores wait
    if (nk > 0) mbar_arrive(bars + 8 * (kStages + prev), lead);
#pragma unroll
    for (int h = 0; h < NH; ++h) pin(acc[h]);
    if constexpr (MODE == DW) {
      // The consumer's 64 x 128 fp32 rows into ep (once the copies of its previous tile have read it), then a bulk
      // copy a row by its warp 0: accumulator element 4j + q at row warp 16 + g + 8 (q >> 1), column 8j + 2 t4 + (q & 1).
      if (warp == 0) bulk_wait_read<0>();
      bar_sync(3 + c, 128);
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(ep + ((warp * 16 + g + 8 * r) * kEpLd + 8 * j + 2 * t4) * 4),
                       "f"(acc[0][4 * j + 2 * r]), "f"(acc[0][4 * j + 2 * r + 1])
                       : "memory");
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      bar_sync(3 + c, 128);
      if (psum) ws_square(acc[0], w.m0 + c * 64 + warp * 16 + g, w.n0 + 2 * t4, M, N, sq, bad);
      if (warp == 0) {
        const uint32_t bytes = uint32_t(N - w.n0 < BN ? N - w.n0 : BN) * 4;
        for (int rr = lane; rr < 64; rr += 32) {
          const int64_t m = w.m0 + c * 64 + rr;
          if (m >= M) break;
          float* dst = static_cast<float*>(C) + (int64_t(w.e) * n_out + m) * n_in + w.n0;
          if (accumulate) bulk_add_f32(dst, ep + rr * kEpLd * 4, bytes);
          else bulk_store(dst, ep + rr * kEpLd * 4, bytes);
        }
        bulk_commit();
      }
    } else {
      // Accumulator element 4j + q of N half h: row rt + 8 (q >> 1), column 128 h + 8 j + 2 t4 + (q & 1).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t m = w.m0 + rt + 8 * r;
        if (m >= M) continue;
        S* row = static_cast<S*>(C) + (w.s + m) * N;
#pragma unroll
        for (int h = 0; h < NH; ++h)
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const int64_t n = w.n0 + 128 * h + 8 * j + 2 * t4;
            if (n >= N) continue;  // N % 8 == 0: the pair is whole
            float v0 = acc[h][4 * j + 2 * r], v1 = acc[h][4 * j + 2 * r + 1];
            if (accumulate) v0 += ld(row, n), v1 += ld(row, n + 1);
            *reinterpret_cast<uint32_t*>(row + n) = pack2<S>(v0, v1);
          }
      }
    }
  }
  if (MODE == DW && warp == 0) bulk_wait_all();  // the last rows are out before the block's shared memory goes
  if (MODE == DW && psum) ws_squares_out(sq, bad, c, ct, psum, pbad);
}

template <class S, int MODE>
__global__ void __launch_bounds__(kWsThreads, 1)
    grouped_ws(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tb, void* __restrict__ C,
               const int32_t* __restrict__ start, const int32_t* __restrict__ tile_prefix, int E, int64_t n_in,
               int64_t n_out, bool accumulate, double* psum, int32_t* pbad) {
#ifdef Q3VL_WGMMA
  __shared__ alignas(8) uint64_t bars[2 * kStages];  // full, then empty
  extern __shared__ __align__(16) unsigned char smraw[];
  const uint32_t stages = (su32(smraw) + 1023u) & ~1023u, bar0 = su32(bars);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar0 + 8 * s, 1);
      mbar_init(bar0 + 8 * (kStages + s), 8);  // the consumers' warps
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) ws_produce<MODE>(&ta, &tb, stages, bar0, start, tile_prefix, E, n_in, n_out);
  } else {
    regs_inc<232>();
    ws_consume<S, MODE>(stages, bar0, C, start, tile_prefix, E, n_in, n_out, accumulate, threadIdx.x / 128 - 1,
                        threadIdx.x % 128, psum, pbad);
  }
#else
  __trap();
#endif
}

// grouped_ws where the TMA takes the operands (false: the caller runs k_grouped).
bool grouped_ws_launch(cudaStream_t st, bool bf16, int mode, const void* A, const void* B, void* C,
                       const int32_t* start, const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in,
                       int64_t n_out, bool accumulate, int sms, const SumSq& sq, double* psum) {
  if (!aligned16(C) || R * std::max(n_in, n_out) >= (int64_t(1) << 31) || E * n_out >= (int64_t(1) << 31))
    return false;
  CUtensorMap ta{}, tb{};
  const bool ok = mode == FWD ? tmap_16bit(ta, A, R, n_in, n_in, kBM, bf16) &&
                                    tmap_16bit(tb, B, E * n_out, n_in, n_in, kBN, bf16)
                  : mode == DX ? tmap_16bit(ta, A, R, n_out, n_out, kBM, bf16) &&
                                     tmap_16bit(tb, B, E * n_out, n_in, n_in, kBK, bf16)
                               : tmap_16bit(ta, A, R, n_out, n_out, kBK, bf16) &&
                                     tmap_16bit(tb, B, R, n_in, n_in, kBK, bf16);
  if (!ok) return false;
  const int64_t bn = mode == DW ? ws_bn<DW>() : kBN, nN = ((mode == FWD ? n_out : n_in) + bn - 1) / bn;
  const int64_t tiles = mode == DW ? E * ((n_out + kBM - 1) / kBM) * nN : ((R + kBM - 1) / kBM + E) * nN;
  const int nb = int(std::min<int64_t>(tiles, sms));
  const bool squares = mode == DW && sq.sum;
  int32_t* pbad = squares ? reinterpret_cast<int32_t*>(psum + nb) : nullptr;
  auto go = [&]<class S>() {
    auto run = [&](auto kern) {
      launch(kern, dim3(unsigned(nb)), kWsThreads, mode == DW ? ws_smem<DW>() : ws_smem<FWD>(), st, ta, tb, C, start,
             tile_prefix, int(E), n_in, n_out, accumulate, squares ? psum : nullptr, pbad);
    };
    mode == FWD ? run(grouped_ws<S, FWD>) : mode == DX ? run(grouped_ws<S, DX>) : run(grouped_ws<S, DW>);
  };
  bf16 ? go.template operator()<__nv_bfloat16>() : go.template operator()<__half>();
  if (squares) sumsq_fold(st, psum, pbad, nb, sq.sum, sq.nonfinite);
  return true;
}

}  // namespace

// moe.cu's grouped<MODE> on wgmma (mode FWD: A = xg, B = W, C = y; DX: A = dy, B = W, C = dxg; DW: A = dy, B = xg,
// C = dW; accumulate: DX/DW add to C); false where it does not apply (not a 9.0 device: the sm_90a cubin runs there
// only; rows not whole 16-byte chunks, operands not 16-byte aligned): the caller runs k_grouped. tile_prefix (FWD,
// DX): moe.cu's, in M tiles of 128 rows (kBM). sq (DW written, not accumulated): dW's squares added there, the
// blocks' partials in psum (room for grouped_sq_partials(): a double and an int32 an SM).
bool grouped_sm90(cudaStream_t st, bool bf16, int mode, const void* A, const void* B, void* C, const int32_t* start,
                  const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                  const SumSq& sq, double* psum) {
  if (n_in % 8 || n_out % 8 || !aligned16(A) || !aligned16(B)) return false;
  int dev = 0, major = 0, minor = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  Q3VL_CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return false;
  return grouped_ws_launch(st, bf16, mode, A, B, C, start, tile_prefix, R, E, n_in, n_out, accumulate, sm_count(), sq,
                           psum);
}

}  // namespace q3vl::dev::cuda
