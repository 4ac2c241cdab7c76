// Shared by the CUDA kernels: status checks that name file:line and the library's status string, the stream of
// an Exec, and dtype-generic loads and stores (fp32 math whatever the storage dtype), an element or a vector at a time.
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "q3vl/core/env.hpp"
#include "q3vl/core/error.hpp"
#include "tensor/cuda/dev_cuda.hpp"

namespace q3vl::dev::cuda {

[[noreturn]] inline void cuda_fail(const char* file, int line, const char* what, const std::string& status) {
  fail(std::string(file) + ":" + std::to_string(line) + ": " + what + ": " + status);
}
#define Q3VL_CU(call)                                                                                     \
  do {                                                                                                    \
    cudaError_t e_ = (call);                                                                              \
    if (e_ != cudaSuccess)                                                                                \
      ::q3vl::dev::cuda::cuda_fail(__FILE__, __LINE__, #call, std::string(cudaGetErrorName(e_)) + " (" + \
                                                                  cudaGetErrorString(e_) + ")");         \
  } while (0)
#define Q3VL_CUBLAS(call)                                                                                  \
  do {                                                                                                     \
    cublasStatus_t s_ = (call);                                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                                       \
      ::q3vl::dev::cuda::cuda_fail(__FILE__, __LINE__, #call, cublasLt_status_string(s_));                \
  } while (0)
// After a kernel launch: launch-configuration errors surface here, at the launch's file:line.
#define Q3VL_LAUNCHED() Q3VL_CU(cudaGetLastError())

// optim.cu: *acc += psum[0] + ... + psum[nb - 1] and *nonfinite (may be null) += the same of pbad, in a fixed order
// on one block: sum_squares' fold of its blocks' partials, also the grouped GEMM's (moe_sm90.cu).
void sumsq_fold(cudaStream_t st, const double* psum, const int32_t* pbad, int nb, double* acc, int32_t* nonfinite);

inline std::string cublasLt_status_string(cublasStatus_t s) {
  return std::string(cublasGetStatusName(s)) + " (" + cublasGetStatusString(s) + ")";
}

inline cudaStream_t stream_of(const Exec& x) { return static_cast<cudaStream_t>(x.stream); }

// The GPU's global timer in ns (the chain's stamps, the benchmarks' spin kernel).
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The sum of v over the warp's lanes, in every lane (xor butterfly).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// silu(g) * u in fp32: the one SwiGLU formula of the op (elementwise.cu), the decode chain's pair and its staging
// (gemv.cuh), whose bitwise agreement depends on it.
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

// Storage types by DType; kernels are templated on the storage type and compute in float.
template <class S> __device__ __forceinline__ float ld(const S* p, int64_t i) { return float(p[i]); }
template <> __device__ __forceinline__ float ld<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <> __device__ __forceinline__ float ld<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }
template <class S> __device__ __forceinline__ void st(S* p, int64_t i, float v) { p[i] = S(v); }
template <> __device__ __forceinline__ void st<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ void st<__half>(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }
// v rounded to S, as a store of it would (st) and a load back.
template <class S>
__device__ __forceinline__ float round_to(float v) {
  S t;
  st(&t, 0, v);
  return ld(&t, 0);
}

// y[i] = v, or with add y[i] + v rounded to S first (a residual add, as axpy of the rounded product would).
template <class S>
__device__ __forceinline__ void store_y(S* y, int64_t i, float v, bool add) {
  if (add) {
    S t;
    st(&t, 0, v);
    v = ld(y, i) + ld(&t, 0);
  }
  st(y, i, v);
}

// V consecutive elements of S at p + i, i a multiple of V, in one access of V * sizeof(S) bytes (two 16-byte ones
// above 16: 8 fp32 beside a 16-bit operand), aligned to that size up to 16 bytes: with V > 1 the caller sees that the
// pointers and strides allow it (16-byte aligned bases, row lengths a multiple of V).
template <class S, int V> struct alignas(sizeof(S) * V < 16 ? sizeof(S) * V : 16) Pack {
  S v[V];
};
template <class S, int V> __device__ __forceinline__ Pack<S, V> ldp(const S* p, int64_t i) {
  return *reinterpret_cast<const Pack<S, V>*>(p + i);
}
template <class S, int V> __device__ __forceinline__ void stp(S* p, int64_t i, const Pack<S, V>& pk) {
  *reinterpret_cast<Pack<S, V>*>(p + i) = pk;
}
// The V elements at p + i as floats (ld's conversion), and floats stored as V elements (st's rounding).
template <class S, int V> __device__ __forceinline__ void ldv(const S* p, int64_t i, float (&f)[V]) {
  const Pack<S, V> pk = ldp<S, V>(p, i);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = ld(pk.v, j);
}
template <class S, int V> __device__ __forceinline__ void stv(S* p, int64_t i, const float (&f)[V]) {
  Pack<S, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) st(pk.v, j, f[j]);
  stp<S, V>(p, i, pk);
}
// What a gradient output adds to: its values (accumulate), or the zeros of a zeroed buffer, unread (dev.hpp).
template <class S, int V> __device__ __forceinline__ void priorv(const S* p, int64_t i, bool acc, float (&f)[V]) {
  if (acc) return ldv<S, V>(p, i, f);
#pragma unroll
  for (int j = 0; j < V; ++j) f[j] = 0.f;
}

// Calls f.template operator()<S>() with S the storage type of dt (F32, BF16, F16).
template <class F> void by_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f.template operator()<float>(); break;
    case DType::BF16: f.template operator()<__nv_bfloat16>(); break;
    case DType::F16: f.template operator()<__half>(); break;
    default: fail(std::string("CUDA op: unsupported dtype ") + dtype_name(dt));
  }
}

// Dynamic shared memory above 48 KiB must be allowed first.
template <class... KA> void allow_smem(void (*kern)(KA...), size_t smem) {
  if (smem > 48 * 1024)
    Q3VL_CU(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

// A launch with dynamic shared memory, checked.
template <class... KA, class... A>
void launch(void (*kern)(KA...), dim3 grid, int threads, size_t smem, cudaStream_t st, A... a) {
  allow_smem(kern, smem);
  kern<<<grid, threads, smem, st>>>(a...);
  Q3VL_LAUNCHED();
}

// Programmatic dependent launch (Hopper): a kernel launched by launch_pdl may start while the kernel before it in the
// stream still runs (a CUDA graph keeps the edge). It must call pdl_wait() before it reads anything the kernels before
// wrote or writes anything they read; what it does before (loading weights) overlaps them. pdl_trigger() lets the
// next kernel's blocks start before this one ends (a no-op unless that kernel is launched by launch_pdl); it is
// called once a kernel has passed its own wait, so at most two grids overlap.
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// The first statement of a kernel launched by launch_pdl that has nothing to do before its inputs are there.
__device__ __forceinline__ void pdl_enter() {
  pdl_wait();
  pdl_trigger();
}
// A hint, no result: the L2 starts pulling [p, p + bytes) from HBM (cp.async.bulk.prefetch). p and bytes are
// multiples of 16; nothing is waited for, and a later load of the range is never stale (every write lands in L2).
__device__ __forceinline__ void l2_prefetch(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Whether launch_pdl launches programmatically dependent: on unless the environment sets Q3VL_PDL=0 (for A/B runs);
// benchmarks may flip it.
inline bool& pdl_on() {
  static bool on = !env_is("Q3VL_PDL", "0");
  return on;
}

// launch(), programmatically dependent on the stream's previous kernel (pdl_on()); kern calls pdl_wait() first
// for everything that depends on earlier work. cluster > 1: the grid runs as thread-block clusters of `cluster`
// blocks along x (Hopper; grid.x a multiple of it; above 8, the portable limit, the kernel is allowed the
// non-portable sizes), whatever pdl_on() says. Checked as launch() is.
template <class... KA, class... A>
void launch_pdl_cluster(void (*kern)(KA...), int cluster, dim3 grid, int threads, size_t smem, cudaStream_t st,
                        A... a) {
  if (!pdl_on() && cluster <= 1) return launch(kern, grid, threads, smem, st, a...);
  allow_smem(kern, smem);
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_on()) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    if (cluster > 8) Q3VL_CU(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = attr[n].val.clusterDim.z = 1;
    ++n;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = n;
  Q3VL_CU(cudaLaunchKernelEx(&cfg, kern, KA(a)...));
}
template <class... KA, class... A>
void launch_pdl(void (*kern)(KA...), dim3 grid, int threads, size_t smem, cudaStream_t st, A... a) {
  launch_pdl_cluster(kern, 1, grid, threads, smem, st, a...);
}

// The current device's SMs.
inline int sm_count() {
  int dev = 0, sms = 132;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

// The dynamic shared memory a block may opt in to (the device's).
inline size_t smem_optin() {
  static const size_t bytes = [] {
    int dev = 0, b = 0;
    Q3VL_CU(cudaGetDevice(&dev));
    Q3VL_CU(cudaDeviceGetAttribute(&b, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return size_t(b);
  }();
  return bytes;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int grid_for(int64_t n, int block = 256) {
  int64_t g = (n + block - 1) / block;
  return int(g < 65535 * 16 ? (g < 1 ? 1 : g) : 65535 * 16);
}

}  // namespace q3vl::dev::cuda
