// PTX helpers shared by the attention kernels (attention.cu: mma.sync, attention_sm90.cu: wgmma,
// paged_attention.cu's tensor-core path): cp.async copies,
// ldmatrix, mma.m16n8k16, 16-bit packing, the SFU exp2 and quad reductions over the 4 threads of an mma row.
#pragma once
#include <cstdint>
#include <type_traits>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

__device__ __forceinline__ uint32_t su32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// 16-byte async copy to shared address s; pred false zero-fills the destination (rows past the segment's end).
__device__ __forceinline__ void cp16(uint32_t s, const void* g, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(g), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp16(void* s, const void* g, bool pred) { cp16(su32(s), g, pred); }
__device__ __forceinline__ void cp4(uint32_t s, const void* g, bool pred) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(g), "r"(pred ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp4(void* s, const void* g, bool pred) { cp4(su32(s), g, pred); }
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
// Until at most N committed groups are still in flight (N + 1 stages: the newest N stay pending).
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
__device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(su32(p)));
}
__device__ __forceinline__ void ldsm4t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(su32(p)));
}
template <class S>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two floats as one 32-bit register of S pairs; `lo` is the lower column.
template <class S> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
// p[0] += x, p[1] += y on a 4-byte aligned 16-bit S pair (gradient accumulation); acc false: p = 0 + (x, y), p
// unread (dev.hpp).
template <class S> __device__ __forceinline__ void add2(S* p, float x, float y, bool acc) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    const float2 f = acc ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p)) : float2{0.f, 0.f};
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(f.x + x, f.y + y);
  } else {
    const float2 f = acc ? __half22float2(*reinterpret_cast<const __half2*>(p)) : float2{0.f, 0.f};
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(f.x + x, f.y + y);
  }
}
// 2^x on the SFU (inputs are <= 0 or -inf here; flushing tiny results to 0 is harmless).
__device__ __forceinline__ float fexp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

}  // namespace q3vl::dev::cuda
