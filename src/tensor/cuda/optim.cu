// AdamW on fp32 shards (with the parameter copy in the compute dtype in the same pass) and the sum-of-squares
// reduction behind the gradient norm.
#include <algorithm>
#include <cmath>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

// dev::adamw's CPU reference (src/tensor/dev_cpu.cpp) element for element: the constants come from the host in the same double
// arithmetic, and the explicit _rn intrinsics keep nvcc from fusing into FMAs, so the result is bitwise the
// reference's (which the host compiler builds without FMA contraction on plain x86-64).
struct AdamWConst {
  float b1, omb1, b2, omb2, step, sqrt_bc2, eps, decay, gs;
};
__device__ __forceinline__ void adamw_el(float& p, float g, float& m, float& v, const AdamWConst& c) {
  const float gi = __fmul_rn(g, c.gs);
  m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.omb1, gi));
  v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.omb2, gi), gi));
  const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_bc2), c.eps);
  p = __fsub_rn(__fmul_rn(p, c.decay), __fdiv_rn(__fmul_rn(c.step, m), den));
}
// Four updated parameters into the copy at o: st() rounds each as convert's kernel does; one 4-element store where o
// is aligned to it (vec), else one store each.
template <class O> struct alignas(4 * sizeof(O)) Four { O e[4]; };
template <class O> __device__ __forceinline__ void put4(O* o, const float4& P, bool vec) {
  Four<O> w;
  st(w.e, 0, P.x), st(w.e, 1, P.y), st(w.e, 2, P.z), st(w.e, 3, P.w);
  if (vec) *reinterpret_cast<Four<O>*>(o) = w;
  else o[0] = w.e[0], o[1] = w.e[1], o[2] = w.e[2], o[3] = w.e[3];
}
// Elements [head, head + 4 nv) as float4 (16-byte loads: the four arrays equally aligned there), the head and the
// tail past them one at a time. Scalar loads left the 30B-A3B's optimizer pass at 2.1 TB/s. out (may be null): the
// parameter copy, written from the registers (out_vec: aligned as the masters are).
template <class O>
__global__ void k_adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                        float* __restrict__ v, O* __restrict__ out, bool out_vec, int64_t n, int64_t head,
                        AdamWConst c, const int32_t* __restrict__ skip) {
  if (skip && *skip) return;
  const int64_t nv = (n - head) / 4, t0 = head + 4 * nv;
  const int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  float4* p4 = reinterpret_cast<float4*>(p + head);
  const float4* g4 = reinterpret_cast<const float4*>(g + head);
  float4* m4 = reinterpret_cast<float4*>(m + head);
  float4* v4 = reinterpret_cast<float4*>(v + head);
  for (int64_t i = id; i < nv; i += stride) {
    float4 P = p4[i], M = m4[i], V = v4[i];
    const float4 G = __ldcs(g4 + i);
    adamw_el(P.x, G.x, M.x, V.x, c), adamw_el(P.y, G.y, M.y, V.y, c);
    adamw_el(P.z, G.z, M.z, V.z, c), adamw_el(P.w, G.w, M.w, V.w, c);
    p4[i] = P, m4[i] = M, v4[i] = V;
    if (out) put4(out + head + 4 * i, P, out_vec);
  }
  for (int64_t j = id; j < head + (n - t0); j += stride) {  // the head's elements, then the tail's
    const int64_t i = j < head ? j : t0 + (j - head);
    adamw_el(p[i], g[i], m[i], v[i], c);
    if (out) st(out, i, p[i]);
  }
}

__device__ __forceinline__ void sumsq_add(float x, double& acc, int32_t& bad) {
  if (isfinite(x)) acc += double(x) * double(x);
  else ++bad;
}
// A thread's share of the elements (first id, then every stride-th): one at a time in 16-bit storage; fp32 as
// float4 over [head, head + 4 nv) (16-byte aligned there), its head and tail one at a time, as k_adamw reads them
// (scalar loads: 2.36 TB/s over the 30B-A3B's gradients).
template <class S>
__device__ __forceinline__ void sumsq_share(const S* a, int64_t n, int64_t, int64_t id, int64_t stride, double& acc,
                                            int32_t& bad) {
  for (int64_t i = id; i < n; i += stride) sumsq_add(ld(a, i), acc, bad);
}
__device__ __forceinline__ void sumsq_share(const float* a, int64_t n, int64_t head, int64_t id, int64_t stride,
                                            double& acc, int32_t& bad) {
  const int64_t nv = (n - head) / 4, t0 = head + 4 * nv;
  const float4* a4 = reinterpret_cast<const float4*>(a + head);
  for (int64_t i = id; i < nv; i += stride) {
    const float4 q = a4[i];
    sumsq_add(q.x, acc, bad), sumsq_add(q.y, acc, bad), sumsq_add(q.z, acc, bad), sumsq_add(q.w, acc, bad);
  }
  for (int64_t j = id; j < head + (n - t0); j += stride) sumsq_add(a[j < head ? j : t0 + (j - head)], acc, bad);
}

// Per-block partial sums of squares (double, finite elements only) and non-finite counts.
template <class S>
__global__ void k_sumsq_part(const S* __restrict__ a, int64_t n, int64_t head, double* psum, int32_t* pbad) {
  __shared__ double ss[256];
  __shared__ int32_t sb[256];
  double acc = 0;
  int32_t bad = 0;
  sumsq_share(a, n, head, blockIdx.x * int64_t(blockDim.x) + threadIdx.x, int64_t(gridDim.x) * blockDim.x, acc, bad);
  ss[threadIdx.x] = acc;
  sb[threadIdx.x] = bad;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) {
      ss[threadIdx.x] += ss[threadIdx.x + w];
      sb[threadIdx.x] += sb[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    psum[blockIdx.x] = ss[0];
    pbad[blockIdx.x] = sb[0];
  }
}
// One block folds the partials in a fixed order: the sum does not depend on scheduling.
__global__ void k_sumsq_final(const double* __restrict__ psum, const int32_t* __restrict__ pbad, int nb, double* acc,
                              int32_t* nonfinite) {
  __shared__ double ss[256];
  __shared__ int32_t sb[256];
  double a = 0;
  int32_t b = 0;
  for (int i = threadIdx.x; i < nb; i += blockDim.x) {
    a += psum[i];
    b += pbad[i];
  }
  ss[threadIdx.x] = a;
  sb[threadIdx.x] = b;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) {
      ss[threadIdx.x] += ss[threadIdx.x + w];
      sb[threadIdx.x] += sb[threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *acc += ss[0];
    if (nonfinite) *nonfinite += sb[0];
  }
}

// The elements before the first one at which a float array is 16-byte aligned (0 to 3).
int64_t head_of(const float* a) { return int64_t((4 - reinterpret_cast<uintptr_t>(a) / sizeof(float) % 4) % 4); }

}  // namespace

void adamw(const Exec& x, float* p, const float* g, float* m, float* v, int64_t n, double beta1, double beta2,
           double eps, double lr, double weight_decay, double gscale, int64_t t, void* copy, DType copy_dt,
           const int32_t* skip) {
  if (n <= 0) return;
  // The same constants as the CPU reference, computed the same way.
  const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
  const float b1 = float(beta1), b2 = float(beta2), gs = float(gscale);
  const float step = float(lr / bc1), sqrt_bc2 = float(std::sqrt(bc2)), e = float(eps);
  const float decay = float(1.0 - lr * weight_decay);
  const AdamWConst c{b1, 1.f - b1, b2, 1.f - b2, step, sqrt_bc2, e, decay, gs};
  // The first element from which all four arrays are 16-byte aligned; none (the whole range one at a time, head n)
  // when their offsets differ mod 16 bytes. The copy's four elements there make one store when it is aligned
  // as the masters are (the trainer's copy: at the masters' offsets).
  auto mis = [](const void* a, size_t es) { return reinterpret_cast<uintptr_t>(a) / es % 4; };
  const bool same = mis(p, 4) == mis(g, 4) && mis(p, 4) == mis(m, 4) && mis(p, 4) == mis(v, 4);
  const int64_t head = same ? std::min<int64_t>(n, head_of(p)) : n;
  const bool copy_vec = copy && mis(copy, dtype_size(copy_dt)) == mis(p, 4);
  by_dtype(copy ? copy_dt : DType::F32, [&]<class O>() {
    k_adamw<O><<<grid_for(std::max<int64_t>((n - head) / 4, head + 3)), 256, 0, stream_of(x)>>>(
        p, g, m, v, static_cast<O*>(copy), copy_vec, n, head, c, skip);
    Q3VL_LAUNCHED();
  });
}

void sum_squares(const Exec& x, const void* a, int64_t n, DType dt, double* acc, int32_t* nonfinite) {
  if (n <= 0) return;
  const bool f32 = dt == DType::F32;  // four elements a load (sumsq_share)
  const int nb = std::min(grid_for(f32 ? (n + 3) / 4 : n), 1024);
  Q3VL_CHECK(size_t(nb) * (sizeof(double) + sizeof(int32_t)) <= x.ws_bytes, "sum_squares: workspace too small");
  auto* psum = static_cast<double*>(x.ws);
  auto* pbad = reinterpret_cast<int32_t*>(psum + nb);
  const int64_t head = f32 ? std::min<int64_t>(n, head_of(static_cast<const float*>(a))) : 0;
  by_dtype(dt, [&]<class S>() {
    k_sumsq_part<S><<<nb, 256, 0, stream_of(x)>>>(static_cast<const S*>(a), n, head, psum, pbad);
    Q3VL_LAUNCHED();
  });
  sumsq_fold(stream_of(x), psum, pbad, nb, acc, nonfinite);
}

namespace {
// One thread, in order: the CPU reference's sums, bit for bit (a unit holds a few slots).
__global__ void k_sum_slots(const double* sums, const int32_t* bad, const int32_t* ids, int64_t n, double* acc,
                            int32_t* nonfinite) {
  double a = *acc;
  int32_t b = *nonfinite;
  for (int64_t i = 0; i < n; ++i) a += sums[ids[i]], b += bad[ids[i]];
  *acc = a, *nonfinite = b;
}
}  // namespace

void sum_slots(const Exec& x, const double* sums, const int32_t* bad, const int32_t* ids, int64_t n, double* acc,
               int32_t* nonfinite) {
  if (n <= 0) return;
  k_sum_slots<<<1, 1, 0, stream_of(x)>>>(sums, bad, ids, n, acc, nonfinite);
  Q3VL_LAUNCHED();
}

void sumsq_fold(cudaStream_t st, const double* psum, const int32_t* pbad, int nb, double* acc, int32_t* nonfinite) {
  k_sumsq_final<<<1, 256, 0, st>>>(psum, pbad, nb, acc, nonfinite);
  Q3VL_LAUNCHED();
}

}  // namespace q3vl::dev::cuda
