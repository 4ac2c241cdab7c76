// Elementwise ops, activations, rotary, embeddings, row moves and the vision position embedding. Grid-stride loops,
// fp32 math on any storage dtype, formulas written as ops:: writes them. The memory-bound maps (activations, axpy,
// convert, ...), SwiGLU and rotary move W consecutive elements a thread per step, one 16-byte access per operand at
// full width, where pointers and shapes allow. Every backward is deterministic: the many-to-one ones (embedding_bwd,
// pos_embed_bwd) sum per destination row in a fixed order instead of atomics.
#include <algorithm>
#include <cmath>
#include <utility>

#include <cub/cub.cuh>

#include "q3vl/core/hash.hpp"
#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

#define Q3VL_GRID_LOOP(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// ---- vectors: W consecutive elements in one access ------------------------------------------------------------------
// ldv / stv / priorv (common.cuh) on W elements of S: one access of W * sizeof(S) bytes, two 16-byte ones above 16
// (fp32 beside a 16-bit operand). The base pointer is 16-byte aligned whenever W > 1 (see row_width, map).

// The vector width for rows of D elements of S: the widest power of two up to 16 bytes that divides D, when every
// pointer is 16-byte aligned (each row then starts on a vector), else 1.
template <class S> int row_width(int64_t D, std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (!aligned16(p)) return 1;
  int w = int(16 / sizeof(S));
  while (D % w != 0) w /= 2;
  return w;
}
// f.template operator()<W>() for the power of two w <= WMAX.
template <int WMAX, class F> void by_width(int w, F&& f) {
  if constexpr (WMAX == 1) f.template operator()<1>();
  else if (w == WMAX) f.template operator()<WMAX>();
  else by_width<WMAX / 2>(w, f);
}

// ---- flat maps: y[i] = f(i, prior, x0[i], x1[i], ...) over n elements -----------------------------------------------
// prior is y[i] when read_y (accumulating, or y an operand as in axpy), else 0 and y unread. A thread takes W
// consecutive elements a step, the n % W at the end one each. f gets fp32 values and returns what y stores.
template <int W, class Y, class F, class... X, size_t... K>
__device__ __forceinline__ void map_at(std::index_sequence<K...>, int64_t i, const F& f, Y* y, bool read_y,
                                       const X*... x) {
  float in[sizeof...(X) + 1][W];  // + 1: fill has no operand, and an array needs a size
  (ldv<X, W>(x, i, in[K]), ...);
  float o[W];
  priorv<Y, W>(y, i, read_y, o);
#pragma unroll
  for (int j = 0; j < W; ++j) o[j] = f(i + j, o[j], in[K][j]...);
  stv<Y, W>(y, i, o);
}
template <int W, class Y, class F, class... X>
__global__ void k_map(int64_t n, F f, Y* y, bool read_y, const X*... x) {
  constexpr auto ks = std::index_sequence_for<X...>{};
  const int64_t nv = n / W;
  Q3VL_GRID_LOOP(v, nv) map_at<W>(ks, v * W, f, y, read_y, x...);
  Q3VL_GRID_LOOP(t, n - nv * W) map_at<1>(ks, nv * W + t, f, y, read_y, x...);
}
// W: 16 bytes of the narrowest operand (bf16 -> fp32: 8, a 16-byte load and two 16-byte stores); 1 when a pointer
// is not 16-byte aligned.
template <class Y, class F, class... X> void map(const Exec& ex, int64_t n, F f, Y* y, bool read_y, const X*... x) {
  constexpr int W = int(16 / std::min({sizeof(Y), sizeof(X)...}));
  if ((aligned16(y) && ... && aligned16(x)))
    k_map<W><<<grid_for((n + W - 1) / W), 256, 0, stream_of(ex)>>>(n, f, y, read_y, x...);
  else k_map<1><<<grid_for(n), 256, 0, stream_of(ex)>>>(n, f, y, read_y, x...);
  Q3VL_LAUNCHED();
}

// The maps' f, each formula as ops:: writes it.
struct Fill {
  float v;
  __device__ float operator()(int64_t, float) const { return v; }
};
struct Copy {
  __device__ float operator()(int64_t, float, float a) const { return a; }
};
struct Axpy {
  float alpha;
  __device__ float operator()(int64_t, float y, float a) const { return y + alpha * a; }
};
struct Scale {
  float alpha;
  __device__ float operator()(int64_t, float y) const { return y * alpha; }
};
// acc: y += mask(a) (backward), else y = mask(a). The mask is element i's, whatever the vector width.
struct Dropout {
  double p;
  float keep;
  uint64_t key;
  int64_t first;
  bool acc;
  __device__ float operator()(int64_t i, float y, float a) const {
    const float v = dropout_drops(key, first + i, p) ? 0.f : a * keep;
    return acc ? y + v : v;
  }
};
struct GeluTanhFwd {
  __device__ float operator()(int64_t, float, float v) const {
    return 0.5f * v * (1.f + tanhf(kSqrt2OverPi * (v + 0.044715f * v * v * v)));
  }
};
struct GeluTanhBwd {  // dx = prior + dy * gelu'(x)
  __device__ float operator()(int64_t, float dx, float dy, float v) const {
    const float t = tanhf(kSqrt2OverPi * (v + 0.044715f * v * v * v));
    const float g = 0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * kSqrt2OverPi * (1.f + float(3 * 0.044715) * v * v);
    return dx + dy * g;
  }
};
struct GeluErfFwd {
  __device__ float operator()(int64_t, float, float v) const { return 0.5f * v * (1.f + erff(v * kInvSqrt2)); }
};
struct GeluErfBwd {
  __device__ float operator()(int64_t, float dx, float dy, float v) const {
    const float g = 0.5f * (1.f + erff(v * kInvSqrt2)) + v * expf(-0.5f * v * v) * kInvSqrt2Pi;
    return dx + dy * g;
  }
};

// ---- SwiGLU: gu [N, 2I] is gate | up per row; W consecutive columns a thread (W divides I), one division a vector -
template <class S, int W> __global__ void k_swiglu_fwd(const S* gu, S* y, int64_t N, int64_t I) {
  pdl_enter();  // launched by launch_pdl
  const int64_t IW = I / W;  // vectors a row
  Q3VL_GRID_LOOP(v, N * IW) {
    const int64_t i = v / IW, ig = i * 2 * I + (v - i * IW) * W;
    float g[W], u[W], o[W];
    ldv<S, W>(gu, ig, g);
    ldv<S, W>(gu, ig + I, u);
#pragma unroll
    for (int k = 0; k < W; ++k) o[k] = silu_mul(g[k], u[k]);
    stv<S, W>(y, v * W, o);
  }
}
template <class S, int W>
__global__ void k_swiglu_bwd(const S* dy, const S* gu, S* dgu, int64_t N, int64_t I, bool acc) {
  const int64_t IW = I / W;
  Q3VL_GRID_LOOP(v, N * IW) {
    const int64_t i = v / IW, ig = i * 2 * I + (v - i * IW) * W, iu = ig + I;
    float g[W], u[W], d[W], dg[W], du[W];
    ldv<S, W>(gu, ig, g);
    ldv<S, W>(gu, iu, u);
    ldv<S, W>(dy, v * W, d);
    priorv<S, W>(dgu, ig, acc, dg);
    priorv<S, W>(dgu, iu, acc, du);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float s = 1.f / (1.f + expf(-g[k]));
      dg[k] = dg[k] + d[k] * u[k] * s * (1.f + g[k] * (1.f - s));
      du[k] = du[k] + d[k] * g[k] * s;
    }
    stv<S, W>(dgu, ig, dg);
    stv<S, W>(dgu, iu, du);
  }
}

// ---- rotary: a thread per W consecutive pairs (d, d + hd/2) of one (token, head); W divides hd/2 -------------------
template <class S, int W>
__global__ void k_rope(S* x, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd, float sign) {
  const int64_t half = hd / 2, hw = half / W;  // vectors a half head
  Q3VL_GRID_LOOP(e, N * heads * hw) {
    const int64_t ih = e / hw, d = (e - ih * hw) * W, i = ih / heads;
    S* xi = x + ih * hd;
    float c[W], s[W], a[W], b[W], oa[W], ob[W];
    ldv<float, W>(cos, i * half + d, c);
    ldv<float, W>(sin, i * half + d, s);
    ldv<S, W>(xi, d, a);
    ldv<S, W>(xi, d + half, b);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      oa[k] = a[k] * c[k] - sign * b[k] * s[k];
      ob[k] = b[k] * c[k] + sign * a[k] * s[k];
    }
    stv<S, W>(xi, d, oa);
    stv<S, W>(xi, d + half, ob);
  }
}
// rope_table: one thread per (token, column); the fp32 angle as the CPU's, cosine and sine rounded from fp64.
struct RopeCols {
  float freq[64];
  int8_t axis[64];
};
__global__ void k_rope_table(const int32_t* __restrict__ pos, int64_t N, int W, RopeCols c, float* __restrict__ cos,
                             float* __restrict__ sin) {
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < N * W; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / W;
    const int j = int(e - i * W);
    const float f = __fmul_rn(float(pos[c.axis[j] * N + i]), c.freq[j]);
    double s, co;
    ::sincos(double(f), &s, &co);
    cos[e] = float(co), sin[e] = float(s);
  }
}

template <class S>
void rope(const Exec& x, void* q, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd,
          float sign) {
  by_width<16 / sizeof(S)>(row_width<S>(hd / 2, {q, cos, sin}), [&]<int W>() {
    k_rope<S, W><<<grid_for(N * heads * (hd / 2 / W)), 256, 0, stream_of(x)>>>(static_cast<S*>(q), cos, sin, N,
                                                                                heads, hd, sign);
    Q3VL_LAUNCHED();
  });
}

// ---- row moves: raw copies in the widest unit that every row's bytes and pointers allow -------------------------
template <class U>
__global__ void k_copy_rows(const char* src, const int32_t* ids, int64_t div, int64_t V, char* dst, int64_t R,
                            int64_t row_units, int64_t sp, int64_t dp) {
  // dst row i (dp units apart) = src row ids[i] / div (ids null: row i; sp units apart); an id outside [0, V) yields
  // a NaN-patterned row (V > 0 only)
  Q3VL_GRID_LOOP(e, R * row_units) {
    const int64_t i = e / row_units, u = e % row_units;
    const int64_t r = ids ? int64_t(ids[i]) / div : i;
    U* d = reinterpret_cast<U*>(dst) + i * dp + u;
    if (V > 0 && (r < 0 || r >= V)) {
      U bad;
      memset(&bad, 0xff, sizeof(U));  // all-ones: NaN in fp32, bf16 and fp16
      *d = bad;
    } else {
      *d = reinterpret_cast<const U*>(src)[r * sp + u];
    }
  }
}
// Rows of row_bytes, src_pitch and dst_pitch bytes apart (0: row_bytes).
void copy_rows(const Exec& x, const void* src, const int32_t* ids, int64_t div, int64_t V, void* dst, int64_t R,
               size_t row_bytes, size_t src_pitch = 0, size_t dst_pitch = 0) {
  if (R <= 0 || row_bytes == 0) return;
  src_pitch = src_pitch ? src_pitch : row_bytes, dst_pitch = dst_pitch ? dst_pitch : row_bytes;
  const uintptr_t al =
      reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | row_bytes | src_pitch | dst_pitch;
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const auto go = [&]<class U>() {
    const int64_t u = int64_t(row_bytes / sizeof(U)), sp = int64_t(src_pitch / sizeof(U));
    k_copy_rows<U><<<grid_for(R * u), 256, 0, stream_of(x)>>>(s, ids, div, V, d, R, u, sp,
                                                              int64_t(dst_pitch / sizeof(U)));
  };
  if (al % 16 == 0) go.template operator()<uint4>();
  else if (al % 4 == 0) go.template operator()<uint32_t>();
  else go.template operator()<uint16_t>();
  Q3VL_LAUNCHED();
}

template <class S>
__global__ void k_scatter_rows(const S* src, const int32_t* rows, S* dst, int64_t R, int64_t D, bool accumulate) {
  Q3VL_GRID_LOOP(e, R * D) {
    const int64_t i = e / D, j = e % D;
    if (rows[i] < 0) continue;
    const int64_t o = int64_t(rows[i]) * D + j;
    st(dst, o, accumulate ? ld(dst, o) + ld(src, e) : ld(src, e));
  }
}

// ---- embedding backward, deterministic ------------------------------------------------------------------------------
// The positions are stably sorted by id (CUB radix sort), so each id's positions form one run in increasing order;
// a thread per (run, column) then adds the run's dout rows into dtable[id] in exactly the reference's order, alone
// writing that element. O(N log N) whatever the repetition (image-pad ids repeat thousands of times).
__global__ void k_iota(int32_t* p, int64_t n) {
  Q3VL_GRID_LOOP(i, n) p[i] = int32_t(i);
}
template <class S>
__global__ void k_embedding_runs(const int32_t* __restrict__ id_of_run, const int32_t* __restrict__ run_len,
                                 const int32_t* __restrict__ run_start, const int32_t* __restrict__ num_runs,
                                 const int32_t* __restrict__ order, const S* __restrict__ dout, float* dtable,
                                 int64_t D) {
  const int64_t d = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (d >= D) return;
  const int32_t nr = *num_runs;
  for (int32_t r = blockIdx.x; r < nr; r += gridDim.x) {
    const int32_t v = id_of_run[r];
    if (v < 0) continue;
    const int32_t j0 = run_start[r], n = run_len[r];
    float acc = dtable[int64_t(v) * D + d];
    int32_t j = 0;
    for (; j + 16 <= n; j += 16) {  // 16 loads in flight, added in order
      float x[16];
#pragma unroll
      for (int u = 0; u < 16; ++u) x[u] = ld(dout, int64_t(order[j0 + j + u]) * D + d);
#pragma unroll
      for (int u = 0; u < 16; ++u) acc += x[u];
    }
    for (; j < n; ++j) acc += ld(dout, int64_t(order[j0 + j]) * D + d);
    dtable[int64_t(v) * D + d] = acc;
  }
}

// ---- vision position embedding --------------------------------------------------------------------------------------
// One axis of align_corners bilinear (cpu_ops.cpp axis_taps), in the same fp32 operations.
struct Taps {
  int32_t t0, t1;
  float w0, w1;
};
__device__ __forceinline__ Taps axis_taps(int64_t i, int64_t n, int64_t G) {
  const float src = float(i * (G - 1)) / float(n - 1 > 1 ? n - 1 : 1);
  const float fl = floorf(src);
  Taps t;
  t.t0 = int32_t(min(int64_t(fl), G - 1));
  t.t1 = int32_t(min(int64_t(fl) + 1, G - 1));
  t.w0 = fmaxf(0.f, 1.f - fabsf(src - fl - 0.f));
  t.w1 = fmaxf(0.f, 1.f - fabsf(src - fl - 1.f));
  return t;
}
// Patch p in (t, br, bc, ir, ic) order -> its image row and column.
__device__ __forceinline__ void patch_rc(int64_t p, int64_t h, int64_t w, int64_t merge, int64_t& row, int64_t& col) {
  const int64_t within = p % (h * w), bw = w / merge;
  const int64_t ic = within % merge, ir = (within / merge) % merge;
  const int64_t bc = (within / (merge * merge)) % bw, br = within / (merge * merge * bw);
  row = br * merge + ir;
  col = bc * merge + ic;
}

template <class S>
__global__ void k_pos_embed_fwd(const S* table, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w, int64_t merge,
                                S* out) {
  Q3VL_GRID_LOOP(e, t * h * w * D) {
    const int64_t p = e / D, d = e % D;
    int64_t r, c;
    patch_rc(p, h, w, merge, r, c);
    const Taps ty = axis_taps(r, h, G), tx = axis_taps(c, w, G);
    const int32_t yy[2] = {ty.t0, ty.t1}, xx[2] = {tx.t0, tx.t1};
    const float wy[2] = {ty.w0, ty.w1}, wx[2] = {tx.w0, tx.w1};
    float acc = 0.f;
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int b = 0; b < 2; ++b) acc += (wy[a] * wx[b]) * ld(table, (int64_t(yy[a]) * G + xx[b]) * D + d);
    st(out, e, ld(out, e) + acc);
  }
}

// Taps of every image row (ytaps[0..h)) and column (xtaps[0..w)), for the backward's gather.
__global__ void k_taps(Taps* ytaps, Taps* xtaps, int64_t h, int64_t w, int64_t G) {
  Q3VL_GRID_LOOP(i, h + w) {
    if (i < h) ytaps[i] = axis_taps(i, h, G);
    else xtaps[i - h] = axis_taps(i - h, w, G);
  }
}
// Taps are nondecreasing along an axis (src = i (G-1) / (n-1) and floor are monotone), so the image rows whose tap
// a is table row g form one range: yr[g*2 + a] = [first, last + 1) (empty: {0, 0}); likewise xr for columns.
__global__ void k_tap_ranges(const Taps* ytaps, const Taps* xtaps, int64_t h, int64_t w, int64_t G, int2* yr,
                             int2* xr) {
  Q3VL_GRID_LOOP(q, 4 * G) {
    const bool is_x = q >= 2 * G;
    const int64_t g = (q % (2 * G)) / 2, a = q % 2, n = is_x ? w : h;
    const Taps* t = is_x ? xtaps : ytaps;
    int lo = -1, hi = -1;
    for (int64_t i = 0; i < n; ++i)
      if ((a ? t[i].t1 : t[i].t0) == g) {
        if (lo < 0) lo = int(i);
        hi = int(i) + 1;
      }
    (is_x ? xr : yr)[g * 2 + a] = lo < 0 ? make_int2(0, 0) : make_int2(lo, hi);
  }
}
// Backward as a gather: block (table row g, 128-column chunk); each thread owns one column d and sums, in a fixed
// order, every (patch, tap) that reads table row g, then adds once into dtable (it alone writes it).
template <class S>
__global__ void k_pos_embed_bwd(const S* __restrict__ dout, const Taps* __restrict__ ytaps,
                                const Taps* __restrict__ xtaps, const int2* __restrict__ yr,
                                const int2* __restrict__ xr, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                                int64_t merge, float* dtable) {
  const int64_t d = blockIdx.y * int64_t(blockDim.x) + threadIdx.x;
  if (d >= D) return;
  const int64_t bw = w / merge, hw = h * w;
  for (int64_t g = blockIdx.x; g < G * G; g += gridDim.x) {
    const int64_t gy = g / G, gx = g % G;
    float acc = 0.f;
    for (int a = 0; a < 2; ++a) {
      const int2 ry = yr[gy * 2 + a];
      for (int iy = ry.x; iy < ry.y; ++iy) {
        const float wy = a ? ytaps[iy].w1 : ytaps[iy].w0;
        const int64_t br = iy / merge, ir = iy % merge;
        for (int b = 0; b < 2; ++b) {
          const int2 rx = xr[gx * 2 + b];
          for (int ix = rx.x; ix < rx.y; ++ix) {
            const float wgt = wy * (b ? xtaps[ix].w1 : xtaps[ix].w0);
            const int64_t within = ((br * bw + ix / merge) * merge + ir) * merge + ix % merge;
            for (int64_t tt = 0; tt < t; ++tt) acc += wgt * ld(dout, (tt * hw + within) * D + d);
          }
        }
      }
    }
    dtable[g * D + d] += acc;
  }
}

}  // namespace

// ---- public launchers -------------------------------------------------------------------------------------------------
void fill(const Exec& x, void* p, DType t, int64_t n, float value) {
  if (n <= 0) return;
  if (value == 0.f && !std::signbit(value)) {  // +0 is all zero bits in every dtype: a memset, at full bandwidth
    Q3VL_CU(cudaMemsetAsync(p, 0, size_t(n) * dtype_size(t), stream_of(x)));
    return;
  }
  if (t == DType::I32) return map(x, n, Fill{value}, static_cast<int32_t*>(p), false);
  if (t == DType::F64) return map(x, n, Fill{value}, static_cast<double*>(p), false);
  by_dtype(t, [&]<class S>() { map(x, n, Fill{value}, static_cast<S*>(p), false); });
}

void convert(const Exec& x, void* dst, DType dt_dst, const void* src, DType dt_src, int64_t n) {
  if (n <= 0) return;
  if (dt_dst == dt_src) {
    if (dst != src)
      Q3VL_CU(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(dt_src), cudaMemcpyDeviceToDevice, stream_of(x)));
    return;
  }
  by_dtype(dt_dst, [&]<class D>() {
    by_dtype(dt_src, [&]<class S>() { map(x, n, Copy{}, static_cast<D*>(dst), false, static_cast<const S*>(src)); });
  });
}

void axpy(const Exec& x, float alpha, const void* a, void* y, int64_t n, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() { map(x, n, Axpy{alpha}, static_cast<S*>(y), true, static_cast<const S*>(a)); });
}

void scale(const Exec& x, void* y, int64_t n, float alpha, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() { map(x, n, Scale{alpha}, static_cast<S*>(y), true); });
}

void dropout_fwd(const Exec& x, const void* in, void* y, int64_t n, double p, uint64_t key, int64_t first, DType dt) {
  if (n <= 0) return;
  const Dropout f{p, float(1 / (1 - p)), key, first, false};
  by_dtype(dt, [&]<class S>() { map(x, n, f, static_cast<S*>(y), false, static_cast<const S*>(in)); });
}
void dropout_bwd(const Exec& x, const void* dy, void* dx, int64_t n, double p, uint64_t key, int64_t first, DType dt) {
  if (n <= 0) return;
  const Dropout f{p, float(1 / (1 - p)), key, first, true};
  by_dtype(dt, [&]<class S>() { map(x, n, f, static_cast<S*>(dx), true, static_cast<const S*>(dy)); });
}

void gelu_tanh_fwd(const Exec& x, const void* in, void* y, int64_t n, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() { map(x, n, GeluTanhFwd{}, static_cast<S*>(y), false, static_cast<const S*>(in)); });
}
void gelu_tanh_bwd(const Exec& x, const void* dy, const void* in, void* din, int64_t n, bool accumulate, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() {
    map(x, n, GeluTanhBwd{}, static_cast<S*>(din), accumulate, static_cast<const S*>(dy), static_cast<const S*>(in));
  });
}
void gelu_erf_fwd(const Exec& x, const void* in, void* y, int64_t n, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() { map(x, n, GeluErfFwd{}, static_cast<S*>(y), false, static_cast<const S*>(in)); });
}
void gelu_erf_bwd(const Exec& x, const void* dy, const void* in, void* din, int64_t n, bool accumulate, DType dt) {
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() {
    map(x, n, GeluErfBwd{}, static_cast<S*>(din), accumulate, static_cast<const S*>(dy), static_cast<const S*>(in));
  });
}
void swiglu_fwd(const Exec& x, const void* gu, void* y, int64_t N, int64_t I, DType dt) {
  if (N * I <= 0) return;
  by_dtype(dt, [&]<class S>() {
    by_width<16 / sizeof(S)>(row_width<S>(I, {gu, y}), [&]<int W>() {
      launch_pdl(k_swiglu_fwd<S, W>, dim3(unsigned(grid_for(N * (I / W)))), 256, 0, stream_of(x),
                 static_cast<const S*>(gu), static_cast<S*>(y), N, I);
    });
  });
}
void swiglu_bwd(const Exec& x, const void* dy, const void* gu, void* dgu, int64_t N, int64_t I, bool accumulate,
                DType dt) {
  if (N * I <= 0) return;
  by_dtype(dt, [&]<class S>() {
    by_width<16 / sizeof(S)>(row_width<S>(I, {dy, gu, dgu}), [&]<int W>() {
      k_swiglu_bwd<S, W><<<grid_for(N * (I / W)), 256, 0, stream_of(x)>>>(
          static_cast<const S*>(dy), static_cast<const S*>(gu), static_cast<S*>(dgu), N, I, accumulate);
      Q3VL_LAUNCHED();
    });
  });
}

void rope_fwd(const Exec& x, void* q, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd,
              DType dt) {
  if (N * heads * (hd / 2) <= 0) return;
  by_dtype(dt, [&]<class S>() { rope<S>(x, q, cos, sin, N, heads, hd, 1.f); });
}
void rope_bwd(const Exec& x, void* dq, const float* cos, const float* sin, int64_t N, int64_t heads, int64_t hd,
              DType dt) {
  if (N * heads * (hd / 2) <= 0) return;
  by_dtype(dt, [&]<class S>() { rope<S>(x, dq, cos, sin, N, heads, hd, -1.f); });
}
void rope_table(const Exec& x, const int32_t* pos, int64_t N, int64_t W, const int* axis, const float* freq,
                float* cos, float* sin) {
  RopeCols c{};
  for (int64_t j = 0; j < W; ++j) c.axis[j] = int8_t(axis[j]), c.freq[j] = freq[j];
  const int64_t n = N * W;
  if (n) launch(k_rope_table, dim3(grid_for(n)), 256, 0, stream_of(x), pos, N, int(W), c, cos, sin);
}

void embedding_fwd(const Exec& x, const int32_t* ids, const void* table, void* out, int64_t N, int64_t D, int64_t V,
                   DType dt) {
  // No host check of the ids (they live on the device): an id outside [0, V) gives a NaN row.
  copy_rows(x, table, ids, 1, std::max<int64_t>(V, 1), out, N, size_t(D) * dtype_size(dt));
}

void embedding_bwd(const Exec& x, const int32_t* ids, const void* dout, float* dtable, int64_t N, int64_t D,
                   DType dt) {
  if (!dtable || N <= 0 || D <= 0) return;  // null: frozen
  Q3VL_CHECK(N < (int64_t(1) << 31), "embedding_bwd: too many positions");
  const auto s = stream_of(x);
  const int n = int(N);
  // Workspace: sorted ids, positions (in, sorted), run ids, run lengths, run starts, run count, CUB's scratch.
  const size_t arr = (size_t(N) * sizeof(int32_t) + 255) / 256 * 256;
  char* w = static_cast<char*>(x.ws);
  auto* keys = reinterpret_cast<int32_t*>(w);
  auto* pos_in = reinterpret_cast<int32_t*>(w + arr);
  auto* order = reinterpret_cast<int32_t*>(w + 2 * arr);
  auto* id_of_run = reinterpret_cast<int32_t*>(w + 3 * arr);
  auto* run_len = reinterpret_cast<int32_t*>(w + 4 * arr);
  auto* run_start = reinterpret_cast<int32_t*>(w + 5 * arr);
  auto* num_runs = reinterpret_cast<int32_t*>(w + 6 * arr);
  void* tmp = w + 6 * arr + 256;
  size_t t1 = 0, t2 = 0, t3 = 0;
  Q3VL_CU(cub::DeviceRadixSort::SortPairs(nullptr, t1, ids, keys, pos_in, order, n, 0, 32, s));
  Q3VL_CU(cub::DeviceRunLengthEncode::Encode(nullptr, t2, keys, id_of_run, run_len, num_runs, n, s));
  Q3VL_CU(cub::DeviceScan::ExclusiveSum(nullptr, t3, run_len, run_start, n, s));
  const size_t tb = std::max({t1, t2, t3});
  Q3VL_CHECK(6 * arr + 256 + tb <= x.ws_bytes, "embedding_bwd: workspace too small");
  k_iota<<<grid_for(N), 256, 0, s>>>(pos_in, N);
  Q3VL_LAUNCHED();
  Q3VL_CU(cudaMemsetAsync(run_len, 0, size_t(N) * sizeof(int32_t), s));  // the scan reads past the last run
  Q3VL_CU(cub::DeviceRadixSort::SortPairs(tmp, t1, ids, keys, pos_in, order, n, 0, 32, s));
  Q3VL_CU(cub::DeviceRunLengthEncode::Encode(tmp, t2, keys, id_of_run, run_len, num_runs, n, s));
  Q3VL_CU(cub::DeviceScan::ExclusiveSum(tmp, t3, run_len, run_start, n, s));
  const dim3 grid(unsigned(std::min<int64_t>(N, 8192)), unsigned((D + 255) / 256));
  by_dtype(dt, [&]<class S>() {
    k_embedding_runs<S><<<grid, 256, 0, s>>>(id_of_run, run_len, run_start, num_runs, order,
                                             static_cast<const S*>(dout), dtable, D);
    Q3VL_LAUNCHED();
  });
}

void gather_rows(const Exec& x, const void* src, const int32_t* rows, int64_t div, void* dst, int64_t R, int64_t D,
                 DType dt) {
  copy_rows(x, src, rows, div, 0, dst, R, size_t(D) * dtype_size(dt));
}

void copy_2d(const Exec& x, const void* src, int64_t lds, void* dst, int64_t ldd, int64_t rows, int64_t cols,
             DType dt) {
  const size_t e = dtype_size(dt);
  copy_rows(x, src, nullptr, 1, 0, dst, rows, size_t(cols) * e, size_t(lds) * e, size_t(ldd) * e);
}

void scatter_rows(const Exec& x, const void* src, const int32_t* rows, void* dst, int64_t R, int64_t D,
                  bool accumulate, DType dt) {
  if (R * D <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_scatter_rows<S><<<grid_for(R * D), 256, 0, stream_of(x)>>>(static_cast<const S*>(src), rows,
                                                                  static_cast<S*>(dst), R, D, accumulate);
    Q3VL_LAUNCHED();
  });
}

void pos_embed_fwd(const Exec& x, const void* table, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                   int64_t merge, void* out, DType dt) {
  Q3VL_CHECK(merge > 0 && h % merge == 0 && w % merge == 0, "pos_embed: grid not divisible by the merge size");
  const int64_t n = t * h * w * D;
  if (n <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_pos_embed_fwd<S><<<grid_for(n), 256, 0, stream_of(x)>>>(static_cast<const S*>(table), G, D, t, h, w, merge,
                                                               static_cast<S*>(out));
    Q3VL_LAUNCHED();
  });
}

void pos_embed_bwd(const Exec& x, const void* dout, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w,
                   int64_t merge, float* dtable, DType dt) {
  Q3VL_CHECK(merge > 0 && h % merge == 0 && w % merge == 0, "pos_embed: grid not divisible by the merge size");
  if (!dtable || t * h * w <= 0 || D <= 0 || G <= 0) return;  // null: frozen
  Q3VL_CHECK(size_t(h + w) * sizeof(Taps) + size_t(4 * G) * sizeof(int2) <= x.ws_bytes,
             "pos_embed_bwd: workspace too small for the tap tables");
  const auto s = stream_of(x);
  auto* ytaps = static_cast<Taps*>(x.ws);
  auto* xtaps = ytaps + h;
  auto* yr = reinterpret_cast<int2*>(xtaps + w);
  auto* xr = yr + 2 * G;
  k_taps<<<grid_for(h + w), 256, 0, s>>>(ytaps, xtaps, h, w, G);
  Q3VL_LAUNCHED();
  k_tap_ranges<<<grid_for(4 * G, 64), 64, 0, s>>>(ytaps, xtaps, h, w, G, yr, xr);
  Q3VL_LAUNCHED();
  const dim3 grid(unsigned(std::min<int64_t>(G * G, 65535)), unsigned((D + 127) / 128));
  by_dtype(dt, [&]<class S>() {
    k_pos_embed_bwd<S><<<grid, 128, 0, s>>>(static_cast<const S*>(dout), ytaps, xtaps, yr, xr, G, D, t, h, w, merge,
                                            dtable);
    Q3VL_LAUNCHED();
  });
}

}  // namespace q3vl::dev::cuda
