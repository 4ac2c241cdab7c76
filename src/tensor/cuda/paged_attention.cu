// Paged attention (dev::paged_attention_fwd): the new tokens of several sequences against their paged KV cache, for
// serving (decode rows and chunked-prefill chunks in one call). Online softmax over key tiles in shared memory, never
// a score matrix in global memory. Two kernels:
//  - paged_tc (bf16/fp16, hd 64 or 128, 16-byte aligned): tensor cores (mma.sync, fp32 accumulation), K/V tiles
//    gathered through the block table with cp.async; see its comment. paged_attention_path(tc = false) keeps the
//    SIMT kernel (tools/gpu/paged_check.cu compares the two).
//  - paged_fwd (everything else: fp32 parity mode, other head dims), SIMT in fp32:
//  - One block per (tile of query items, kv head, segment x key split). A query item is (new row i, head g of the kv
//    head's GQA group), items i-major, so each K/V row a block loads into shared memory (once, as fp32) serves every
//    query head of its group. TPI threads own one item (TPI = 32 for decode-sized calls, 8 or 4 for prefill chunks):
//    thread t of an item scores the tile's keys t, t+TPI, ... and accumulates the output columns t, t+TPI, ...
//  - Keys come through the block table: the tile's pool rows are looked up once per tile into shared memory.
// Both: split-K (flash-decoding): when one tile of items covers every segment's new rows (decode, max_q * nh/nkv small)
//    and the grid would not fill the GPU, each segment's keys are split over up to 64 blocks; each writes its
//    unnormalised output row, running max and sum to Exec::ws, and a second kernel combines them. The host sizes the
//    grid from max_ctx, an upper bound (a decode step captured as a CUDA graph passes the block table's capacity); each
//    segment's split length comes from its own context on the device (split_chunk), so a short context uses a few
//    splits and the rest return at once, and the combine reads only the splits that ran.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/mma_util.cuh"

namespace q3vl::dev::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;
constexpr int kThreads = 256;  // per block
constexpr int kBN = 32;        // keys per tile
constexpr int kSplitMin = 256; // keys per split at least
constexpr int kMaxSplit = 64;

// Keys a split of a segment with C keys covers: an even share of C over nsplit splits, whole tiles of bn keys, at least
// min_keys; splits from ceil(C / chunk) on have no keys (splits_used: how many have).
__device__ __forceinline__ int split_chunk(int C, int nsplit, int bn, int min_keys) {
  const int c = max((C + nsplit - 1) / nsplit, min_keys);
  return (c + bn - 1) / bn * bn;
}
__device__ __forceinline__ int splits_used(int C, int nsplit, int bn, int min_keys) {
  const int c = split_chunk(C, nsplit, bn, min_keys);
  return max(1, min(nsplit, (C + c - 1) / c));
}

// W consecutive values of row g (element offset c) into fp32 smem, times mul; W = 8 with 16-byte loads (vec), else 1.
template <class S>
__device__ __forceinline__ void load_chunk(float* sm, const S* g, bool vec, float mul) {
  if (vec) {
    if constexpr (std::is_same_v<S, float>) {
      const float4 a = reinterpret_cast<const float4*>(g)[0], b = reinterpret_cast<const float4*>(g)[1];
      sm[0] = a.x * mul, sm[1] = a.y * mul, sm[2] = a.z * mul, sm[3] = a.w * mul;
      sm[4] = b.x * mul, sm[5] = b.y * mul, sm[6] = b.z * mul, sm[7] = b.w * mul;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(g);
      const S* e = reinterpret_cast<const S*>(&u);
#pragma unroll
      for (int k = 0; k < 8; ++k) sm[k] = ld(e, k) * mul;
    }
  } else {
    sm[0] = ld(g, 0) * mul;
  }
}
__device__ __forceinline__ void zero_chunk(float* sm, bool vec) {
  if (vec) {
#pragma unroll
    for (int k = 0; k < 8; ++k) sm[k] = 0.f;
  } else {
    sm[0] = 0.f;
  }
}

// part_acc [nsplit][N*nh][hd] (unnormalised output rows), part_ml [nsplit][N*nh][2] (running max in log2 units,
// sum); used when nsplit > 1, otherwise the block writes out directly.
template <class S, int TPI, int DM>
__global__ void __launch_bounds__(kThreads)
    paged_fwd(const S* __restrict__ q, const S* __restrict__ kp, const S* __restrict__ vp, S* __restrict__ out,
              float* __restrict__ part_acc, float* __restrict__ part_ml, const int32_t* __restrict__ cu,
              const int32_t* __restrict__ ctx, const int32_t* __restrict__ table, int64_t max_blocks, int block,
              int nsplit, int64_t rows_total, int nh, int nkv, int hd, float sl2, bool vec) {
  pdl_enter();  // launched by launch_pdl
  constexpr int BM = kThreads / TPI, NC = kBN / TPI;
  extern __shared__ __align__(16) unsigned char smraw[];
  __shared__ int64_t sRow[kBN];  // the tile's pool rows (-1: past the key range)
  const int lds = hd + 1;        // odd stride: column walks across rows are free of bank conflicts
  float* sQ = reinterpret_cast<float*>(smraw);
  float* sK = sQ + BM * lds;
  float* sV = sK + kBN * lds;

  const int seg = blockIdx.z / nsplit, sp = blockIdx.z - seg * nsplit, kh = blockIdx.y;
  const int G = nh / nkv;
  const int r0 = cu[seg], n = cu[seg + 1] - r0, C = ctx[seg];
  const int it0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest (latest rows) tiles first
  if (it0 >= n * G) return;
  const int tid = threadIdx.x, r = tid / TPI, t = tid % TPI;
  const int it = it0 + r, i = it / G, h = kh * G + (it - i * G);
  const bool live = i < n;
  const int p = live ? C - n + i : -1;  // the item's position: keys [0, p]
  const int kend_tile = C - n + (min(it0 + BM, n * G) - 1) / G + 1;
  const int chunk = nsplit == 1 ? C : split_chunk(C, nsplit, kBN, kSplitMin);
  if (sp > 0 && sp >= splits_used(C, nsplit, kBN, kSplitMin)) return;  // no keys: the combine skips it
  const int kbeg = sp * chunk, kend = min(kbeg + chunk, kend_tile);

  const int W = vec ? 8 : 1, nch = hd / W;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  for (int e = tid; e < BM * nch; e += kThreads) {  // queries, pre-scaled by scale * log2(e)
    const int rr = e / nch, c = e - rr * nch, itr = it0 + rr, ir = itr / G;
    float* dst = sQ + rr * lds + c * W;
    if (ir < n)
      load_chunk(dst, q + int64_t(r0 + ir) * ldq + int64_t(kh * G + itr - ir * G) * hd + c * W, vec, sl2);
    else
      zero_chunk(dst, vec);
  }

  float acc[DM];
#pragma unroll
  for (int c = 0; c < DM; ++c) acc[c] = 0.f;
  float m = kNegInf, l = 0.f;
  const int32_t* tab = table + int64_t(seg) * max_blocks;
  for (int j0 = kbeg; j0 < kend; j0 += kBN) {
    __syncthreads();  // the previous tile is consumed (and sQ is stored, the first time)
    if (tid < kBN) {
      const int j = j0 + tid;
      sRow[tid] = j < kend ? int64_t(tab[j / block]) * block + j % block : -1;
    }
    __syncthreads();
    for (int e = tid; e < kBN * nch; e += kThreads) {
      const int rr = e / nch, c = e - rr * nch;
      const int64_t row = sRow[rr];
      if (row >= 0) {
        const int64_t off = row * ldk + int64_t(kh) * hd + c * W;
        load_chunk(sK + rr * lds + c * W, kp + off, vec, 1.f);
        load_chunk(sV + rr * lds + c * W, vp + off, vec, 1.f);
      } else {
        zero_chunk(sK + rr * lds + c * W, vec);
        zero_chunk(sV + rr * lds + c * W, vec);
      }
    }
    __syncthreads();

    float s[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) s[c] = 0.f;
    for (int d = 0; d < hd; ++d) {
      const float qd = sQ[r * lds + d];
#pragma unroll
      for (int c = 0; c < NC; ++c) s[c] += qd * sK[(t + TPI * c) * lds + d];
    }
    float mx = m;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = j0 + t + TPI * c;
      s[c] = (j < kend && j <= p) ? s[c] : kNegInf;
      mx = fmaxf(mx, s[c]);
    }
#pragma unroll
    for (int o = TPI / 2; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float ms = mx == kNegInf ? 0.f : mx;
    const float alpha = exp2f(m - ms);
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) sum += (s[c] = exp2f(s[c] - ms));
    l = l * alpha + sum;
    m = mx;
#pragma unroll
    for (int c = 0; c < DM; ++c) acc[c] *= alpha;
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int u = 0; u < TPI; ++u) {
        const float pj = __shfl_sync(0xffffffffu, s[c], u, TPI);  // key u + TPI*c's weight, from the item's thread u
        const float* vr = sV + (u + TPI * c) * lds;
#pragma unroll
        for (int cc = 0; cc < DM; ++cc)
          if (t + TPI * cc < hd) acc[cc] += pj * vr[t + TPI * cc];
      }
  }
#pragma unroll
  for (int o = TPI / 2; o; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
  if (!live) return;
  const int64_t orow = int64_t(r0 + i) * nh + h;
  if (nsplit == 1) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int cc = 0; cc < DM; ++cc)
      if (t + TPI * cc < hd) st(out, orow * hd + t + TPI * cc, acc[cc] * inv);
  } else {
    const int64_t prow = int64_t(sp) * rows_total + orow;
#pragma unroll
    for (int cc = 0; cc < DM; ++cc)
      if (t + TPI * cc < hd) part_acc[prow * hd + t + TPI * cc] = acc[cc];
    if (t == 0) part_ml[prow * 2] = m, part_ml[prow * 2 + 1] = l;
  }
}

// Combines the splits: blockIdx.x the segment, a warp per (row, head) of its rows; out = sum_s w_s acc_s / sum_s w_s l_s
// with w_s = 2^(m_s - max m), over the splits that ran (splits_used of the segment's context, as the attention kernel
// sized them with bn and min_keys).
template <class S>
__global__ void paged_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                              S* __restrict__ out, const int32_t* __restrict__ cu, const int32_t* __restrict__ ctx,
                              int64_t rows_total, int nh, int nsplit, int hd, int bn, int min_keys) {
  pdl_enter();  // launched by launch_pdl
  const int seg = blockIdx.x, lane = threadIdx.x & 31, nw = (blockDim.x >> 5) * gridDim.y;
  const int ns = splits_used(ctx[seg], nsplit, bn, min_keys);
  const int64_t lo = int64_t(cu[seg]) * nh, hi = int64_t(cu[seg + 1]) * nh;
  for (int64_t rw = lo + blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5); rw < hi; rw += nw) {
    float M = kNegInf;
#pragma unroll 4
    for (int s = 0; s < ns; ++s) M = fmaxf(M, part_ml[(int64_t(s) * rows_total + rw) * 2]);
    float L = 0.f, o[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] = 0.f;
#pragma unroll 4
    for (int s = 0; s < ns; ++s) {
      const int64_t pr = int64_t(s) * rows_total + rw;
      const float ms = part_ml[pr * 2];
      const float w = ms == kNegInf ? 0.f : exp2f(ms - M);
      L += w * part_ml[pr * 2 + 1];
#pragma unroll
      for (int c = 0; c < 8; ++c)
        if (lane + 32 * c < hd) o[c] += w * part_acc[pr * hd + lane + 32 * c];
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int c = 0; c < 8; ++c)
      if (lane + 32 * c < hd) st(out, rw * hd + lane + 32 * c, o[c] * inv);
  }
}


// ---- tensor-core path (bf16/fp16, hd 64 or 128, 16-byte aligned) ---------------------------------------------------
// attention.cu's fwd_tc with the keys gathered through the block table: a block owns BM = 16*MT*NW query items of one
// segment and kv head (items i-major as above, so the K/V tiles in shared memory serve all G heads of the group), warp
// w the MT m-tiles of items [16*MT*w, 16*MT*(w+1)); keys come in tiles of BN, cp.async double-buffered. Shared memory
// rows have stride HD + 8 (an odd number of 16-byte chunks: ldmatrix is free of bank conflicts). The pool rows of
// the tile after next are read from the table during the current tile's math (their latency hidden) and parked in
// sRow. ST-stage pipeline (ST - 1 tiles in flight). Decode (NW = 1, one m-tile: the G heads of a row or a few
// rows) relies on split-K for parallelism; prefill chunks take NW = 4, MT = 2, BN = 64, ST = 2: fwd_tc's tile.
// int32 pool rows: a row here is hd * 2 >= 128 bytes, so a pool in device memory has fewer than 2^31 of them.
__device__ __forceinline__ int pool_row(const int32_t* tab, int block, int j, int kend) {
  return j < kend ? tab[j / block] * block + j % block : -1;
}

// The BN keys whose pool rows are rows[] (-1: zero-filled) of kv head Kg/Vg (token stride ldk) into sK/sV.
template <class S, int HD, int BN, int NT>
__device__ __forceinline__ void kv_issue(S* sK, S* sV, const int* rows, const S* Kg, const S* Vg, int64_t ldk,
                                         int tid) {
  constexpr int NCH = HD / 8, LD = HD + 8;
#pragma unroll
  for (int c = tid; c < BN * NCH; c += NT) {
    const int r = c / NCH, ch = c - r * NCH;
    const int row = rows[r];
    const int64_t off = row >= 0 ? int64_t(row) * ldk + ch * 8 : 0;
    cp16(sK + r * LD + ch * 8, Kg + off, row >= 0);
    cp16(sV + r * LD + ch * 8, Vg + off, row >= 0);
  }
}

// Split sp of nsplit covers keys [sp*chunk, (sp+1)*chunk) with chunk = split_chunk(context, nsplit, BN, min_keys);
// nsplit == 1: every key. Outputs as paged_fwd.
template <class S, int HD, int MT, int NW, int BN, int ST>
__global__ void __launch_bounds__(32 * NW)
    paged_tc(const S* __restrict__ q, const S* __restrict__ kp, const S* __restrict__ vp, S* __restrict__ out,
             float* __restrict__ part_acc, float* __restrict__ part_ml, const int32_t* __restrict__ cu,
             const int32_t* __restrict__ ctx, const int32_t* __restrict__ table, int64_t max_blocks, int block,
             int nsplit, int min_keys, int64_t rows_total, int nh, int nkv, float sl2) {
  pdl_enter();  // launched by launch_pdl
  constexpr int NT = 32 * NW, LD = HD + 8, NCH = HD / 8, BM = 16 * MT * NW, WR = 16 * MT;
  static_assert(NT >= BN && NT % NCH == 0 && BN * NCH % NT == 0 && BM * NCH % NT == 0 && ST >= 2, "tile shape");
  extern __shared__ __align__(16) unsigned char smraw[];
  __shared__ int sRow[ST][BN];  // pool rows of the next tiles, tile T in slot T % ST (-1: past the block's keys)
  S* sQ = reinterpret_cast<S*>(smraw);
  S* sK = sQ + BM * LD;  // ST buffers, tile T in buffer T % ST
  S* sV = sK + ST * BN * LD;

  const int seg = blockIdx.z / nsplit, sp = blockIdx.z - seg * nsplit, kh = blockIdx.y, G = nh / nkv;
  const int r0 = cu[seg], n = cu[seg + 1] - r0, items = n * G, base = ctx[seg] - n;  // base: new row 0's position
  const int it0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest (latest rows) tiles first
  if (it0 >= items) return;
  const int C = ctx[seg], chunk = nsplit == 1 ? C : split_chunk(C, nsplit, BN, min_keys);
  if (sp > 0 && sp >= splits_used(C, nsplit, BN, min_keys)) return;  // no keys: the combine skips it
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kbeg = sp * chunk;
  const int kend = min(kbeg + chunk, base + (min(it0 + BM, items) - 1) / G + 1);  // causal: the last item's keys
  const int nkb = kend > kbeg ? (kend - kbeg + BN - 1) / BN : 0;
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  const int32_t* tab = table + int64_t(seg) * max_blocks;
  const S* Kg = kp + int64_t(kh) * HD;
  const S* Vg = vp + int64_t(kh) * HD;

  for (int c = tid; c < BM * NCH; c += NT) {  // the items' query rows; past the segment: zeros
    const int r = c / NCH, ch = c - r * NCH, it = it0 + r, i = it / G;
    const bool ok = it < items;
    cp16(sQ + r * LD + ch * 8, ok ? q + int64_t(r0 + i) * ldq + int64_t(kh * G + it - i * G) * HD + ch * 8 : q,
             ok);
  }
  if (tid < BN)
#pragma unroll
    for (int u = 0; u < ST; ++u) sRow[u][tid] = pool_row(tab, block, kbeg + u * BN + tid, kend);
  __syncthreads();
#pragma unroll
  for (int u = 0; u < ST - 1; ++u) {  // tiles 0 .. ST-2 in flight, one commit group each (the queries in the first)
    if (u < nkb) kv_issue<S, HD, BN, NT>(sK + u * BN * LD, sV + u * BN * LD, sRow[u], Kg, Vg, ldk, tid);
    cp_commit();
  }

  const int wr0 = it0 + w * WR;  // the warp's first item; thread rows wr0 + 16*mt + g (+8)
  const bool wlive = wr0 < items;
  const int pmin = base + wr0 / G, pmax = base + (min(wr0 + WR, items) - 1) / G;  // the warp's rows' positions
  int prow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) prow[mt][r] = base + (wr0 + mt * 16 + g + 8 * r) / G;

  float o[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nn = 0; nn < HD / 8; ++nn) o[mt][nn][0] = o[mt][nn][1] = o[mt][nn][2] = o[mt][nn][3] = 0.f;
  float mrow[MT][2], lrow[MT][2];  // running max (log2 units), per-thread partial sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) mrow[mt][0] = mrow[mt][1] = kNegInf, lrow[mt][0] = lrow[mt][1] = 0.f;

  for (int kb = 0; kb < nkb; ++kb) {
    // groups 0 .. ST-2+kb are committed, group T holding tile T: all but the newest ST-2 done = tile kb landed
    cp_wait<ST - 2>();
    __syncthreads();  // ... for every thread; everyone is done with tile kb-1, whose buffer the next issue reuses
    const int nt = kb + ST - 1;
    if (nt < nkb)
      kv_issue<S, HD, BN, NT>(sK + nt % ST * BN * LD, sV + nt % ST * BN * LD, sRow[nt % ST], Kg, Vg, ldk, tid);
    cp_commit();
    const int next_row = tid < BN ? pool_row(tab, block, kbeg + (kb + ST) * BN + tid, kend) : -1;
    const S* cK = sK + kb % ST * BN * LD;
    const S* cV = sV + kb % ST * BN * LD;
    const int j0 = kbeg + kb * BN;
    if (wlive && j0 <= pmax) {  // warp-uniform: some of the warp's items see some of these keys
      float s[MT][BN / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nn = 0; nn < BN / 8; ++nn) s[mt][nn][0] = s[mt][nn][1] = s[mt][nn][2] = s[mt][nn][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldsm4(qa[mt], sQ + (w * WR + mt * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int n2 = 0; n2 < BN / 16; ++n2) {
          uint32_t b[4];
          ldsm4(b, cK + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<S>(s[mt][2 * n2], qa[mt], b[0], b[1]);
            mma<S>(s[mt][2 * n2 + 1], qa[mt], b[2], b[3]);
          }
        }
      }
      const bool need_mask = j0 + BN > kend || j0 + BN - 1 > pmin;  // warp-uniform
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int nn = 0; nn < BN / 8; ++nn)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float xv = s[mt][nn][e] * sl2;
            if (need_mask) {
              const int j = j0 + nn * 8 + 2 * t + (e & 1);
              if (j >= kend || j > prow[mt][e >> 1]) xv = kNegInf;
            }
            s[mt][nn][e] = xv;
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = mrow[mt][r];
#pragma unroll
          for (int nn = 0; nn < BN / 8; ++nn) mx = fmaxf(mx, fmaxf(s[mt][nn][2 * r], s[mt][nn][2 * r + 1]));
          mx = quad_max(mx);
          const float ms = mx == kNegInf ? 0.f : mx;  // a row with no key yet: keep everything 0, not NaN
          const float alpha = fexp2(mrow[mt][r] - ms);
          float sum = 0.f;
#pragma unroll
          for (int nn = 0; nn < BN / 8; ++nn) {
            s[mt][nn][2 * r] = fexp2(s[mt][nn][2 * r] - ms);
            s[mt][nn][2 * r + 1] = fexp2(s[mt][nn][2 * r + 1] - ms);
            sum += s[mt][nn][2 * r] + s[mt][nn][2 * r + 1];
          }
          lrow[mt][r] = lrow[mt][r] * alpha + sum;
          mrow[mt][r] = mx;
#pragma unroll
          for (int nn = 0; nn < HD / 8; ++nn) {
            o[mt][nn][2 * r] *= alpha;
            o[mt][nn][2 * r + 1] *= alpha;
          }
        }
      }
      // O += P V: the score accumulators are already in A-fragment order.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack2<S>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack2<S>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack2<S>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack2<S>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int d2 = 0; d2 < HD / 16; ++d2) {
          uint32_t b[4];
          ldsm4t(b, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d2 * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma<S>(o[mt][2 * d2], a[mt], b[0], b[1]);
            mma<S>(o[mt][2 * d2 + 1], a[mt], b[2], b[3]);
          }
        }
      }
    }
    if (tid < BN) sRow[kb % ST][tid] = next_row;  // tile kb+ST's rows; the slot's last reader issued tile kb, before
                                                   // this iteration's barrier
  }
  cp_wait_all();
  if (!wlive) return;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(lrow[mt][r]);
      const int it = wr0 + mt * 16 + g + 8 * r;
      if (it >= items) continue;
      const int i = it / G;
      const int64_t orow = int64_t(r0 + i) * nh + kh * G + (it - i * G);
      if (nsplit == 1) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        S* op = out + orow * HD;
#pragma unroll
        for (int nn = 0; nn < HD / 8; ++nn)
          *reinterpret_cast<uint32_t*>(op + nn * 8 + 2 * t) =
              pack2<S>(o[mt][nn][2 * r] * inv, o[mt][nn][2 * r + 1] * inv);
      } else {
        const int64_t prow2 = int64_t(sp) * rows_total + orow;
        float* pa = part_acc + prow2 * HD;
#pragma unroll
        for (int nn = 0; nn < HD / 8; ++nn)
          *reinterpret_cast<float2*>(pa + nn * 8 + 2 * t) = make_float2(o[mt][nn][2 * r], o[mt][nn][2 * r + 1]);
        if (t == 0) part_ml[prow2 * 2] = mrow[mt][r], part_ml[prow2 * 2 + 1] = l;
      }
    }
}
template <int MT, int NW, int BN, int ST> constexpr size_t paged_tc_smem(int hd, size_t es) {
  return size_t(16 * MT * NW + 2 * ST * BN) * size_t(hd + 8) * es;
}

// One call's arguments, as dev::paged_attention_fwd takes them.
struct PagedArgs {
  const void *q, *k, *v;
  void* out;
  const int32_t *cu, *ctx, *table;
  int64_t max_blocks, block, nseg, max_q, max_ctx, N, nh, nkv, hd;
  float scale;
};

// Key splits for a grid of `base` blocks that one split would leave short of `want_blocks`: splits of at least
// min_keys keys, at most kMaxSplit, and as many as the workspace holds partial rows for (1: no split).
int split_count(const Exec& x, const PagedArgs& a, int64_t base, int64_t want_blocks, int64_t min_keys) {
  if (a.max_ctx < 2 * min_keys || x.ws == nullptr) return 1;
  const size_t per = size_t(a.N * a.nh) * size_t(a.hd + 2) * sizeof(float);
  const int64_t ns = std::min<int64_t>({(want_blocks + base - 1) / base, a.max_ctx / min_keys, kMaxSplit,
                                        65535 / a.nseg, int64_t(x.ws_bytes / per)});
  return ns >= 2 ? int(ns) : 1;
}

template <class S>
void combine(cudaStream_t st, const float* part_acc, const float* part_ml, const PagedArgs& a, int nsplit, int bn,
             int64_t min_keys) {
  // a warp per (row, head) of a segment, 8 a block: one block per segment was one SM's worth of loads for a long
  // context's partial rows (1 x 4096 keys: 53 us against 47 with the combine spread over SMs)
  const int64_t warps = a.max_q * a.nh;
  const dim3 grid(unsigned(a.nseg), unsigned(std::min<int64_t>((warps + 7) / 8, 65535)));
  launch_pdl(paged_combine<S>, grid, 256, 0, st, part_acc, part_ml, static_cast<S*>(a.out), a.cu,
             a.ctx, a.N * a.nh, int(a.nh), nsplit, int(a.hd), bn, int(min_keys));
}

// The tensor-core kernel at one tile shape. Decode-sized calls (one tile of items a segment) split the keys so
// that the grid holds ~`waves` blocks per SM (decode blocks are one warp and small: several fit an SM).
template <class S, int HD, int MT, int NW, int BN, int ST>
void run_tc(const Exec& x, const PagedArgs& a, int waves, int64_t min_keys) {
  const cudaStream_t st = stream_of(x);
  const int64_t G = a.nh / a.nkv, bm = 16 * MT * NW, tiles = (a.max_q * G + bm - 1) / bm;
  const int nsplit = tiles == 1 ? split_count(x, a, a.nkv * a.nseg, int64_t(waves) * sm_count(), min_keys) : 1;
  float* part_acc = static_cast<float*>(x.ws);
  float* part_ml = nsplit > 1 ? part_acc + size_t(nsplit) * size_t(a.N * a.nh) * size_t(HD) : nullptr;
  const dim3 grid(unsigned(tiles), unsigned(a.nkv), unsigned(a.nseg * nsplit));
  launch_pdl(paged_tc<S, HD, MT, NW, BN, ST>, grid, 32 * NW, paged_tc_smem<MT, NW, BN, ST>(HD, sizeof(S)), st,
             static_cast<const S*>(a.q), static_cast<const S*>(a.k), static_cast<const S*>(a.v), static_cast<S*>(a.out),
             part_acc, part_ml, a.cu, a.ctx, a.table, a.max_blocks, int(a.block), nsplit, int(min_keys), a.N * a.nh,
             int(a.nh), int(a.nkv), a.scale * kLog2e);
  if (nsplit > 1) combine<S>(st, part_acc, part_ml, a, nsplit, BN, min_keys);
}
// Decode (the items of every segment fit one m-tile of 16: G heads of one row, or a few rows): one-warp blocks,
// 32-key tiles, 4 stages (three tiles in flight while one is used: a decode block has little math to hide latency
// behind; at hd 128, 74 KB: 3 blocks an SM keep 144 KB of loads in flight), splits of >= 64 keys for ~16 blocks per
// SM. Otherwise (prefill chunks) fwd_tc's forward tile.
template <class S, int HD> void run_tc_hd(const Exec& x, const PagedArgs& a) {
  if (a.max_q * (a.nh / a.nkv) <= 16) run_tc<S, HD, 1, 1, 32, 4>(x, a, 16, 64);
  else run_tc<S, HD, 2, 4, 64, 2>(x, a, 4, 128);
}

void run_simt(const Exec& x, const PagedArgs& a, DType dt) {
  const cudaStream_t st = stream_of(x);
  const int64_t G = a.nh / a.nkv, items = a.max_q * G, hd = a.hd;
  const int tpi = items <= 8 ? 32 : items <= 32 ? 8 : 4;
  const int64_t bm = kThreads / tpi, tiles = (items + bm - 1) / bm;
  const int64_t rows_total = a.N * a.nh;
  // Split-K for decode-sized calls whose grid would not fill the GPU twice over.
  const int nsplit = tiles == 1 ? split_count(x, a, a.nkv * a.nseg, 2 * sm_count(), kSplitMin) : 1;
  float* part_acc = static_cast<float*>(x.ws);
  float* part_ml = nsplit > 1 ? part_acc + size_t(nsplit) * size_t(rows_total) * size_t(hd) : nullptr;

  const size_t smem = size_t(bm + 2 * kBN) * size_t(hd + 1) * sizeof(float);
  const dim3 grid(unsigned(tiles), unsigned(a.nkv), unsigned(a.nseg * nsplit));
  const bool vec = hd % 8 == 0 && aligned16(a.q) && aligned16(a.k) && aligned16(a.v);
  const int ib = int(a.block), inh = int(a.nh), inkv = int(a.nkv), ihd = int(hd);
  const float sl2 = a.scale * kLog2e;
  by_dtype(dt, [&]<class S>() {
    const S *Q = static_cast<const S*>(a.q), *K = static_cast<const S*>(a.k), *V = static_cast<const S*>(a.v);
    S* O = static_cast<S*>(a.out);
    auto run = [&]<int TPI>() {
      if (hd <= 128)
        launch_pdl(paged_fwd<S, TPI, 128 / TPI>, grid, kThreads, smem, st, Q, K, V, O, part_acc, part_ml, a.cu,
                   a.ctx, a.table, a.max_blocks, ib, nsplit, rows_total, inh, inkv, ihd, sl2, vec);
      else
        launch_pdl(paged_fwd<S, TPI, 256 / TPI>, grid, kThreads, smem, st, Q, K, V, O, part_acc, part_ml, a.cu,
                   a.ctx, a.table, a.max_blocks, ib, nsplit, rows_total, inh, inkv, ihd, sl2, vec);
    };
    if (tpi == 32) run.template operator()<32>();
    else if (tpi == 8) run.template operator()<8>();
    else run.template operator()<4>();
    if (nsplit > 1) combine<S>(st, part_acc, part_ml, a, nsplit, kBN, kSplitMin);
  });
}

}  // namespace

// paged_attention_fwd with the path chosen by the caller (tools/gpu/paged_check.cu times both in one process): tc
// takes the tensor-core kernel where it applies (bf16/fp16, hd 64 or 128, 16-byte aligned pointers); returns
// whether it did.
bool paged_attention_path(const Exec& x, bool tc, const void* q, const void* k_pool, const void* v_pool, void* out,
                          const int32_t* cu, const int32_t* ctx, const int32_t* table, int64_t max_blocks,
                          int64_t block, int64_t nseg, int64_t max_q, int64_t max_ctx, int64_t N, int64_t nh,
                          int64_t nkv, int64_t hd, float scale, DType dt) {
  if (N == 0 || nseg == 0 || max_q <= 0) return false;
  const std::string op = "paged_attention_fwd";
  Q3VL_CHECK(nkv > 0 && nh % nkv == 0, op + ": heads must be a multiple of kv heads");
  Q3VL_CHECK(hd >= 1 && hd <= 256, op + ": head dim " + std::to_string(hd) + " outside [1, 256]");
  Q3VL_CHECK(block >= 1 && block <= (int64_t(1) << 30), op + ": block size " + std::to_string(block));
  Q3VL_CHECK(max_ctx >= max_q && max_ctx < (int64_t(1) << 30) && N < (int64_t(1) << 31),
             op + ": context " + std::to_string(max_ctx) + " shorter than " + std::to_string(max_q) +
                 " new tokens, or too long");
  Q3VL_CHECK(nkv <= 65535 && nseg <= 65535 && max_q * (nh / nkv) < (int64_t(1) << 30),
             op + ": too many kv heads, segments or query rows for one launch");
  const PagedArgs a{q, k_pool, v_pool, out, cu, ctx, table, max_blocks, block, nseg, max_q, max_ctx, N, nh, nkv, hd,
                    scale};
  tc = tc && (dt == DType::BF16 || dt == DType::F16) && (hd == 64 || hd == 128) && aligned16(q) &&
       aligned16(k_pool) && aligned16(v_pool) && aligned16(out);
  if (!tc) run_simt(x, a, dt);
  else if (dt == DType::BF16) hd == 64 ? run_tc_hd<__nv_bfloat16, 64>(x, a) : run_tc_hd<__nv_bfloat16, 128>(x, a);
  else hd == 64 ? run_tc_hd<__half, 64>(x, a) : run_tc_hd<__half, 128>(x, a);
  return tc;
}

void paged_attention_fwd(const Exec& x, const void* q, const void* k_pool, const void* v_pool, void* out,
                         const int32_t* cu, const int32_t* ctx, const int32_t* table, int64_t max_blocks,
                         int64_t block, int64_t nseg, int64_t max_q, int64_t max_ctx, int64_t /*keys*/, int64_t N,
                         int64_t nh, int64_t nkv, int64_t hd, float scale, DType dt) {
  paged_attention_path(x, true, q, k_pool, v_pool, out, cu, ctx, table, max_blocks, block, nseg,
                       max_q, max_ctx, N, nh, nkv, hd, scale, dt);
}

}  // namespace q3vl::dev::cuda
