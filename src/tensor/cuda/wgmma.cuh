// wgmma (Hopper, sm_90a) building blocks of the kernels that use it (attention_sm90.cu, moe_sm90.cu): shared-memory
// matrix descriptors for wgmma's 128-byte swizzle, register pinning, fences, and the m64nNk16 instructions with both
// operands in shared memory (wg_ss) or A in registers (wg_rs). Shared-memory tiles use the canonical 128-byte
// swizzle: a tile of R rows x C columns (16-bit) is C/64 column panels, each R rows of 128 bytes (64 elements);
// 16-byte chunk c of row r sits at chunk position c ^ (r % 8). 8-row groups (1024 bytes) are the descriptors' stride
// dimension; every panel starts 1024-aligned. Only files built for sm_90a (the Makefile's per-file rule) include it.
#pragma once
#include <cstdint>
#include <type_traits>

#include "tensor/cuda/mma_util.cuh"

namespace q3vl::dev::cuda {

// wgmma needs the arch-specific sm_90a target; any other pass compiles the kernel to a trap (never launched there).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define Q3VL_WGMMA 1
#endif

// ---- wgmma -----------------------------------------------------------------------------------------------------
// Shared-memory matrix descriptor (PTX ISA "matrix descriptor"): start address >> 4 in bits 0-13, leading-dimension
// byte offset >> 4 in 16-29, stride-dimension byte offset >> 4 in 32-45, base offset 0 (panels 1024-aligned) in
// 49-51, swizzle mode in 62-63 (1 = 128-byte). SBO is always 1024 here (the next 8-row group). LBO: unused for
// K-major swizzled operands (1 by convention); for the N-major V operand, the byte distance between 64-column panels.
__device__ __forceinline__ uint64_t sdesc(uint32_t addr, uint32_t lbo) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(1024 >> 4) << 32) | (1ull << 62);
}
// Pins registers in program order around the wgmma asm statements: the compiler sees wgmma's accumulators written
// at issue, so without this it could move their reads above wgmma.wait_group, or writes to wgmma's register inputs
// below wgmma.fence (CUTLASS's warpgroup_fence_operand).
template <class T, int N> __device__ __forceinline__ void pin(T (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if constexpr (sizeof(T) == 4 && std::is_floating_point_v<T>) asm volatile("" : "+f"(r[i])::"memory");
    else asm volatile("" : "+r"(r[i])::"memory");
  }
}
template <int M> __device__ __forceinline__ void pin2(uint32_t (&r)[M][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i) pin(r[i]);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

#define Q3_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                 "+f"(d[i + 6]), "+f"(d[i + 7])
#define Q3_D32 Q3_D8(0), Q3_D8(8), Q3_D8(16), Q3_D8(24)
#define Q3_D64 Q3_D32, Q3_D8(32), Q3_D8(40), Q3_D8(48), Q3_D8(56)
#define Q3_D36 Q3_D32, "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define Q3_R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define Q3_R36 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35}"
#define Q3_R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// d (64 x N fp32, this thread's N/2) (+)= A (64 x 16, smem) * B (16 x N, smem); acc 0 overwrites. TA/TB 0: the
// operand is K-major; 1: M-/N-major (stored transposed: rows along K), PTX's imm-trans-a/b.
#define Q3_WG_SS128(TY)                                                                                          \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " Q3_R64 ", %64, %65, p, 1, 1, %67, %68;\n}\n" \
               : Q3_D64                                                                                          \
               : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB))
#define Q3_WG_SS64(TY)                                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " Q3_R32 ", %32, %33, p, 1, 1, %35, %36;\n}\n" \
               : Q3_D32                                                                                          \
               : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB))
#define Q3_WG_SS72(TY)                                                                                           \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                                     \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TY "." TY " " Q3_R36 ", %36, %37, p, 1, 1, %39, %40;\n}\n" \
               : Q3_D36                                                                                          \
               : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB))
template <class S, int N, int TA = 0, int TB = 0>
__device__ __forceinline__ void wg_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
#ifdef Q3VL_WGMMA
  constexpr bool bf = std::is_same_v<S, __nv_bfloat16>;
  if constexpr (N == 128) {
    if constexpr (bf) Q3_WG_SS128("bf16");
    else Q3_WG_SS128("f16");
  } else if constexpr (N == 72) {  // head dim 72 (the 8B's and 30B-A3B's vision towers)
    if constexpr (bf) Q3_WG_SS72("bf16");
    else Q3_WG_SS72("f16");
  } else {
    static_assert(N == 64);
    if constexpr (bf) Q3_WG_SS64("bf16");
    else Q3_WG_SS64("f16");
  }
#endif
}
// d (64 x N fp32) += A (64 x 16 from registers: per warp the A fragment of mma.m16n8k16) * B (16 x N, N-major
// smem: imm-trans-b 1).
#define Q3_WG_RS128(TY)                                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " Q3_R64                             \
               ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                                    \
               : Q3_D64                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define Q3_WG_RS64(TY)                                                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " Q3_R32                              \
               ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                                    \
               : Q3_D32                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define Q3_WG_RS72(TY)                                                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %41, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n72k16.f32." TY "." TY " " Q3_R36                              \
               ", {%36,%37,%38,%39}, %40, p, 1, 1, 1;\n}\n"                                                    \
               : Q3_D36                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <class S, int N> __device__ __forceinline__ void wg_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
#ifdef Q3VL_WGMMA
  constexpr bool bf = std::is_same_v<S, __nv_bfloat16>;
  if constexpr (N == 128) {
    if constexpr (bf) Q3_WG_RS128("bf16");
    else Q3_WG_RS128("f16");
  } else if constexpr (N == 72) {
    if constexpr (bf) Q3_WG_RS72("bf16");
    else Q3_WG_RS72("f16");
  } else {
    static_assert(N == 64);
    if constexpr (bf) Q3_WG_RS64("bf16");
    else Q3_WG_RS64("f16");
  }
#endif
}

}  // namespace q3vl::dev::cuda
