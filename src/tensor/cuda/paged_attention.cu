// Paged attention (dev::paged_attention_fwd): the new tokens of several sequences against their paged KV cache, for
// serving (decode rows and chunked-prefill chunks in one call). fp32 math whatever the storage dtype, online
// softmax over key tiles in shared memory, never a score matrix in global memory.
//  - One block per (tile of query items, kv head, segment x key split). A query item is (new row i, head g of the kv
//    head's GQA group), items i-major, so each K/V row a block loads into shared memory (once, as fp32) serves every
//    query head of its group. TPI threads own one item (TPI = 32 for decode-sized calls, 8 or 4 for prefill chunks):
//    thread t of an item scores the tile's keys t, t+TPI, ... and accumulates the output columns t, t+TPI, ...
//  - Keys come through the block table: the tile's pool rows are looked up once per tile into shared memory.
//  - Split-K (flash-decoding): when one tile of items covers every segment's new rows (decode, max_q * nh/nkv small)
//    and the grid would not fill the GPU, each segment's keys are split over up to 64 blocks; each writes its
//    unnormalised output row, running max and sum to Exec::ws, and a second kernel combines them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -INFINITY;
constexpr int kThreads = 256;  // per block
constexpr int kBN = 32;        // keys per tile
constexpr int kSplitMin = 256; // keys per split at least
constexpr int kMaxSplit = 64;

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
  int chunk = (C + nsplit - 1) / nsplit;
  chunk = (chunk + kBN - 1) / kBN * kBN;
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

// Combines the splits: one warp per (row, head) of rows [cu[0], cu[nseg]); out = sum_s w_s acc_s / sum_s w_s l_s with
// w_s = 2^(m_s - max m).
template <class S>
__global__ void paged_combine(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                              S* __restrict__ out, const int32_t* __restrict__ cu, int nseg, int64_t rows_total,
                              int nh, int nsplit, int hd) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = (int64_t(gridDim.x) * blockDim.x) >> 5;
  const int64_t lo = int64_t(cu[0]) * nh, hi = int64_t(cu[nseg]) * nh;
  for (int64_t rw = lo + ((int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5); rw < hi; rw += nw) {
    float M = kNegInf;
    for (int s = 0; s < nsplit; ++s) M = fmaxf(M, part_ml[(int64_t(s) * rows_total + rw) * 2]);
    float L = 0.f, o[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) o[c] = 0.f;
    for (int s = 0; s < nsplit; ++s) {
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



}  // namespace

void paged_attention_fwd(const Exec& x, const void* q, const void* k_pool, const void* v_pool, void* out,
                         const int32_t* cu, const int32_t* ctx, const int32_t* table, int64_t max_blocks,
                         int64_t block, int64_t nseg, int64_t max_q, int64_t max_ctx, int64_t N, int64_t nh,
                         int64_t nkv, int64_t hd, float scale, DType dt) {
  if (N == 0 || nseg == 0 || max_q <= 0) return;
  const std::string op = "paged_attention_fwd";
  Q3VL_CHECK(nkv > 0 && nh % nkv == 0, op + ": heads must be a multiple of kv heads");
  Q3VL_CHECK(hd >= 1 && hd <= 256, op + ": head dim " + std::to_string(hd) + " outside [1, 256]");
  Q3VL_CHECK(block >= 1 && block <= (int64_t(1) << 30), op + ": block size " + std::to_string(block));
  Q3VL_CHECK(max_ctx >= max_q && max_ctx < (int64_t(1) << 30) && N < (int64_t(1) << 31),
             op + ": context " + std::to_string(max_ctx) + " shorter than " + std::to_string(max_q) +
                 " new tokens, or too long");
  Q3VL_CHECK(nkv <= 65535 && nseg <= 65535 && max_q * (nh / nkv) < (int64_t(1) << 30),
             op + ": too many kv heads, segments or query rows for one launch");
  const cudaStream_t st = stream_of(x);
  const int64_t G = nh / nkv, items = max_q * G;
  const int tpi = items <= 8 ? 32 : items <= 32 ? 8 : 4;
  const int64_t bm = kThreads / tpi, tiles = (items + bm - 1) / bm;
  const int64_t rows_total = N * nh;

  // Split-K for decode-sized calls whose grid would not fill the GPU twice over.
  int nsplit = 1;
  if (tiles == 1 && max_ctx >= 2 * kSplitMin) {
    int dev = 0, sms = 132;
    Q3VL_CU(cudaGetDevice(&dev));
    Q3VL_CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    const int64_t base = nkv * nseg, want = (2 * sms + base - 1) / base;
    int64_t ns = std::min<int64_t>({want, max_ctx / kSplitMin, kMaxSplit, 65535 / nseg});
    const size_t per = size_t(rows_total) * size_t(hd + 2) * sizeof(float);
    if (x.ws == nullptr) ns = 1;
    else ns = std::min<int64_t>(ns, int64_t(x.ws_bytes / per));
    nsplit = ns >= 2 ? int(ns) : 1;
  }
  float* part_acc = static_cast<float*>(x.ws);
  float* part_ml = nsplit > 1 ? part_acc + size_t(nsplit) * size_t(rows_total) * size_t(hd) : nullptr;

  const size_t smem = size_t(bm + 2 * kBN) * size_t(hd + 1) * sizeof(float);
  const dim3 grid(unsigned(tiles), unsigned(nkv), unsigned(nseg * nsplit));
  const bool vec = hd % 8 == 0 && aligned16(q) && aligned16(k_pool) && aligned16(v_pool);
  const int ib = int(block), inh = int(nh), inkv = int(nkv), ihd = int(hd);
  const float sl2 = scale * kLog2e;
  by_dtype(dt, [&]<class S>() {
    const S *Q = static_cast<const S*>(q), *K = static_cast<const S*>(k_pool), *V = static_cast<const S*>(v_pool);
    S* O = static_cast<S*>(out);
    auto run = [&]<int TPI>() {
      if (hd <= 128)
        launch(paged_fwd<S, TPI, 128 / TPI>, grid, kThreads, smem, st, Q, K, V, O, part_acc, part_ml, cu, ctx, table,
               max_blocks, ib, nsplit, rows_total, inh, inkv, ihd, sl2, vec);
      else
        launch(paged_fwd<S, TPI, 256 / TPI>, grid, kThreads, smem, st, Q, K, V, O, part_acc, part_ml, cu, ctx, table,
               max_blocks, ib, nsplit, rows_total, inh, inkv, ihd, sl2, vec);
    };
    if (tpi == 32) run.template operator()<32>();
    else if (tpi == 8) run.template operator()<8>();
    else run.template operator()<4>();
    if (nsplit > 1)
      launch(paged_combine<S>, dim3(grid_for(int64_t(N) * nh * 32)), 256, 0, st,
             static_cast<const float*>(part_acc), static_cast<const float*>(part_ml), O, cu, int(nseg), rows_total,
             inh, nsplit, ihd);
  });
}

}  // namespace q3vl::dev::cuda
