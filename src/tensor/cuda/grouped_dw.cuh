// The weight-gradient epilogue of the grouped expert GEMMs (moe.cu's k_grouped): a
// block's BM x BN fp32 tile of dW[e] out of shared memory. DW's output is large against its K (an expert's bucket:
// 256 rows on average at the 30B-A3B shape, 2 K FLOPs an fp32 element written, and read when accumulating), so the
// store is the kernel's cost: whole rows of 16-byte accesses (a warp moves 512 contiguous bytes), the prior values
// prefetched into L2 during the main loop and read a group of 8 at a time (not one dependent DRAM round trip each),
// or not read at all when the caller's dW is fresh. 256 threads.
#pragma once

#include <cstdint>

namespace q3vl::dev::cuda::grouped_dw {

// The tile's rows [m0, m0 + BM) x columns [n0, n0 + BN) of c (row stride ldc) into L2: 128-byte lines, BN/32 a row.
template <int BM, int BN>
__device__ __forceinline__ void prefetch_tile(const float* c, int64_t ldc, int64_t m0, int64_t n0, int64_t M,
                                              int64_t N) {
  for (int v = threadIdx.x; v < BM * (BN / 32); v += 256) {
    const int64_t m = m0 + v / (BN / 32), n = n0 + 32 * (v % (BN / 32));
    if (m < M && n < N) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(c + m * ldc + n));
  }
}

// c[m0 + r, n0 + col] (+)= sc[r * LDC + col] for the rows < M and columns < N; sc filled and published by the caller
// (__syncthreads). Edge columns and an unaligned c go element by element, with the same sums.
template <int BM, int BN, int LDC>
__device__ __forceinline__ void rows_out(const float* sc, float* c, int64_t ldc, int64_t m0, int64_t n0, int64_t M,
                                         int64_t N, bool accumulate) {
  constexpr int kRowV = BN / 4, kPer = BM * kRowV / 256, kGroup = 8;  // float4s: a row, a thread, loads in flight
  static_assert(kPer % kGroup == 0 && LDC % 4 == 0, "whole groups, 16-byte rows");
  const bool vec = (ldc & 3) == 0 && (reinterpret_cast<uintptr_t>(c) & 15) == 0;
  const int tid = threadIdx.x;
  for (int u0 = 0; u0 < kPer; u0 += kGroup) {
    float4 old[kGroup];
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int v = tid + 256 * (u0 + u);
      const int64_t m = m0 + v / kRowV, n = n0 + 4 * (v % kRowV);
      old[u] = accumulate && vec && m < M && n + 3 < N ? *reinterpret_cast<const float4*>(c + m * ldc + n)
                                                       : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kGroup; ++u) {
      const int v = tid + 256 * (u0 + u), r = v / kRowV, col = 4 * (v % kRowV);
      const int64_t m = m0 + r, n = n0 + col;
      if (m >= M || n >= N) continue;
      const float4 a = *reinterpret_cast<const float4*>(sc + r * LDC + col);
      if (vec && n + 3 < N) {  // asm: a plain float4 store came out as four 4-byte stores
        asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(c + m * ldc + n), "f"(old[u].x + a.x),
                     "f"(old[u].y + a.y), "f"(old[u].z + a.z), "f"(old[u].w + a.w)
                     : "memory");
      } else {
        const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (n + q < N) c[m * ldc + n + q] = (accumulate ? c[m * ldc + n + q] : 0.f) + av[q];
      }
    }
  }
}

}  // namespace q3vl::dev::cuda::grouped_dw
