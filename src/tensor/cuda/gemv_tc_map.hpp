// The index mapping of the tensor-core decode GEMV (gemv.cuh, wgemv::gemv_tc), in a plain header so that the CPU
// unit tests (tests/unit/test_gemv_tc_map.cpp) check the very functions the kernel uses.
//
// mma.sync.aligned.m16n8k16.row.col (f16/bf16 in, f32 out), lane = 4 g + t (g = lane / 4, t = lane % 4), as the PTX
// ISA's fragment figures give them:
//   A (16 x 16, row = output row, k): reg r in 0..3 holds rows g + 8 (r & 1), k = 2 t + h + 8 (r >> 1), h = 0, 1 the
//     low and high halves of the 32-bit register;
//   B (16 x 8, k, col = x row): reg r in 0..1 holds x row g, k = 2 t + h + 8 r;
//   C/D (16 x 8, fp32): element i in 0..3 is output row g + 8 (i >> 1), x row 2 t + (i & 1).
// The GEMV's weights are A, x is B. A lane loads one 16-byte group of each of its two rows g and g + 8: G = 16
// (8-bit weights) or 8 (bf16/fp16) consecutive columns starting at t G of a warp step of 4 G columns. The dot product
// sums over k, so any bijection between logical k and physical columns serves, as long as A and B use the same one.
// The one chosen makes every loaded byte feed a fragment directly (no shuffles): mma m (0 .. G/4 - 1) of a step
// covers, on lane t's side, the group elements 4 m .. 4 m + 3, pair p = 0 (logical k 2t, 2t+1) being elements
// 4m, 4m+1 and pair p = 1 (k 2t+8, 2t+9) elements 4m+2, 4m+3:
//   physical column (within the step) of logical k = 2 t + h + 8 p in mma m  =  t G + 4 m + 2 p + h.
// Over t, m, p, h this is a bijection onto [0, 4 G), and within one mma it is the same map for A (a lane's rows) and
// B (its x row), since both sides of a lane use its own t. x is staged in shared memory in plain column order, so a
// lane reads its B registers as the G consecutive x values at t G of its x row (2 G bytes: one or two 16-byte loads).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define Q3VL_TC_HD __host__ __device__ __forceinline__
#else
#define Q3VL_TC_HD inline
#endif

namespace q3vl::dev::cuda::wgemv {

// PTX fragment coordinates of m16n8k16 (see above).
constexpr Q3VL_TC_HD int frag_a_row(int lane, int r) { return lane / 4 + 8 * (r & 1); }
constexpr Q3VL_TC_HD int frag_a_k(int lane, int r, int h) { return 2 * (lane % 4) + h + 8 * (r >> 1); }
constexpr Q3VL_TC_HD int frag_b_k(int lane, int r, int h) { return 2 * (lane % 4) + h + 8 * r; }
constexpr Q3VL_TC_HD int frag_b_n(int lane) { return lane / 4; }
constexpr Q3VL_TC_HD int frag_c_row(int lane, int i) { return lane / 4 + 8 * (i >> 1); }
constexpr Q3VL_TC_HD int frag_c_n(int lane, int i) { return 2 * (lane % 4) + (i & 1); }

// The element offset within a lane's 16-byte group of the (even-aligned) pair that A regs {2p, 2p+1} (rows g and
// g + 8) and B reg p of mma m hold, low half first.
constexpr Q3VL_TC_HD int tc_pair(int m, int p) { return 4 * m + 2 * p; }
// The physical column, within a warp step of 4 G columns, of a lane's element h of pair p of mma m.
constexpr Q3VL_TC_HD int tc_col(int G, int lane, int m, int p, int h) { return (lane % 4) * G + tc_pair(m, p) + h; }

// The TMA-fed GEMV (gemv_tma.cuh) reads its weights from panels of 16 rows x 128 bytes that the TMA unit wrote with
// the 128-byte swizzle: row r at 128 r bytes, its 16-byte chunk c at c ^ (r % 8). A panel is two warp steps; in step
// s (0, 1) lane 4 g + t takes chunk 2 t + s of rows g and g + 8 as its 16-byte group (the x columns it multiplies
// are the same chunk's). Each quarter-warp (rows g, g + 1 for even g) then reads eight distinct 16-byte bank groups,
// where chunk t + 4 s would read four twice.
constexpr Q3VL_TC_HD int tma_chunk(int lane, int s) { return 2 * (lane % 4) + s; }
constexpr Q3VL_TC_HD int tma_offset(int row, int chunk) { return 128 * row + 16 * (chunk ^ (row % 8)); }

// The TMA GEMV's schedule: block b of grid takes the items (16-row tiles) b, b + grid, ... below items, spt stages
// each in order; its stage i is stage i % spt of item tma_stage_item(i), in ring slot i % stages. The producer issues
// stages 0 .. tma_block_stages - 1 in that order and the consumers take them so.
constexpr Q3VL_TC_HD int64_t tma_block_stages(int64_t items, int64_t spt, int64_t b, int64_t grid) {
  return items > b ? ((items - 1 - b) / grid + 1) * spt : 0;
}
constexpr Q3VL_TC_HD int64_t tma_stage_item(int64_t i, int64_t spt, int64_t b, int64_t grid) {
  return b + (i / spt) * grid;
}

}  // namespace q3vl::dev::cuda::wgemv
