// Hopper (sm_90a) asynchronous-pipeline building blocks of the warp-specialized kernels (attention_sm90.cu's fwd_ws):
// mbarriers, TMA tensor copies (cp.async.bulk.tensor) that complete on them, named barriers between warpgroups,
// setmaxnreg, and on the host the TMA tensor maps of a row-major 16-bit matrix and of any matrix as 128-byte panels
// (cuTensorMapEncodeTiled, reached through the runtime's driver entry point: no -lcuda). The decode GEMV
// (gemv_tma.cuh, built for sm_90) uses the copies and mbarriers only; setmaxnreg and wgmma need sm_90a.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

// ---- device ------------------------------------------------------------------------------------------------------
// mbarrier at shared address `bar` (8 bytes): init with an arrival count; arrive (pred: whether this thread does);
// arrive and add `bytes` to the transaction count the phase also waits for (the TMA copies' complete_tx); wait for
// the phase of the given parity to complete (a fresh barrier counts its phase "before 0", parity 1, as complete).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// After the inits, before the barrier that publishes them: makes them visible to the async proxy (TMA) too.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
               "r"(int(pred))
               : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// L2 policies for the TMA copies: data read once (evict first), reused by other blocks (evict last), or neither.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_normal() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ uint64_t l2_evict_last() {
  uint64_t p;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}
__device__ __forceinline__ void tmap_prefetch(const CUtensorMap* m) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(m)) : "memory");
}
// The box of tensor map m at (column x, row y) to shared address dst; completes `bar`'s transactions with its bytes
// (the whole box, elements out of bounds included: the TMA unit writes those as zeros).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* m, int x, int y, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(m)), "r"(x), "r"(y), "r"(bar), "l"(policy)
      : "memory");
}

// The box of the 3-D tensor map m at (x, y, z) to shared address dst, completing `bar`'s transactions (as tma_load_2d).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* m, int x, int y, int z, uint32_t bar,
                                            uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(m)), "r"(x), "r"(y), "r"(z), "r"(bar), "l"(policy)
      : "memory");
}

// A hint, no result: the L2 starts pulling the box at {x, y, z} of m from HBM. Like l2_prefetch, never stale: a write
// that lands after it updates the L2's copy.
__device__ __forceinline__ void tma_prefetch_3d(const CUtensorMap* m, int x, int y, int z) {
  asm volatile("cp.async.bulk.prefetch.tensor.3d.L2.global.tile [%0, {%1, %2, %3}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(m)), "r"(x), "r"(y), "r"(z)
               : "memory");
}

// A bulk asynchronous copy of bytes (a multiple of 16, both addresses 16-byte aligned) from global memory to shared
// address dst, completing `bar`'s transactions with its bytes (as tma_load_*).
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Bulk asynchronous copies (the copy engine) from shared to global memory, contiguous: dst[0 .. bytes) = src, or +=
// src (fp32, reduced in L2); bytes and both addresses multiples of 16. Grouped per thread: commit closes a group;
// wait_read<N> waits until at most N of this thread's groups still read their shared source; wait_all: all done.
__device__ __forceinline__ void bulk_store(void* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Named barrier `id` (1..15; 0 is __syncthreads) over n threads (a multiple of 32): sync waits for the n, arrive
// counts this warp without waiting; pred: whether this warp arrives.
__device__ __forceinline__ void bar_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p bar.arrive %0, %1;\n}\n" ::"r"(id), "r"(n), "r"(int(pred))
               : "memory");
}

// A warpgroup's register budget (every thread of it executes): dec hands registers back to the pool, inc takes them.
template <int R> __device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R> __device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---- host --------------------------------------------------------------------------------------------------------
// cuTensorMapEncodeTiled, reached through the runtime's driver entry point (no -lcuda); null where the driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tmap_encoder() {
  using Encode = PFN_cuTensorMapEncodeTiled_v12000;
  static const Encode encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return Encode(nullptr);
    }
    return reinterpret_cast<Encode>(fn);
  }();
  return encode;
}

// The tensor map of a rows x cols matrix of 16-bit elements (bf16 or fp16) at base, row stride ld elements, read in
// boxes of 64 columns x box_rows rows with the 128-byte swizzle: a box lands as wgmma's canonical swizzled panel
// (row r at 128 r bytes, its 16-byte chunk c at c ^ (r % 8); the destination 1024-aligned). False where the TMA
// unit cannot take it (base not 16-byte aligned, row stride not a multiple of 16 bytes, no driver entry point).
inline bool tmap_16bit(CUtensorMap& m, const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows,
                       bool bf16) {
  const auto encode = tmap_encoder();
  if (!encode || !aligned16(base) || (ld * 2) % 16 != 0 || rows < 1 || cols < 1) return false;
  const cuuint64_t dims[2] = {cuuint64_t(cols), cuuint64_t(rows)}, strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)}, step[2] = {1, 1};
  return encode(&m, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                const_cast<void*>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A rows x row_bytes row-major matrix (any element type, seen as bytes) as 128-byte panels: coordinates (byte in
// the panel row, row, panel), so that one box of 128 x box_rows x box_panels bytes is box_panels panels of box_rows
// rows, each panel box_rows x 128 bytes in shared memory with the 128-byte swizzle (row r at 128 r, its 16-byte
// chunk c at c ^ (r % 8); the destination 1024-aligned). Rows and panels past the matrix read as zeros. False where
// the TMA unit cannot take it (row_bytes not a multiple of 128, base not 16-byte aligned, no driver entry point).
inline bool tmap_panels(CUtensorMap& m, const void* base, int64_t rows, int64_t row_bytes, int box_rows,
                        int box_panels) {
  const auto encode = tmap_encoder();
  if (!encode || !aligned16(base) || row_bytes % 128 != 0 || rows < 1 || row_bytes < 128) return false;
  const cuuint64_t dims[3] = {128, cuuint64_t(rows), cuuint64_t(row_bytes / 128)};
  const cuuint64_t strides[2] = {cuuint64_t(row_bytes), 128};
  const cuuint32_t box[3] = {128, cuuint32_t(box_rows), cuuint32_t(box_panels)}, step[3] = {1, 1, 1};
  return encode(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box, step,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace q3vl::dev::cuda
