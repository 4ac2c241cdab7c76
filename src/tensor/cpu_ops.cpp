// CPU reference kernels: the truth that other backends are tested against. Plain loops plus BLAS GEMMs.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "q3vl/core/error.hpp"
#include "q3vl/tensor/ops.hpp"

namespace q3vl::ops {

// ---- GEMM -------------------------------------------------------------------------------------------------------
template <>
void gemm<float>(bool tA, bool tB, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                 const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_sgemm(CblasRowMajor, tA ? CblasTrans : CblasNoTrans, tB ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}
template <>
void gemm<double>(bool tA, bool tB, int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t lda,
                  const double* B, int64_t ldb, double beta, double* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  cblas_dgemm(CblasRowMajor, tA ? CblasTrans : CblasNoTrans, tB ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K,
              alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
}

// ---- linear -----------------------------------------------------------------------------------------------------
template <class T>
void linear_fwd(const T* x, const T* W, const T* b, T* y, int64_t N, int64_t in, int64_t out) {
  if (b)
    for (int64_t i = 0; i < N; ++i) std::copy(b, b + out, y + i * out);
  gemm<T>(false, true, N, out, in, T(1), x, in, W, in, b ? T(1) : T(0), y, out);
}

template <class T>
void linear_bwd(const T* dy, const T* x, const T* W, T* dx, T* dW, T* db, int64_t N, int64_t in, int64_t out) {
  if (dx) gemm<T>(false, false, N, in, out, T(1), dy, out, W, in, T(1), dx, in);
  if (dW && N > 0) gemm<T>(true, false, out, in, N, T(1), dy, out, x, in, T(1), dW, in);
  if (db)
    for (int64_t i = 0; i < N; ++i)
      for (int64_t o = 0; o < out; ++o) db[o] += dy[i * out + o];
}

// ---- weight-only int8 and fp8 ---------------------------------------------------------------------------------------
namespace {
// Row r's weights into q, given its largest magnitude.
void quantize_row_int8(const float* w, int64_t cols, float amax, int8_t* q, float& scale) {
  scale = amax / 127.0f;
  const float inv = amax > 0 ? 127.0f / amax : 0.0f;
  for (int64_t c = 0; c < cols; ++c) q[c] = (int8_t)std::clamp(std::lround(w[c] * inv), -127L, 127L);
}
void quantize_row_fp8(const float* w, int64_t cols, float amax, uint8_t* q, float& scale) {
  scale = amax / 448.0f;
  const bool zero = !(scale > 0);  // an all-zero row (or one whose scale underflows)
  for (int64_t c = 0; c < cols; ++c) q[c] = zero ? 0 : f32_to_fp8_e4m3(w[c] / scale);
}
}  // namespace

void quantize_rows(QFormat f, const float* W, int64_t rows, int64_t cols, void* q, float* scale) {
  if (f != QFormat::Int8 && f != QFormat::Fp8) fail("quantize_rows: the format is int8 or fp8");
  for (int64_t r = 0; r < rows; ++r) {
    const float* w = W + r * cols;
    float amax = 0;
    bool finite = true;  // std::max skips a NaN: it is looked for apart
    for (int64_t c = 0; c < cols; ++c) amax = std::max(amax, std::fabs(w[c])), finite = finite && std::isfinite(w[c]);
    if (!finite)
      fail(std::string("quantize (") + qformat_name(f) + "): row " + std::to_string(r) + " holds a non-finite weight");
    if (f == QFormat::Int8) quantize_row_int8(w, cols, amax, static_cast<int8_t*>(q) + r * cols, scale[r]);
    else quantize_row_fp8(w, cols, amax, static_cast<uint8_t*>(q) + r * cols, scale[r]);
  }
}

template <class S>
int64_t round_to(const float* W, int64_t n, S* out) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<S, Bf16>) out[i] = {f32_to_bf16(W[i])};
    else out[i] = {f32_to_f16(W[i])};
    if (!std::isfinite(widen(out[i]))) return i;  // not finite already, or fp16 overflow (rounded to infinity)
  }
  return -1;
}
template int64_t round_to<Bf16>(const float*, int64_t, Bf16*);
template int64_t round_to<Fp16>(const float*, int64_t, Fp16*);

// Rows of w widened per tile: 64 Ki elements of T, so a tile stays in cache while the GEMM reads it N times.
constexpr int64_t kLowpTileElems = 1 << 16;

// t = T(w): in blocks of a fixed 64 so that -O2's cheap vectorizer takes the loop (no remainder to handle).
template <class T, class S>
static void widen_rows(const S* __restrict w, T* __restrict t, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 64; ++j) t[i + j] = T(widen(w[i + j]));
  for (; i < n; ++i) t[i] = T(widen(w[i]));
}

template <class T, class S>
void linear_lowp_fwd(const T* x, const S* w, const float* scale, const T* b, T* y, int64_t N, int64_t in,
                     int64_t out) {
  if (N == 0 || out == 0) return;
  const int64_t R = std::clamp<int64_t>(kLowpTileElems / std::max<int64_t>(in, 1), 1, out);
  std::vector<T> tile(R * in);
  for (int64_t o0 = 0; o0 < out; o0 += R) {
    const int64_t n = std::min(R, out - o0);
    widen_rows(w + o0 * in, tile.data(), n * in);  // exact: every int8, fp8, bf16 and fp16 value is a float
    gemm<T>(false, true, N, n, in, T(1), x, in, tile.data(), in, T(0), y + o0, out);
  }
  if (!scale && !b) return;
  for (int64_t i = 0; i < N; ++i) {
    T* yi = y + i * out;
    for (int64_t o = 0; o < out; ++o) yi[o] = yi[o] * (scale ? T(scale[o]) : T(1)) + (b ? b[o] : T(0));
  }
}

template <class T, class S>
void embedding_lowp_fwd(const int64_t* ids, const S* w, const float* scale, T* out, int64_t N, int64_t D,
                        int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    if (ids[i] < 0 || ids[i] >= V)
      fail("embedding: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
           " outside vocabulary [0," + std::to_string(V) + ")");
    const S* r = w + ids[i] * D;
    const T s = scale ? T(scale[ids[i]]) : T(1);
    for (int64_t d = 0; d < D; ++d) out[i * D + d] = T(widen(r[d])) * s;
  }
}

// ---- LayerNorm --------------------------------------------------------------------------------------------------
template <class T>
void layernorm_fwd(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int64_t N, int64_t D, double eps) {
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * D;
    T mu = 0;
    for (int64_t d = 0; d < D; ++d) mu += xi[d];
    mu /= T(D);
    T var = 0;
    for (int64_t d = 0; d < D; ++d) var += (xi[d] - mu) * (xi[d] - mu);
    var /= T(D);  // biased variance, as torch
    T r = T(1) / std::sqrt(var + T(eps));
    for (int64_t d = 0; d < D; ++d) y[i * D + d] = (xi[d] - mu) * r * w[d] + b[d];
    mean[i] = mu;
    rstd[i] = r;
  }
}

template <class T>
void layernorm_bwd(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, T* dx, T* dw, T* db, int64_t N,
                   int64_t D) {
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * D;
    const T* gi = dy + i * D;
    T a = 0, c = 0;  // mean(g*w), mean(g*w*xhat)
    for (int64_t d = 0; d < D; ++d) {
      T xh = (xi[d] - mean[i]) * rstd[i];
      T gw = gi[d] * w[d];
      a += gw;
      c += gw * xh;
      if (dw) dw[d] += gi[d] * xh;  // null: frozen
      if (db) db[d] += gi[d];
    }
    a /= T(D);
    c /= T(D);
    if (dx)
      for (int64_t d = 0; d < D; ++d) {
        T xh = (xi[d] - mean[i]) * rstd[i];
        dx[i * D + d] += rstd[i] * (gi[d] * w[d] - a - xh * c);
      }
  }
}

// ---- RMSNorm ----------------------------------------------------------------------------------------------------
template <class T>
void rmsnorm_fwd(const T* x, const T* w, T* y, T* rstd, int64_t N, int64_t D, double eps) {
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * D;
    T ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += xi[d] * xi[d];
    T r = T(1) / std::sqrt(ss / T(D) + T(eps));
    for (int64_t d = 0; d < D; ++d) y[i * D + d] = w[d] * (xi[d] * r);
    rstd[i] = r;
  }
}

template <class T>
void rmsnorm_bwd(const T* dy, const T* x, const T* w, const T* rstd, T* dx, T* dw, int64_t N, int64_t D) {
  for (int64_t i = 0; i < N; ++i) {
    const T* xi = x + i * D;
    const T* gi = dy + i * D;
    T r = rstd[i], c = 0;
    for (int64_t d = 0; d < D; ++d) {
      c += gi[d] * w[d] * xi[d];
      if (dw) dw[d] += gi[d] * xi[d] * r;  // null: frozen
    }
    c *= r * r * r / T(D);
    if (dx)
      for (int64_t d = 0; d < D; ++d) dx[i * D + d] += gi[d] * w[d] * r - xi[d] * c;
  }
}

// ---- activations ------------------------------------------------------------------------------------------------
namespace {
template <class T> constexpr T kSqrt2OverPi = T(0.7978845608028654);
template <class T> constexpr T kInvSqrt2 = T(0.7071067811865476);
template <class T> constexpr T kInvSqrt2Pi = T(0.3989422804014327);
}  // namespace

template <class T>
void gelu_tanh_fwd(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    y[i] = T(0.5) * v * (T(1) + std::tanh(kSqrt2OverPi<T> * (v + T(0.044715) * v * v * v)));
  }
}
template <class T>
void gelu_tanh_bwd(const T* dy, const T* x, T* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    T t = std::tanh(kSqrt2OverPi<T> * (v + T(0.044715) * v * v * v));
    T g = T(0.5) * (T(1) + t) + T(0.5) * v * (T(1) - t * t) * kSqrt2OverPi<T> * (T(1) + T(3 * 0.044715) * v * v);
    dx[i] += dy[i] * g;
  }
}
template <class T>
void gelu_erf_fwd(const T* x, T* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = T(0.5) * x[i] * (T(1) + std::erf(x[i] * kInvSqrt2<T>));
}
template <class T>
void gelu_erf_bwd(const T* dy, const T* x, T* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    T v = x[i];
    T g = T(0.5) * (T(1) + std::erf(v * kInvSqrt2<T>)) + v * std::exp(T(-0.5) * v * v) * kInvSqrt2Pi<T>;
    dx[i] += dy[i] * g;
  }
}

template <class T>
void swiglu_fwd(const T* gu, T* y, int64_t N, int64_t I) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      T g = gu[i * 2 * I + j], u = gu[i * 2 * I + I + j];
      y[i * I + j] = g / (T(1) + std::exp(-g)) * u;
    }
}
template <class T>
void swiglu_bwd(const T* dy, const T* gu, T* dgu, int64_t N, int64_t I) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < I; ++j) {
      T g = gu[i * 2 * I + j], u = gu[i * 2 * I + I + j];
      T s = T(1) / (T(1) + std::exp(-g));
      T d = dy[i * I + j];
      dgu[i * 2 * I + j] += d * u * s * (T(1) + g * (T(1) - s));
      dgu[i * 2 * I + I + j] += d * g * s;
    }
}

// ---- rotary -----------------------------------------------------------------------------------------------------
template <class T>
static void rope_apply(T* x, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t hd, T sign) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      T* xi = x + (i * heads + h) * hd;
      const T* c = cos + i * half;
      const T* s = sin + i * half;
      for (int64_t d = 0; d < half; ++d) {
        T a = xi[d], b = xi[d + half];
        xi[d] = a * c[d] - sign * b * s[d];
        xi[d + half] = b * c[d] + sign * a * s[d];
      }
    }
}
template <class T>
void rope_fwd(T* x, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t hd) {
  rope_apply(x, cos, sin, N, heads, hd, T(1));
}
template <class T>
void rope_bwd(T* dx, const T* cos, const T* sin, int64_t N, int64_t heads, int64_t hd) {
  rope_apply(dx, cos, sin, N, heads, hd, T(-1));
}

// HF computes inv_freq = 1 / theta ** (arange(0, dim, 2) / dim) and the angles in fp32; so do we.
static std::vector<float> inv_freq(double theta, int64_t dim) {
  std::vector<float> f(dim / 2);
  for (int64_t j = 0; j < dim / 2; ++j)
    f[j] = 1.0f / std::pow((float)theta, (float)(2 * j) / (float)dim);
  return f;
}

void mrope_cols(int64_t hd, double theta, const int* section, int* axis, float* freq) {
  const auto inv = inv_freq(theta, hd);
  for (int64_t j = 0; j < hd / 2; ++j) {
    axis[j] = 0;  // interleaved: H at j%3==1, W at j%3==2 within their sections, T elsewhere
    if (j % 3 == 1 && j < 3 * section[1]) axis[j] = 1;
    if (j % 3 == 2 && j < 3 * section[2]) axis[j] = 2;
    freq[j] = inv[j];
  }
}
void vision_rope_cols(int64_t hd, int* axis, float* freq) {
  const int64_t q = hd / 4;  // frequencies per axis
  const auto inv = inv_freq(10000.0, hd / 2);
  for (int64_t j = 0; j < 2 * q; ++j) axis[j] = int(j / q), freq[j] = inv[j % q];
}
template <class T, class P>
void rope_table(const P* pos, int64_t N, int64_t W, const int* axis, const float* freq, T* cos, T* sin) {
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < W; ++c) {
      const float f = (float)pos[axis[c] * N + i] * freq[c];
      cos[i * W + c] = std::cos(f);
      sin[i * W + c] = std::sin(f);
    }
}
template void rope_table<float, int64_t>(const int64_t*, int64_t, int64_t, const int*, const float*, float*, float*);
template void rope_table<float, int32_t>(const int32_t*, int64_t, int64_t, const int*, const float*, float*, float*);

template <class T>
void vision_rope_table(const int64_t* row, const int64_t* col, int64_t N, int64_t hd, T* cos, T* sin) {
  std::vector<int64_t> pos(row, row + N);
  pos.insert(pos.end(), col, col + N);
  std::vector<int> axis(hd / 2);
  std::vector<float> freq(hd / 2);
  vision_rope_cols(hd, axis.data(), freq.data());
  rope_table(pos.data(), N, hd / 2, axis.data(), freq.data(), cos, sin);
}

template <class T>
void mrope_table(const int64_t* pos3, int64_t N, int64_t hd, double theta, const int* section, T* cos, T* sin) {
  std::vector<int> axis(hd / 2);
  std::vector<float> freq(hd / 2);
  mrope_cols(hd, theta, section, axis.data(), freq.data());
  rope_table(pos3, N, hd / 2, axis.data(), freq.data(), cos, sin);
}

// ---- attention --------------------------------------------------------------------------------------------------
template <class T>
void attention_fwd(const T* q, const T* k, const T* v, T* out, T* lse, const int64_t* cu, int64_t nseg, int64_t nh,
                   int64_t nkv, int64_t hd, bool causal, T scale) {
  Q3VL_CHECK(nkv > 0 && nh % nkv == 0, "attention: heads must be a multiple of kv heads");
  const int64_t B = kAttnBlock, ldq = nh * hd, ldk = nkv * hd, grp = nh / nkv;
  const T ninf = -std::numeric_limits<T>::infinity();
  std::vector<T> S(B * B), acc(B * hd), m(B), l(B);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t b0 = cu[s], L = cu[s + 1] - cu[s];
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kh = h / grp;
      const T* Q = q + b0 * ldq + h * hd;
      const T* K = k + b0 * ldk + kh * hd;
      const T* Vv = v + b0 * ldk + kh * hd;
      for (int64_t i0 = 0; i0 < L; i0 += B) {
        const int64_t bi = std::min(B, L - i0);
        std::fill(m.begin(), m.end(), ninf);
        std::fill(l.begin(), l.end(), T(0));
        std::fill(acc.begin(), acc.end(), T(0));
        const int64_t jend = causal ? i0 + bi : L;
        for (int64_t j0 = 0; j0 < jend; j0 += B) {
          const int64_t bj = std::min(B, jend - j0);
          gemm<T>(false, true, bi, bj, hd, scale, Q + i0 * ldq, ldq, K + j0 * ldk, ldk, T(0), S.data(), bj);
          for (int64_t r = 0; r < bi; ++r) {
            T* Sr = S.data() + r * bj;
            const int64_t cmax = causal ? std::min(bj, i0 + r - j0 + 1) : bj;  // keys <= query
            T mx = m[r];
            for (int64_t c = 0; c < cmax; ++c) mx = std::max(mx, Sr[c]);
            const T alpha = (m[r] == ninf) ? T(0) : std::exp(m[r] - mx);
            T sum = 0;
            for (int64_t c = 0; c < bj; ++c) {
              Sr[c] = c < cmax ? std::exp(Sr[c] - mx) : T(0);
              sum += Sr[c];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
            for (int64_t d = 0; d < hd; ++d) acc[r * hd + d] *= alpha;
          }
          gemm<T>(false, false, bi, hd, bj, T(1), S.data(), bj, Vv + j0 * ldk, ldk, T(1), acc.data(), hd);
        }
        for (int64_t r = 0; r < bi; ++r) {
          T* o = out + (b0 + i0 + r) * ldq + h * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = acc[r * hd + d] / l[r];
          lse[(b0 + i0 + r) * nh + h] = m[r] + std::log(l[r]);
        }
      }
    }
  }
}

template <class T>
void attention_bwd(const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse, T* dq, T* dk, T* dv,
                   const int64_t* cu, int64_t nseg, int64_t nh, int64_t nkv, int64_t hd, bool causal, T scale) {
  const int64_t B = kAttnBlock, ldq = nh * hd, ldk = nkv * hd, grp = nh / nkv;
  std::vector<T> P(B * B), dP(B * B), Dr(B);
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t b0 = cu[s], L = cu[s + 1] - cu[s];
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kh = h / grp;
      const int64_t qo = b0 * ldq + h * hd, ko = b0 * ldk + kh * hd;
      for (int64_t i0 = 0; i0 < L; i0 += B) {
        const int64_t bi = std::min(B, L - i0);
        for (int64_t r = 0; r < bi; ++r) {  // D = rowsum(dO * O)
          const T* g = dout + qo + (i0 + r) * ldq;
          const T* o = out + qo + (i0 + r) * ldq;
          T acc = 0;
          for (int64_t d = 0; d < hd; ++d) acc += g[d] * o[d];
          Dr[r] = acc;
        }
        const int64_t jend = causal ? i0 + bi : L;
        for (int64_t j0 = 0; j0 < jend; j0 += B) {
          const int64_t bj = std::min(B, jend - j0);
          gemm<T>(false, true, bi, bj, hd, scale, q + qo + i0 * ldq, ldq, k + ko + j0 * ldk, ldk, T(0), P.data(), bj);
          gemm<T>(false, true, bi, bj, hd, T(1), dout + qo + i0 * ldq, ldq, v + ko + j0 * ldk, ldk, T(0), dP.data(),
                  bj);
          for (int64_t r = 0; r < bi; ++r) {
            const T ls = lse[(b0 + i0 + r) * nh + h];
            const int64_t cmax = causal ? std::min(bj, i0 + r - j0 + 1) : bj;
            for (int64_t c = 0; c < bj; ++c) {
              T p = c < cmax ? std::exp(P[r * bj + c] - ls) : T(0);
              P[r * bj + c] = p;
              dP[r * bj + c] = p * (dP[r * bj + c] - Dr[r]) * scale;  // dS, pre-scaled
            }
          }
          gemm<T>(true, false, bj, hd, bi, T(1), P.data(), bj, dout + qo + i0 * ldq, ldq, T(1), dv + ko + j0 * ldk,
                  ldk);
          gemm<T>(false, false, bi, hd, bj, T(1), dP.data(), bj, k + ko + j0 * ldk, ldk, T(1), dq + qo + i0 * ldq, ldq);
          gemm<T>(true, false, bj, hd, bi, T(1), dP.data(), bj, q + qo + i0 * ldq, ldq, T(1), dk + ko + j0 * ldk, ldk);
        }
      }
    }
  }
}

template <class T>
void attention_ref(const T* q, const T* k, const T* v, T* out, const int64_t* cu, int64_t nseg, int64_t nh,
                   int64_t nkv, int64_t hd, bool causal, T scale) {
  const int64_t ldq = nh * hd, ldk = nkv * hd, grp = nh / nkv;
  for (int64_t s = 0; s < nseg; ++s) {
    const int64_t b0 = cu[s], L = cu[s + 1] - cu[s];
    std::vector<T> S(L * L);
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t kh = h / grp;
      for (int64_t i = 0; i < L; ++i) {
        const int64_t n = causal ? i + 1 : L;
        T mx = -std::numeric_limits<T>::infinity(), sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          T acc = 0;
          for (int64_t d = 0; d < hd; ++d) acc += q[(b0 + i) * ldq + h * hd + d] * k[(b0 + j) * ldk + kh * hd + d];
          S[i * L + j] = acc * scale;
          mx = std::max(mx, S[i * L + j]);
        }
        for (int64_t j = 0; j < n; ++j) sum += (S[i * L + j] = std::exp(S[i * L + j] - mx));
        for (int64_t d = 0; d < hd; ++d) {
          T acc = 0;
          for (int64_t j = 0; j < n; ++j) acc += S[i * L + j] * v[(b0 + j) * ldk + kh * hd + d];
          out[(b0 + i) * ldq + h * hd + d] = acc / sum;
        }
      }
    }
  }
}

// ---- embedding --------------------------------------------------------------------------------------------------
template <class T>
void embedding_fwd(const int64_t* ids, const T* table, T* out, int64_t N, int64_t D, int64_t V) {
  for (int64_t i = 0; i < N; ++i) {
    if (ids[i] < 0 || ids[i] >= V)
      fail("embedding: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
           " outside vocabulary [0," + std::to_string(V) + ")");
    std::copy(table + ids[i] * D, table + (ids[i] + 1) * D, out + i * D);
  }
}
template <class T>
void embedding_bwd(const int64_t* ids, const T* dout, T* dtable, int64_t N, int64_t D) {
  if (!dtable) return;  // frozen
  for (int64_t i = 0; i < N; ++i)
    for (int64_t d = 0; d < D; ++d) dtable[ids[i] * D + d] += dout[i * D + d];
}

// ---- cross-entropy ----------------------------------------------------------------------------------------------
template <class T>
double cross_entropy(const T* logits, const int64_t* target, T* loss, T* dlogits, int64_t N, int64_t V, T scale) {
  double total = 0;
  for (int64_t i = 0; i < N; ++i) {
    const T* x = logits + i * V;
    if (target[i] == -100) {
      if (loss) loss[i] = 0;
      continue;
    }
    if (target[i] < 0 || target[i] >= V)
      fail("cross_entropy: target " + std::to_string(target[i]) + " at row " + std::to_string(i) +
           " outside vocabulary [0," + std::to_string(V) + ")");
    T mx = *std::max_element(x, x + V);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - mx);
    const T lse = mx + std::log(sum);
    const T li = lse - x[target[i]];
    if (loss) loss[i] = li;
    total += (double)li;
    if (dlogits) {
      T* g = dlogits + i * V;
      for (int64_t j = 0; j < V; ++j) g[j] += scale * std::exp(x[j] - lse);
      g[target[i]] -= scale;
    }
  }
  return total;
}

// ---- MoE router -------------------------------------------------------------------------------------------------
template <class T>
void router_fwd(const T* logits, T* probs, int64_t* idx, T* w, int64_t N, int64_t E, int64_t k) {
  Q3VL_CHECK(k >= 1 && k <= E, "router: experts_per_tok must be in [1, num_experts]");
  std::vector<char> taken(E);
  for (int64_t i = 0; i < N; ++i) {
    const T* z = logits + i * E;
    T* p = probs + i * E;
    T mx = *std::max_element(z, z + E), sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(z[e] - mx));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    T sel = 0;
    for (int64_t j = 0; j < k; ++j) {  // strict '>' keeps the lower index on ties, as torch.topk
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      idx[i * k + j] = best;
      sel += p[best];
    }
    for (int64_t j = 0; j < k; ++j) w[i * k + j] = p[idx[i * k + j]] / sel;
  }
}

template <class T>
void router_bwd(const T* dw, const T* probs, const int64_t* idx, T* dlogits, int64_t N, int64_t E, int64_t k) {
  std::vector<T> dp(E);
  for (int64_t i = 0; i < N; ++i) {
    const T* p = probs + i * E;
    T sel = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) sel += p[idx[i * k + j]];
    for (int64_t j = 0; j < k; ++j) dot += dw[i * k + j] * p[idx[i * k + j]] / sel;
    std::fill(dp.begin(), dp.end(), T(0));
    for (int64_t j = 0; j < k; ++j) dp[idx[i * k + j]] = (dw[i * k + j] - dot) / sel;
    T pdp = 0;
    for (int64_t j = 0; j < k; ++j) pdp += p[idx[i * k + j]] * dp[idx[i * k + j]];
    for (int64_t e = 0; e < E; ++e) dlogits[i * E + e] += p[e] * (dp[e] - pdp);
  }
}

template <class T>
double aux_loss_fwd(const T* probs, const int64_t* idx, int64_t N, int64_t E, int64_t k, T* f) {
  if (N == 0) return 0;
  std::vector<double> cnt(E, 0.0), pm(E, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t j = 0; j < k; ++j) cnt[idx[i * k + j]] += 1;
    for (int64_t e = 0; e < E; ++e) pm[e] += probs[i * E + e];
  }
  double aux = 0;
  for (int64_t e = 0; e < E; ++e) {
    f[e] = T(cnt[e] / N);
    aux += (double)f[e] * (pm[e] / N);
  }
  return aux * E;
}

template <class T>
void aux_loss_bwd(const T* probs, const T* f, T coef, T* dlogits, int64_t N, int64_t E) {
  if (N == 0) return;
  std::vector<T> g(E);  // d aux / d probs[r, e] = E f_e / N
  for (int64_t e = 0; e < E; ++e) g[e] = coef * T(E) * f[e] / T(N);
  for (int64_t i = 0; i < N; ++i) {
    const T* p = probs + i * E;
    T pg = 0;
    for (int64_t e = 0; e < E; ++e) pg += p[e] * g[e];
    for (int64_t e = 0; e < E; ++e) dlogits[i * E + e] += p[e] * (g[e] - pg);
  }
}

// ---- vision position embedding ----------------------------------------------------------------------------------
namespace {
// One axis of align_corners bilinear: src = i*(G-1)/max(n-1,1) in fp32; taps floor, floor+1 (clamped).
void axis_taps(int64_t i, int64_t n, int64_t G, int64_t tap[2], float wt[2]) {
  float src = (float)(i * (G - 1)) / (float)std::max<int64_t>(n - 1, 1);
  float fl = std::floor(src);
  for (int o = 0; o < 2; ++o) {
    tap[o] = std::min<int64_t>((int64_t)fl + o, G - 1);
    wt[o] = std::max(0.0f, 1.0f - std::fabs(src - fl - (float)o));
  }
}
// Patch order (t, br, bc, ir, ic) -> the four table rows and weights.
void patch_taps(int64_t p, int64_t h, int64_t w, int64_t merge, int64_t G, int64_t idx[4], float wt[4]) {
  const int64_t within = p % (h * w), bw = w / merge;
  const int64_t ic = within % merge, ir = (within / merge) % merge;
  const int64_t bc = (within / (merge * merge)) % bw, br = within / (merge * merge * bw);
  int64_t ty[2], tx[2];
  float wy[2], wx[2];
  axis_taps(br * merge + ir, h, G, ty, wy);
  axis_taps(bc * merge + ic, w, G, tx, wx);
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 2; ++b) {
      idx[a * 2 + b] = ty[a] * G + tx[b];
      wt[a * 2 + b] = wy[a] * wx[b];
    }
}
}  // namespace

template <class T>
void pos_embed_fwd(const T* table, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w, int64_t merge, T* out) {
  Q3VL_CHECK(h % merge == 0 && w % merge == 0, "pos_embed: grid not divisible by the merge size");
  for (int64_t p = 0; p < t * h * w; ++p) {
    int64_t idx[4];
    float wt[4];
    patch_taps(p, h, w, merge, G, idx, wt);
    for (int64_t d = 0; d < D; ++d) {
      T acc = 0;
      for (int c = 0; c < 4; ++c) acc += T(wt[c]) * table[idx[c] * D + d];
      out[p * D + d] += acc;
    }
  }
}
template <class T>
void pos_embed_bwd(const T* dout, int64_t G, int64_t D, int64_t t, int64_t h, int64_t w, int64_t merge, T* dtable) {
  if (!dtable) return;  // frozen
  for (int64_t p = 0; p < t * h * w; ++p) {
    int64_t idx[4];
    float wt[4];
    patch_taps(p, h, w, merge, G, idx, wt);
    for (int c = 0; c < 4; ++c)
      for (int64_t d = 0; d < D; ++d) dtable[idx[c] * D + d] += T(wt[c]) * dout[p * D + d];
  }
}

// ---- instantiations ---------------------------------------------------------------------------------------------
#define Q3VL_LOWP_INST(T, S)                                                                                        \
  template void linear_lowp_fwd<T, S>(const T*, const S*, const float*, const T*, T*, int64_t, int64_t, int64_t);  \
  template void embedding_lowp_fwd<T, S>(const int64_t*, const S*, const float*, T*, int64_t, int64_t, int64_t);
#define Q3VL_OPS_INST(T)                                                                                            \
  template void linear_fwd<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t);                       \
  template void linear_bwd<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, int64_t);               \
  Q3VL_LOWP_INST(T, int8_t)                                                                                       \
  Q3VL_LOWP_INST(T, Fp8E4M3)                                                                                      \
  Q3VL_LOWP_INST(T, Bf16)                                                                                         \
  Q3VL_LOWP_INST(T, Fp16)                                                                                         \
  template void layernorm_fwd<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double);             \
  template void layernorm_bwd<T>(const T*, const T*, const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t); \
  template void rmsnorm_fwd<T>(const T*, const T*, T*, T*, int64_t, int64_t, double);                             \
  template void rmsnorm_bwd<T>(const T*, const T*, const T*, const T*, T*, T*, int64_t, int64_t);                 \
  template void gelu_tanh_fwd<T>(const T*, T*, int64_t);                                                          \
  template void gelu_tanh_bwd<T>(const T*, const T*, T*, int64_t);                                                \
  template void gelu_erf_fwd<T>(const T*, T*, int64_t);                                                           \
  template void gelu_erf_bwd<T>(const T*, const T*, T*, int64_t);                                                 \
  template void swiglu_fwd<T>(const T*, T*, int64_t, int64_t);                                                    \
  template void swiglu_bwd<T>(const T*, const T*, T*, int64_t, int64_t);                                          \
  template void rope_fwd<T>(T*, const T*, const T*, int64_t, int64_t, int64_t);                                   \
  template void rope_bwd<T>(T*, const T*, const T*, int64_t, int64_t, int64_t);                                   \
  template void vision_rope_table<T>(const int64_t*, const int64_t*, int64_t, int64_t, T*, T*);                   \
  template void mrope_table<T>(const int64_t*, int64_t, int64_t, double, const int*, T*, T*);                     \
  template void attention_fwd<T>(const T*, const T*, const T*, T*, T*, const int64_t*, int64_t, int64_t, int64_t, \
                                 int64_t, bool, T);                                                               \
  template void attention_bwd<T>(const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, T*,          \
                                 const int64_t*, int64_t, int64_t, int64_t, int64_t, bool, T);                    \
  template void attention_ref<T>(const T*, const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t,     \
                                 int64_t, bool, T);                                                               \
  template void embedding_fwd<T>(const int64_t*, const T*, T*, int64_t, int64_t, int64_t);                        \
  template void embedding_bwd<T>(const int64_t*, const T*, T*, int64_t, int64_t);                                 \
  template double cross_entropy<T>(const T*, const int64_t*, T*, T*, int64_t, int64_t, T);                        \
  template void router_fwd<T>(const T*, T*, int64_t*, T*, int64_t, int64_t, int64_t);                             \
  template void router_bwd<T>(const T*, const T*, const int64_t*, T*, int64_t, int64_t, int64_t);                 \
  template double aux_loss_fwd<T>(const T*, const int64_t*, int64_t, int64_t, int64_t, T*);                       \
  template void aux_loss_bwd<T>(const T*, const T*, T, T*, int64_t, int64_t);                                     \
  template void pos_embed_fwd<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, T*);             \
  template void pos_embed_bwd<T>(const T*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, T*);

Q3VL_OPS_INST(float)
Q3VL_OPS_INST(double)
#undef Q3VL_OPS_INST

}  // namespace q3vl::ops
