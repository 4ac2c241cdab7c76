// Shared by the CUDA kernels: status checks that name file:line and the library's status string, the stream of
// an Exec, and dtype-generic loads and stores (fp32 math whatever the storage dtype).
#pragma once
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

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

inline std::string cublasLt_status_string(cublasStatus_t s) {
  return std::string(cublasGetStatusName(s)) + " (" + cublasGetStatusString(s) + ")";
}

inline cudaStream_t stream_of(const Exec& x) { return static_cast<cudaStream_t>(x.stream); }

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

// Calls f.template operator()<S>() with S the storage type of dt (F32, BF16, F16).
template <class F> void by_dtype(DType dt, F&& f) {
  switch (dt) {
    case DType::F32: f.template operator()<float>(); break;
    case DType::BF16: f.template operator()<__nv_bfloat16>(); break;
    case DType::F16: f.template operator()<__half>(); break;
    default: fail(std::string("CUDA op: unsupported dtype ") + dtype_name(dt));
  }
}

// A launch with dynamic shared memory (above 48 KiB it must be allowed first), checked.
template <class... KA, class... A>
void launch(void (*kern)(KA...), dim3 grid, int threads, size_t smem, cudaStream_t st, A... a) {
  if (smem > 48 * 1024)
    Q3VL_CU(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kern<<<grid, threads, smem, st>>>(a...);
  Q3VL_LAUNCHED();
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int grid_for(int64_t n, int block = 256) {
  int64_t g = (n + block - 1) / block;
  return int(g < 65535 * 16 ? (g < 1 ? 1 : g) : 65535 * 16);
}

}  // namespace q3vl::dev::cuda
