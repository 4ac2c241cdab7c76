// AdamW on fp32 shards and the sum-of-squares reduction behind the gradient norm.
#include <algorithm>
#include <cmath>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

// dev::adamw's CPU reference (src/tensor/dev_cpu.cpp) element for element: the constants come from the host in the same double
// arithmetic, and the explicit _rn intrinsics keep nvcc from fusing into FMAs, so the result is bitwise the
// reference's (which the host compiler builds without FMA contraction on plain x86-64).
__global__ void k_adamw(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                        float* __restrict__ v, int64_t n, float b1, float omb1, float b2, float omb2, float step,
                        float sqrt_bc2, float eps, float decay, float gs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float gi = __fmul_rn(g[i], gs);
    const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
    const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float den = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), sqrt_bc2), eps);
    p[i] = __fsub_rn(__fmul_rn(p[i], decay), __fdiv_rn(__fmul_rn(step, mi), den));
  }
}

// Per-block partial sums of squares (double, finite elements only) and non-finite counts.
template <class S>
__global__ void k_sumsq_part(const S* __restrict__ a, int64_t n, double* psum, int32_t* pbad) {
  __shared__ double ss[256];
  __shared__ int32_t sb[256];
  double acc = 0;
  int32_t bad = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float v = ld(a, i);
    if (isfinite(v)) acc += double(v) * double(v);
    else ++bad;
  }
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

}  // namespace

void adamw(const Exec& x, float* p, const float* g, float* m, float* v, int64_t n, double beta1, double beta2,
           double eps, double lr, double weight_decay, double gscale, int64_t t) {
  if (n <= 0) return;
  // The same constants as the CPU reference, computed the same way.
  const double bc1 = 1.0 - std::pow(beta1, double(t)), bc2 = 1.0 - std::pow(beta2, double(t));
  const float b1 = float(beta1), b2 = float(beta2), gs = float(gscale);
  const float step = float(lr / bc1), sqrt_bc2 = float(std::sqrt(bc2)), e = float(eps);
  const float decay = float(1.0 - lr * weight_decay);
  k_adamw<<<grid_for(n), 256, 0, stream_of(x)>>>(p, g, m, v, n, b1, 1.f - b1, b2, 1.f - b2, step, sqrt_bc2, e, decay,
                                                 gs);
  Q3VL_LAUNCHED();
}

void sum_squares(const Exec& x, const void* a, int64_t n, DType dt, double* acc, int32_t* nonfinite) {
  if (n <= 0) return;
  const int nb = std::min(grid_for(n), 1024);
  Q3VL_CHECK(size_t(nb) * (sizeof(double) + sizeof(int32_t)) <= x.ws_bytes, "sum_squares: workspace too small");
  auto* psum = static_cast<double*>(x.ws);
  auto* pbad = reinterpret_cast<int32_t*>(psum + nb);
  by_dtype(dt, [&]<class S>() {
    k_sumsq_part<S><<<nb, 256, 0, stream_of(x)>>>(static_cast<const S*>(a), n, psum, pbad);
    Q3VL_LAUNCHED();
  });
  k_sumsq_final<<<1, 256, 0, stream_of(x)>>>(psum, pbad, nb, acc, nonfinite);
  Q3VL_LAUNCHED();
}

}  // namespace q3vl::dev::cuda
