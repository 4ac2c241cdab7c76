// RMSNorm and LayerNorm over the last dim (fp32 math, 16-byte vector loads when every row is aligned). rmsnorm_fwd:
// one warp per row. layernorm_fwd and the backwards hold a row in registers (row groups below), so it is read from
// memory once. The backwards are one pass over dy and x: dx and the weight/bias gradients together, the latter as
// column sums done deterministically: each block's partial row in x.ws, then a fixed-order sum over the blocks (no
// atomics; the order depends only on N, D and the workspace size, so results do not depend on scheduling).
#include <algorithm>
#include <type_traits>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr int kWarps = 8;  // rows per 256-thread block

// Element j of a pack (common.cuh's Pack, ldp), as float. Bf16 from its bits (a shift or a mask of the word holding
// it; the same floats as ld): cheap to recompute, where the conversion's inline asm kept the converted floats live
// (k_norm_bwd spilled at bf16 only).
template <class S, int V> __device__ __forceinline__ float fv(const Pack<S, V>& p, int j) {
  if constexpr (std::is_same_v<S, __nv_bfloat16> && V % 2 == 0) {
    const uint32_t w = reinterpret_cast<const uint32_t*>(p.v)[j / 2];
    return __uint_as_float(j % 2 ? w & 0xffff0000u : w << 16);
  } else {
    return ld(p.v, j);
  }
}

// Vector width for rows of D elements of S when every listed pointer (null ones ignored) is 16-byte aligned.
template <class S> int vec_width(int64_t D, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(S);
  if (D % V != 0) return 1;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return 1;
  return V;
}

// ---- row groups -------------------------------------------------------------------------------------------------
// A row held in registers by T threads (a power of two, kMinT to 256; a block works on 256 / T rows at a time), each
// NV slots of V elements: slot k of thread t is the row's vector k * T + t, so a warp's load reads T * V contiguous
// elements of each of its rows (and, T < 32, of 32 / T consecutive rows: contiguous memory). The whole row is loaded
// before anything waits on it: a warp a row looping over a 1152-wide row waited on 5 loads in turn, twice or thrice.
// Slots past D are idle (zeros).
constexpr int kThreads = 256;
constexpr int kMinT = 4;
constexpr int kScalarNV = 8;  // slots a thread without vector loads (V = 1)

struct RowShape {
  int T = 0, NV = 0;  // T = 0: no shape holds the row
};
// The shape, NV in [nv_lo, nv_hi], that holds W vectors with the fewest idle slots (ties: the larger NV, more loads
// in flight a thread and fewer shuffle steps). Bf16 rows: 128 as 4 x 4, 1152 as 64 x 3, 2048 as 64 x 4.
RowShape row_shape(int64_t W, int nv_lo, int nv_hi) {
  RowShape best;
  int64_t idle = INT64_MAX;
  for (int nv = nv_lo; nv <= nv_hi; ++nv) {
    int64_t t = kMinT;
    while (t * nv < W) t *= 2;
    if (t <= kThreads && t * nv - W <= idle) best = {int(t), nv}, idle = t * nv - W;
  }
  return best;
}

// The warps' sums of a block's row groups (T > 32): a slot a warp, two sets used in turn.
template <int K> struct GroupRed {
  float v[2][kThreads / 32][K];
};
// Sums v over the T threads of each row group; every thread ends with its group's sums, the same bits in each.
// T > 32 adds the warps' sums through red (set `phase & 1`) behind a barrier: every thread of the block must make
// the same calls, with phase advancing by one a call.
template <int K>
__device__ __forceinline__ void group_sum(float (&v)[K], int T, GroupRed<K>& red, int phase) {
  for (int o = min(T, 32) / 2; o > 0; o >>= 1)
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], o);
  if (T <= 32) return;
  const int wp = threadIdx.x >> 5, set = phase & 1, w0 = wp & ~(T / 32 - 1);  // w0: the group's first warp
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int k = 0; k < K; ++k) red.v[set][wp][k] = v[k];
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float s = 0.f;
    for (int j = 0; j < T / 32; ++j) s += red.v[set][w0 + j][k];
    v[k] = s;
  }
}

// row[c0 + c] (+)= the sum over a block's row groups, in group order, of each group's per-column values v (slot k of
// thread t: column c = (k T + t) V + [0, V)), for the columns below D: written (a chunk's partial row) or (add) added
// (the gradient itself). buf: kThreads * NV * V floats of shared memory (the groups' rows of T * NV * V columns).
template <int NV, int V>
__device__ void block_colsum(const float (&v)[NV][V], float* buf, float* row, int64_t D, int64_t c0, int T,
                             bool add) {
  const int lt = __ffs(T) - 1, R = kThreads >> lt, g = threadIdx.x >> lt, t = threadIdx.x & (T - 1);
  const int span = T * NV * V;
  __syncthreads();  // buf's readers of a previous call are done
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * T + t) * V;
    if (c0 + c >= D) continue;
    float* b = buf + g * span + c;
    if constexpr (V % 4 == 0) {
#pragma unroll
      for (int j = 0; j < V; j += 4)
        *reinterpret_cast<float4*>(b + j) = make_float4(v[k][j], v[k][j + 1], v[k][j + 2], v[k][j + 3]);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) b[j] = v[k][j];
    }
  }
  __syncthreads();
  for (int c = threadIdx.x; c < span && c0 + c < D; c += kThreads) {
    float s = 0.f;
#pragma unroll 8
    for (int q = 0; q < R; ++q) s += buf[q * span + c];
    if (add) row[c0 + c] += s;
    else row[c0 + c] = s;
  }
}

// ---- forward ----------------------------------------------------------------------------------------------------
// A row per T threads: T = 32, a warp per row, for many rows; T = 256, a block per row, for the few rows of decode
// steps, whose loads would otherwise wait one after another in one warp (a 4096-wide row: 16 dependent 16-byte loads
// a lane, twice). RES: io += a first, stored in S and reread, so that the norm sees the rounded sums (as axpy then
// rmsnorm_fwd); without it io is only read. saved (may be null) gets a copy of the row as the norm sees it.
constexpr int kNormThreads = 256;
template <class S, int V, int T, bool RES>
__global__ void __launch_bounds__(kNormThreads)
    k_rms_fwd(const S* __restrict__ a, S* __restrict__ io, const S* __restrict__ w, S* __restrict__ y,
              S* __restrict__ saved, float* __restrict__ rstd, int64_t N, int64_t D, float eps) {
  pdl_enter();  // launched by launch_pdl
  constexpr int R = kNormThreads / T;  // rows a block
  __shared__ float part[kNormThreads / 32];
  const int t = threadIdx.x % T;
  for (int64_t i0 = blockIdx.x * int64_t(R); i0 < N; i0 += int64_t(gridDim.x) * R) {  // uniform: the block syncs
    const int64_t i = i0 + threadIdx.x / T;
    const bool live = i < N;
    S* xi = io + i * D;
    float ss = 0.f;
    for (int64_t d = t * V; live && d < D; d += int64_t(T) * V) {
      float u[V];
      ldv<S, V>(xi, d, u);
      if constexpr (RES) {
        float v[V];
        ldv<S, V>(a + i * D, d, v);
#pragma unroll
        for (int j = 0; j < V; ++j) u[j] += v[j];
        stv<S, V>(xi, d, u);
        ldv<S, V>(xi, d, u);
      }
      if (saved) stv<S, V>(saved + i * D, d, u);
#pragma unroll
      for (int j = 0; j < V; ++j) ss += u[j] * u[j];
    }
    ss = warp_sum(ss);
    if constexpr (T > 32) {
      if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
      __syncthreads();
      ss = 0.f;
#pragma unroll
      for (int k = 0; k < T / 32; ++k) ss += part[k];
    }
    const float r = 1.f / sqrtf(ss / float(D) + eps);
    for (int64_t d = t * V; live && d < D; d += int64_t(T) * V) {
      float u[V], wv[V], o[V];
      ldv<S, V>(xi, d, u);
      ldv<S, V>(w, d, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = wv[j] * (u[j] * r);
      stv<S, V>(y + i * D, d, o);
    }
    if (live && t == 0 && rstd) rstd[i] = r;
    if constexpr (T > 32) __syncthreads();  // part is rewritten for the next row
  }
}

// A warp per head row of q (the first N*nh rows), k (the next N*nkv) or, with vin, v (the last N*nkv): q and k
// rows get their rstd, then each lane's pairs (d, d + hd/2) normalised, rounded to S (as rmsnorm_fwd stores them) and
// rotated with the row's token's cos/sin (as rope_fwd); v rows are copied. Inputs: token rows ldq / ldk apart (the
// fused projection's [q | k | v] rows, or separate arrays). Outputs: q [N, nh, hd]; k and v at pool rows slots[tok]
// (negative: not stored), or k and v [N, nkv, hd] without slots. rq/rk may be null.
template <class S>
__global__ void k_qk_norm_rope(const S* __restrict__ qin, const S* __restrict__ kin, const S* __restrict__ vin,
                               int64_t ldq, int64_t ldk, const S* __restrict__ wq, const S* __restrict__ wk,
                               S* __restrict__ q, S* __restrict__ k, S* __restrict__ vout,
                               const int32_t* __restrict__ slots, float* __restrict__ rq, float* __restrict__ rk,
                               const float* __restrict__ cos, const float* __restrict__ sin, int64_t N, int nh, int nkv,
                               int hd, float eps) {
  pdl_enter();  // launched by launch_pdl
  const int lane = threadIdx.x & 31, half = hd / 2;
  const int64_t nq = N * nh, nk = N * nkv, rows = nq + nk + (vin ? nk : 0);
  for (int64_t r = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); r < rows; r += int64_t(gridDim.x) * kWarps) {
    const int kind = r < nq ? 0 : r < nq + nk ? 1 : 2;  // q, k, v
    const int64_t row = kind == 0 ? r : kind == 1 ? r - nq : r - nq - nk;
    const int heads = kind == 0 ? nh : nkv;
    const int64_t tok = row / heads, h = row - tok * heads;
    const S* x = (kind == 0 ? qin : kind == 1 ? kin : vin) + tok * (kind == 0 ? ldq : ldk) + h * hd;
    S* o;
    if (kind == 0) {
      o = q + row * hd;
    } else if (slots) {
      const int64_t slot = slots[tok];
      if (slot < 0) continue;
      o = (kind == 1 ? k : vout) + (slot * nkv + h) * hd;
    } else {
      o = (kind == 1 ? k : vout) + row * hd;
    }
    if (kind == 2) {
      for (int d = lane; d < hd; d += 32) o[d] = x[d];
      continue;
    }
    const S* w = kind == 0 ? wq : wk;
    float ss = 0.f;
    for (int d = lane; d < hd; d += 32) {
      const float v = ld(x, d);
      ss += v * v;
    }
    ss = warp_sum(ss);
    const float rs = 1.f / sqrtf(ss / float(hd) + eps);
    for (int d = lane; d < half; d += 32) {
      const float a = round_to<S>(ld(w, d) * (ld(x, d) * rs));
      const float b = round_to<S>(ld(w, d + half) * (ld(x, d + half) * rs));
      const float c = cos[tok * half + d], s = sin[tok * half + d];
      st(o, d, a * c - b * s);
      st(o, d + half, b * c + a * s);
    }
    float* rr = kind == 0 ? rq : rk;
    if (lane == 0 && rr) rr[row] = rs;
  }
}


// k_qk_norm_rope with vector loads (half = hd / 2 a multiple of V; rows, weights and cos/sin aligned to them): T
// lanes a head row (a power of two, T V >= half, T <= 32: 32 / T rows a warp), lane t holding the V pairs
// (d, d + half), d = t V + [0, V). Same arguments and results; only the row's sum of squares is added in another
// order. (The warp-a-row kernel read 2 bytes a lane, 64 bytes a load: a 128-wide row took 8 loads of half a line.)
template <class S, int V>
__global__ void __launch_bounds__(kThreads)
    k_qk_norm_rope_vec(const S* __restrict__ qin, const S* __restrict__ kin, const S* __restrict__ vin, int64_t ldq,
                       int64_t ldk, const S* __restrict__ wq, const S* __restrict__ wk, S* __restrict__ q,
                       S* __restrict__ k, S* __restrict__ vout, const int32_t* __restrict__ slots,
                       float* __restrict__ rq, float* __restrict__ rk, const float* __restrict__ cos,
                       const float* __restrict__ sin, int64_t N, int nh, int nkv, int hd, float eps, int T) {
  pdl_enter();  // launched by launch_pdl
  const int lt = __ffs(T) - 1, half = hd / 2, d = (threadIdx.x & (T - 1)) * V;
  const int64_t nq = N * nh, nk = N * nkv, rows = nq + nk + (vin ? nk : 0), per_block = kThreads >> lt;
  // Block-uniform loop: a row's lanes shuffle, so no lane leaves early.
  for (int64_t r0 = blockIdx.x * per_block; r0 < rows; r0 += int64_t(gridDim.x) * per_block) {
    const int64_t r = r0 + (threadIdx.x >> lt);
    const bool live = r < rows;
    const int kind = r < nq ? 0 : r < nq + nk ? 1 : 2;  // q, k, v
    const int64_t row = kind == 0 ? r : kind == 1 ? r - nq : r - nq - nk;
    const int heads = kind == 0 ? nh : nkv;
    const int64_t tok = row / heads, h = row - tok * heads;
    const S* x = (kind == 0 ? qin : kind == 1 ? kin : vin) + tok * (kind == 0 ? ldq : ldk) + h * hd;
    S* o = nullptr;
    if (!live) {
    } else if (kind == 0) {
      o = q + row * hd;
    } else if (slots) {
      const int64_t slot = slots[tok];
      if (slot >= 0) o = (kind == 1 ? k : vout) + (slot * nkv + h) * hd;
    } else {
      o = (kind == 1 ? k : vout) + row * hd;
    }
    const bool on = live && d < half;
    const Pack<S, V> pa = on ? ldp<S, V>(x, d) : Pack<S, V>{}, pb = on ? ldp<S, V>(x, d + half) : Pack<S, V>{};
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) ss += fv(pa, j) * fv(pa, j) + fv(pb, j) * fv(pb, j);
    for (int m = T / 2; m > 0; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float rs = 1.f / sqrtf(ss / float(hd) + eps);
    if (on && o && kind == 2) {
      stp<S, V>(o, d, pa);
      stp<S, V>(o, d + half, pb);
    } else if (on && o) {
      const S* w = kind == 0 ? wq : wk;
      float wa[V], wb[V], c[V], s[V], ya[V], yb[V];
      ldv<S, V>(w, d, wa);
      ldv<S, V>(w, d + half, wb);
      ldv<float, V>(cos, tok * half + d, c);
      ldv<float, V>(sin, tok * half + d, s);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float a = round_to<S>(wa[j] * (fv(pa, j) * rs)), b = round_to<S>(wb[j] * (fv(pb, j) * rs));
        ya[j] = a * c[j] - b * s[j];
        yb[j] = b * c[j] + a * s[j];
      }
      stv<S, V>(o, d, ya);
      stv<S, V>(o, d + half, yb);
    }
    float* rr = kind == 0 ? rq : rk;
    if (live && kind != 2 && d == 0 && rr) rr[row] = rs;
  }
}

// layernorm_fwd, a row group a row (above); w and b stay in registers across the block's rows.
template <class S, int V, int NV>
__global__ void __launch_bounds__(kThreads)
    k_ln_fwd(const S* __restrict__ x, const S* __restrict__ w, const S* __restrict__ b, S* __restrict__ y,
             float* __restrict__ mean, float* __restrict__ rstd, int64_t N, int64_t D, int T, float eps) {
  __shared__ GroupRed<1> red;
  const int lt = __ffs(T) - 1, R = kThreads >> lt, g = threadIdx.x >> lt, t = threadIdx.x & (T - 1);
  bool on[NV];
  Pack<S, V> wp[NV], bp[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    on[k] = int64_t(k * T + t) * V < D;
    wp[k] = on[k] ? ldp<S, V>(w, (k * T + t) * V) : Pack<S, V>{};
    bp[k] = on[k] ? ldp<S, V>(b, (k * T + t) * V) : Pack<S, V>{};
  }
  int phase = 0;
  for (int64_t i0 = blockIdx.x * int64_t(R); i0 < N; i0 += int64_t(gridDim.x) * R) {  // uniform: group_sum syncs
    const int64_t i = i0 + g;
    const bool live = i < N;
    Pack<S, V> xp[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) xp[k] = live && on[k] ? ldp<S, V>(x, i * D + (k * T + t) * V) : Pack<S, V>{};
    float s[1] = {0.f};
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) s[0] += fv(xp[k], j);
    group_sum(s, T, red, phase++);
    const float mu = s[0] / float(D);
    float var[1] = {0.f};  // two-pass (biased) variance, as the reference
#pragma unroll
    for (int k = 0; k < NV; ++k)
#pragma unroll
      for (int j = 0; j < V; ++j) var[0] += on[k] ? (fv(xp[k], j) - mu) * (fv(xp[k], j) - mu) : 0.f;
    group_sum(var, T, red, phase++);
    const float r = 1.f / sqrtf(var[0] / float(D) + eps);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!live || !on[k]) continue;
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = (fv(xp[k], j) - mu) * r * fv(wp[k], j) + fv(bp[k], j);
      stv<S, V>(y + i * D, (k * T + t) * V, o);
    }
    if (live && t == 0) {
      mean[i] = mu;
      rstd[i] = r;
    }
  }
}

// layernorm_fwd on rows too wide for a row group: a warp a row, reading the row thrice (the later passes mostly
// from cache).
template <class S, int V>
__global__ void k_ln_fwd_wide(const S* __restrict__ x, const S* __restrict__ w, const S* __restrict__ b,
                              S* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd, int64_t N,
                              int64_t D, float eps) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const S* xi = x + i * D;
    float s = 0.f;
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float a[V];
      ldv<S, V>(xi, d, a);
#pragma unroll
      for (int j = 0; j < V; ++j) s += a[j];
    }
    const float mu = warp_sum(s) / float(D);
    float var = 0.f;  // two-pass (biased) variance, as the reference
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float a[V];
      ldv<S, V>(xi, d, a);
#pragma unroll
      for (int j = 0; j < V; ++j) var += (a[j] - mu) * (a[j] - mu);
    }
    var = warp_sum(var) / float(D);
    const float r = 1.f / sqrtf(var + eps);
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float a[V], wv[V], bv[V], o[V];
      ldv<S, V>(xi, d, a);
      ldv<S, V>(w, d, wv);
      ldv<S, V>(b, d, bv);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = (a[j] - mu) * r * wv[j] + bv[j];
      stv<S, V>(y + i * D, d, o);
    }
    if (lane == 0) {
      mean[i] = mu;
      rstd[i] = r;
    }
  }
}

// ---- backward: input gradient of rows too wide for a row group (one warp per row, din += or =) ------------------
template <class S, int V>
__global__ void k_rms_bwd_dx(const S* __restrict__ dy, const S* __restrict__ x, const S* __restrict__ w,
                             const float* __restrict__ rstd, S* __restrict__ dx, int64_t N, int64_t D, bool acc) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const S* xi = x + i * D;
    const S* gi = dy + i * D;
    const float r = rstd[i];
    float c = 0.f;
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float a[V], g[V], wv[V];
      ldv<S, V>(xi, d, a);
      ldv<S, V>(gi, d, g);
      ldv<S, V>(w, d, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) c += g[j] * wv[j] * a[j];
    }
    c = warp_sum(c) * (r * r * r / float(D));
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float a[V], g[V], wv[V], o[V];
      ldv<S, V>(xi, d, a);
      ldv<S, V>(gi, d, g);
      ldv<S, V>(w, d, wv);
      priorv<S, V>(dx + i * D, d, acc, o);
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] += g[j] * wv[j] * r - a[j] * c;
      stv<S, V>(dx + i * D, d, o);
    }
  }
}

template <class S, int V>
__global__ void k_ln_bwd_dx(const S* __restrict__ dy, const S* __restrict__ x, const S* __restrict__ w,
                            const float* __restrict__ mean, const float* __restrict__ rstd, S* __restrict__ dx,
                            int64_t N, int64_t D, bool acc) {
  const int lane = threadIdx.x & 31;
  for (int64_t i = blockIdx.x * int64_t(kWarps) + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * kWarps) {
    const S* xi = x + i * D;
    const S* gi = dy + i * D;
    const float mu = mean[i], r = rstd[i];
    float a = 0.f, c = 0.f;  // mean(g*w), mean(g*w*xhat)
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float xv[V], g[V], wv[V];
      ldv<S, V>(xi, d, xv);
      ldv<S, V>(gi, d, g);
      ldv<S, V>(w, d, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float gw = g[j] * wv[j];
        a += gw;
        c += gw * ((xv[j] - mu) * r);
      }
    }
    a = warp_sum(a) / float(D);
    c = warp_sum(c) / float(D);
    for (int64_t d = lane * V; d < D; d += 32 * V) {
      float xv[V], g[V], wv[V], o[V];
      ldv<S, V>(xi, d, xv);
      ldv<S, V>(gi, d, g);
      ldv<S, V>(w, d, wv);
      priorv<S, V>(dx + i * D, d, acc, o);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xh = (xv[j] - mu) * r;
        o[j] += r * (g[j] * wv[j] - a - xh * c);
      }
      stv<S, V>(dx + i * D, d, o);
    }
  }
}

// ---- backward -----------------------------------------------------------------------------------------------------
// rmsnorm_bwd / layernorm_bwd in one pass over dy and x: a row group a row (above). Block (b, s) takes rows
// [b rows_per, (b + 1) rows_per), each group every R-th of them, and the columns [c0, c0 + T NV V), c0 = s T NV V:
// one slice, unless the row is too wide to hold (then dx is null: k_*_bwd_dx did it). dx (+)= the input gradient
// (null: none); each group sums the columns of dw (RMS: g x r, LN: g xhat) and db (LN: g) over its rows in registers,
// then block_colsum adds the groups in order into pw / pb (null: none): the chunk partials, or (direct) dw / db.
template <class S, int V, int NV, bool LN>
__global__ void __launch_bounds__(kThreads, 2)
    k_norm_bwd(const S* __restrict__ dy, const S* __restrict__ x, const S* __restrict__ w,
               const float* __restrict__ mean, const float* __restrict__ rstd, S* __restrict__ dx, float* pw,
               float* pb, int64_t N, int64_t D, int T, int64_t rows_per, bool acc, bool direct) {
  __shared__ GroupRed<LN ? 2 : 1> red;
  __shared__ alignas(16) float buf[kThreads * NV * V];
  const int lt = __ffs(T) - 1, R = kThreads >> lt, g = threadIdx.x >> lt, t = threadIdx.x & (T - 1);
  const int64_t c0 = int64_t(blockIdx.y) * T * NV * V, r0 = blockIdx.x * rows_per, r1 = min(N, r0 + rows_per);
  bool on[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) on[k] = c0 + int64_t(k * T + t) * V < D;
  // w is read where used, from L1 (the same for every row): registers holding it spilled the 4-slot shapes.
  const S* wt = w + c0 + t * V;
  float sw[NV][V] = {}, sb[NV][V] = {};  // this group's column sums
  int phase = 0;
  for (int64_t i0 = r0; i0 < r1; i0 += R) {  // uniform: group_sum may sync
    const int64_t i = i0 + g, at = i * D + c0 + t * V;  // slot k at at + k T V
    const bool live = i < r1;
    Pack<S, V> xp[NV], gp[NV], op[NV], wp;
#pragma unroll
    for (int k = 0; k < NV; ++k) {  // every load of the row issued before any is used
      const bool ld_k = live && on[k];
      xp[k] = ld_k ? ldp<S, V>(x, at + k * T * V) : Pack<S, V>{};
      gp[k] = ld_k ? ldp<S, V>(dy, at + k * T * V) : Pack<S, V>{};
      op[k] = ld_k && dx && acc ? ldp<S, V>(dx, at + k * T * V) : Pack<S, V>{};
    }
    const float r = live ? rstd[i] : 0.f, mu = LN && live ? mean[i] : 0.f;
    float s[LN ? 2 : 1] = {};  // the row's RMS: sum(g w x); LN: sum(g w), sum(g w xhat)
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      wp = live && on[k] && dx ? ldp<S, V>(wt, k * T * V) : Pack<S, V>{};
#pragma unroll
      for (int j = 0; j < V; ++j) {  // the column sums first, so only the packs live past group_sum
        const float gv = fv(gp[k], j), xv = fv(xp[k], j), gw = gv * fv(wp, j);
        if constexpr (LN) {
          const float xh = (xv - mu) * r;
          sw[k][j] += gv * xh;
          sb[k][j] += gv;
          s[0] += gw;
          s[1] += gw * xh;
        } else {
          sw[k][j] += gv * xv * r;
          s[0] += gw * xv;
        }
      }
    }
    if (!dx) continue;  // uniform
    group_sum(s, T, red, phase++);
    const float a = LN ? s[0] / float(D) : 0.f, c = LN ? s[1] / float(D) : s[0] * (r * r * r / float(D));
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (!live || !on[k]) continue;
      wp = ldp<S, V>(wt, k * T * V);
      float o[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float gv = fv(gp[k], j), xv = fv(xp[k], j), wv = fv(wp, j);
        if constexpr (LN) o[j] = fv(op[k], j) + r * (gv * wv - a - ((xv - mu) * r) * c);
        else o[j] = fv(op[k], j) + (gv * wv * r - xv * c);
      }
      stv<S, V>(dx, at + k * T * V, o);
    }
  }
  const int64_t part = direct ? 0 : blockIdx.x * D;  // the chunk's partial row
  if (pw) block_colsum<NV, V>(sw, buf, pw + part, D, c0, T, direct);
  if (LN && pb) block_colsum<NV, V>(sb, buf, pb + part, D, c0, T, direct);
}

// dst[col] += the sum over chunks of part[chunk * D + col], for (part, dst, chunks) = (part0, dst0, chunks0) at
// blockIdx.y 0 and (part1, dst1, chunks1) at 1 (two gradients in one launch: LayerNorm's dw and db, QK-norm's dwq and
// dwk): 32 columns a block, each summed by 32 lanes over every 32nd chunk, then over the lanes, in a fixed order.
__global__ void __launch_bounds__(1024) k_chunk_sum(const float* part0, float* dst0, const float* part1, float* dst1,
                                                    int64_t chunks0, int64_t chunks1, int64_t D) {
  __shared__ float sh[32][33];
  const float* __restrict__ part = blockIdx.y ? part1 : part0;
  float* dst = blockIdx.y ? dst1 : dst0;
  const int64_t chunks = blockIdx.y ? chunks1 : chunks0;
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f;
  if (col < D)
#pragma unroll 4
    for (int64_t c = threadIdx.y; c < chunks; c += 32) a += part[c * D + col];
  sh[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    float s = 0.f;
    for (int y = 0; y < 32; ++y) s += sh[y][threadIdx.x];
    dst[col] += s;
  }
}

int row_blocks(int64_t N) { return grid_for(N, kWarps); }

// The least rows a chunk of norm_bwd: 16, or Q3VL_NORM_CHUNK_ROWS=n (n >= 1; for A/B runs of the rule below; a
// fixed setting keeps the sums' order fixed).
int64_t chunk_rows_floor() {
  static const int64_t r = env_positive("Q3VL_NORM_CHUNK_ROWS", 16);
  return r;
}

// rmsnorm_bwd / layernorm_bwd: k_norm_bwd over chunks of rows (grid.x; each block writes its chunk's column sums as a
// partial row in x.ws, k_chunk_sum adds them in chunk order; one chunk adds into dw/db directly). Rows too wide to
// hold (bf16 past 8192 for RMS, 4096 for LN; unaligned past 2048) take k_*_bwd_dx for dx and k_norm_bwd over column
// slices for dw/db.
//
// Chunks: ceil(N / m) for m = max(4 R, 16) rows (R = 256 / T, the rows a block takes at a time, so 4 R is 4 rows a
// group), at most 512, at least min(256, N / R), and at most as many partial rows as x.ws holds; the rows spread
// evenly (rows_per = ceil(N / chunks)). The order of the sums depends only on N, D, the dtype (through T) and ws_bytes (and a set
// Q3VL_NORM_CHUNK_ROWS). Rows too wide to hold take T = 256 (R = 1), so m = 16.
// - m >= 16 keeps the partials, chunks x D x 4 bytes x outputs (written, then read back by k_chunk_sum), within 1/8
//   of the bytes of dy and x, N x D x 2 x sizeof(S) (up to the rounding of N / m): 1/8 for 16-bit LayerNorm (dw and
//   db), 1/16 for 16-bit RMSNorm and fp32 LayerNorm, 1/32 for fp32 RMSNorm.
// - 512 (past 8192 rows where m = 16): about two waves of blocks at 2 an SM (the launch bound) on 132 SMs; more
//   chunks would add partial bytes rather than parallelism. 13399 x 2048 (bf16 RMS): 497 chunks of 27 rows, partials
//   1/27 of dy and x; 16384 x 2048: 512 of 32, 1/32.
// - At small N, where the kernel waits on latency rather than bytes, smaller: at least min(256, N / R) chunks. A block
//   takes its rows R at a time, each step a dependent load of the rows and a barrier (group_sum), so its time grows
//   with rows_per / R, while k_chunk_sum costs about its launch and one round of loads. 784 x 1152 (the 30B-A3B and
//   8B vision tower, bf16 LN, T = 128, R = 2): 196 chunks of 4 rows, 2 steps a block, partials 1.7 MiB of 3.4 MiB
//   (49 chunks of 16 rows, 8 steps, took 27 us a call on an H100, 0.2 TB/s: 2026-12-05). 3920 x 1024 (the 2B's,
//   T = 64, R = 4): 245 chunks of 16 rows, 4 steps, as m alone gives.
template <bool LN>
void norm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* mean, const float* rstd,
              void* din, float* dw, float* db, int64_t N, int64_t D, bool acc, DType dt) {
  if (!LN) db = nullptr;
  if (N <= 0 || D <= 0 || (!din && !dw && !db)) return;
  by_dtype(dt, [&]<class S>() {
    // Slots a thread, at most: LN keeps two column sums a slot, so fewer (16-bit LN at 3 spilled at 128 registers).
    constexpr int VW = 16 / sizeof(S), kNV = !LN ? 4 : sizeof(S) == 4 ? 3 : 2;
    const S *g = static_cast<const S*>(dy), *xi = static_cast<const S*>(in), *wi = static_cast<const S*>(w);
    S* dx = static_cast<S*>(din);
    const int V = vec_width<S>(D, {dy, in, w, din});
    RowShape rs = V > 1 ? row_shape(D / V, 2, kNV) : row_shape(D, kScalarNV, kScalarNV);
    if (rs.T == 0) {
      if (dx) {
        if constexpr (LN)
          (V > 1 ? k_ln_bwd_dx<S, VW> : k_ln_bwd_dx<S, 1>)<<<row_blocks(N), 256, 0, stream_of(x)>>>(
              g, xi, wi, mean, rstd, dx, N, D, acc);
        else
          (V > 1 ? k_rms_bwd_dx<S, VW> : k_rms_bwd_dx<S, 1>)<<<row_blocks(N), 256, 0, stream_of(x)>>>(
              g, xi, wi, rstd, dx, N, D, acc);
        Q3VL_LAUNCHED();
      }
      if (!dw && !db) return;
      dx = nullptr;
      rs = {kThreads, V > 1 ? kNV : kScalarNV};
    }
    const int64_t span = int64_t(rs.T) * rs.NV * V, slices = (D + span - 1) / span, nout = (dw ? 1 : 0) + (db ? 1 : 0);
    const int64_t min_rows = std::max<int64_t>(4 * (kThreads / rs.T), chunk_rows_floor());  // see above
    int64_t chunks = std::min<int64_t>((N + min_rows - 1) / min_rows, 512);
    chunks = std::max<int64_t>(chunks, std::min<int64_t>(256, N / (kThreads / rs.T)));  // small N (above)
    if (nout) chunks = std::min<int64_t>(chunks, int64_t(x.ws_bytes / (sizeof(float) * size_t(D * nout))));
    chunks = std::max<int64_t>(chunks, 1);
    const int64_t rows_per = (N + chunks - 1) / chunks;
    chunks = (N + rows_per - 1) / rows_per;
    const bool direct = chunks == 1;
    float* p0 = direct ? dw : (dw ? static_cast<float*>(x.ws) : nullptr);
    float* p1 = direct ? db : (db ? static_cast<float*>(x.ws) + (dw ? chunks * D : 0) : nullptr);
    const dim3 grid{unsigned(chunks), unsigned(slices)};
    auto go = [&]<int VV, int NV>() {
      k_norm_bwd<S, VV, NV, LN><<<grid, kThreads, 0, stream_of(x)>>>(g, xi, wi, mean, rstd, dx, p0, p1, N, D, rs.T,
                                                                     rows_per, acc, direct);
      Q3VL_LAUNCHED();
    };
    if (V == 1) {
      go.template operator()<1, kScalarNV>();
    } else if (rs.NV == 2) {
      go.template operator()<VW, 2>();
    } else if constexpr (kNV >= 3) {
      if (rs.NV == 3) go.template operator()<VW, 3>();
      else if constexpr (kNV == 4) go.template operator()<VW, 4>();
    }
    if (direct || !nout) return;
    // One launch for both outputs: grid row 0 the first of (p0, dw), (p1, db) present, row 1 (LN with both) db.
    const float* q0 = dw ? p0 : p1;
    float* d0 = dw ? dw : db;
    k_chunk_sum<<<dim3(unsigned((D + 31) / 32), unsigned(nout)), dim3(32, 32), 0, stream_of(x)>>>(q0, d0, p1, db,
                                                                                                   chunks, chunks, D);
    Q3VL_LAUNCHED();
  });
}

// ---- QK-norm and rotary backward --------------------------------------------------------------------------------
// qk_norm_rope_bwd, T lanes a head row as k_qk_norm_rope_vec (x's and dx's token rows ld apart, 0: contiguous) (T V = hd / 2 here, T <= 32: R = 256 / T rows a block at
// a time), lane t holding the pairs (d, d + hd/2), d = t V + [0, V): its columns are the same in every row, so its
// dw sums stay in registers across the rows, as block_colsum's two slots (slot 1: columns hd/2 + t V). Block b takes
// the rows [b rows_per, (b + 1) rows_per) of q (b < cq) or of k (b - cq). A row: g = rope_bwd(dy) in fp32 (not
// rounded to S), dx (+)= g w r - x sum(g w x) r^3 / hd (the row's sum over its lanes by shuffles), the lane's column
// sums += g x r. At the end block_colsum writes them as the block's partial row b of pw [cq + ck, hd] (q's, then
// k's), or, for a kind of one chunk, adds them to its dw.
template <class S, int V>
__global__ void __launch_bounds__(kThreads, 3)
    k_qk_norm_rope_bwd(const S* __restrict__ dq, const S* __restrict__ dk, const S* __restrict__ qraw,
                       const S* __restrict__ kraw, const S* __restrict__ wq, const S* __restrict__ wk,
                       const float* __restrict__ rq, const float* __restrict__ rk, const float* __restrict__ cos,
                       const float* __restrict__ sin, S* __restrict__ dqr, S* __restrict__ dkr, float* dwq,
                       float* dwk, float* pw, int64_t N, int nh, int nkv, int hd, int64_t ld, int T, int64_t rows_per,
                       int64_t cq, int64_t ck, bool acc) {
  __shared__ alignas(16) float buf[kThreads * 2 * V];
  pdl_enter();  // launched by launch_pdl
  const int lt = __ffs(T) - 1, half = hd / 2, g = threadIdx.x >> lt, d = (threadIdx.x & (T - 1)) * V;
  const bool isk = blockIdx.x >= cq;  // uniform
  const int heads = isk ? nkv : nh;
  const S *dy = isk ? dk : dq, *x = isk ? kraw : qraw, *w = isk ? wk : wq;
  const float* rstd = isk ? rk : rq;
  S* dx = isk ? dkr : dqr;
  const int64_t r0 = (isk ? blockIdx.x - cq : blockIdx.x) * rows_per, r1 = min(N * heads, r0 + rows_per);
  const int64_t ldx = ld ? ld : int64_t(heads) * hd;  // a token's row of x and dx (dy's rows are contiguous)
  float sw[2][V] = {};  // this lane's column sums of g x r: columns d + [0, V), half + d + [0, V)
  for (int64_t i0 = r0; i0 < r1; i0 += kThreads >> lt) {  // uniform: a row's lanes shuffle
    const int64_t i = i0 + g, tok = i / heads, at = i * hd + d, cs = tok * half + d;  // cs: the token's cos/sin
    const int64_t ax = tok * ldx + (i - tok * heads) * hd + d;  // x's and dx's
    const bool live = i < r1;
    Pack<S, V> ya{}, yb{}, xa{}, xb{}, wa{}, wb{};
    float c[V] = {}, s[V] = {}, oa[V], ob[V];
    if (live) {  // w too, from L1: its floats held across rows spilled (k_norm_bwd's experience too)
      ya = ldp<S, V>(dy, at), yb = ldp<S, V>(dy, at + half), xa = ldp<S, V>(x, ax), xb = ldp<S, V>(x, ax + half);
      wa = ldp<S, V>(w, d), wb = ldp<S, V>(w, d + half);
      ldv<float, V>(cos, cs, c);
      ldv<float, V>(sin, cs, s);
    }
    const float r = live ? rstd[i] : 0.f;
    float ga[V], gb[V], sum = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float a = fv(ya, j), b = fv(yb, j);
      ga[j] = a * c[j] + b * s[j];  // the rotation by minus the angle (rope_bwd)
      gb[j] = b * c[j] - a * s[j];
      sum += ga[j] * fv(wa, j) * fv(xa, j) + gb[j] * fv(wb, j) * fv(xb, j);
      sw[0][j] += ga[j] * fv(xa, j) * r;
      sw[1][j] += gb[j] * fv(xb, j) * r;
    }
    for (int m = T / 2; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
    const float cc = sum * (r * r * r / float(hd));
    if (!live) continue;
    priorv<S, V>(dx, ax, acc, oa);  // here, not with the other loads: fewer registers live across the shuffles
    priorv<S, V>(dx, ax + half, acc, ob);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      oa[j] += ga[j] * fv(wa, j) * r - fv(xa, j) * cc;
      ob[j] += gb[j] * fv(wb, j) * r - fv(xb, j) * cc;
    }
    stv<S, V>(dx, ax, oa);
    stv<S, V>(dx, ax + half, ob);
  }
  float* dw = isk ? dwk : dwq;
  if (!dw) return;  // uniform
  const bool direct = (isk ? ck : cq) == 1;
  block_colsum<2, V>(sw, buf, direct ? dw : pw + int64_t(blockIdx.x) * hd, hd, 0, T, direct);
}

// qk_norm_rope_bwd on k_qk_norm_rope_bwd at the widest of 16- and 8-byte vectors V with hd / 2 = T V for a power of
// two T <= 32 and every pointer aligned to V elements (cos/sin to 16 bytes); false: not taken (nothing launched).
// Chunks: rows_per = max(the norms' least rows a chunk, 4 R or chunk_rows_floor(), and a 1024th of all q and k rows;
// 1024 blocks: about 2.6 waves of 256-thread blocks at 3 an SM, the launch bound, on 132 SMs), doubled until the
// partial rows fit x.ws (a kind of one chunk, or frozen, needs none). A partial row is hd floats, so 1024 of them are 512 KiB, about 1/500 of
// the dy and x they sum at the 2B's 16384 tokens in bf16. The sums' order depends only on N, nh, nkv, hd, the vector
// width and ws_bytes (and a set Q3VL_NORM_CHUNK_ROWS).
template <class S>
bool qk_rope_bwd(const Exec& x, const void* dq, const void* dk, const void* qraw, const void* kraw, const void* wq,
                 const void* wk, const float* rq, const float* rk, const float* cos, const float* sin, void* dqr,
                 void* dkr, float* dwq, float* dwk, int64_t N, int64_t nh, int64_t nkv, int64_t hd, int64_t ld,
                 bool acc) {
  const int64_t half = hd / 2;
  const auto fits = [&](int V) {
    const uintptr_t m = uintptr_t(V) * sizeof(S) - 1;
    for (const void* p : {dq, dk, qraw, kraw, wq, wk, static_cast<const void*>(dqr), static_cast<const void*>(dkr)})
      if (reinterpret_cast<uintptr_t>(p) & m) return false;
    const int64_t T = half / V;
    return half % V == 0 && ld % V == 0 && T <= 32 && (T & (T - 1)) == 0 && aligned16(cos) && aligned16(sin);
  };
  constexpr int VW = 16 / sizeof(S);
  const int V = fits(VW) ? VW : fits(VW / 2) ? VW / 2 : 0;
  if (V == 0) return false;
  const int T = int(half / V);
  const int64_t nq = N * nh, nk = N * nkv;
  int64_t rows_per = std::max({4 * int64_t(kThreads / T), chunk_rows_floor(), (nq + nk + 1023) / 1024});
  int64_t cq, ck;
  for (;; rows_per *= 2) {
    cq = (nq + rows_per - 1) / rows_per, ck = (nk + rows_per - 1) / rows_per;
    const bool parts = (dwq && cq > 1) || (dwk && ck > 1);
    if (!parts || size_t((cq + ck) * hd) * sizeof(float) <= x.ws_bytes) break;
  }
  float* pw = static_cast<float*>(x.ws);
  const auto go = [&]<int VV>() {
    launch_pdl(k_qk_norm_rope_bwd<S, VV>, dim3(unsigned(cq + ck)), kThreads, 0, stream_of(x),
               static_cast<const S*>(dq), static_cast<const S*>(dk), static_cast<const S*>(qraw),
               static_cast<const S*>(kraw), static_cast<const S*>(wq), static_cast<const S*>(wk), rq, rk, cos, sin,
               static_cast<S*>(dqr), static_cast<S*>(dkr), dwq, dwk, pw, N, int(nh), int(nkv), int(hd), ld, T,
               rows_per, cq, ck, acc);
  };
  if (V == VW) go.template operator()<VW>();
  else go.template operator()<VW / 2>();
  // The partials of each kind of several chunks, in one launch.
  struct Sum {
    const float* part;
    float* dw;
    int64_t chunks;
  } sums[2];
  int n = 0;
  if (dwq && cq > 1) sums[n++] = {pw, dwq, cq};
  if (dwk && ck > 1) sums[n++] = {pw + cq * hd, dwk, ck};
  if (n == 0) return true;
  const Sum &a = sums[0], &b = sums[n - 1];
  k_chunk_sum<<<dim3(unsigned((hd + 31) / 32), unsigned(n)), dim3(32, 32), 0, stream_of(x)>>>(
      a.part, a.dw, b.part, b.dw, a.chunks, b.chunks, hd);
  Q3VL_LAUNCHED();
  return true;
}

}  // namespace

namespace {
// rmsnorm_fwd and residual_rmsnorm_fwd: a block per row for up to 64 rows of 1024 or more, else a warp per row.
void rms_fwd(const Exec& x, const void* a, void* io, const void* w, void* y, void* saved, float* rstd, int64_t N,
             int64_t D, double eps, DType dt) {
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    const S *ai = static_cast<const S*>(a), *wi = static_cast<const S*>(w);
    S *xo = static_cast<S*>(io), *yo = static_cast<S*>(y), *so = static_cast<S*>(saved);
    const bool vec = vec_width<S>(D, {a, io, w, y, saved}) > 1, row_block = N <= 64 && D >= 1024;
    const unsigned grid = unsigned(row_block ? N : row_blocks(N));
    auto go = [&]<int V, int T>() {
      if (a)
        launch_pdl(k_rms_fwd<S, V, T, true>, dim3(grid), kNormThreads, 0, stream_of(x), ai, xo, wi, yo, so, rstd, N, D,
                   float(eps));
      else
        launch_pdl(k_rms_fwd<S, V, T, false>, dim3(grid), kNormThreads, 0, stream_of(x), ai, xo, wi, yo, so, rstd, N, D,
                   float(eps));
    };
    constexpr int VW = 16 / sizeof(S);
    if (row_block) vec ? go.template operator()<VW, 256>() : go.template operator()<1, 256>();
    else vec ? go.template operator()<VW, 32>() : go.template operator()<1, 32>();
  });
}
// qk_norm_rope_fwd and qkv_to_cache_fwd: the vector kernel at the widest of 16- and 8-byte vectors that divides half
// the head dim and the row strides, with every pointer aligned to it (cos/sin to 16 bytes); else a warp a row.
template <class S>
void qk_rope(const Exec& x, const S* qin, const S* kin, const S* vin, int64_t ldq, int64_t ldk, const void* wq,
             const void* wk, void* q, void* k, void* vout, const int32_t* slots, float* rq, float* rk,
             const float* cos, const float* sin, int64_t N, int64_t nh, int64_t nkv, int64_t hd, double eps) {
  const int64_t half = hd / 2, rows = N * (nh + nkv + (vin ? nkv : 0));
  const auto fits = [&](int V) {
    const uintptr_t m = uintptr_t(V) * sizeof(S) - 1;
    for (const void* p : {static_cast<const void*>(qin), static_cast<const void*>(kin),
                          static_cast<const void*>(vin), wq, wk, static_cast<const void*>(q),
                          static_cast<const void*>(k), static_cast<const void*>(vout)})
      if (reinterpret_cast<uintptr_t>(p) & m) return false;
    return half % V == 0 && ldq % V == 0 && ldk % V == 0 && half / V <= 32 && aligned16(cos) && aligned16(sin);
  };
  const auto go = [&]<int V>() {
    int T = 1;
    while (T * V < half) T *= 2;
    launch_pdl(k_qk_norm_rope_vec<S, V>, dim3(unsigned(grid_for(rows, kThreads / T))), kThreads, 0, stream_of(x),
               qin, kin, vin, ldq, ldk, static_cast<const S*>(wq), static_cast<const S*>(wk), static_cast<S*>(q),
               static_cast<S*>(k), static_cast<S*>(vout), slots, rq, rk, cos, sin, N, int(nh), int(nkv), int(hd),
               float(eps), T);
  };
  constexpr int VW = 16 / sizeof(S);
  if (fits(VW)) return go.template operator()<VW>();
  if (fits(VW / 2)) return go.template operator()<VW / 2>();
  launch_pdl(k_qk_norm_rope<S>, dim3(unsigned(row_blocks(rows))), 256, 0, stream_of(x), qin, kin, vin, ldq, ldk,
             static_cast<const S*>(wq), static_cast<const S*>(wk), static_cast<S*>(q), static_cast<S*>(k),
             static_cast<S*>(vout), slots, rq, rk, cos, sin, N, int(nh), int(nkv), int(hd), float(eps));
}
}  // namespace

void rmsnorm_fwd(const Exec& x, const void* in, const void* w, void* y, float* rstd, int64_t N, int64_t D, double eps,
                 DType dt) {
  rms_fwd(x, nullptr, const_cast<void*>(in), w, y, nullptr, rstd, N, D, eps, dt);  // io is only read without a
}

void residual_rmsnorm_fwd(const Exec& x, const void* a, void* io, const void* w, void* y, void* saved, float* rstd,
                          int64_t N, int64_t D, double eps, DType dt) {
  rms_fwd(x, a, io, w, y, saved, rstd, N, D, eps, dt);
}

void qk_norm_rope_fwd(const Exec& x, const void* qraw, const void* kraw, const void* wq, const void* wk, void* q,
                      void* k, float* rq, float* rk, const float* cos, const float* sin, int64_t N, int64_t nh,
                      int64_t nkv, int64_t hd, double eps, DType dt) {
  if (N <= 0) return;
  Q3VL_CHECK(hd % 2 == 0 && hd <= 4096 && nh + nkv <= 65536, "qk_norm_rope_fwd: head dim must be even");
  by_dtype(dt, [&]<class S>() {
    qk_rope<S>(x, static_cast<const S*>(qraw), static_cast<const S*>(kraw), nullptr, nh * hd, nkv * hd, wq, wk, q, k,
               nullptr, nullptr, rq, rk, cos, sin, N, nh, nkv, hd, eps);
  });
}

void qkv_to_cache_fwd(const Exec& x, const void* qkv, const void* wq, const void* wk, void* q, void* k_pool,
                      void* v_pool, const int32_t* slots, float* rq, float* rk, const float* cos, const float* sin,
                      int64_t N, int64_t nh, int64_t nkv, int64_t hd, double eps, DType dt) {
  if (N <= 0) return;
  Q3VL_CHECK(hd % 2 == 0 && hd <= 4096 && nh + nkv <= 65536, "qkv_to_cache_fwd: head dim must be even");
  const int64_t ld = (nh + 2 * nkv) * hd;
  by_dtype(dt, [&]<class S>() {
    const S* in = static_cast<const S*>(qkv);
    qk_rope<S>(x, in, in + nh * hd, in + (nh + nkv) * hd, ld, ld, wq, wk, q, k_pool, v_pool, slots, rq, rk, cos, sin,
               N, nh, nkv, hd, eps);
  });
}

void qk_norm_rope_bwd(const Exec& x, void* dq, void* dk, const void* qraw, const void* kraw, const void* wq,
                      const void* wk, const float* rq, const float* rk, const float* cos, const float* sin, void* dqr,
                      void* dkr, float* dwq, float* dwk, int64_t N, int64_t nh, int64_t nkv, int64_t hd, int64_t ld,
                      bool accumulate, DType dt) {
  if (N <= 0) return;
  Q3VL_CHECK(hd % 2 == 0 && dqr && dkr, "qk_norm_rope_bwd: head dim must be even, dqr and dkr given");
  const bool strided = ld != 0 && !(ld == nh * hd && ld == nkv * hd);
  bool done = false;
  by_dtype(dt, [&]<class S>() {
    done = qk_rope_bwd<S>(x, dq, dk, qraw, kraw, wq, wk, rq, rk, cos, sin, dqr, dkr, dwq, dwk, N, nh, nkv, hd, ld,
                          accumulate);
  });
  if (done) return;
  Q3VL_CHECK(!strided, "qk_norm_rope_bwd: rows " + std::to_string(ld) + " elements apart need the vector kernel (hd / "
                       "2 = T V, T a power of two <= 32, V 4 or 8 bf16 elements dividing the row stride; hd = " +
                       std::to_string(hd) + ")");
  // The shapes the kernel does not take: the two ops, rotating dq and dk in place (cuda::: the launchers, which ADL
  // on Exec would confuse with the public ops).
  cuda::rope_bwd(x, dq, cos, sin, N, nh, hd, dt);
  cuda::rope_bwd(x, dk, cos, sin, N, nkv, hd, dt);
  cuda::rmsnorm_bwd(x, dq, qraw, wq, rq, dqr, dwq, N * nh, hd, accumulate, dt);
  cuda::rmsnorm_bwd(x, dk, kraw, wk, rk, dkr, dwk, N * nkv, hd, accumulate, dt);
}

void rmsnorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* rstd, void* din,
                 float* dw, int64_t N, int64_t D, bool accumulate, DType dt) {
  norm_bwd<false>(x, dy, in, w, nullptr, rstd, din, dw, nullptr, N, D, accumulate, dt);
}

// A row group a row (bf16 up to 8192 wide, fp32 4096, unaligned 2048), else a warp a row.
void layernorm_fwd(const Exec& x, const void* in, const void* w, const void* b, void* y, float* mean, float* rstd,
                   int64_t N, int64_t D, double eps, DType dt) {
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    constexpr int VW = 16 / sizeof(S);
    const S *xi = static_cast<const S*>(in), *wi = static_cast<const S*>(w), *bi = static_cast<const S*>(b);
    S* yo = static_cast<S*>(y);
    const int V = vec_width<S>(D, {in, w, b, y});
    const RowShape rs = V > 1 ? row_shape(D / V, 2, 4) : row_shape(D, kScalarNV, kScalarNV);
    const int grid = grid_for(N, kThreads / std::max(rs.T, 1));
    auto go = [&]<int VV, int NV>() {
      k_ln_fwd<S, VV, NV><<<grid, kThreads, 0, stream_of(x)>>>(xi, wi, bi, yo, mean, rstd, N, D, rs.T, float(eps));
    };
    if (rs.T == 0)
      (V > 1 ? k_ln_fwd_wide<S, VW> : k_ln_fwd_wide<S, 1>)<<<row_blocks(N), 256, 0, stream_of(x)>>>(
          xi, wi, bi, yo, mean, rstd, N, D, float(eps));
    else if (V == 1) go.template operator()<1, kScalarNV>();
    else if (rs.NV == 2) go.template operator()<VW, 2>();
    else if (rs.NV == 3) go.template operator()<VW, 3>();
    else go.template operator()<VW, 4>();
    Q3VL_LAUNCHED();
  });
}

void layernorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* mean, const float* rstd,
                   void* din, float* dw, float* db, int64_t N, int64_t D, bool accumulate, DType dt) {
  norm_bwd<true>(x, dy, in, w, mean, rstd, din, dw, db, N, D, accumulate, dt);
}

}  // namespace q3vl::dev::cuda
