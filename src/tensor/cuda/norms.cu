// RMSNorm and LayerNorm over the last dim: one warp per row (fp32 math, 16-byte vector loads when every row is
// aligned). Weight/bias gradients are column sums over rows, done deterministically: per-chunk partials in x.ws,
// then a fixed-order sum over chunks (no atomics, so results do not depend on scheduling).
#include <algorithm>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr int kWarps = 8;  // rows per 256-thread block

__device__ __forceinline__ float warp_sum(float v) {
  // xor butterfly: every lane ends with the same value
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// V consecutive elements at p[i] (i a multiple of V; 16-byte aligned when V > 1).
template <class S, int V> struct alignas(V > 1 ? 16 : alignof(S)) Pack {
  S v[V];
};
template <class S, int V> __device__ __forceinline__ void ldv(const S* p, int64_t i, float (&f)[V]) {
  const Pack<S, V> pk = *reinterpret_cast<const Pack<S, V>*>(p + i);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = ld(pk.v, j);
}
// What an input gradient adds to: its values (accumulate), or the zeros of a zeroed buffer, unread (dev.hpp).
template <class S, int V> __device__ __forceinline__ void priorv(const S* p, int64_t i, bool acc, float (&f)[V]) {
  if (acc) return ldv<S, V>(p, i, f);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = 0.f;
}
template <class S, int V> __device__ __forceinline__ void stv(S* p, int64_t i, const float (&f)[V]) {
  Pack<S, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) st(pk.v, j, f[j]);
  *reinterpret_cast<Pack<S, V>*>(p + i) = pk;
}

// Vector width for rows of D elements of S when every listed pointer (null ones ignored) is 16-byte aligned.
template <class S> int vec_width(int64_t D, std::initializer_list<const void*> ptrs) {
  constexpr int V = 16 / sizeof(S);
  if (D % V != 0) return 1;
  for (const void* p : ptrs)
    if (p && !aligned16(p)) return 1;
  return V;
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
// (negative: not stored), or k [N, nkv, hd] without slots. rq/rk may be null.
template <class S>
__device__ __forceinline__ float round_to(float v) {
  S t;
  st(&t, 0, v);
  return ld(&t, 0);
}
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
      o = k + row * hd;
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

template <class S, int V>
__global__ void k_ln_fwd(const S* __restrict__ x, const S* __restrict__ w, const S* __restrict__ b, S* __restrict__ y,
                         float* __restrict__ mean, float* __restrict__ rstd, int64_t N, int64_t D, float eps) {
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

// ---- backward: input gradient (one warp per row, din += or =) -----------------------------------------------------
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

// ---- backward: weight/bias gradients as column sums ---------------------------------------------------------------
// Block (32 columns x 8 row lanes) sums its chunk of rows; LN: out0 = dw (g * xhat), out1 = db (g); RMS: out0 = dw
// (g * x * r). `direct` (one chunk): add into dw/db; otherwise write the chunk's partial row.
template <class S, bool LN>
__global__ void k_norm_wgrad(const S* __restrict__ dy, const S* __restrict__ x, const float* __restrict__ mean,
                             const float* __restrict__ rstd, int64_t N, int64_t D, int64_t rows_per, float* out0,
                             float* out1, bool direct) {
  __shared__ float sh0[8][33], sh1[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per, r1 = min(N, r0 + rows_per);
  float a0 = 0.f, a1 = 0.f;
  if (col < D)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      const float g = ld(dy, r * D + col), xv = ld(x, r * D + col);
      if (LN) {
        a0 += g * ((xv - mean[r]) * rstd[r]);
        a1 += g;
      } else {
        a0 += g * xv * rstd[r];
      }
    }
  sh0[threadIdx.y][threadIdx.x] = a0;
  sh1[threadIdx.y][threadIdx.x] = a1;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    float s0 = 0.f, s1 = 0.f;
    for (int y = 0; y < 8; ++y) {
      s0 += sh0[y][threadIdx.x];
      s1 += sh1[y][threadIdx.x];
    }
    if (direct) {
      if (out0) out0[col] += s0;
      if (LN && out1) out1[col] += s1;
    } else {
      if (out0) out0[blockIdx.y * D + col] = s0;
      if (LN && out1) out1[blockIdx.y * D + col] = s1;
    }
  }
}

// dst[col] += sum over chunks of part[chunk * D + col], fixed order (block: 32 columns x 8 chunk lanes).
__global__ void k_chunk_sum(const float* __restrict__ part, int64_t chunks, int64_t D, float* dst) {
  __shared__ float sh[8][33];
  const int64_t col = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f;
  if (col < D)
    for (int64_t c = threadIdx.y; c < chunks; c += 8) a += part[c * D + col];
  sh[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && col < D) {
    float s = 0.f;
    for (int y = 0; y < 8; ++y) s += sh[y][threadIdx.x];
    dst[col] += s;
  }
}

template <bool LN>
void norm_wgrad(const Exec& x, const void* dy, const void* in, const float* mean, const float* rstd, float* dw,
                float* db, int64_t N, int64_t D, DType dt) {
  if (!LN) db = nullptr;
  if (N <= 0 || D <= 0 || (!dw && !db)) return;
  const int64_t tiles = (D + 31) / 32, nout = (dw ? 1 : 0) + (db ? 1 : 0);
  int64_t chunks = std::max<int64_t>(1, 2048 / tiles);
  chunks = std::min<int64_t>(chunks, (N + 31) / 32);  // at least 32 rows a chunk
  chunks = std::min<int64_t>(chunks, int64_t(x.ws_bytes / (sizeof(float) * size_t(D * nout))));
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per = (N + chunks - 1) / chunks;
  chunks = (N + rows_per - 1) / rows_per;
  const bool direct = chunks == 1;
  float* p0 = direct ? dw : (dw ? static_cast<float*>(x.ws) : nullptr);
  float* p1 = direct ? db : (db ? static_cast<float*>(x.ws) + (dw ? chunks * D : 0) : nullptr);
  by_dtype(dt, [&]<class S>() {
    k_norm_wgrad<S, LN><<<dim3(unsigned(tiles), unsigned(chunks)), dim3(32, 8), 0, stream_of(x)>>>(
        static_cast<const S*>(dy), static_cast<const S*>(in), mean, rstd, N, D, rows_per, p0, p1, direct);
    Q3VL_LAUNCHED();
  });
  if (direct) return;
  if (dw) {
    k_chunk_sum<<<unsigned(tiles), dim3(32, 8), 0, stream_of(x)>>>(p0, chunks, D, dw);
    Q3VL_LAUNCHED();
  }
  if (db) {
    k_chunk_sum<<<unsigned(tiles), dim3(32, 8), 0, stream_of(x)>>>(p1, chunks, D, db);
    Q3VL_LAUNCHED();
  }
}

int row_blocks(int64_t N) { return grid_for(N, kWarps); }

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
    launch_pdl(k_qk_norm_rope<S>, dim3(unsigned(row_blocks(N * (nh + nkv)))), 256, 0, stream_of(x),
        static_cast<const S*>(qraw), static_cast<const S*>(kraw), nullptr, nh * hd, nkv * hd, static_cast<const S*>(wq),
        static_cast<const S*>(wk), static_cast<S*>(q), static_cast<S*>(k), nullptr, nullptr, rq, rk, cos, sin, N,
        int(nh), int(nkv), int(hd), float(eps));
  });
}

void qkv_to_cache_fwd(const Exec& x, const void* qkv, const void* wq, const void* wk, void* q, void* k_pool,
                      void* v_pool, const int32_t* slots, const float* cos, const float* sin, int64_t N, int64_t nh,
                      int64_t nkv, int64_t hd, double eps, DType dt) {
  if (N <= 0) return;
  Q3VL_CHECK(hd % 2 == 0 && hd <= 4096 && nh + nkv <= 65536, "qkv_to_cache_fwd: head dim must be even");
  const int64_t ld = (nh + 2 * nkv) * hd;
  by_dtype(dt, [&]<class S>() {
    const S* in = static_cast<const S*>(qkv);
    launch_pdl(k_qk_norm_rope<S>, dim3(unsigned(row_blocks(N * (nh + 2 * nkv)))), 256, 0, stream_of(x),
        in, in + nh * hd, in + (nh + nkv) * hd, ld, ld, static_cast<const S*>(wq), static_cast<const S*>(wk),
        static_cast<S*>(q), static_cast<S*>(k_pool), static_cast<S*>(v_pool), slots, nullptr, nullptr, cos, sin, N,
        int(nh), int(nkv), int(hd), float(eps));
  });
}

void rmsnorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* rstd, void* din,
                 float* dw, int64_t N, int64_t D, bool accumulate, DType dt) {
  if (N <= 0) return;
  if (din)
    by_dtype(dt, [&]<class S>() {
      const S *g = static_cast<const S*>(dy), *xi = static_cast<const S*>(in), *wi = static_cast<const S*>(w);
      S* dx = static_cast<S*>(din);
      if (vec_width<S>(D, {dy, in, w, din}) > 1)
        k_rms_bwd_dx<S, 16 / sizeof(S)><<<row_blocks(N), 256, 0, stream_of(x)>>>(g, xi, wi, rstd, dx, N, D,
                                                                                  accumulate);
      else
        k_rms_bwd_dx<S, 1><<<row_blocks(N), 256, 0, stream_of(x)>>>(g, xi, wi, rstd, dx, N, D, accumulate);
      Q3VL_LAUNCHED();
    });
  norm_wgrad<false>(x, dy, in, nullptr, rstd, dw, nullptr, N, D, dt);
}

void layernorm_fwd(const Exec& x, const void* in, const void* w, const void* b, void* y, float* mean, float* rstd,
                   int64_t N, int64_t D, double eps, DType dt) {
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    const S *xi = static_cast<const S*>(in), *wi = static_cast<const S*>(w), *bi = static_cast<const S*>(b);
    S* yo = static_cast<S*>(y);
    if (vec_width<S>(D, {in, w, b, y}) > 1)
      k_ln_fwd<S, 16 / sizeof(S)><<<row_blocks(N), 256, 0, stream_of(x)>>>(xi, wi, bi, yo, mean, rstd, N, D,
                                                                           float(eps));
    else
      k_ln_fwd<S, 1><<<row_blocks(N), 256, 0, stream_of(x)>>>(xi, wi, bi, yo, mean, rstd, N, D, float(eps));
    Q3VL_LAUNCHED();
  });
}

void layernorm_bwd(const Exec& x, const void* dy, const void* in, const void* w, const float* mean, const float* rstd,
                   void* din, float* dw, float* db, int64_t N, int64_t D, bool accumulate, DType dt) {
  if (N <= 0) return;
  if (din)
    by_dtype(dt, [&]<class S>() {
      const S *g = static_cast<const S*>(dy), *xi = static_cast<const S*>(in), *wi = static_cast<const S*>(w);
      S* dx = static_cast<S*>(din);
      if (vec_width<S>(D, {dy, in, w, din}) > 1)
        k_ln_bwd_dx<S, 16 / sizeof(S)><<<row_blocks(N), 256, 0, stream_of(x)>>>(g, xi, wi, mean, rstd, dx, N, D,
                                                                                 accumulate);
      else
        k_ln_bwd_dx<S, 1><<<row_blocks(N), 256, 0, stream_of(x)>>>(g, xi, wi, mean, rstd, dx, N, D, accumulate);
      Q3VL_LAUNCHED();
    });
  norm_wgrad<true>(x, dy, in, mean, rstd, dw, db, N, D, dt);
}

}  // namespace q3vl::dev::cuda
