// The weight-streaming GEMV of decode steps, shared by the int8/fp8 linear and experts (q8.cu) and the bf16/fp16/fp32
// experts (moe.cu): y[n, n_out] = (x[n, n_in] W^T) * scale + b for n <= kMaxN rows, W [n_out, n_in] read once.
// Two paths behind gemv(): bf16/fp16 activations run the tensor-core GEMV (gemv_tc, the second half of this file:
// mma.m16n8k16 on the weights as they stream in); fp32 activations the CUDA-core GEMV (gemv_simt, described here,
// also callable directly for A/B benchmarks: tools/gpu/gemv_bench.cu).
// A decode step is bound by the bytes of weights it reads, so the weights are streamed with 16-byte non-caching loads
// and everything else is arranged around that:
//  - W is int8 or fp8 E4M3 (__nv_fp8_e4m3) with one fp32 scale per output row, or the activation storage type S
//    itself (scale null: 1). A lane loads 16 bytes of a row per step: kGroup<W> = 16 / sizeof(W) columns (16 int8 or
//    fp8, 8 bf16/fp16, 4 fp32).
//  - each warp owns kRows output rows; the n input rows are staged in shared memory as fp32 (in column chunks when
//    they do not fit), so every x value read from shared memory feeds kRows rows; fp32 accumulation, warp-shuffle
//    reduction, scale and bias at the end.
//  - experts (start non-null): grid.y walks only the experts that have rows, found on the device from start (nothing
//    syncs with the host; the others' weights are never read), a block looping over its expert's rows n at a time.
// Rows go through 16-byte loads when every row start is 16-byte aligned (n_in * sizeof(W) % 16 == 0 and W aligned),
// else through scalar loads.
#pragma once
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_fp8.h>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv_tc_map.hpp"
#include "tensor/cuda/mma_util.cuh"

namespace q3vl::dev::cuda::wgemv {

constexpr int kWarps = 8;                 // warps per block
constexpr int kRows = 4;                  // output rows per warp: each x value loaded from shared memory serves kRows
constexpr int kMaxN = 16;                 // x rows per pass (larger N: the callers' GEMM paths)
constexpr int kGroupedRows = 8;           // experts: the GEMV up to 8 rows per expert on average (decode steps)
constexpr size_t kSmemBudget = 96 << 10;  // staged x (fp32) per block; above 48 KiB needs the opt-in attribute

template <class W> inline constexpr int kGroup = 16 / int(sizeof(W));  // columns per lane per step: a 16-byte load
template <class W> inline constexpr int kStep = 32 * kGroup<W>;         // columns per warp step
template <class W> inline constexpr int kPieces = kGroup<W> / 4;        // float4 pieces of x per group: 4, 2, 1

// 8-bit weights carry one fp32 scale per output row; the others are the activations' own type (no scale).
template <class W> inline constexpr bool kScaled = std::is_same_v<W, int8_t> || std::is_same_v<W, __nv_fp8_e4m3>;
template <class W>
inline constexpr bool kWeightOk = kScaled<W> || std::is_same_v<W, float> || std::is_same_v<W, __nv_bfloat16> ||
                                  std::is_same_v<W, __half>;

// int8 -> fp32 without I2F (a quarter-rate conversion): each byte biased to unsigned (xor 0x80) is placed into the
// low mantissa byte of 2^23 (0x4B000000), and 2^23 + 128 subtracted. Exact.
__device__ __forceinline__ void i8x4_to_f32(uint32_t w, float (&f)[4]) {
  const uint32_t u = w ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7441)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7442)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7443)) - 8388736.f;
}

// fp8 E4M3 -> fp32, two at a time: cvt.rn.f16x2.e4m3x2 (exact: every E4M3 value is a half), the halves widened.
// Byte k of w is element k, as i8x4_to_f32's.
__device__ __forceinline__ void e4m3x4_to_f32(uint32_t w, float (&f)[4]) {
  const __half2 lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2 hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  const float2 a = __half22float2(lo), b = __half22float2(hi);
  f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y;
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// The weights of columns 4t .. 4t+3 of a lane's 16-byte group (t < kPieces<W>), as fp32. t is a constant after the
// callers' unrolling, so the word selection folds away.
template <class W>
__device__ __forceinline__ void piece_f32(const uint4& v, int t, float (&f)[4]) {
  if constexpr (std::is_same_v<W, int8_t>) {
    i8x4_to_f32(word_of(v, t), f);
  } else if constexpr (std::is_same_v<W, __nv_fp8_e4m3>) {
    e4m3x4_to_f32(word_of(v, t), f);
  } else if constexpr (std::is_same_v<W, float>) {
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = __uint_as_float(word_of(v, k));
  } else {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint32_t u = word_of(v, 2 * t + k);
      if constexpr (std::is_same_v<W, __nv_bfloat16>) {  // bf16 is the high half of an fp32
        f[2 * k] = __uint_as_float(u << 16);
        f[2 * k + 1] = __uint_as_float(u & 0xffff0000u);
      } else {
        f[2 * k] = __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu)));
        f[2 * k + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
      }
    }
  }
}

// Weights are read once: non-coherent path, not kept in L1 (shared memory and x use it).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Staged x: row j of the chunk at j * kc floats; column group c (kGroup columns = kPieces float4 pieces) at c * kGroup,
// piece i stored in slot i ^ ((c / (8 / kPieces)) % kPieces). A warp reads piece i of groups c = lane + 32 s: the
// eight lanes of a quarter-warp then hit eight distinct 16-byte bank slots (without the swizzle, 8-bit 64-byte group
// strides conflict 4-way, bf16/fp16's 32-byte ones 2-way; fp32's 16-byte strides need none).
template <class W>
__device__ __forceinline__ int swz(int col) {
  constexpr unsigned G = kGroup<W>, P = kPieces<W>;
  const unsigned c = unsigned(col) / G, i = (unsigned(col) >> 2) & (P - 1);
  return int(c * G + ((i ^ ((c / (8 / P)) & (P - 1))) << 2) + (unsigned(col) & 3));
}

// The kGroup<W> weights of row r at columns col .. col + kGroup - 1 as one 16-byte group (zeros outside the matrix).
// VEC: every row start is 16-byte aligned and n_in % kGroup == 0, so a group that starts inside a row is whole.
template <class W, bool VEC>
__device__ __forceinline__ uint4 load_group(const W* q, int64_t r, int64_t n_out, int64_t n_in, int64_t col) {
  constexpr int G = kGroup<W>;
  if (r >= n_out || col >= n_in) return make_uint4(0, 0, 0, 0);
  const W* p = q + r * n_in + col;
  if constexpr (VEC) {
    return ld_stream16(p);
  } else {
    // The bits of each element, packed as a 16-byte load would have them (zero bits: 0 in every W).
    using U = std::conditional_t<sizeof(W) == 1, uint8_t, std::conditional_t<sizeof(W) == 2, uint16_t, uint32_t>>;
    constexpr int PER = 4 / int(sizeof(W));  // elements per 32-bit word
    const U* pu = reinterpret_cast<const U*>(p);
    const int64_t left = n_in - col;  // > 0
    uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
    for (int e = 0; e < G; ++e)
      if (e < left) v[e / PER] |= uint32_t(pu[e]) << (8 * int(sizeof(W)) * (e % PER));
    return make_uint4(v[0], v[1], v[2], v[3]);
  }
}

// Loads the kGroup weights of rows row0..row0+kRows-1 at column group c of the chunk starting at k0 (zeros outside).
template <class W, bool VEC>
__device__ __forceinline__ void load_w(uint4 (&w)[kRows], const W* q, int64_t row0, int64_t n_out, int64_t n_in,
                                       int64_t k0, int c, int groups) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
    w[i] = c < groups ? load_group<W, VEC>(q, row0 + i, n_out, n_in, k0 + int64_t(c) * kGroup<W>)
                      : make_uint4(0, 0, 0, 0);
}

// One step: the lane's kGroup columns (group c) of kRows weight rows against the NB (n valid) staged x rows.
template <class W, int NB>
__device__ __forceinline__ void fma_step(float (&acc)[kRows][NB], const uint4 (&w)[kRows], const float* xs, int kc,
                                         int c, int n) {
  constexpr unsigned G = kGroup<W>, P = kPieces<W>;
  const int base = c * int(G), sw = int((unsigned(c) / (8 / P)) & (P - 1));
#pragma unroll
  for (int t = 0; t < int(P); ++t) {
    float wf[kRows][4];
#pragma unroll
    for (int i = 0; i < kRows; ++i) piece_f32<W>(w[i], t, wf[i]);
    const int off = base + ((t ^ sw) << 2);
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      if (j >= n) break;
      const float4 xv = *reinterpret_cast<const float4*>(xs + j * kc + off);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        float a = acc[i][j];
        a = fmaf(wf[i][0], xv.x, a);
        a = fmaf(wf[i][1], xv.y, a);
        a = fmaf(wf[i][2], xv.z, a);
        a = fmaf(wf[i][3], xv.w, a);
        acc[i][j] = a;
      }
    }
  }
}

// One block's rows of y = (in q^T) * scale + b (add: y +=): kWarps warps, warp w owning rows (blockIdx.x * kWarps + w) * kRows +
// [0, kRows). x[n, n_in] staged kc columns at a time into xs (n * kc floats of dynamic shared memory); the block
// synchronizes before it stages, so it may be called again on other rows. scale: 8-bit weights only (else unread).
template <class S, class W, int NB, bool VEC>
__device__ __forceinline__ void gemv_rows(const S* __restrict__ in, const W* __restrict__ q,
                                          const float* __restrict__ scale, const S* __restrict__ b, S* __restrict__ y,
                                          int n, int64_t n_in, int64_t n_out, int kc, float* xs, bool add) {
  constexpr int G = kGroup<W>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + warp) * kRows;

  float acc[kRows][NB];
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[i][j] = 0.f;

  for (int64_t k0 = 0; k0 < n_in; k0 += kc) {
    const int len = int(std::min<int64_t>(kc, n_in - k0));
    const int groups = (len + G - 1) / G;
    const int cols = groups * G;  // staged columns (zeros past n_in)
    __syncthreads();              // the previous chunk is consumed
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int j = idx / cols, col = idx - j * cols;
      xs[j * kc + swz<W>(col)] = col < len ? ld(in, int64_t(j) * n_in + k0 + col) : 0.f;
    }
    __syncthreads();

    // Steps over the lane's groups c = lane + 32 s, the next step's weights loaded before this one's math.
    const int steps = (groups + 31) / 32;
    uint4 w[kRows], wn[kRows];
    load_w<W, VEC>(w, q, row0, n_out, n_in, k0, lane, groups);
    for (int s = 0; s < steps; ++s) {
      const int c = lane + 32 * s;
      const bool more = s + 1 < steps;
      if (more) load_w<W, VEC>(wn, q, row0, n_out, n_in, k0, c + 32, groups);
      if (c < groups) fma_step<W, NB>(acc, w, xs, kc, c, n);
      if (more)
#pragma unroll
        for (int i = 0; i < kRows; ++i) w[i] = wn[i];
    }
  }

#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = row0 + i;
    float sc = 1.f;  // weights in the activation type: no scale
    if constexpr (kScaled<W>) sc = r < n_out ? scale[r] : 0.f;
    const float bias = (b && r < n_out) ? ld(b, r) : 0.f;
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      if (j >= n) break;
      float v = acc[i][j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (r < n_out && lane == ((i * NB + j) & 31)) store_y(y, int64_t(j) * n_out + r, v * sc + bias, add);
    }
  }
}

// The slot-th expert (in order) that has rows, -1 when fewer have: one warp's ballots over start.
__device__ __forceinline__ int busy_expert(const int32_t* __restrict__ start, int E, int slot) {
  const int lane = threadIdx.x & 31;
  for (int e0 = 0; e0 < E; e0 += 32) {
    const int e = e0 + lane;
    const bool busy = e < E && start[e + 1] > start[e];
    const unsigned m = __ballot_sync(0xffffffffu, busy);
    if (slot < __popc(m)) {
      const unsigned hit = __ballot_sync(0xffffffffu, busy && __popc(m & ((1u << lane) - 1)) == slot);
      return e0 + __ffs(int(hit)) - 1;
    }
    slot -= __popc(m);
  }
  return -1;
}

// start null: one matrix, n rows of in. Else experts: blockIdx.y picks the blockIdx.y-th expert with rows (q, scale
// and the rows of in and y its own), whose rows go through n at a time (n <= NB; an expert's rows are at most R).
template <class S, class W, int NB, bool VEC>
__global__ void __launch_bounds__(kWarps * 32, 2)
    k_gemv(const S* __restrict__ in, const W* __restrict__ q, const float* __restrict__ scale,
           const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in, int64_t n_out, int kc,
           const int32_t* __restrict__ start, int E, bool add) {
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  if (!start) return gemv_rows<S, W, NB, VEC>(in, q, scale, b, y, n, n_in, n_out, kc, xs, add);
  const int e = busy_expert(start, E, int(blockIdx.y));
  if (e < 0) return;
  const int64_t r1 = start[e + 1];
  for (int64_t r = start[e]; r < r1; r += n)
    gemv_rows<S, W, NB, VEC>(in + r * n_in, q + int64_t(e) * n_out * n_in,
                             kScaled<W> ? scale + int64_t(e) * n_out : nullptr, b, y + r * n_out,
                             int(min(int64_t(n), r1 - r)), n_in, n_out, kc, xs, add);
}

// n: rows of in (experts: at most NB per pass); start/E: the experts (null: one matrix), R their rows.
template <class S, class W, int NB>
void launch_nb(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int n, int64_t n_in,
               int64_t n_out, const int32_t* start, int64_t E, int64_t R, bool add) {
  constexpr int64_t step = kStep<W>;
  // Columns staged per chunk: a multiple of the step (keeps the swizzle's 128-byte rows), all of n_in when it fits.
  const int64_t fit = std::max<int64_t>(step, int64_t(kSmemBudget / (sizeof(float) * size_t(n))) / step * step);
  const int kc = int(std::min<int64_t>(fit, std::max<int64_t>(step, (n_in + step - 1) / step * step)));
  const size_t smem = sizeof(float) * size_t(n) * size_t(kc);
  // Every row (and expert) starts 16-byte aligned when a row is a multiple of 16 bytes and q is aligned.
  const bool vec = n_in % kGroup<W> == 0 && aligned16(q);
  const dim3 grid(unsigned((n_out + kWarps * kRows - 1) / (kWarps * kRows)), start ? unsigned(std::min(E, R)) : 1u);
  auto go = [&](auto kernel) {
    launch(kernel, grid, kWarps * 32, smem, stream_of(x), in, q, scale, b, y, n, n_in, n_out, kc, start, int(E), add);
  };
  if (vec) go(k_gemv<S, W, NB, true>);
  else go(k_gemv<S, W, NB, false>);
}

// The CUDA-core GEMV (fp32 FMAs) for n <= kMaxN rows of in (experts: up to n rows per expert and pass, start[E+1] on the device, R rows in
// all, E <= 65535), NB the smallest bucket that holds n. W: int8_t or __nv_fp8_e4m3 with its scale, or S (scale null,
// unread). The path of fp32 activations; gemv() sends 16-bit ones to gemv_tc (kept callable for
// A/B benchmarks: tools/gpu/gemv_bench.cu).
template <class S, class W>
void gemv_simt(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
          int64_t n_out, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0, bool add = false) {
  static_assert(kWeightOk<W>, "wgemv: weights are int8, fp8, fp32, bf16 or fp16");
  static_assert(kScaled<W> || std::is_same_v<W, S>, "wgemv: weights int8, fp8 or the activation type");
  const int m = int(n);
  if (m <= 1) launch_nb<S, W, 1>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, add);
  else if (m <= 2) launch_nb<S, W, 2>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, add);
  else if (m <= 4) launch_nb<S, W, 4>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, add);
  else if (m <= 8) launch_nb<S, W, 8>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, add);
  else launch_nb<S, W, 16>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, add);
}


// ---- tensor-core GEMV (16-bit activations) -------------------------------------------------------------------------
// The CUDA-core GEMV above spends one or more conversions per weight plus an FMA per weight and x row: on an H200 it
// is instruction bound at 2-2.8 TB/s. Here the weights are the A operand of mma.m16n8k16 (16 output rows a tile), x
// the B operand (x rows 0-7 one n-tile, 8-15 a second), fp32 accumulators; per 16 weight bytes a lane spends 2-4
// conversion instructions and 1-2 mmas per n-tile (gemv_tc_map.hpp: the index mapping, no shuffles).
//  - weights: 8-bit to f16 exactly (fp8: cvt.rn.f16x2.e4m3x2; int8: the byte biased to unsigned placed in the low
//    mantissa byte of 1024 (0x64xx halves), 1024 + 128 subtracted: no I2F); bf16/fp16 weights go in as they are
//    (bf16 mma for bf16).
//  - x is staged per block in shared memory as the mma's type. bf16 x against 8-bit weights (f16 mma) is scaled per
//    x row by a power of two 2^-e with max|x| 2^-e in [2^13, 2^14) (no f16 overflow, values down to max * 2^-27
//    still normal f16: exact), the row's sums multiplied back by 2^e; f16 x and bf16-on-bf16 need no scaling.
//  - a block of K::kWarps warps owns K::kMt 16-row tiles; the warps split K: warp w takes the warp steps (4 G columns
//    each) w, w + kWarps, ..., keeping K::kDepth steps of 16-byte loads in flight (the next steps' weights are issued
//    before the current step's mmas, and across x chunks). The warps' partial sums are added through shared memory.
//  - x is staged kc columns at a time when n rows do not fit kTcSmemBudget (each chunk its own scale exponent: the
//    chunk's sums are folded into the total with it).
//  - the kernel is launched programmatically dependent (launch_pdl): a dense block prefetches its first 32 KiB of
//    weights into L2 (cp.async.bulk.prefetch) before it waits for the kernel before it (pdl_wait), so the weight
//    stream starts while the RMSNorm, SwiGLU or attention that produces x still runs (one stream of the 8B fp8:
//    3.83 ms a token against 3.95 with Q3VL_PDL=0). Prefetching further ahead in the loop as well (4 or 8 rounds of
//    every warp's steps) halved the GEMV's bandwidth in gemv_bench (eleventh session): the loads alone stream.
template <int WARPS, int MT, int DEPTH> struct TcKnobs {
  static_assert(WARPS >= 1 && WARPS <= 32 && MT >= 1 && DEPTH >= 1, "wgemv: knobs");
  static constexpr int kWarps = WARPS, kMt = MT, kDepth = DEPTH;
};
struct TcAuto {};  // the default knobs by shape (launch_knobs)
// The knobs by shape (TcAuto), from tools/gpu/gemv_bench on an H200 (2026-12-03, tenth session's call 1,
// docs/PERFORMANCE.md): experts and wide matrices (n_out >= 12288: gate_up, the LM head) take 4 warps and two row
// tiles a block, loads 2 deep (enough blocks either way; two tiles amortize the staged x). Narrower matrices have
// fewer row tiles than the GPU has warp slots: up to 6144 rows (the 8B's qkv) 4 warps with one tile and loads 4 deep
// up to 8 x rows; up to 4096 rows (o_proj, down) 8 warps splitting K, one tile 4 deep up to 8 x rows (fp8 down at one
// row 21.5 us against 26.4 with 4 warps), else two tiles 2 deep. The kernels take ~168 registers (ptxas, CUDA 13:
// capping them at 128 for two 8-warp blocks an SM spills), so 8-warp blocks run one an SM, 4-warp ones three.
using TcWide = TcKnobs<4, 2, 2>;
using TcNarrowFew = TcKnobs<4, 1, 4>;
using TcNarrowMany = TcKnobs<8, 2, 2>;
using TcSmallFew = TcKnobs<8, 1, 4>;

constexpr size_t kTcSmemBudget = 64 << 10;  // staged x per block: three blocks a Hopper SM at n 16

template <class W> inline constexpr int kTcStep = 4 * kGroup<W>;  // columns of a warp step: 64 (8-bit), 32 (16-bit)
template <class W> inline constexpr int kTcMmas = kGroup<W> / 4;  // mmas per group and n-tile: 4, 2
// Row stride pad of staged x (halves): a row is a multiple of 128 bytes plus 16 (8-bit: a lane reads 32 bytes at
// 32 t, two rows a quarter-warp) or plus 64 (16-bit: 16 bytes at 16 t), so a quarter-warp's 16-byte reads hit 8
// distinct bank groups.
template <class W> inline constexpr int kTcPad = sizeof(W) == 1 ? 8 : 32;
template <class W> using TcType = std::conditional_t<std::is_same_v<W, __nv_bfloat16>, __nv_bfloat16, __half>;
template <class S, class W>
inline constexpr bool kTcRescale = std::is_same_v<S, __nv_bfloat16> && sizeof(W) == 1;
template <class S, class W>
inline constexpr bool kTcOk = (std::is_same_v<S, __nv_bfloat16> || std::is_same_v<S, __half>) &&
                              (kScaled<W> || std::is_same_v<W, S>);

// A register of mma m, pair p (tc_pair) from one row's 16-byte group: two weights as f16x2 / bf16x2, low half the
// lower column.
template <class W>
__device__ __forceinline__ uint32_t a_reg(const uint4& v, int m, int p) {
  const int e = tc_pair(m, p);  // even: a 16-bit pair never straddles a word
  if constexpr (sizeof(W) == 2) {
    return word_of(v, e / 2);
  } else {
    const uint32_t w = word_of(v, e / 4);
    const bool hi = (e & 2) != 0;
    if constexpr (std::is_same_v<W, int8_t>) {
      // bytes b0 b1 ^ 0x80 into 0x64xx halves: 1024 + (b + 128), minus 1152 = b (exact in f16)
      const uint32_t h2 = __byte_perm(w ^ 0x80808080u, 0x64646464u, hi ? 0x4342u : 0x4140u);
      const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&h2), __half2(__half(1152.f), __half(1152.f)));
      return *reinterpret_cast<const uint32_t*>(&r);
    } else {
      const __half2_raw r =
          __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(hi ? w >> 16 : w & 0xffffu), __NV_E4M3);
      return uint32_t(r.x) | (uint32_t(r.y) << 16);
    }
  }
}

// One warp step: MT row tiles (w[mt][0] row g, w[mt][1] row g + 8) against the NB/8 n-tiles of staged x; xp points
// at the lane's group (column t G of the step) in x row 0, rows rs halves apart; x rows >= n read as zeros.
template <class W, int NB, int MT>
__device__ __forceinline__ void tc_step(float (&acc)[MT][NB / 8][4], const uint4 (&w)[MT][2], const uint16_t* xp,
                                        int rs, int n, int g) {
  using T = TcType<W>;
  constexpr int NT = NB / 8, G = kGroup<W>;
  uint32_t xb[NT][G / 2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int j = nt * 8 + g;
#pragma unroll
    for (int v = 0; v < G / 8; ++v) {
      const uint4 u = j < n ? reinterpret_cast<const uint4*>(xp + j * rs)[v] : make_uint4(0, 0, 0, 0);
      xb[nt][4 * v] = u.x, xb[nt][4 * v + 1] = u.y, xb[nt][4 * v + 2] = u.z, xb[nt][4 * v + 3] = u.w;
    }
  }
#pragma unroll
  for (int m = 0; m < kTcMmas<W>; ++m) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      uint32_t a[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = a_reg<W>(w[mt][r & 1], m, r >> 1);  // frag_a_row: g + 8 (r & 1)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma<T>(acc[mt][nt], a, xb[nt][tc_pair(m, 0) / 2], xb[nt][tc_pair(m, 1) / 2]);
    }
  }
}

// How the tensor-core GEMV reads its x rows (dev::RowsIn on the device; the decode fusions of the MLP and the MoE
// block): row r of the product is x[r] (default), x[rows[r] / div] (gather: the routed tokens' rows, no gather_rows
// pass), silu(gate) * up of row r of a [R, 2 n_in] gate|up input rounded to S as swiglu_fwd rounds it (no SwiGLU
// pass, no [R, n_in] activation written and read back), or x[r] RMS-normalized with weights norm, rounded to S as
// rmsnorm_fwd rounds it (the residual stream's norm before qkv and gate_up: no norm pass; tc_stage).
struct XRows {
  const int32_t* rows = nullptr;
  int div = 1;
  bool swiglu = false;
  const void* norm = nullptr;  // RMSNorm weights [n_in] in S (dev::RowsIn's norm): x staged whole, then normalized
  float eps = 0.f;
};
inline XRows x_rows(const RowsIn& r) { return {r.rows, int(r.div), r.swiglu, r.norm, r.eps}; }

// One 8-element vector of x row src at column c (zeros at and past len). NC: read through the non-coherent path (x
// written before the kernel began); else at L2 (x written by other blocks of a persistent kernel: gemv_chain.cuh).
template <class S, bool NC = true>
__device__ __forceinline__ uint4 x_vec(const S* __restrict__ src, int c, int len, bool vec_x) {
  if (vec_x && c + 8 <= len) {
    const uint4* p = reinterpret_cast<const uint4*>(src + c);
    return NC ? __ldg(p) : __ldcg(p);
  }
  const unsigned short* s16 = reinterpret_cast<const unsigned short*>(src);
  uint32_t e[4] = {0, 0, 0, 0};
#pragma unroll
  for (int k = 0; k < 8; ++k)
    if (c + k < len) e[k / 2] |= uint32_t(NC ? s16[c + k] : __ldcg(s16 + c + k)) << (16 * (k % 2));
  return make_uint4(e[0], e[1], e[2], e[3]);
}

constexpr int kTcStageLoads = 4;  // x vectors a lane has in flight while staging

// tc_stage's barrier: the whole block's, or (gemv_chain) the named barrier of the warps that stage.
struct SyncCta {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// Row r of the product's input from x (XRows): its element at column k0 (SwiGLU: the gate's; the up half is n_in on).
template <class S>
__device__ __forceinline__ const S* x_row(const S* __restrict__ x, const XRows& xr, int64_t r, int64_t n_in,
                                          int64_t k0) {
  const int64_t src = xr.rows ? int64_t(xr.rows[r] / xr.div) : r;
  return x + src * (xr.swiglu ? 2 * n_in : n_in) + k0;
}

// The 16-bit value of S in the low half of u, as fp32.
template <class S>
__device__ __forceinline__ float s_f32(uint32_t u) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) return __uint_as_float(u << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu)));
}
// f(a_k, b_k) of two vectors of 8 S values, rounded to S.
template <class S, class F>
__device__ __forceinline__ uint4 map8(const uint4& a, const uint4& b, F f) {
  const uint32_t* aw = &a.x;
  const uint32_t* bw = &b.x;
  uint4 r;
  uint32_t* rw = &r.x;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int sh = 16 * (k % 2);
    const S y = S(f(s_f32<S>(aw[k / 2] >> sh), s_f32<S>(bw[k / 2] >> sh)));
    const uint32_t yb = *reinterpret_cast<const uint16_t*>(&y);
    rw[k / 2] = k % 2 ? (rw[k / 2] & 0xffffu) | (yb << 16) : yb;
  }
  return r;
}
// silu(g) * u of 8 elements (gate and up vectors of S bits), rounded to S: swiglu_fwd's formula and rounding.
template <class S>
__device__ __forceinline__ uint4 swiglu8(const uint4& g, const uint4& u) {
  return map8<S>(g, u, [](float gf, float uf) { return silu_mul(gf, uf); });
}
// w * (x * r) of 8 S values rounded to S: rmsnorm_fwd's formula and rounding.
template <class S>
__device__ __forceinline__ uint4 norm8(const uint4& x, const uint4& w, float r) {
  return map8<S>(x, w, [r](float xf, float wf) { return wf * (xf * r); });
}
// Sum of squares of 8 S values.
template <class S>
__device__ __forceinline__ float sumsq8(const uint4& v) {
  const uint32_t* w = &v.x;
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float f = s_f32<S>(w[k / 2] >> (16 * (k % 2)));
    ss = fmaf(f, f, ss);
  }
  return ss;
}

// Stages rows r0 .. r0+n-1 of the input (x_row), columns [k0, k0+len), into xs (row j at j rs halves, as the mma
// type; zeros from len to the end of the last warp step) and xmul[j] = 2^e_j, the factor that undoes row j's
// scaling. Every warp takes part, also for one row: gw = WARPS / n warps a row (at least one), each lane keeping
// kTcStageLoads 16-byte loads in flight, so that staging costs a few L2 round trips, not one a vector (one warp
// staging a 12288-column row alone took ~10 us, a third of the 8B's fp8 down_proj). wmax: 32 words, the warps'
// partial max |x| of each row (with a norm first their partial sums of squares).
// A norm (xr.norm: the whole row staged, k0 0 and len n_in) takes two more passes over the staged rows: each row's
// 1 / rms from the warps' partial sums into xmul[j], then every lane normalizes its own vectors in place. Each block
// computes the norm again (a few us of L2 reads and shared memory against a kernel of its own).
template <class S, class W, int WARPS, bool NC = true, class Sync = SyncCta>
__device__ __forceinline__ void tc_stage(const S* __restrict__ in, const XRows& xr, int64_t r0, int n, int64_t n_in,
                                         int64_t k0, int len, bool vec_x, uint16_t* xs, int rs, float* xmul,
                                         uint32_t* wmax, Sync sync = {}) {
  constexpr int U = kTcStageLoads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nv = (len + kTcStep<W> - 1) / kTcStep<W> * kTcStep<W> / 8;  // 8-element vectors
  const int gw = max(1, WARPS / n), par = WARPS / gw;                    // warps a row, rows at once
  const int wg = warp / gw, wi = warp % gw, step = 32 * gw;
  const bool norm = xr.norm != nullptr;
  const auto vmax = [](uint32_t mx, const uint4& u) {  // max |x| as bf16 bits, per half
    mx = __vmaxu2(mx, u.x & 0x7fff7fffu), mx = __vmaxu2(mx, u.y & 0x7fff7fffu);
    return __vmaxu2(__vmaxu2(mx, u.z & 0x7fff7fffu), u.w & 0x7fff7fffu);
  };
  // The warp's partial max |x| of row j (a lane's two per-half maxima) into wmax.
  const auto put_max = [&](int j, uint32_t mx) {
    mx = max(mx & 0xffffu, mx >> 16);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) wmax[j * gw + wi] = mx;  // j gw + wi < max(n, WARPS) <= 32
  };
  // The warp's partial max (or, with a norm, its partial sum of squares) of row j into wmax.
  const auto partial = [&](int j, uint32_t mx, float ss) {
    if (norm) {
      ss = warp_sum(ss);
      if (lane == 0) wmax[j * gw + wi] = __float_as_uint(ss);
    } else if constexpr (kTcRescale<S, W>) {
      put_max(j, mx);
    }
  };
  if (wg < par) {
    for (int j = wg; j < n; j += par) {
      const S* src = x_row(in, xr, r0 + j, n_in, k0);
      uint16_t* dst = xs + j * rs;
      uint32_t mx = 0;
      float ss = 0.f;
      for (int v0 = wi * 32 + lane; v0 < nv; v0 += U * step) {
        uint4 u[U];
#pragma unroll
        for (int q = 0; q < U; ++q) {
          const int v = v0 + q * step;
          if (v >= nv) u[q] = make_uint4(0, 0, 0, 0);
          else if (xr.swiglu) u[q] = swiglu8<S>(x_vec<S, NC>(src, 8 * v, len, vec_x),
                                                   x_vec<S, NC>(src + n_in, 8 * v, len, vec_x));
          else u[q] = x_vec<S, NC>(src, 8 * v, len, vec_x);
          // the norm's weights of this vector, read after the row's sum: into L1 now, under the x loads
          if (norm && 8 * v < len)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const S*>(xr.norm) + 8 * v));
        }
#pragma unroll
        for (int q = 0; q < U; ++q) {
          const int v = v0 + q * step;
          if (v >= nv) break;
          if (norm) ss += sumsq8<S>(u[q]);
          else if constexpr (kTcRescale<S, W>) mx = vmax(mx, u[q]);
          *reinterpret_cast<uint4*>(dst + 8 * v) = u[q];
        }
      }
      partial(j, mx, ss);
    }
  }
  if (norm) {
    sync();  // every row's partial sums are in
    if (threadIdx.x < n) {
      float ss = 0.f;
      for (int i = 0; i < gw; ++i) ss += __uint_as_float(wmax[threadIdx.x * gw + i]);
      xmul[threadIdx.x] = 1.f / sqrtf(ss / float(n_in) + xr.eps);  // rmsnorm_fwd's 1 / rms
    }
    sync();  // the rows' 1 / rms are in; wmax is free
    if (wg < par) {
      const S* w = static_cast<const S*>(xr.norm);
      for (int j = wg; j < n; j += par) {
        const float r = xmul[j];
        uint16_t* dst = xs + j * rs;
        uint32_t mx = 0;
        for (int v = wi * 32 + lane; v < nv; v += step) {  // the lane's own vectors, as staged above
          const uint4 u = norm8<S>(*reinterpret_cast<const uint4*>(dst + 8 * v), x_vec(w, 8 * v, len, vec_x), r);
          if constexpr (kTcRescale<S, W>) mx = vmax(mx, u);
          *reinterpret_cast<uint4*>(dst + 8 * v) = u;
        }
        if constexpr (kTcRescale<S, W>) put_max(j, mx);
      }
    }
    if constexpr (!kTcRescale<S, W>) sync();  // xmul's 1 / rms are read before it is set to 1
  }
  if constexpr (!kTcRescale<S, W>) {
    if (threadIdx.x < n) xmul[threadIdx.x] = 1.f;
    return;
  }
  sync();  // every row's partial maxima and vectors are in
  if (wg >= par) return;
  for (int j = wg; j < n; j += par) {
    uint32_t mx = 0;
    for (int i = 0; i < gw; ++i) mx = max(mx, wmax[j * gw + i]);
    // max|x| in [2^(b-127), 2^(b-126)) for biased exponent b: e = b - 140 puts it in [2^13, 2^14). Zero, Inf or
    // NaN: e = 0 (Inf/NaN propagate as they would). Clamped so that 2^-e and 2^e are normal floats.
    const int b = int(mx >> 7);
    const int e = (mx == 0 || mx >= 0x7f80u) ? 0 : max(max(b, 1) - 140, -100);
    const float down = __int_as_float((127 - e) << 23);
    uint16_t* dst = xs + j * rs;
    for (int v = wi * 32 + lane; v < nv; v += step) {  // the lane's own vectors: no other lane touched them
      uint4 u = *reinterpret_cast<uint4*>(dst + 8 * v);
      uint32_t* pw = &u.x;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const __half2 h = __floats2half2_rn(__uint_as_float(pw[k] << 16) * down,
                                            __uint_as_float(pw[k] & 0xffff0000u) * down);
        pw[k] = *reinterpret_cast<const uint32_t*>(&h);
      }
      *reinterpret_cast<uint4*>(dst + 8 * v) = u;
    }
    if (wi == 0 && lane == 0) xmul[j] = __int_as_float((127 + e) << 23);
  }
}

constexpr int kTcHeader = 64 + 128;  // smem before the staged x: xmul (16 floats), wmax (32 words)

// Warp step i of the calling warp (over all of K) of the block's rows row0 on: columns (warp + WARPS i) STEP +
// [0, STEP), the lane's group at t G.
template <class W, class K, bool VEC>
__device__ __forceinline__ void tc_load_step(uint4 (&w)[K::kMt][2], const W* __restrict__ q, int64_t row0,
                                             int64_t n_out, int64_t n_in, int64_t i) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t col = (warp + int64_t(K::kWarps) * i) * kTcStep<W> + t * kGroup<W>;
#pragma unroll
  for (int mt = 0; mt < K::kMt; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) w[mt][h] = load_group<W, VEC>(q, row0 + mt * 16 + g + 8 * h, n_out, n_in, col);
}

// Columns [c0, c1) of the block's rows row0 .. row0 + 16 K::kMt - 1 into L2 (cp.async.bulk.prefetch), thread r
// row row0 + r; whole 16-byte rows only (VEC), nothing past the matrix. A hint: L2 is where every write lands, so
// a prefetch issued before the writer finished cannot make a later load stale.
template <class W, class K, bool VEC>
__device__ __forceinline__ void tc_prefetch(const W* __restrict__ q, int64_t row0, int64_t n_out, int64_t n_in,
                                            int64_t c0, int64_t c1) {
  if constexpr (VEC) {
    const int64_t r = row0 + threadIdx.x, e = std::min(c1, n_in);
    if (threadIdx.x < 16 * K::kMt && r < n_out && c0 < e) {
      const uint32_t bytes = uint32_t((e - c0) * int64_t(sizeof(W)));
      l2_prefetch(q + r * n_in + c0, bytes);
    }
  }
}
// What a dense block prefetches before it waits for its x (launch_pdl): the first 32 KiB of its rows.
template <class W, class K>
inline constexpr int64_t kTcEarlyCols = (32 << 10) / (16 * K::kMt * int64_t(sizeof(W)));

// The ring: the block's first K::kDepth warp steps.
template <class W, class K, bool VEC>
__device__ __forceinline__ void tc_preload(uint4 (&ring)[K::kDepth][K::kMt][2], const W* __restrict__ q,
                                           int64_t row0, int64_t n_out, int64_t n_in) {
#pragma unroll
  for (int d = 0; d < K::kDepth; ++d) tc_load_step<W, K, VEC>(ring[d], q, row0, n_out, n_in, d);
}

// The decode chain's epilogues (gemv_chain.cuh): yf set, the sums in fp32 into yf [n, n_out] in place of y (a MoE
// link's router logits); rw set, a pair's SwiGLU of gate row rg times rw[rg / seg] (a pick's weight), rounded once;
// sg set, the tile's 16 row scales in shared memory (a pair's: its 8 gate rows', then their 8 up rows') in place of
// scale's.
struct TcEpi {
  float* yf = nullptr;
  const float* rw = nullptr;
  int64_t seg = 1;
  const float* sg = nullptr;
};

// The end of a tile: the WARPS warps' fragments acc (MT x NT m16n8 tiles of rows row0 on) added through red
// (WARPS MT NT 128 floats: element ((mt NT + nt) 4 + i) 32 + lane of each warp) and stored as y[j n_out + r] =
// sum xmul[j] scale[r] + b[r] for r < n_out, j < n (xmul null: 1; scale only for scaled weights; add: added to y,
// store_y). sync: the barrier of the warps taking part, which the caller has passed before red is written.
// half > 0: a SwiGLU pair (gemv_chain.cuh): each m16 tile's rows g are gate rows (row0 + 16 mt) / 2 + g of W, its rows
// g + 8 the up rows half on from them, and y [n, half] = silu(gate) * up of the two rounded to S (swiglu_fwd's
// arithmetic on gate_up's stored rows); add unused. ep: the chain's MoE links' epilogues.
template <class S, class W, int MT, int NT, int WARPS, class Sync>
__device__ __forceinline__ void tc_store(const float (&acc)[MT][NT][4], float* red, int warp, int64_t row0,
                                         const float* __restrict__ scale, const S* __restrict__ b,
                                         const float* xmul, S* __restrict__ y, int n, int64_t n_out, bool add,
                                         Sync sync, int64_t half = 0, const TcEpi& ep = {}) {
  constexpr int EL = MT * NT * 4 * 32;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp * EL + ((mt * NT + nt) * 4 + i) * 32 + lane] = acc[mt][nt][i];
  sync();
  for (int e = threadIdx.x; e < EL; e += WARPS * 32) {
    if (half && (e & 64)) continue;  // a pair's up rows (fragment rows g + 8, i >= 2) go with their gate rows
    float v = 0.f;
    for (int w = 0; w < WARPS; ++w) v += red[w * EL + e];
    const int ln = e & 31, i = (e >> 5) & 3, tile = e >> 7, nt = tile % NT, mt = tile / NT;
    const int j = nt * 8 + frag_c_n(ln, i);
    if (half) {
      const int64_t rg = (row0 + mt * 16) / 2 + frag_c_row(ln, i), ru = half + rg;
      if (rg >= half || j >= n) continue;
      float u = 0.f;
      for (int w = 0; w < WARPS; ++w) u += red[w * EL + e + 64];
      float sg = xmul ? xmul[j] : 1.f, su = sg;
      if constexpr (kScaled<W>) {
        const int64_t k = rg - row0 / 2;
        sg *= ep.sg ? ep.sg[k] : scale[rg], su *= ep.sg ? ep.sg[8 + k] : scale[ru];
      }
      const float g = round_to<S>(v * sg + (b ? ld(b, rg) : 0.f)), up = round_to<S>(u * su + (b ? ld(b, ru) : 0.f));
      st(y, int64_t(j) * half + rg, ep.rw ? silu_mul(g, up) * ep.rw[rg / ep.seg] : silu_mul(g, up));
      continue;
    }
    const int64_t r = row0 + mt * 16 + frag_c_row(ln, i);
    if (r >= n_out || j >= n) continue;
    float sc = xmul ? xmul[j] : 1.f;  // weights in the activation type: no scale
    if constexpr (kScaled<W>) sc *= ep.sg ? ep.sg[r - row0] : scale[r];
    if (ep.yf) {
      ep.yf[int64_t(j) * n_out + r] = v * sc;
      continue;
    }
    store_y(y, int64_t(j) * n_out + r, v * sc + (b ? ld(b, r) : 0.f), add);
  }
}

// One block's 16 K::kMt rows (blockIdx.x) of y = (in q^T) * scale + b for n <= NB rows of the input (rows r0 on,
// read through xr). smem: xmul (16 floats), wmax (32 words), then staged x (n rows of rs halves, kc columns a
// chunk); the warps' partial sums reuse it at the end. The block synchronizes before it stages, so it may be called
// again on other rows (experts). ring: the first K::kDepth steps' weights (tc_preload).
template <class S, class W, int NB, class K, bool VEC>
__device__ __forceinline__ void tc_rows(const S* __restrict__ in, const XRows& xr, int64_t r0,
                                        const W* __restrict__ q, const float* __restrict__ scale,
                                        const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in, int64_t n_out,
                                        int kc, int rs, bool vec_x, bool add, char* smem,
                                        uint4 (&ring)[K::kDepth][K::kMt][2]) {
  constexpr int NT = NB / 8, MT = K::kMt, WARPS = K::kWarps, D = K::kDepth, G = kGroup<W>, STEP = kTcStep<W>;
  float* xmul = reinterpret_cast<float*>(smem);
  uint32_t* wmax = reinterpret_cast<uint32_t*>(smem + 64);
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem + kTcHeader);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t row0 = int64_t(blockIdx.x) * (16 * MT);

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.f;

  const int per_chunk = kc / (STEP * WARPS);  // warp steps a chunk: a multiple of D (kc: of STEP WARPS D)
  int64_t i_base = 0;
  for (int64_t k0 = 0; k0 < n_in; k0 += kc, i_base += per_chunk) {
    const int len = int(std::min<int64_t>(kc, n_in - k0));
    __syncthreads();  // the previous chunk (or rows, or partial sums) consumed
    tc_stage<S, W, WARPS>(in, xr, r0, n, n_in, k0, len, vec_x, xs, rs, xmul, wmax);
    __syncthreads();
    float part[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) part[mt][nt][0] = part[mt][nt][1] = part[mt][nt][2] = part[mt][nt][3] = 0.f;
    for (int i0 = 0; i0 < per_chunk; i0 += D) {
      // Only the last chunk ends early; the ring's contents past it are never used.
      if ((warp + WARPS * i0) * STEP >= len) break;
#pragma unroll
      for (int d = 0; d < D; ++d) {
        const int cs = (warp + WARPS * (i0 + d)) * STEP;  // the step's first column in the chunk
        if (cs < len) tc_step<W, NB, MT>(part, ring[d], xs + cs + t * G, rs, n, g);
        tc_load_step<W, K, VEC>(ring[d], q, row0, n_out, n_in, i_base + i0 + d + D);
      }
    }
    // part holds sums of scaled x: undo each x row's 2^-e (frag_c_n: the lane's x rows)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int j = nt * 8 + frag_c_n(lane, i);
        const float f = j < n ? xmul[j] : 0.f;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][nt][i] = fmaf(part[mt][nt][i], f, acc[mt][nt][i]);
      }
  }

  __syncthreads();  // every warp is done reading xs and xmul
  tc_store<S, W, MT, NT, WARPS>(acc, reinterpret_cast<float*>(smem), warp, row0, scale, b, nullptr, y, n, n_out, add,
                                [] { __syncthreads(); });
}

// As k_gemv: start null, one matrix; else blockIdx.y picks the blockIdx.y-th expert with rows, n rows a pass. The
// input rows are read through xr. Launched programmatically dependent (launch_pdl): a dense block prefetches its
// first weights into L2 before pdl_wait (loads into registers wait: the kernel before may have written them);
// experts need start, the kernel before's output, first.
template <class S, class W, int NB, class K, bool VEC>
__global__ void __launch_bounds__(K::kWarps * 32, 1)
    k_gemv_tc(const S* __restrict__ in, const W* __restrict__ q, const float* __restrict__ scale,
              const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in, int64_t n_out, int kc, int rs,
              bool vec_x, const int32_t* __restrict__ start, int E, XRows xr, bool add) {
  extern __shared__ float4 smem_tc[];
  char* smem = reinterpret_cast<char*>(smem_tc);
  uint4 ring[K::kDepth][K::kMt][2];
  if (!start) {
    const int64_t row0 = int64_t(blockIdx.x) * (16 * K::kMt);
    tc_prefetch<W, K, VEC>(q, row0, n_out, n_in, 0, kTcEarlyCols<W, K>);
    pdl_wait();
    pdl_trigger();
    tc_preload<W, K, VEC>(ring, q, row0, n_out, n_in);
    return tc_rows<S, W, NB, K, VEC>(in, xr, 0, q, scale, b, y, n, n_in, n_out, kc, rs, vec_x, add, smem, ring);
  }
  pdl_wait();
  pdl_trigger();
  const int e = busy_expert(start, E, int(blockIdx.y));
  if (e < 0) return;
  const int64_t r1 = start[e + 1];
  const W* qe = q + int64_t(e) * n_out * n_in;
  for (int64_t r = start[e]; r < r1; r += n) {
    tc_preload<W, K, VEC>(ring, qe, int64_t(blockIdx.x) * (16 * K::kMt), n_out, n_in);
    tc_rows<S, W, NB, K, VEC>(in, xr, r, qe, kScaled<W> ? scale + int64_t(e) * n_out : nullptr, b, y + r * n_out,
                              int(min(int64_t(n), r1 - r)), n_in, n_out, kc, rs, vec_x, add, smem, ring);
  }
}

// Whether every x row (SwiGLU's up halves, the norm's weights) starts 16-byte aligned and is read in 8-element vectors.
template <class S>
bool x_vectors(const S* in, const XRows& xr, int64_t n_in) {
  return n_in % 8 == 0 && aligned16(in) && (!xr.norm || aligned16(xr.norm));
}
// Whether launch_tc stages n rows of n_in columns of x in one chunk, whatever the knobs (a chunk is a multiple of
// every knob's super-step, all of which divide 2048 columns): a norm needs the whole row.
inline bool tc_one_chunk(int64_t n, int64_t n_in) {
  return int64_t(kTcSmemBudget / (2 * size_t(std::max<int64_t>(n, 1)))) / 2048 * 2048 >= n_in;
}

template <class S, class W, int NB, class K>
void launch_tc(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int n, int64_t n_in,
               int64_t n_out, const int32_t* start, int64_t E, int64_t R, const XRows& xr, bool add) {
  constexpr int64_t super = int64_t(kTcStep<W>) * K::kWarps * K::kDepth;  // a chunk: whole rounds of every warp
  const int64_t fit = std::max<int64_t>(super, int64_t(kTcSmemBudget / (2 * size_t(n))) / super * super);
  const int64_t kc = std::min<int64_t>(fit, std::max<int64_t>(super, (n_in + super - 1) / super * super));
  const int64_t rs = (std::min<int64_t>(kc, std::max<int64_t>(n_in, 1)) + 63) / 64 * 64 + kTcPad<W>;
  const size_t red = sizeof(float) * size_t(K::kWarps) * K::kMt * (NB / 8) * 128;
  const size_t smem = std::max<size_t>(kTcHeader + 2 * size_t(n) * size_t(rs), red);
  const bool vec = n_in % kGroup<W> == 0 && aligned16(q);  // every row and expert starts 16-byte aligned
  const bool vec_x = x_vectors(in, xr, n_in);             // every x row too (and SwiGLU's up halves)
  Q3VL_CHECK(!xr.norm || (kc >= n_in && !start), "wgemv: a norm needs x staged whole (tc_one_chunk), one matrix");
  const dim3 grid(unsigned((n_out + 16 * K::kMt - 1) / (16 * K::kMt)), start ? unsigned(std::min(E, R)) : 1u);
  auto go = [&](auto kernel) {
    launch_pdl(kernel, grid, K::kWarps * 32, smem, stream_of(x), in, q, scale, b, y, n, n_in, n_out, int(kc),
               int(rs), vec_x, start, int(E), xr, add);
  };
  if (vec) go(k_gemv_tc<S, W, NB, K, true>);
  else go(k_gemv_tc<S, W, NB, K, false>);
}

// The n bucket's launch with knobs K (TcAuto: by shape, see TcWide).
template <class S, class W, int NB, class K>
void launch_knobs(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int n, int64_t n_in,
                  int64_t n_out, const int32_t* start, int64_t E, int64_t R, const XRows& xr, bool add) {
  auto go = [&]<class KK>() { launch_tc<S, W, NB, KK>(x, in, q, scale, b, y, n, n_in, n_out, start, E, R, xr, add); };
  if constexpr (!std::is_same_v<K, TcAuto>) go.template operator()<K>();
  else if (start || n_out >= 12288) go.template operator()<TcWide>();
  else if (n_out <= 4096 && n <= 8) go.template operator()<TcSmallFew>();
  else if (n_out <= 4096) go.template operator()<TcNarrowMany>();
  else if (n <= 8) go.template operator()<TcNarrowFew>();
  else go.template operator()<TcWide>();
}

// The tensor-core GEMV, arguments as gemv_simt's, the input rows read through xr; S bf16 or fp16, W int8, fp8 or S.
// K: TcKnobs or TcAuto, a template parameter so that benchmarks can sweep it.
template <class S, class W, class K = TcAuto>
void gemv_tc(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
             int64_t n_out, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0, const XRows& xr = {},
             bool add = false) {
  static_assert(kTcOk<S, W>, "wgemv::gemv_tc: 16-bit activations, weights int8, fp8 or the activation type");
  const int m = int(n);
  if (m <= 8) launch_knobs<S, W, 8, K>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, xr, add);
  else launch_knobs<S, W, 16, K>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R, xr, add);
}

// The GEMV for n <= kMaxN rows of in (experts: up to n rows per expert and pass, start[E+1] on the device, R rows in
// all, E <= 65535), the input rows as ri says (dev::RowsIn). W: int8_t or __nv_fp8_e4m3 with its scale, or S (scale
// null, unread). 16-bit activations take the tensor cores, which read through ri; fp32 ones the CUDA cores, after
// ri's rows are written to ri.scratch.
// Every block that stages a row computes its SwiGLU again (n_out / 16 or 32 blocks a matrix or expert): that beats a
// pass of its own only for a few short rows, one stream's experts (8 rows of 768 for the 30B-A3B: 4.62 -> 4.24 ms a
// token with the gather). 64 streams' 512 rows (17.8 ms a step against 15.2) and the 8B's 12288-wide fp8 down_proj
// (no gain) write it out first.
constexpr int64_t kSwigluRows = 8, kSwigluCols = 4096;

}  // namespace q3vl::dev::cuda::wgemv

#include "tensor/cuda/gemv_tma.cuh"

namespace q3vl::dev::cuda::wgemv {

template <class S, class W>
void gemv(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
          int64_t n_out, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0, RowsIn ri = {},
          bool add = false) {
  if constexpr (kTcOk<S, W>) {
    if ((ri.swiglu && ((start ? R : n) > kSwigluRows || n_in > kSwigluCols)) ||
        (ri.norm && (start || !tc_one_chunk(n, n_in)))) {
      constexpr DType dt = std::is_same_v<S, __half> ? DType::F16 : DType::BF16;
      in = static_cast<const S*>(rows_in(x, in, ri, start ? R : n, n_in, dt));
      ri = {};
    }
    const XRows xr = x_rows(ri);
    if (!start && tma_wanted(n, n_in, n_out, sizeof(W), false) &&
        gemv_tma<S, W>(x, in, q, scale, b, y, n, n_in, n_out, xr, add))
      return;
    gemv_tc<S, W>(x, in, q, scale, b, y, n, n_in, n_out, start, E, R, xr, add);
  } else {
    static_assert(std::is_same_v<S, float>, "wgemv::gemv: the CUDA-core GEMV is for fp32 activations");
    const S* rows = static_cast<const S*>(rows_in(x, in, ri, start ? R : n, n_in, DType::F32));
    gemv_simt<S, W>(x, rows, q, scale, b, y, n, n_in, n_out, start, E, R, add);
  }
}

}  // namespace q3vl::dev::cuda::wgemv
