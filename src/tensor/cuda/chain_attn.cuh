// The attention link of a decode chain (gemv_chain.cuh; dev::ChainAttn): what qkv_to_cache_fwd and
// paged_attention_fwd do for decode-sized steps, done by the chain kernel's consumer warps between two of its grid
// barriers, while its producer warp goes on streaming the next links' weights (issue 32: on the H100 the two ops, the
// split combine and the gaps between them took ~15 us of a chained 8B fp8 layer's ~100).
//  - Work units: (segment, kv head, key split), blocks taking units blockIdx.x, + gridDim.x, ... A split covers keys
//    [sp * chunk, ...) with paged_attention.cu's split_chunk (tiles of 32 keys, at least 64 keys a split); splits past
//    the segment's context return at once.
//  - A unit first puts its first two tiles of keys in flight, then normalizes and rotates its own query heads (the G
//    heads of its kv head, each new row of the segment) from the fused projection rows: q is never written. The unit
//    whose keys hold a new position normalizes and rotates that key and writes it and its value to the pools (slots),
//    and puts them into its tile in shared memory at their positions, over what the tile loaded there: what the two ops
//    compute, rounding for rounding (q and k rounded to the activations' type after the norm and after the rotation,
//    qk_rope's order), without waiting for the stores.
//  - Keys 32 a tile through the block table, cp.async into two stages; lane j of a warp scores key j against the
//    warp's items (a new row and one of its query heads; items warp, warp + 8, ...), online softmax in log2 units
//    (paged_fwd's), and lane l accumulates output columns [l hd/32, (l + 1) hd/32).
//  - One split: the unit writes its rows. Several: each writes its unnormalized rows, running max and sum, and the
//    last split of a (segment, kv head) to arrive (a counter in global memory, left zeroed) combines them.
#pragma once
#include "tensor/cuda/mma_util.cuh"
#include "tensor/cuda/tma.cuh"

namespace q3vl::dev::cuda::wgemv {

constexpr int kAttnTile = 32;        // keys a tile (a warp's lanes)
constexpr int kAttnMinKeys = 64;     // keys a split at least (two tiles: fewer partial rows to combine)
constexpr int kAttnMaxSplit = 64;
constexpr int kAttnItems = 32;       // query items (rows x heads of a kv head) a unit at most: 4 a consumer warp
constexpr int kAttnCounters = 1024;  // (segment, kv head) pairs a link at most
constexpr int kAttnNew = 8;          // new rows a segment at most (the chain's rows: kTmaNb)

// An attention link's arguments (in a ChainJob in place of its tensor map: at most 128 bytes).
struct ChainAttnJob {
  const void *wq, *wk;  // q_norm, k_norm [hd] in S
  const float *cos, *sin;
  void *kp, *vp;  // the pools [rows, nkv, hd] in S
  const int32_t *slots, *cu, *ctx, *table;
  float* part;  // nsplit > 1: [nsplit][N nh][hd] unnormalized rows, then [nsplit][N nh][2] (max, sum)
  int max_blocks, block, nseg, nh, nkv, hd, nsplit, max_q;
  float eps, sl2;  // sl2: the softmax scale times log2(e)
};
static_assert(sizeof(ChainAttnJob) <= 128, "ChainAttnJob must fit a tensor map's bytes");

// The split arithmetic of paged_attention.cu (tiles of kAttnTile, at least kAttnMinKeys a split).
__device__ __forceinline__ int attn_chunk(int C, int nsplit) {
  const int c = max((C + nsplit - 1) / nsplit, kAttnMinKeys);
  return (c + kAttnTile - 1) / kAttnTile * kAttnTile;
}
__device__ __forceinline__ int attn_splits_used(int C, int nsplit) {
  const int c = attn_chunk(C, nsplit);
  return max(1, min(nsplit, (C + c - 1) / c));
}

// A unit's shared memory: the items' q (fp32, pre-scaled by sl2), two stages of K and V tiles (rows hd + 8 apart:
// an odd number of 16-byte chunks, so 16-byte reads by 32 lanes of 32 rows are free of bank conflicts), the new rows'
// keys and values, and the unit's flag.
template <class S> __host__ __device__ constexpr size_t attn_smem_bytes(int items, int hd) {
  return size_t(items) * size_t(hd) * 4 + (4 * size_t(kAttnTile) * size_t(hd + 8) + kAttnNew * 2 * size_t(hd)) *
         sizeof(S) + 16;
}

// x[i] of a 16-bit S read at L2: x was written by other blocks of the chain (a link before), and the same buffer is
// rewritten by each layer's link, so this SM's L1 may hold an older line of it.
template <class S> __device__ __forceinline__ float ld_l2(const S* x, int64_t i) {
  const unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(x) + i);
  if constexpr (std::is_same_v<S, __nv_bfloat16>) return __bfloat162float(__ushort_as_bfloat16(u));
  else return __half2float(__ushort_as_half(u));
}

// One head row of hd (at x, read at L2) RMS-normalized with w and rotated by the token's cos/sin rows (half = hd / 2
// columns), by one warp: qk_rope's arithmetic (the normalized pair rounded to S, then rotated), each lane its pairs
// (d, d + half) for d = lane, lane + 32, ...; fn(d, ya, yb) takes the rotated pair.
template <class S, int HD, class Fn>
__device__ __forceinline__ void norm_rope_row(const S* x, const S* w, const float* cos, const float* sin, float eps,
                                              int lane, Fn&& fn) {
  constexpr int half = HD / 2, PL = half / 32;
  float a[PL], b[PL], wa[PL], wb[PL], c[PL], s[PL], ss = 0.f;
#pragma unroll
  for (int k = 0; k < PL; ++k) {  // every load in flight before the sum
    const int d = lane + 32 * k;
    a[k] = ld_l2(x, d), b[k] = ld_l2(x, d + half);
    wa[k] = ld(w, d), wb[k] = ld(w, d + half), c[k] = cos[d], s[k] = sin[d];
  }
#pragma unroll
  for (int k = 0; k < PL; ++k) ss += a[k] * a[k] + b[k] * b[k];
  const float rs = 1.f / sqrtf(warp_sum(ss) / float(HD) + eps);
#pragma unroll
  for (int k = 0; k < PL; ++k) {
    const float ra = round_to<S>(wa[k] * (a[k] * rs)), rb = round_to<S>(wb[k] * (b[k] * rs));
    fn(lane + 32 * k, ra * c[k] - rb * s[k], rb * c[k] + ra * s[k]);
  }
}

// One unit u of an attention link over the n rows of the chain: in the fused projection rows [n, (nh + 2 nkv) hd],
// out the attention rows [n, nh hd], cnt the link's counters. Every consumer thread calls it (block-uniform returns).
template <class S, int HD, int CW>
__device__ void attn_unit(const ChainAttnJob& a, const S* __restrict__ in, S* __restrict__ out, int n_rows, int u,
                          unsigned char* smem, uint32_t* cnt, unsigned long long* stamp) {
  constexpr int NT = CW * 32, LD = HD + 8, NCH = HD / 8, DPL = HD / 32, IPW = kAttnItems / CW;
  static_assert(IPW * CW == kAttnItems && (HD == 64 || HD == 128), "attention link shape");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int per_seg = a.nkv * a.nsplit, seg = u / per_seg, kh = (u - seg * per_seg) / a.nsplit;
  const int sp = u - seg * per_seg - kh * a.nsplit;
  const int r0 = a.cu[seg], n = a.cu[seg + 1] - r0, C = a.ctx[seg], base = C - n, G = a.nh / a.nkv;
  const int used = a.nsplit == 1 ? 1 : attn_splits_used(C, a.nsplit);
  if (n <= 0 || sp >= used) return;
  const int chunk = a.nsplit == 1 ? C : attn_chunk(C, a.nsplit);
  const int kbeg = sp * chunk, kend = min(kbeg + chunk, C), items = n * G;
  const int64_t ldr = int64_t(a.nh + 2 * a.nkv) * HD, ldk = int64_t(a.nkv) * HD;
  const S *wq = static_cast<const S*>(a.wq), *wk = static_cast<const S*>(a.wk);
  S *kp = static_cast<S*>(a.kp), *vp = static_cast<S*>(a.vp);
  float* sQ = reinterpret_cast<float*>(smem);
  S* sKV = reinterpret_cast<S*>(smem + size_t(items) * HD * 4);  // stage t: K at 2t, V at 2t + 1
  S* sNew = sKV + 4 * kAttnTile * LD;                             // [kAttnNew][2][HD]: the new rows' k and v
  int* sFlag = reinterpret_cast<int*>(sNew + kAttnNew * 2 * HD);
  const int32_t* tab = a.table + int64_t(seg) * a.max_blocks;
  const auto issue = [&](int t) {  // tile t's K and V rows (through the block table) into stage t & 1
    S* sk = sKV + (t & 1) * 2 * kAttnTile * LD;
    for (int c = tid; c < kAttnTile * NCH; c += NT) {
      const int r = c / NCH, ch = c - r * NCH, j = kbeg + t * kAttnTile + r;
      const int row = j < kend ? __ldg(tab + j / a.block) * a.block + j % a.block : -1;
      const int64_t off = row >= 0 ? int64_t(row) * ldk + int64_t(kh) * HD + ch * 8 : 0;
      cp16(sk + r * LD + ch * 8, kp + off, row >= 0);
      cp16(sk + (kAttnTile + r) * LD + ch * 8, vp + off, row >= 0);
    }
    cp_commit();
  };
  const int ntiles = (kend - kbeg + kAttnTile - 1) / kAttnTile;
  issue(0);  // both stages in flight while the queries and new keys are computed
  if (ntiles > 1) issue(1);

  // The new positions among this split's keys (rows i0 .. i1 - 1): their keys and values into the pools (a warp a
  // row) and into sNew, from which they replace what the tiles loaded at their positions (the pool rows, stored by
  // another SM's L1 path or not yet, are never read back here).
  const int i0 = max(kbeg - base, 0), i1 = min(kend - base, n);
  for (int i = i0 + CW - 1 - warp; i < i1; i += CW) {  // from the last warp: the queries start at the first
    const int64_t slot = a.slots[r0 + i];
    const S* x = in + int64_t(r0 + i) * ldr + int64_t(a.nh + kh) * HD;
    S* kd = kp + (slot * a.nkv + kh) * HD;
    S* nk = sNew + (i - i0) * 2 * HD;
    norm_rope_row<S, HD>(x, wk, a.cos + int64_t(r0 + i) * (HD / 2), a.sin + int64_t(r0 + i) * (HD / 2), a.eps, lane,
                         [&](int d, float ya, float yb) {
                           st(nk, d, ya);
                           st(nk, d + HD / 2, yb);
                           if (slot >= 0) st(kd, d, ya), st(kd, d + HD / 2, yb);
                         });
    for (int d = lane; d < HD; d += 32) {
      const float v = ld_l2(x + a.nkv * HD, d);
      st(nk + HD, d, v);
      if (slot >= 0) st(vp, (slot * a.nkv + kh) * HD + d, v);
    }
  }
  // The items' queries (item it: row it / G, head kh G + it % G), as the attention reads them (rounded to S), scaled.
  for (int it = warp; it < items; it += CW) {
    const int i = it / G, h = kh * G + it - i * G;
    float* q = sQ + it * HD;
    norm_rope_row<S, HD>(in + int64_t(r0 + i) * ldr + int64_t(h) * HD, wq, a.cos + int64_t(r0 + i) * (HD / 2),
                         a.sin + int64_t(r0 + i) * (HD / 2), a.eps, lane, [&](int d, float ya, float yb) {
                           q[d] = round_to<S>(ya) * a.sl2;
                           q[d + HD / 2] = round_to<S>(yb) * a.sl2;
                         });
  }

  if (stamp) stamp[0] = clock64();  // chain stamps (gemv_chain.cuh): queries and new keys done
  float acc[IPW][DPL], m[IPW], l[IPW];
#pragma unroll
  for (int k = 0; k < IPW; ++k) {
    m[k] = -INFINITY, l[k] = 0.f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) acc[k][c] = 0.f;
  }
  for (int t = 0; t < ntiles; ++t) {
    const int j0 = kbeg + t * kAttnTile;
    if (t + 1 < ntiles) cp_wait<1>();  // tile t + 1 may stay in flight
    else cp_wait<0>();
    bar_sync(1, NT);  // tile t is in stage t & 1 for every thread (and, at t = 0, sQ and sNew are written)
    // The tile's new positions [max(j0, base + i0), min(j0 + 32, base + i1)): their rows from sNew.
    const int p0 = max(j0, base + i0), p1 = min(j0 + kAttnTile, base + i1);
    if (p0 < p1) {
      S* sk = sKV + (t & 1) * 2 * kAttnTile * LD;
      for (int e = tid; e < (p1 - p0) * 2 * HD; e += NT) {
        const int r = e / (2 * HD), kv = (e / HD) & 1, d = e % HD, pos = p0 + r;
        sk[(kv * kAttnTile + pos - j0) * LD + d] = sNew[(pos - base - i0) * 2 * HD + kv * HD + d];
      }
      bar_sync(1, NT);
    }
    const S* sk = sKV + (t & 1) * 2 * kAttnTile * LD;
    const S* sv = sk + kAttnTile * LD;
    const int j = j0 + lane;
#pragma unroll
    for (int k = 0; k < IPW; ++k) {
      const int it = warp + k * CW;
      if (it >= items) break;  // warp-uniform
      const int pos = base + it / G;
      if (j0 > pos) continue;  // causal: none of the tile's keys (warp-uniform)
      float s = 0.f;
      const float* q = sQ + it * HD;
#pragma unroll
      for (int d = 0; d < HD; d += 8) {
        const uint4 kv = *reinterpret_cast<const uint4*>(sk + lane * LD + d);
        const S* ke = reinterpret_cast<const S*>(&kv);
        const float4 q0 = *reinterpret_cast<const float4*>(q + d), q1 = *reinterpret_cast<const float4*>(q + d + 4);
        s += q0.x * ld(ke, 0) + q0.y * ld(ke, 1) + q0.z * ld(ke, 2) + q0.w * ld(ke, 3) + q1.x * ld(ke, 4) +
             q1.y * ld(ke, 5) + q1.z * ld(ke, 6) + q1.w * ld(ke, 7);
      }
      s = j < kend && j <= pos ? s : -INFINITY;
      float mx = fmaxf(m[k], s);
#pragma unroll
      for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float ms = mx == -INFINITY ? 0.f : mx;
      const float alpha = exp2f(m[k] - ms), p = exp2f(s - ms);
      l[k] = l[k] * alpha + p;
      m[k] = mx;
#pragma unroll
      for (int c = 0; c < DPL; ++c) acc[k][c] *= alpha;
#pragma unroll 8
      for (int jj = 0; jj < kAttnTile; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
        const S* vr = sv + jj * LD + lane * DPL;
#pragma unroll
        for (int c = 0; c < DPL; ++c) acc[k][c] += pj * ld(vr, c);
      }
    }
    bar_sync(1, NT);  // stage t & 1 is read: tile t + 2 may refill it
    if (t + 2 < ntiles) issue(t + 2);
  }

  if (stamp) stamp[1] = clock64();  // the split's keys done
  const int64_t rows_total = int64_t(n_rows) * a.nh;
  float* part_ml = used == 1 ? nullptr : a.part + size_t(a.nsplit) * size_t(rows_total) * HD;
#pragma unroll
  for (int k = 0; k < IPW; ++k) {
    const int it = warp + k * CW;
    if (it >= items) break;
    const int i = it / G;
    const int64_t orow = int64_t(r0 + i) * a.nh + kh * G + it - i * G;
    const float lsum = warp_sum(l[k]);
    if (used == 1) {
      const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
#pragma unroll
      for (int c = 0; c < DPL; ++c) st(out, orow * HD + lane * DPL + c, acc[k][c] * inv);
    } else {
      const int64_t pr = int64_t(sp) * rows_total + orow;
#pragma unroll
      for (int c = 0; c < DPL; ++c) a.part[pr * HD + lane * DPL + c] = acc[k][c];
      if (lane == 0) part_ml[pr * 2] = m[k], part_ml[pr * 2 + 1] = lsum;
    }
  }
  if (used == 1) return;
  // The last split of (segment, kv head) to arrive combines them: out = sum_s w_s acc_s / sum_s w_s l_s with
  // w_s = 2^(m_s - max m) (paged_combine's sums). Lane s holds split s's (and s + 32's) max and weight, so that every
  // load of the combine is in flight at once: the splits' maxima and sums, then their rows (a warp an item). The count
  // is an acquire-release add at gpu scope by thread 0 between two block barriers (grid_arrive's pattern): it
  // publishes the block's rows and, to the last split, every other split's.
  bar_sync(1, NT);
  if (tid == 0) {
    uint32_t* c = cnt + seg * a.nkv + kh;
    uint32_t before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(c) : "memory");
    const bool last = before == uint32_t(used - 1);
    if (last) *c = 0;  // every split has arrived: zeroed for the next link (and graph replays)
    *sFlag = last;
  }
  bar_sync(1, NT);
  if (stamp) stamp[2] = clock64();  // the split's rows written and counted
  if (!*sFlag) return;
  static_assert(kAttnMaxSplit <= 64, "two splits a lane");
  for (int it = warp; it < items; it += CW) {
    const int i = it / G;
    const int64_t orow = int64_t(r0 + i) * a.nh + kh * G + it - i * G;
    float ms[2], ws[2], L = 0.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int sp2 = lane + 32 * k;
      const int64_t pr = int64_t(sp2) * rows_total + orow;
      ms[k] = sp2 < used ? __ldcg(part_ml + pr * 2) : -INFINITY;  // -inf: no key of the split is visible
      ws[k] = sp2 < used ? __ldcg(part_ml + pr * 2 + 1) : 0.f;   // its sum, until it becomes its weight
    }
    float M = fmaxf(ms[0], ms[1]);
#pragma unroll
    for (int sh = 16; sh; sh >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, sh));
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float w = ms[k] == -INFINITY ? 0.f : exp2f(ms[k] - M);
      L += ws[k] * w;
      ws[k] = w;
    }
    L = warp_sum(L);
    float o[DPL] = {};
#pragma unroll 8
    for (int s2 = 0; s2 < used; ++s2) {
      const float w = __shfl_sync(0xffffffffu, s2 < 32 ? ws[0] : ws[1], s2 & 31);
      const float* ps = a.part + (int64_t(s2) * rows_total + orow) * HD + lane * DPL;
#pragma unroll
      for (int c = 0; c < DPL; ++c) o[c] += w * __ldcg(ps + c);
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) st(out, orow * HD + lane * DPL + c, o[c] * inv);
  }
  if (stamp) stamp[3] = clock64();  // the combine done
}

// Every unit of the link for this block (consumer threads only). stamp: null, or thread 0's four clock64 stamps of its
// last unit (gemv_chain.cuh's kAttnQ ..).
template <class S, int CW>
__device__ __forceinline__ void attn_link(const ChainAttnJob& a, const S* in, S* out, int n_rows,
                                          unsigned char* smem, uint32_t* cnt, unsigned long long* stamp) {
  const int units = a.nseg * a.nkv * a.nsplit;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    if (a.hd == 128) attn_unit<S, 128, CW>(a, in, out, n_rows, u, smem, cnt, stamp);
    else attn_unit<S, 64, CW>(a, in, out, n_rows, u, smem, cnt, stamp);
    bar_sync(1, CW * 32);  // the unit's shared memory is free
  }
}

}  // namespace q3vl::dev::cuda::wgemv
