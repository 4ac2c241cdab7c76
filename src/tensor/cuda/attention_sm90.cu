// Flash attention for Hopper (sm_90a): wgmma tensor-core instructions, called by attention.cu's attention_fwd and
// attention_bwd (bf16/fp16; forward head dim 128, backward 64, 72 and 128) on a compute-capability 9.0 device. Same
// semantics as fwd_tc / dkdv_tc + dq_tc there (packed variable-length segments, GQA, causal or not; out [N, nh*hd],
// lse [N, nh] natural log). The forward that attention_fwd_sm90 takes, fwd_ws (TMA, mbarriers, a producer and two
// consumer warpgroups in pingpong), is described above it; the backward above bwd_wgmma. (fwd_ws replaced fwd_wgmma,
// two warpgroups loading with cp.async in lockstep: 0.595 against 0.967 ms at the 2B's shape, sixteenth session.)
//
// The forward's per-tile steps: S = Q K^T by wgmma m64n128k16 with Q and K both from shared memory, online softmax
// in registers (the accumulator layout is that of mma.m16n8 per warp, rows 16*warp + g, g+8), P packed to 16-bit
// registers as wgmma's A operand, and O += P V by wgmma m64nHDk16 with V from shared memory read N-major (the
// descriptor's transpose bit).
//
// Shared-memory tiles use wgmma's canonical 128-byte swizzle: a tile of R rows x HD columns is HD/64 column panels,
// each R rows of 128 bytes (64 elements); 16-byte chunk c of row r sits at chunk position c ^ (r % 8). 8-row groups
// (1024 bytes) are the descriptors' stride dimension; every panel starts 1024-aligned.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>

#include "q3vl/core/log.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/mma_util.cuh"
#include "tensor/cuda/tma.cuh"
#include "tensor/cuda/wgmma.cuh"

namespace q3vl::dev::cuda {
namespace {

constexpr int kThreads = 256, kBM = 128, kBN = 128;
// Head dims 64, 72 and 128. Products over the head dim run over kdim<HD> (a multiple of 16: 80 for 72; the columns
// past HD are zero in shared memory); a tile of R rows holds panels<HD> panels of R x 128 bytes (2 for 72, the
// second 8 of its 64 columns used). Products whose N is the head dim use wgmma's n = HD (n72 reads the second panel's
// first columns through the descriptor's panel distance).
template <int HD> constexpr int kdim() { return (HD + 15) / 16 * 16; }
template <int HD> constexpr int panels() { return (HD + 63) / 64; }
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

// ROWS rows [row0, row0+ROWS) of a segment (token stride ld, HD columns) into the swizzled tile at shared address
// s; rows >= L and the columns [HD, kdim) are zero-filled. Consecutive threads take consecutive 16-byte chunks of a row (coalesced reads; the
// XOR keeps each 8-chunk row segment a permutation of its 128 bytes, so no bank conflicts on the writes).
template <class S, int HD, int ROWS>
__device__ __forceinline__ void load_tile(uint32_t s, const S* g, int64_t ld, int row0, int L, int tid) {
  constexpr int NCH = HD / 8, NCHP = kdim<HD>() / 8;
#pragma unroll
  for (int c = tid; c < ROWS * NCHP; c += kThreads) {
    const int r = c / NCHP, ch = c % NCHP;
    const bool ok = row0 + r < L && ch < NCH;
    const uint32_t dst = s + (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    cp16(dst, ok ? g + int64_t(row0 + r) * ld + ch * 8 : g, ok);
  }
}

// ---- per-tile steps of one warpgroup ------------------------------------------------------------------------------
// Accumulator element 4n+e of a thread: row tr0 + 8*(e>>1), column 8n + 2t + (e&1) (S: key j0 + column).
// s = Q K^T over the warpgroup's 64 rows (qa) and the 128 keys of the K tile at ka: panel kk/4, 32 bytes (16
// elements) per k-step inside the 128-byte rows.
template <class S, int HD> __device__ __forceinline__ void gemm_s(float (&s)[kBN / 2], uint32_t qa, uint32_t ka) {
#pragma unroll
  for (int kk = 0; kk < kdim<HD>() / 16; ++kk)
    wg_ss<S, kBN>(s, sdesc(qa + (kk >> 2) * (kBM * 128) + (kk & 3) * 32, 16),
                sdesc(ka + (kk >> 2) * (kBN * 128) + (kk & 3) * 32, 16), kk > 0);
}
// o += P V for the V tile of R rows at va: 16 rows = two 8-row groups (2048 bytes) of every panel; LBO = the panel
// distance. (The backward's dV += P^T dO and dK += dS^T Q are the same product.)
template <class S, int HD, int R>
__device__ __forceinline__ void gemm_pv(float (&o)[HD / 2], const uint32_t (&p)[R / 16][4], uint32_t va) {
#pragma unroll
  for (int kk = 0; kk < R / 16; ++kk) wg_rs<S, HD>(o, p[kk], sdesc(va + kk * 2048, R * 128));
}
// Online softmax on one score tile (keys j0..): masks, moves the running max (log2 units), replaces s by
// exp2(s*sl2 - max) (one FFMA and an exp2 a score), adds its row sums to lrow; alpha: the factor the accumulated
// output rows must take.
__device__ __forceinline__ void softmax_tile(float (&s)[kBN / 2], float (&mrow)[2], float (&lrow)[2],
                                             float (&alpha)[2], int j0, int L, int tr0, int t, bool causal,
                                             float sl2) {
  const bool need_mask = (j0 + kBN > L) || (causal && j0 + kBN - 1 > tr0);  // tr0: the thread's first row
  if (need_mask)
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = j0 + n * 8 + 2 * t + (e & 1), i = tr0 + (e >> 1) * 8;
        if (j >= L || (causal && j > i)) s[4 * n + e] = kNegInf;
      }
  // The max over raw scores (sl2 > 0 keeps the order), scaled once; each score then takes one FFMA before exp2.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
    mx = fmaxf(mrow[r], quad_max(mx) * sl2);
    const float ms = mx == kNegInf ? 0.f : mx;  // a row with no key yet: keep everything 0, not NaN
    alpha[r] = fexp2(mrow[r] - ms);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) {
      s[4 * n + 2 * r] = fexp2(fmaf(s[4 * n + 2 * r], sl2, -ms));
      s[4 * n + 2 * r + 1] = fexp2(fmaf(s[4 * n + 2 * r + 1], sl2, -ms));
      sum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
    }
    lrow[r] = lrow[r] * alpha[r] + sum;
    mrow[r] = mx;
  }
}
template <int N> __device__ __forceinline__ void rescale(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < N / 4; ++n) o[4 * n] *= alpha[0], o[4 * n + 1] *= alpha[0], o[4 * n + 2] *= alpha[1],
                                  o[4 * n + 3] *= alpha[1];
}
// P in A-fragment order: keys 16kk.. are accumulator chunks 2kk (registers 0, 1) and 2kk+1 (registers 2, 3).
template <class S, int N> __device__ __forceinline__ void to_p(const float (&s)[N / 2], uint32_t (&p)[N / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[kk][e] = pack2<S>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}
// The thread's two output rows tr0, tr0 + 8 of the segment at b0 (those < L): o / l and the lse (natural log).
template <class S, int HD>
__device__ __forceinline__ void store_rows(const float (&o)[HD / 2], const float (&mrow)[2], const float (&lrow)[2],
                                           S* out, float* lse, int b0, int L, int tr0, int t, int h, int nh) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(lrow[r]);
    const int i = tr0 + r * 8;
    if (i < L) {
      const float inv = 1.f / l;
      S* orow = out + int64_t(b0 + i) * nh * HD + int64_t(h) * HD;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t) =
            pack2<S>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      if (t == 0) lse[int64_t(b0 + i) * nh + h] = mrow[r] * kLn2 + logf(l);
    }
  }
}
// cp.async wrote through the generic proxy, wgmma reads through the async proxy: each thread waits for its copies
// and fences, then the barrier publishes every thread's.
__device__ __forceinline__ void tiles_landed() {
  cp_wait_all();
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

// ---- forward, warp-specialized (fwd_ws: FA3's schedule) -------------------------------------------------------------
// A block is 3 warpgroups (384 threads) and 128 queries of one head of one segment:
//  - warpgroup 0, the producer, hands most of its registers back (setmaxnreg 24); its first thread issues the TMA
//    copies: Q once, then K and V tiles of 128 keys into a ring of kStages stages, in the order the consumers read
//    them (K0, K1, V0, K2, V1, ..., V last). Each stage has, for K and for V, a full mbarrier (the producer's
//    arrive.expect_tx, completed by the copies' bytes) and an empty one (an arrival from each of the 8 consumer
//    warps once its wgmmas reading the stage have completed), which the producer waits for before refilling it.
//  - warpgroups 1 and 2, the consumers (setmaxnreg 240), own query rows [0, 64) and [64, 128): the per-tile
//    steps and intra-warpgroup overlap (S of tile kb+1 issued with PV of tile kb, the softmax of tile kb+1 while PV
//    runs); K is released once its S is done, V once its PV is.
//  - Pingpong (FA3's warp-scheduler barriers): a consumer issues the two GEMMs of its next tile only once the other
//    has issued its own (named barrier 1 + c, at which the other arrives right after issuing), so the tensor cores
//    run one warpgroup's GEMMs while the other computes its softmax. Consumer 0 goes first. Every bar.sync has
//    exactly one arrival and none is left over at exit (consumer 0's first arrival stands for consumer 1's last).
// Tiles are TMA boxes of 64 columns x 128 rows whose 128-byte swizzle is the layout above (one copy per 64-column
// panel). Rows are token indices: a tile crossing the segment's end reads the next segment's rows (keys masked by
// softmax_tile, query rows never stored) or zeros past N (the TMA's out-of-bounds fill). The last V tile's rows past
// the end are zeroed in shared memory by each consumer before its PV: P = 0 there must meet zeros, not whatever
// (NaN, say) those rows hold.
constexpr int kWsThreads = 384, kStages = 3;
template <int HD> constexpr uint32_t ws_tile_bytes() { return kBN * panels<HD>() * 128; }  // Q, K or V (kBM == kBN)
template <int HD> constexpr size_t ws_smem() { return (1 + 2 * kStages) * size_t(ws_tile_bytes<HD>()) + 1024; }
static_assert(kBM == kBN && ws_smem<128>() <= 227 * 1024, "Q, 3 K and 3 V stages in an sm_90 block's shared memory");

// Shared addresses: Q, the K and V stages (1024-aligned), and the mbarriers (Q full; per stage K full, K empty,
// V full, V empty).
struct WsSmem {
  uint32_t q, k, v, bars;
  __device__ uint32_t q_full() const { return bars; }
  __device__ uint32_t k_full(int s) const { return bars + 8 * (1 + s); }
  __device__ uint32_t k_empty(int s) const { return bars + 8 * (1 + kStages + s); }
  __device__ uint32_t v_full(int s) const { return bars + 8 * (1 + 2 * kStages + s); }
  __device__ uint32_t v_empty(int s) const { return bars + 8 * (1 + 3 * kStages + s); }
};

// The producer's thread: Q's rows qrow.. (columns qcol..), then key tiles from row krow (columns kcol..) of k and v.
template <int HD>
__device__ __forceinline__ void ws_produce(const CUtensorMap* tq, const CUtensorMap* tk, const CUtensorMap* tv,
                                           const WsSmem& sm, int qrow, int qcol, int krow, int kcol, int nkb) {
  constexpr uint32_t TB = ws_tile_bytes<HD>();
  const uint64_t once = l2_evict_first(), reused = l2_evict_last();  // K and V: the other query blocks and heads
  auto tile = [&](const CUtensorMap* m, uint32_t dst, uint32_t full, int row, int col, uint64_t pol) {
    mbar_expect_tx(full, TB);
#pragma unroll
    for (int p = 0; p < panels<HD>(); ++p) tma_load_2d(dst + p * (kBN * 128), m, col + 64 * p, row, full, pol);
  };
  // Tile kb into stage kb % kStages, its (kb / kStages)-th use: once the consumers released the use before.
  auto kv = [&](bool is_v, int kb) {
    const int s = kb % kStages;
    mbar_wait(is_v ? sm.v_empty(s) : sm.k_empty(s), ((kb / kStages) & 1) ^ 1);
    tile(is_v ? tv : tk, (is_v ? sm.v : sm.k) + s * TB, is_v ? sm.v_full(s) : sm.k_full(s), krow + kb * kBN, kcol,
         reused);
  };
  tmap_prefetch(tq);
  tmap_prefetch(tk);
  tmap_prefetch(tv);
  tile(tq, sm.q, sm.q_full(), qrow, qcol, once);
  kv(false, 0);
  for (int kb = 1; kb < nkb; ++kb) {
    kv(false, kb);
    kv(true, kb - 1);
  }
  kv(true, nkb - 1);
}

// Rows r0.. of every panel of a tile of R rows to zero, by n threads (ct: the thread's index among them).
template <int HD, int R = kBN>
__device__ __forceinline__ void zero_rows(uint32_t tile, int r0, int ct, int n = 128) {
  for (int c = r0 * 8 + ct; c < R * 8; c += n)  // 16-byte chunk c % 8 of row c / 8 (whole rows: no swizzle)
#pragma unroll
    for (int p = 0; p < panels<HD>(); ++p)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(tile + p * (R * 128) + c * 16), "r"(0)
                   : "memory");
}

// Consumer c (0 or 1): query rows i0 + 64c .. +64 of the segment at b0 (length L) over the block's nkb key tiles;
// ct: the thread's index in its warpgroup.
template <class S, int HD>
__device__ __forceinline__ void ws_consume(const WsSmem& sm, S* out, float* lse, int b0, int L, int i0, int nkb,
                                           int h, int nh, bool causal, float sl2, int c, int ct) {
  constexpr uint32_t TB = ws_tile_bytes<HD>();
  const int lane = ct & 31, g = lane >> 2, t = lane & 3;
  const int tr0 = i0 + c * 64 + (ct >> 5) * 16 + g;  // this thread's rows: tr0, tr0 + 8
  const uint32_t qa = sm.q + c * 64 * 128;           // the warpgroup's 64 rows inside each Q panel
  const bool lead = lane == 0;                       // the warp's arrival on an empty barrier
  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float mrow[2] = {kNegInf, kNegInf}, lrow[2] = {0.f, 0.f};  // running max (log2 units), per-thread partial sum
  float s[kBN / 2], alpha[2];
  uint32_t p[kBN / 16][4];

  bar_arrive(1, 2 * 128, c == 0 && nkb > 1);  // consumer 0 issues first
  mbar_wait(sm.q_full(), 0);
  mbar_wait(sm.k_full(0), 0);
  wg_fence();
  gemm_s<S, HD>(s, qa, sm.k);
  wg_commit();
  wg_wait<0>();
  mbar_arrive(sm.k_empty(0), lead);
  pin(s);
  softmax_tile(s, mrow, lrow, alpha, 0, L, tr0, t, causal, sl2);  // o is 0: no rescale
  to_p<S, kBN>(s, p);
  for (int kb = 0; kb + 1 < nkb; ++kb) {
    const int sk = (kb + 1) % kStages, sv = kb % kStages;
    mbar_wait(sm.k_full(sk), ((kb + 1) / kStages) & 1);
    mbar_wait(sm.v_full(sv), (kb / kStages) & 1);  // here, not between the GEMMs: a wait loop there serializes them
    bar_sync(1 + c, 2 * 128);                       // the other consumer has issued its GEMMs
    pin(o);
    pin2(p);
    wg_fence();
    gemm_s<S, HD>(s, qa, sm.k + sk * TB);
    wg_commit();
    gemm_pv<S, HD, kBN>(o, p, sm.v + sv * TB);
    wg_commit();
    bar_arrive(2 - c, 2 * 128, c == 0 || kb + 2 < nkb);  // the other's turn (consumer 1's last: nobody waits)
    wg_wait<1>();  // S of tile kb+1 is done; PV of tile kb keeps running
    mbar_arrive(sm.k_empty(sk), lead);
    pin(s);
    softmax_tile(s, mrow, lrow, alpha, (kb + 1) * kBN, L, tr0, t, causal, sl2);
    wg_wait<0>();
    mbar_arrive(sm.v_empty(sv), lead);
    pin(o);
    rescale(o, alpha);  // p and o are free again
    to_p<S, kBN>(s, p);
  }
  // PV of the last tile (nothing is loaded after it: no release).
  const int kl = nkb - 1, sv = kl % kStages;
  mbar_wait(sm.v_full(sv), (kl / kStages) & 1);
  if (nkb * kBN > L) {  // the segment ends inside it: zero its rows past the end (both consumers write the zeros)
    zero_rows<HD>(sm.v + sv * TB, L - kl * kBN, ct);
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    bar_sync(3 + c, 128);
  }
  pin(o);
  pin2(p);
  wg_fence();
  gemm_pv<S, HD, kBN>(o, p, sm.v + sv * TB);
  wg_commit();
  wg_wait<0>();
  pin(o);
  store_rows<S, HD>(o, mrow, lrow, out, lse, b0, L, tr0, t, h, nh);
}

// tq: q [N, nh*HD], tk / tv: k / v [N, nkv*HD], each in boxes of 64 columns x 128 rows (tmap_16bit).
template <class S, int HD>
__global__ void __launch_bounds__(kWsThreads, 1)
    fwd_ws(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
           const __grid_constant__ CUtensorMap tv, S* __restrict__ out, float* __restrict__ lse,
           const int32_t* __restrict__ cu, int nh, int nkv, float sl2, bool causal) {
#ifdef Q3VL_WGMMA
  static_assert(HD % 64 == 0, "whole 64-column TMA boxes");
  constexpr uint32_t TB = ws_tile_bytes<HD>();
  __shared__ alignas(8) uint64_t bars[1 + 4 * kStages];
  extern __shared__ __align__(16) unsigned char smraw[];
  WsSmem sm;
  sm.q = (su32(smraw) + 1023u) & ~1023u;
  sm.k = sm.q + TB;
  sm.v = sm.k + kStages * TB;
  sm.bars = su32(bars);

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest (causal) blocks first
  if (i0 >= L) return;
  const int nkb = ((causal ? min(i0 + kBM, L) : L) + kBN - 1) / kBN;
  if (threadIdx.x == 0) {
    mbar_init(sm.q_full(), 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(sm.k_full(s), 1);
      mbar_init(sm.v_full(s), 1);
      mbar_init(sm.k_empty(s), 8);  // the consumers' warps
      mbar_init(sm.v_empty(s), 8);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    regs_dec<24>();
    if (threadIdx.x == 0) ws_produce<HD>(&tq, &tk, &tv, sm, b0 + i0, h * HD, b0, h / (nh / nkv) * HD, nkb);
  } else {
    regs_inc<240>();
    ws_consume<S, HD>(sm, out, lse, b0, L, i0, nkb, h, nh, causal, sl2, threadIdx.x / 128 - 1, threadIdx.x % 128);
  }
#else
  __trap();
#endif
}


// ---- backward -------------------------------------------------------------------------------------------------------
// A block is 2 warpgroups and kBwdN = 128 keys of one kv head of one segment; warpgroup w owns keys [64w, 64w+64) and
// their dK/dV rows (fp32 in registers, summed over the group's query heads: GQA without races; where head_split
// shares the heads among blocks, each writes fp32 partials that sum_parts adds in order). The block loops over
// the query heads of the group and, per head, over 64-query tiles (causal: from the block's first key on); per tile
// (Q, dO, lse, D double-buffered: Q and dO by TMA at hd 64 and 128, else cp.async), warpgroup w computes
//   S^T = K_w Q^T, dP^T = V_w dO^T          (wgmma m64n64k16, both operands K-major in smem)
//   P^T = exp2(S^T sl2 - lse log2e), dS^T = P^T (dP^T - D) scale   (registers; lse, D per column = query)
//   dV_w += P^T dO, dK_w += dS^T Q          (wgmma m64n128k16, P^T/dS^T from registers, dO/Q N-major)
// and dS^T goes to shared memory (keys x queries, 128-byte swizzle), from which, once both halves are there,
//   dQ[:, 64w..64w+64) = dS K[:, 64w..]    (wgmma m64n64k16, dS M-major, K N-major)
// is issued before dK's product (FA3's order: dQ's registers are staged while dK runs) and added to an fp32 dQ
// accumulator in global memory (other key blocks add to the same rows). The accumulator is
// kept in tiles of 64 query rows x HD columns (dq_tile: one tile per query tile and head, each a contiguous block in
// the order of the wgmma accumulator's registers), so that a warpgroup's whole contribution is staged in shared memory
// with conflict-free 16-byte stores and goes out as ONE bulk reduction (cp.reduce.async.bulk .add.f32, 16-18 KiB),
// performed by the copy engine while the warps go on; dq_from_acc turns the tiles into dQ rows. Measured at the 2B's
// shape, hd 128 (H200, seventeenth session): the tiles alone no faster than a reduction per row (2.27 ms), the TMA
// loads 2.27 -> 2.01 ms; the reductions still cost ~0.41 ms of it (none sent: 1.60), in proportion to their bytes
// (half the bytes: 1.82), neither from the accumulator's place in L2 (a private region per block: 1.97) nor from the
// add (a plain bulk store: 1.94); an evict-last hint changed nothing, key blocks fastest in the launch order 2.25.
// Eighteenth session: dQ before dK 2.01 -> 1.93 ms; the reductions still cost 0.37 ms (none sent: 1.56), and not by
// waiting for the staging buffer (no wait at all: 1.91). Without the S^T product the backward is no faster (2.02).
constexpr int kBwdM = 64, kBwdN = 128;
// The dQ accumulator's tiles. A warpgroup's part of a tile is its dQ columns (dq_cols: 64 at hd 128, where the two
// warpgroups split them, else HD) for 64 query rows, stored as the warpgroup's registers are: chunk n (the wgmma
// accumulator's registers 4n .. 4n+3) of thread tid at float (n * 128 + tid) * 4. Register 4n + 2rh + e of thread
// (warp, g = lane / 4, t = lane % 4) is dQ row 16 warp + g + 8 rh, column 8n + 2t + e of the part (dq_tile_at).
// Tile T of a segment starting at token b0 (query tile qt) is b0 / 64 + seg + qt: distinct for every segment and
// tile, fewer than N / 64 + nseg (dq_tiles). Tiles are [T][local query head][parts][64 * dq_cols] floats.
template <int HD> constexpr int dq_cols() { return HD == 128 ? 64 : HD; }
template <int HD> constexpr size_t dq_stage_bytes() { return size_t(kBwdM) * dq_cols<HD>() * 4; }
inline int64_t dq_tiles(int64_t N, int nseg) { return N / kBwdM + nseg; }
// The float offset inside a head's tile of row r (0..63), columns c, c + 1 (c even, 0..HD-1).
template <int HD> __device__ __forceinline__ int dq_tile_at(int r, int c) {
  const int part = c / dq_cols<HD>(), cc = c % dq_cols<HD>();
  const int tid = (r / 16) * 32 + (r % 8) * 4 + (cc % 8) / 2;
  return part * (kBwdM * dq_cols<HD>()) + ((cc / 8) * 128 + tid) * 4 + 2 * ((r % 16) / 8);
}
template <int HD> constexpr size_t bwd_smem() {
  return size_t(2 * kBwdN + 4 * kBwdM) * panels<HD>() * 128 + kBwdN * kBwdM * 2 + 4 * kBwdM * 4 +
         2 * 2 * dq_stage_bytes<HD>() + 1024;
}
static_assert(bwd_smem<128>() <= 227 * 1024 && bwd_smem<72>() <= 227 * 1024 && bwd_smem<64>() <= 227 * 1024);

// t (64 x 64: the warpgroup's 64 rows of A x the 64 rows of B) = A B^T, both K-major HD-column tiles: A's rows start
// at a inside panels of pa bytes, B is a 64-row tile at b.
template <class S, int HD>
__device__ __forceinline__ void gemm_t(float (&t)[kBwdM / 2], uint32_t a, uint32_t pa, uint32_t b) {
#pragma unroll
  for (int kk = 0; kk < kdim<HD>() / 16; ++kk)
    wg_ss<S, kBwdM>(t, sdesc(a + (kk >> 2) * pa + (kk & 3) * 32, 16),
                    sdesc(b + (kk >> 2) * (kBwdM * 128) + (kk & 3) * 32, 16), kk > 0);
}

template <class S, int HD>
__global__ void __launch_bounds__(kThreads, 1) bwd_wgmma(const __grid_constant__ CUtensorMap tq,
                                                         const __grid_constant__ CUtensorMap tdo,
                                                         const S* __restrict__ dout, const S* __restrict__ q,
                                                         const S* __restrict__ k, const S* __restrict__ v,
                                                         const float* __restrict__ lse, const float* __restrict__ Dd,
                                                         S* __restrict__ dk, S* __restrict__ dv,
                                                         float* __restrict__ dqacc, const int32_t* __restrict__ cu,
                                                         int nh, int nkv, int kh0, float scale, float sl2,
                                                         bool causal, bool acc, int split, float* __restrict__ part,
                                                         int64_t ntok) {
#ifdef Q3VL_WGMMA
  // dQ: at hd 128 the 2 warpgroups split its 64 columns (each over all 128 keys); at 64 and 72 they split the keys
  // (each its own 64, all HD columns) and both add to the accumulator.
  constexpr bool kSplitCols = HD == 128;
  constexpr int DQN = dq_cols<HD>();  // the warpgroup's dQ columns (above)
  constexpr int BM = kBwdM, BN = kBwdN, TQ = BM * panels<HD>() * 128, TK = BN * panels<HD>() * 128;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ __align__(16) unsigned char smraw[];
  const uint32_t sK = (static_cast<uint32_t>(__cvta_generic_to_shared(smraw)) + 1023u) & ~1023u;
  const uint32_t sV = sK + TK, sQ = sV + TK, sO = sQ + 2 * TQ, sdS = sO + 2 * TQ;  // sQ, sO: 2 buffers
  const uint32_t sLD = sdS + BN * BM * 2;  // lse[2][BM], then D[2][BM]
  const uint32_t sDQ = sLD + 4 * BM * 4;    // staged dQ: [warpgroup][buffer] of dq_stage_bytes
  float* fLD = reinterpret_cast<float*>(smraw + (sLD - static_cast<uint32_t>(__cvta_generic_to_shared(smraw))));

  // Key blocks slowest in the launch order: every head's and segment's first block (the most query tiles when
  // causal) starts before any second one.
  // blockIdx.x: kv head kh0 + x / split (dqacc holds the rows of those nc), and which split-th of its query heads.
  const int nc = gridDim.x / split, kh = kh0 + blockIdx.x / split, hs = blockIdx.x % split, seg = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int j0 = blockIdx.z * BN;
  if (j0 >= L) return;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int grp = nh / nkv, hpb = grp / split, h0 = kh * grp + hs * hpb;  // this block's query heads [h0, h0+hpb)
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  // The segment's first dQ tile (dq_tiles; dq_from_acc computes the same index). A shared dq_tile(b0, seg, row)
  // for both changed this kernel's register allocation (255 -> 248) and cost 2% (1.93 -> 1.97 ms, eighteenth
  // session's call 4): the index stays written out here.
  const int64_t tile0 = b0 / BM + seg;
  const int qb0 = causal ? j0 / BM : 0;  // earlier query tiles see none of these keys
  const int nqb = (L + BM - 1) / BM - qb0, nit = hpb * nqb;

  // At head dims of whole 64-column panels the Q and dO tiles come by TMA (thread 0 issues, full[buf] completes),
  // else by every thread's cp.async. A TMA tile's rows are token rows: past the segment's end they are zeroed in
  // shared memory once landed (rows of another segment, or NaN outside every one, must meet P = dS = 0 as zeros).
  constexpr bool kTma = HD % 64 == 0;
  __shared__ alignas(8) uint64_t full[2];
  const uint32_t sFull = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const uint64_t pol = kTma ? l2_evict_normal() : 0;
  if (kTma && tid == 0) {
    tmap_prefetch(&tq);
    tmap_prefetch(&tdo);
    mbar_init(sFull, 1);
    mbar_init(sFull + 8, 1);
    mbar_init_fence();
  }
  if constexpr (kTma) __syncthreads();
  load_tile<S, HD, BN>(sK, k + int64_t(b0) * ldk + int64_t(kh) * HD, ldk, j0, L, tid);
  load_tile<S, HD, BN>(sV, v + int64_t(b0) * ldk + int64_t(kh) * HD, ldk, j0, L, tid);
  auto stage = [&](int it, int buf) {
    const int h = h0 + it / nqb, i0 = (qb0 + it % nqb) * BM;
    if constexpr (kTma) {
      if (tid == 0) {
        mbar_expect_tx(sFull + 8 * buf, 2 * TQ);
#pragma unroll
        for (int p = 0; p < panels<HD>(); ++p) {
          tma_load_2d(sQ + buf * TQ + p * (BM * 128), &tq, h * HD + 64 * p, b0 + i0, sFull + 8 * buf, pol);
          tma_load_2d(sO + buf * TQ + p * (BM * 128), &tdo, h * HD + 64 * p, b0 + i0, sFull + 8 * buf, pol);
        }
      }
    } else {
      load_tile<S, HD, BM>(sQ + buf * TQ, q + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
      load_tile<S, HD, BM>(sO + buf * TQ, dout + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
    }
    if (tid < 2 * BM) {  // lse (tid < BM) and D; rows past the end read as 0 and are masked
      const int r = tid % BM;
      const bool ok = i0 + r < L;
      const int64_t idx = ok ? int64_t(b0 + i0 + r) * nh + h : 0;
      cp4(sLD + ((tid / BM) * 2 + buf) * BM * 4 + r * 4, (tid < BM ? lse : Dd) + idx, ok);
    }
  };
  stage(0, 0);
  cp_commit();

  float dka[HD / 2], dva[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) dka[i] = dva[i] = 0.f;
  const int kw0 = j0 + wg * 64;            // the warpgroup's first key
  const int kr0 = kw0 + warp * 16 + g;     // this thread's keys: kr0, kr0 + 8 (accumulator rows)
  const uint32_t ka = sK + wg * 64 * 128;  // the warpgroup's 64 rows inside each K / V panel
  const uint32_t va = sV + wg * 64 * 128;

  for (int it = 0; it < nit; ++it) {
    const int buf = it & 1, h = h0 + it / nqb, i0 = (qb0 + it % nqb) * BM;
    // Tile it landed; every wgmma and read of the other buffer and of sdS (iteration it-1) is complete.
    if constexpr (kTma) {
      cp_wait_all();  // lse, D
      mbar_wait(sFull + 8 * buf, (it >> 1) & 1);
      if (i0 + BM > L) {
        zero_rows<HD, BM>(sQ + buf * TQ, L - i0, tid, kThreads);
        zero_rows<HD, BM>(sO + buf * TQ, L - i0, tid, kThreads);
      }
    }
    tiles_landed();
    if (it + 1 < nit) stage(it + 1, (it + 1) & 1);
    cp_commit();
    const uint32_t cQ = sQ + buf * TQ, cO = sO + buf * TQ;
    const float* cL = fLD + buf * BM;
    const float* cD = fLD + (2 + buf) * BM;

    // S^T and dP^T as two groups: P is computed while dP^T runs, dS while dV += P^T dO runs.
    float st[BM / 2], dpt[BM / 2];
    wg_fence();
    gemm_t<S, HD>(st, ka, BN * 128, cQ);
    wg_commit();
    gemm_t<S, HD>(dpt, va, BN * 128, cO);
    wg_commit();
    wg_wait<1>();
    pin(st);
    // Accumulator element 4n+e: key kr0 + 8*(e>>1), query i0 + 8n + 2t + (e&1).
    const bool need_mask = i0 + BM > L || kw0 + 64 > L || (causal && i0 < kw0 + 63);  // warpgroup-uniform
#pragma unroll
    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = 8 * n + 2 * t + (e & 1);
        float p = fexp2(st[4 * n + e] * sl2 - cL[c] * kLog2e);
        if (need_mask) {
          const int i = i0 + c, j = kr0 + 8 * (e >> 1);
          if (i >= L || j >= L || (causal && j > i)) p = 0.f;
        }
        st[4 * n + e] = p;
      }
    uint32_t pa[BM / 16][4], da[BM / 16][4];
    to_p<S, BM>(st, pa);
    pin(dva);
    pin2(pa);
    wg_fence();
    gemm_pv<S, HD, BM>(dva, pa, cO);
    wg_commit();
    wg_wait<1>();  // dP^T (the older group) done; dV keeps running
    pin(dpt);
#pragma unroll
    for (int n = 0; n < BM / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dpt[4 * n + e] = st[4 * n + e] * (dpt[4 * n + e] - cD[8 * n + 2 * t + (e & 1)]) * scale;
    to_p<S, BM>(dpt, da);
    // dS^T to shared memory: key row r = kr0 - j0 (+8), query chunk n at 16-byte position n ^ (r % 8). The pair for
    // chunk n, row half rh is da[n/2][2*(n%2) + rh] (to_p's order). Conflict-free: a warp's 8 rows hit 8 chunks.
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int r = kr0 - j0 + 8 * rh;
#pragma unroll
      for (int n = 0; n < BM / 8; ++n)
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + r * 128 + ((n ^ (r & 7)) << 4) + 4 * t),
                     "r"(da[n >> 1][2 * (n & 1) + rh])
                     : "memory");
    }
    // dS^T written (generic proxy) before wgmma reads it (async proxy): both warpgroups' halves when each reads all
    // 128 keys, else the warpgroup's own (named barrier 1 + wg over its 128 threads).
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    if constexpr (kSplitCols) __syncthreads();
    else asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    // dQ, then dK += dS^T Q as the next group: dQ's registers are staged while dK runs (FA3's order).
    float dqa[DQN / 2];
    pin(dka);
    pin2(da);
    wg_fence();
    if constexpr (kSplitCols) {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wg_ss<S, 64, 1, 1>(dqa, sdesc(sdS + kk * 2048, BN * BM * 2),
                           sdesc(sK + wg * (BN * 128) + kk * 2048, BN * 128), kk > 0);
    } else {
#pragma unroll
      for (int kk = 0; kk < BN / 32; ++kk) {  // 16-key steps inside the warpgroup's 64 keys
        const uint32_t off = (wg * (BN / 32) + kk) * 2048;
        wg_ss<S, HD, 1, 1>(dqa, sdesc(sdS + off, BN * BM * 2), sdesc(sK + off, BN * 128), kk > 0);
      }
    }
    wg_commit();
    gemm_pv<S, HD, BM>(dka, da, cQ);
    wg_commit();
    wg_wait<1>();  // dQ done; dK (and dV before it) may still run
    pin(dqa);
    // The warpgroup's part of dQ tile (query tile i0, head h) staged in its registers' order (dq_tile_at:
    // conflict-free 16-byte stores) into its buffer it % 2, which the reduction of iteration it - 2 (issued by the
    // warpgroup's thread 0) must have read first; made visible to the copy engine (proxy fence, the warpgroup's
    // barrier), and sent by thread 0 as one reduction.
    const uint32_t sq = sDQ + (wg * 2 + (it & 1)) * uint32_t(dq_stage_bytes<HD>());
    const int wtid = tid & 127;
    if (wtid == 0) bulk_wait_read<1>();
    asm volatile("bar.sync %0, 128;\n" ::"r"(5 + wg) : "memory");
#pragma unroll
    for (int n = 0; n < DQN / 8; ++n)
      asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(sq + (n * 128 + wtid) * 16), "f"(dqa[4 * n]),
                   "f"(dqa[4 * n + 1]), "f"(dqa[4 * n + 2]), "f"(dqa[4 * n + 3])
                   : "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(3 + wg) : "memory");
    if (wtid == 0) {
      const int64_t T = tile0 + i0 / BM;
      float* tile = dqacc + (T * (int64_t(nc) * grp) + (h - kh0 * grp)) * (BM * HD);
      bulk_add_f32(tile + (kSplitCols ? wg * BM * DQN : 0), sq, uint32_t(dq_stage_bytes<HD>()));
      bulk_commit();
    }
    wg_wait<0>();  // dK and dV: the next iteration's loads overwrite this one's Q and dO buffers
    pin(dka);
    pin(dva);
    pin2(pa);  // the A fragments of dV/dK stay allocated until those wgmmas have completed
    pin2(da);
  }
  bulk_wait_all();  // the staged rows stay in shared memory until the reductions have read them
#pragma unroll
  for (int rh = 0; rh < 2; ++rh) {
    const int j = kr0 + 8 * rh;
    if (j >= L) continue;
    const int64_t row = int64_t(b0 + j) * ldk + int64_t(kh) * HD + 2 * t;
    if (part) {  // a share of the group's heads: fp32 partials [split][ntok, nkv*HD] (dK, then dV), sum_parts adds
      float* pk = part + int64_t(hs) * ntok * ldk + row;
      float* pv = pk + int64_t(split) * ntok * ldk;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        *reinterpret_cast<float2*>(pk + 8 * n) = make_float2(dka[4 * n + 2 * rh], dka[4 * n + 2 * rh + 1]);
        *reinterpret_cast<float2*>(pv + 8 * n) = make_float2(dva[4 * n + 2 * rh], dva[4 * n + 2 * rh + 1]);
      }
      continue;
    }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      add2<S>(dk + row + 8 * n, dka[4 * n + 2 * rh], dka[4 * n + 2 * rh + 1], acc);
      add2<S>(dv + row + 8 * n, dva[4 * n + 2 * rh], dva[4 * n + 2 * rh + 1], acc);
    }
  }
#else
  __trap();
#endif
}

// dq[:, c0 .. c0 + w) (+)= the fp32 accumulator's tiles (dq_tile_at; w / HD local query heads), 2 elements a
// thread (ldq: dq's row stride). Rows outside every segment get 0.
template <class S, int HD>
__global__ void dq_from_acc(const float* __restrict__ a, S* __restrict__ dq, const int32_t* __restrict__ cu, int nseg,
                            int64_t n2, int w, int64_t ldq, int64_t c0, bool acc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n2; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = 2 * i / w;
    const int col = int(2 * i % w);
    int lo = 0, hi = nseg;  // the segment: the last seg with cu[seg] <= row (binary search)
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (cu[mid] <= row) lo = mid;
      else hi = mid;
    }
    float2 v = make_float2(0.f, 0.f);
    const int b0 = cu[lo];
    if (row >= b0 && row < cu[lo + 1]) {
      const int r = int(row - b0), hl = col / HD;
      const int64_t T = b0 / kBwdM + lo + r / kBwdM;
      v = *reinterpret_cast<const float2*>(a + (T * (w / HD) + hl) * (kBwdM * HD) + dq_tile_at<HD>(r % kBwdM, col % HD));
    }
    add2<S>(dq + row * ldq + c0 + col, v.x, v.y, acc);
  }
}

// out[i] (+)= part[0][i] + part[1][i] + ... (split partials of n elements, in order: deterministic), 2 a thread.
template <class S>
__global__ void sum_parts(const float2* __restrict__ part, int split, int64_t n2, S* __restrict__ out, bool acc) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n2; i += int64_t(gridDim.x) * blockDim.x) {
    float2 a = part[i];
    for (int s = 1; s < split; ++s) a.x += part[s * n2 + i].x, a.y += part[s * n2 + i].y;
    add2<S>(out + 2 * i, a.x, a.y, acc);
  }
}

// How many blocks share a kv head's query heads. A block owns 128 keys of one kv head and loops over its group's
// query heads; with few kv heads and segments the grid under-fills the GPU, and causally the first key block does
// every query tile (the 30B-A3B: 4 kv heads of 8, one 4096-token segment: 128 blocks, the heaviest 2x the mean).
// Split the heads (dK/dV then go through fp32 partials, part_bytes of the workspace) while the grid stays within 4
// blocks an SM and every block keeps 2 heads or more (at the 2B's group of 2, one head a block measured 0.94x: K and
// V loaded twice as often, the partials' traffic on top).
int head_split(int64_t blocks, int grp, size_t part_bytes_per_split, size_t room) {
  int dev = 0, sms = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int split = 1;
  while (grp % (4 * split) == 0 && blocks * 2 * split <= 4 * int64_t(sms) && 2 * split * part_bytes_per_split <= room)
    split *= 2;
  return split;
}

bool is_sm90() {
  int dev = 0, major = 0, minor = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  Q3VL_CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return major == 9 && minor == 0;  // the sm_90a cubin runs on 9.0 only
}


}  // namespace

bool attention_fwd_sm90(cudaStream_t st, bool bf16, const void* q, const void* k, const void* v, void* out, float* lse,
                        const int32_t* cu, int nseg, int max_len, int64_t N, int nh, int nkv, int hd, bool causal,
                        float sl2) {
  // hd 128 only: at 64 and 72 (the vision tower) an earlier wgmma forward measured 0.87-1.15x fwd_tc (sixth and
  // thirteenth sessions); fwd_ws is written for multiples of 64. Where the TMA cannot take the tensors (alignment,
  // no driver entry point) fwd_tc runs, and the log says so once.
  if (hd != 128 || !is_sm90()) return false;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  CUtensorMap tq, tk, tv;
  if (!tmap_16bit(tq, q, N, ldq, ldq, kBM, bf16) || !tmap_16bit(tk, k, N, ldk, ldk, kBN, bf16) ||
      !tmap_16bit(tv, v, N, ldk, ldk, kBN, bf16)) {
    static std::once_flag told;
    std::call_once(told, [] { log_warn("attention_fwd_sm90: no TMA tensor maps for these tensors: fwd_tc instead"); });
    return false;
  }
  const dim3 grid(unsigned((max_len + kBM - 1) / kBM), unsigned(nh), unsigned(nseg));
  auto run = [&]<class S, int HD>() {
    launch(fwd_ws<S, HD>, grid, kWsThreads, ws_smem<HD>(), st, tq, tk, tv, static_cast<S*>(out), lse, cu, nh, nkv,
           sl2, causal);
  };
  if (bf16) run.template operator()<__nv_bfloat16, 128>();
  else run.template operator()<__half, 128>();
  return true;
}

// dqacc: acc_bytes of workspace for the fp32 dQ accumulator (and, when the query heads are split, the dK/dV
// partials first); the kv heads go in chunks whose query heads' rows fit (false, nothing done, when not even one kv
// head's do).
bool attention_bwd_sm90(cudaStream_t st, bool bf16, const void* dout, const void* q, const void* k, const void* v,
                        const float* lse, const float* D, void* dq, void* dk, void* dv, float* dqacc, size_t acc_bytes,
                        const int32_t* cu, int nseg, int max_len, int64_t N, int nh, int nkv, int hd, bool causal,
                        float scale, float sl2, bool acc) {
  const int grp = nh / nkv;
  const size_t per_kv = size_t(dq_tiles(N, nseg)) * kBwdM * grp * hd * sizeof(float);  // one kv head's dQ tiles
  if ((hd != 128 && hd != 72 && hd != 64) || acc_bytes < per_kv || !is_sm90()) return false;
  // The TMA maps of q and dout (head dims 64 and 128; unused at 72): where the TMA cannot take them, the older
  // kernels (attention.cu's) run instead, and the log says so once.
  CUtensorMap tq{}, tdo{};
  if (hd % 64 == 0 && (!tmap_16bit(tq, q, N, int64_t(nh) * hd, int64_t(nh) * hd, kBwdM, bf16) ||
                       !tmap_16bit(tdo, dout, N, int64_t(nh) * hd, int64_t(nh) * hd, kBwdM, bf16))) {
    static std::once_flag told;
    std::call_once(told, [] { log_warn("attention_bwd_sm90: no TMA tensor maps for these tensors: dkdv_tc/dq_tc"); });
    return false;
  }
  const int nkb = (max_len + kBwdN - 1) / kBwdN;
  const size_t kv_elems = size_t(N) * nkv * hd, per_split = 2 * kv_elems * sizeof(float);  // dK and dV partials
  const int split = head_split(int64_t(nkv) * nseg * nkb, grp, per_split, acc_bytes - per_kv);
  float* part = split > 1 ? dqacc : nullptr;  // the partials first, then the dQ accumulator
  dqacc += split > 1 ? split * per_split / sizeof(float) : 0;
  const int chunk = int(std::min<size_t>(nkv, (acc_bytes - (split > 1 ? split * per_split : 0)) / per_kv));
  // Rows outside every segment (possible when accumulating) read 0 from the partials.
  if (part) Q3VL_CU(cudaMemsetAsync(part, 0, split * per_split, st));
  auto run = [&]<class S, int HD>() {
    for (int kh0 = 0; kh0 < nkv; kh0 += chunk) {
      const int nc = std::min(chunk, nkv - kh0), w = nc * grp * hd;
      Q3VL_CU(cudaMemsetAsync(dqacc, 0, nc * per_kv, st));
      const dim3 grid(unsigned(nc * split), unsigned(nseg), unsigned(nkb));
      launch(bwd_wgmma<S, HD>, grid, kThreads, bwd_smem<HD>(), st, tq, tdo, static_cast<const S*>(dout),
             static_cast<const S*>(q), static_cast<const S*>(k), static_cast<const S*>(v), lse, D,
             static_cast<S*>(dk), static_cast<S*>(dv), dqacc, cu, nh, nkv, kh0, scale, sl2, causal, acc, split, part,
             N);
      const int64_t n2 = N * w / 2;
      launch(dq_from_acc<S, HD>, dim3(grid_for(n2)), 256, 0, st, dqacc, static_cast<S*>(dq), cu, nseg, n2, w,
             int64_t(nh) * hd, int64_t(kh0) * grp * hd, acc);
    }
    if (!part) return;
    const int64_t n2 = int64_t(kv_elems / 2);
    launch(sum_parts<S>, dim3(grid_for(n2)), 256, 0, st, reinterpret_cast<const float2*>(part), split, n2,
           static_cast<S*>(dk), acc);
    launch(sum_parts<S>, dim3(grid_for(n2)), 256, 0, st, reinterpret_cast<const float2*>(part) + split * n2, split,
           n2, static_cast<S*>(dv), acc);
  };
  auto by_hd = [&]<class S>() {
    if (hd == 128) run.template operator()<S, 128>();
    else if (hd == 72) run.template operator()<S, 72>();
    else run.template operator()<S, 64>();
  };
  bf16 ? by_hd.template operator()<__nv_bfloat16>() : by_hd.template operator()<__half>();
  return true;
}

}  // namespace q3vl::dev::cuda
