// The weight-streaming GEMV of decode steps, shared by the int8/fp8 linear and experts (q8.cu) and the bf16/fp16/fp32
// experts (moe.cu): y[n, n_out] = (x[n, n_in] W^T) * scale + b for n <= kMaxN rows, W [n_out, n_in] read once.
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

// Loads the kGroup weights of rows row0..row0+kRows-1 at column group c of the chunk starting at k0 (zeros outside).
template <class W, bool VEC>
__device__ __forceinline__ void load_w(uint4 (&w)[kRows], const W* q, int64_t row0, int64_t n_out, int64_t n_in,
                                       int64_t k0, int c, int groups) {
  constexpr int G = kGroup<W>;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    w[i] = make_uint4(0, 0, 0, 0);
    const int64_t r = row0 + i;
    if (r >= n_out || c >= groups) continue;
    const W* p = q + r * n_in + k0 + int64_t(c) * G;
    if constexpr (VEC) {
      w[i] = ld_stream16(p);  // 16-byte rows and W aligned: every row start is aligned, groups are whole
    } else {
      // The bits of each element, packed as a 16-byte load would have them (zero bits: 0 in every W).
      using U = std::conditional_t<sizeof(W) == 1, uint8_t, std::conditional_t<sizeof(W) == 2, uint16_t, uint32_t>>;
      constexpr int PER = 4 / int(sizeof(W));  // elements per 32-bit word
      const U* pu = reinterpret_cast<const U*>(p);
      const int64_t left = n_in - (k0 + int64_t(c) * G);  // > 0
      uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < G; ++e)
        if (e < left) v[e / PER] |= uint32_t(pu[e]) << (8 * int(sizeof(W)) * (e % PER));
      w[i] = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
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

// One block's rows of y = (in q^T) * scale + b: kWarps warps, warp w owning rows (blockIdx.x * kWarps + w) * kRows +
// [0, kRows). x[n, n_in] staged kc columns at a time into xs (n * kc floats of dynamic shared memory); the block
// synchronizes before it stages, so it may be called again on other rows. scale: 8-bit weights only (else unread).
template <class S, class W, int NB, bool VEC>
__device__ __forceinline__ void gemv_rows(const S* __restrict__ in, const W* __restrict__ q,
                                          const float* __restrict__ scale, const S* __restrict__ b, S* __restrict__ y,
                                          int n, int64_t n_in, int64_t n_out, int kc, float* xs) {
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
      if (r < n_out && lane == ((i * NB + j) & 31)) st(y, int64_t(j) * n_out + r, v * sc + bias);
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
           const int32_t* __restrict__ start, int E) {
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  if (!start) return gemv_rows<S, W, NB, VEC>(in, q, scale, b, y, n, n_in, n_out, kc, xs);
  const int e = busy_expert(start, E, int(blockIdx.y));
  if (e < 0) return;
  const int64_t r1 = start[e + 1];
  for (int64_t r = start[e]; r < r1; r += n)
    gemv_rows<S, W, NB, VEC>(in + r * n_in, q + int64_t(e) * n_out * n_in,
                             kScaled<W> ? scale + int64_t(e) * n_out : nullptr, b, y + r * n_out,
                             int(min(int64_t(n), r1 - r)), n_in, n_out, kc, xs);
}

// n: rows of in (experts: at most NB per pass); start/E: the experts (null: one matrix), R their rows.
template <class S, class W, int NB>
void launch_nb(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int n, int64_t n_in,
               int64_t n_out, const int32_t* start, int64_t E, int64_t R) {
  constexpr int64_t step = kStep<W>;
  // Columns staged per chunk: a multiple of the step (keeps the swizzle's 128-byte rows), all of n_in when it fits.
  const int64_t fit = std::max<int64_t>(step, int64_t(kSmemBudget / (sizeof(float) * size_t(n))) / step * step);
  const int kc = int(std::min<int64_t>(fit, std::max<int64_t>(step, (n_in + step - 1) / step * step)));
  const size_t smem = sizeof(float) * size_t(n) * size_t(kc);
  // Every row (and expert) starts 16-byte aligned when a row is a multiple of 16 bytes and q is aligned.
  const bool vec = n_in % kGroup<W> == 0 && aligned16(q);
  const dim3 grid(unsigned((n_out + kWarps * kRows - 1) / (kWarps * kRows)), start ? unsigned(std::min(E, R)) : 1u);
  auto go = [&](auto kernel) {
    launch(kernel, grid, kWarps * 32, smem, stream_of(x), in, q, scale, b, y, n, n_in, n_out, kc, start, int(E));
  };
  if (vec) go(k_gemv<S, W, NB, true>);
  else go(k_gemv<S, W, NB, false>);
}

// The GEMV for n <= kMaxN rows of in (experts: up to n rows per expert and pass, start[E+1] on the device, R rows in
// all, E <= 65535), NB the smallest bucket that holds n. W: int8_t or __nv_fp8_e4m3 with its scale, or S (scale null,
// unread).
template <class S, class W>
void gemv(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
          int64_t n_out, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0) {
  static_assert(kWeightOk<W>, "wgemv: weights are int8, fp8, fp32, bf16 or fp16");
  static_assert(kScaled<W> || std::is_same_v<W, S>, "wgemv: weights int8, fp8 or the activation type");
  const int m = int(n);
  if (m <= 1) launch_nb<S, W, 1>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R);
  else if (m <= 2) launch_nb<S, W, 2>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R);
  else if (m <= 4) launch_nb<S, W, 4>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R);
  else if (m <= 8) launch_nb<S, W, 8>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R);
  else launch_nb<S, W, 16>(x, in, q, scale, b, y, m, n_in, n_out, start, E, R);
}

}  // namespace q3vl::dev::cuda::wgemv
