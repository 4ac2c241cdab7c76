// Weight-only int8 linear (dev::linear_int8_fwd): q[out,in] int8 with one fp32 scale per output row. Two paths:
//  - decode-sized N (<= kGemvMaxN): a GEMV that streams each int8 weight row once with 16-byte loads (half the bytes
//    of bf16 weights: the point of int8 when a step is bound by memory bandwidth). Each warp owns kRows output rows,
//    all N input rows are staged in shared memory as fp32 (in column chunks when they do not fit), every x value
//    read from shared memory feeds kRows rows, fp32 accumulation, warp-shuffle reduction, scale and bias at the end.
//  - larger N (prefill chunks): tiles of rows dequantized into Exec::ws in dt (q * scale rounded to dt), each
//    multiplied by the cuBLASLt GEMM of gemm.cu into its columns of y (ldc = n_out); the bias is broadcast into y
//    first and the GEMMs accumulate onto it (beta = 1), so y is rounded to dt once.
#include <algorithm>
#include <cstdint>
#include <string>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

// ---- GEMV (small N) -----------------------------------------------------------------------------------------------
constexpr int kWarps = 8;               // warps per block
constexpr int kRows = 4;                // output rows per warp: each x value loaded from shared memory serves kRows
constexpr int kGroup = 16;              // int8 columns per lane per step: one 16-byte load per row
constexpr int kStep = 32 * kGroup;      // columns per warp step (512)
constexpr int kGemvMaxN = 16;           // larger N takes the dequantize + GEMM path
constexpr size_t kSmemBudget = 96 << 10;  // staged x (fp32) per block; above 48 KiB needs the opt-in attribute

// int8 -> fp32 without I2F (a quarter-rate conversion): each byte biased to unsigned (xor 0x80) is placed into the
// low mantissa byte of 2^23 (0x4B000000), and 2^23 + 128 subtracted. Exact.
__device__ __forceinline__ void i8x4_to_f32(uint32_t w, float (&f)[4]) {
  const uint32_t u = w ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7441)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7442)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7443)) - 8388736.f;
}

// Weights are read once: non-coherent path, not kept in L1 (shared memory and x use it).
__device__ __forceinline__ uint4 ld_stream16(const int8_t* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Staged x: row j of the chunk at j * kc floats; column group c (16 columns = four float4 pieces) at c * 16, piece i
// stored in slot i ^ ((c >> 1) & 3). A warp reads piece i of groups c = lane + 32 s: the eight lanes of a quarter-warp
// then hit eight distinct 16-byte bank groups (without the swizzle, 64-byte strides conflict 4-way).
__device__ __forceinline__ int swz(int col) {
  const int c = col >> 4, i = (col >> 2) & 3;
  return c * 16 + ((i ^ ((c >> 1) & 3)) << 2) + (col & 3);
}

// Loads the 16 weights of rows row0..row0+kRows-1 at column group c of the chunk starting at k0 (zeros outside).
template <bool VEC>
__device__ __forceinline__ void load_w(uint4 (&w)[kRows], const int8_t* q, int64_t row0, int64_t n_out, int64_t n_in,
                                       int64_t k0, int c, int groups) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    w[i] = make_uint4(0, 0, 0, 0);
    const int64_t r = row0 + i;
    if (r >= n_out || c >= groups) continue;
    const int8_t* p = q + r * n_in + k0 + int64_t(c) * kGroup;
    if constexpr (VEC) {
      w[i] = ld_stream16(p);  // n_in % 16 == 0 and q 16-byte aligned: every row start is aligned, groups are whole
    } else {
      const int64_t left = n_in - (k0 + int64_t(c) * kGroup);  // > 0
      uint32_t v[4] = {0, 0, 0, 0};
#pragma unroll
      for (int e = 0; e < kGroup; ++e)
        if (e < left) v[e >> 2] |= uint32_t(uint8_t(p[e])) << (8 * (e & 3));
      w[i] = make_uint4(v[0], v[1], v[2], v[3]);
    }
  }
}

// One step: the lane's 16 columns (group c) of kRows weight rows against the NB (n valid) staged x rows.
template <int NB>
__device__ __forceinline__ void fma_step(float (&acc)[kRows][NB], const uint4 (&w)[kRows], const float* xs, int kc,
                                         int c, int n) {
  const int base = c * 16, sw = (c >> 1) & 3;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    float wf[kRows][4];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const uint32_t word = t == 0 ? w[i].x : t == 1 ? w[i].y : t == 2 ? w[i].z : w[i].w;
      i8x4_to_f32(word, wf[i]);
    }
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

// Block: kWarps warps, warp w owning rows (blockIdx.x * kWarps + w) * kRows + [0, kRows). x[n, n_in] staged kc columns
// at a time into dynamic shared memory (n * kc floats).
template <class S, int NB, bool VEC>
__global__ void __launch_bounds__(kWarps * 32, 2)
    k_int8_gemv(const S* __restrict__ in, const int8_t* __restrict__ q, const float* __restrict__ scale,
                const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in, int64_t n_out, int kc) {
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = (int64_t(blockIdx.x) * kWarps + warp) * kRows;

  float acc[kRows][NB];
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < NB; ++j) acc[i][j] = 0.f;

  for (int64_t k0 = 0; k0 < n_in; k0 += kc) {
    const int len = int(std::min<int64_t>(kc, n_in - k0));
    const int groups = (len + kGroup - 1) / kGroup;
    const int cols = groups * kGroup;  // staged columns (zeros past n_in)
    __syncthreads();                   // the previous chunk is consumed
    for (int idx = threadIdx.x; idx < n * cols; idx += blockDim.x) {
      const int j = idx / cols, col = idx - j * cols;
      xs[j * kc + swz(col)] = col < len ? ld(in, int64_t(j) * n_in + k0 + col) : 0.f;
    }
    __syncthreads();

    // Steps over the lane's groups c = lane + 32 s, the next step's weights loaded before this one's math.
    const int steps = (groups + 31) / 32;
    uint4 w[kRows], wn[kRows];
    load_w<VEC>(w, q, row0, n_out, n_in, k0, lane, groups);
    for (int s = 0; s < steps; ++s) {
      const int c = lane + 32 * s;
      const bool more = s + 1 < steps;
      if (more) load_w<VEC>(wn, q, row0, n_out, n_in, k0, c + 32, groups);
      if (c < groups) fma_step<NB>(acc, w, xs, kc, c, n);
      if (more)
#pragma unroll
        for (int i = 0; i < kRows; ++i) w[i] = wn[i];
    }
  }

#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = row0 + i;
    const float sc = r < n_out ? scale[r] : 0.f;
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

template <class S, int NB>
void launch_gemv(const Exec& x, const S* in, const int8_t* q, const float* scale, const S* b, S* y, int n,
                 int64_t n_in, int64_t n_out) {
  // Columns staged per chunk: a multiple of kStep (keeps the swizzle's 128-byte rows), all of n_in when it fits.
  const int64_t fit = std::max<int64_t>(kStep, int64_t(kSmemBudget / (sizeof(float) * size_t(n))) / kStep * kStep);
  const int kc = int(std::min<int64_t>(fit, std::max<int64_t>(kStep, (n_in + kStep - 1) / kStep * kStep)));
  const size_t smem = sizeof(float) * size_t(n) * size_t(kc);
  const bool vec = n_in % kGroup == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  const int64_t blocks = (n_out + kWarps * kRows - 1) / (kWarps * kRows);
  auto go = [&](auto kernel) {
    if (smem > (48 << 10))
      Q3VL_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemBudget)));
    kernel<<<unsigned(blocks), kWarps * 32, smem, stream_of(x)>>>(in, q, scale, b, y, n, n_in, n_out, kc);
    Q3VL_LAUNCHED();
  };
  if (vec) go(k_int8_gemv<S, NB, true>);
  else go(k_int8_gemv<S, NB, false>);
}

// ---- dequantize + GEMM (larger N) ---------------------------------------------------------------------------------
constexpr size_t kGemmWs = size_t(32) << 20;    // the head of ws left to cuBLASLt (as gemm.cu uses at most)
constexpr size_t kTileBytes = size_t(32) << 20;  // a dequantized tile: large GEMMs, still mostly L2-resident

// t[r, :] = q[r, :] * scale[r] rounded to S, for r < R. VEC4: n_in % 4 == 0 and q 4-byte aligned.
template <class S, bool VEC4>
__global__ void k_dequant_rows(const int8_t* __restrict__ q, const float* __restrict__ scale, S* __restrict__ t,
                               int64_t R, int64_t n_in) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    const float s = scale[r];
    const int8_t* qr = q + r * n_in;
    S* tr = t + r * n_in;
    if constexpr (VEC4) {
      for (int64_t c4 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c4 * 4 < n_in; c4 += stride) {
        const char4 v = reinterpret_cast<const char4*>(qr)[c4];
        st(tr, c4 * 4 + 0, float(v.x) * s);
        st(tr, c4 * 4 + 1, float(v.y) * s);
        st(tr, c4 * 4 + 2, float(v.z) * s);
        st(tr, c4 * 4 + 3, float(v.w) * s);
      }
    } else {
      for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n_in; c += stride)
        st(tr, c, float(qr[c]) * s);
    }
  }
}

// y[i, :] = b for every row i < N.
template <class S>
__global__ void k_bias_broadcast(S* __restrict__ y, const S* __restrict__ b, int64_t N, int64_t n_out) {
  for (int64_t i = blockIdx.y; i < N; i += gridDim.y)
    for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < n_out; o += int64_t(gridDim.x) * blockDim.x)
      y[i * n_out + o] = b[o];
}

void int8_dequant_gemm(const Exec& x, const void* in, const int8_t* q, const float* scale, const void* b, void* y,
                       int64_t N, int64_t n_in, int64_t n_out, DType dt) {
  const size_t es = dtype_size(dt);
  const size_t gemm_ws = std::min(kGemmWs, x.ws_bytes / 4) / 256 * 256;
  const size_t row_bytes = std::max<size_t>(1, size_t(std::max<int64_t>(n_in, 0)) * es);
  const size_t avail = std::min(x.ws_bytes - gemm_ws, std::max(kTileBytes, row_bytes));
  int64_t R = std::min<int64_t>(n_out, int64_t(avail / row_bytes));
  if (R < 1)
    fail("dev::linear_int8_fwd: the Exec's workspace (Exec::ws, " + std::to_string(x.ws_bytes) +
         " bytes) cannot hold one dequantized weight row (" + std::to_string(row_bytes) + " bytes of " +
         dtype_name(dt) + ") beside " + std::to_string(gemm_ws) +
         " bytes of GEMM workspace; make the Exec with a larger ws_bytes");
  if (R < n_out && R >= 64) R -= R % 64;  // tile starts keep y's column offsets aligned
  void* tile = static_cast<char*>(x.ws) + gemm_ws;
  Exec xg = x;  // cuBLASLt's share of the workspace: the head, before the tile
  xg.ws_bytes = gemm_ws;

  by_dtype(dt, [&]<class S>() {
    if (b) {
      const dim3 grid(unsigned(std::min<int64_t>((n_out + 255) / 256, 64)), unsigned(std::min<int64_t>(N, 65535)));
      k_bias_broadcast<S><<<grid, 256, 0, stream_of(x)>>>(static_cast<S*>(y), static_cast<const S*>(b), N, n_out);
      Q3VL_LAUNCHED();
    }
    const bool vec4 = n_in % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
    for (int64_t r0 = 0; r0 < n_out; r0 += R) {
      const int64_t rt = std::min(R, n_out - r0);
      const int64_t per_row = vec4 ? n_in / 4 : n_in;
      const dim3 grid(unsigned(std::clamp<int64_t>((per_row + 255) / 256, 1, 64)),
                      unsigned(std::min<int64_t>(rt, 65535)));
      if (vec4)
        k_dequant_rows<S, true><<<grid, 256, 0, stream_of(x)>>>(q + r0 * n_in, scale + r0, static_cast<S*>(tile), rt,
                                                                 n_in);
      else
        k_dequant_rows<S, false><<<grid, 256, 0, stream_of(x)>>>(q + r0 * n_in, scale + r0, static_cast<S*>(tile),
                                                                  rt, n_in);
      Q3VL_LAUNCHED();
      cuda::gemm(xg, false, true, N, rt, n_in, 1.f, in, n_in, tile, n_in, b ? 1.f : 0.f, static_cast<char*>(y) + r0 * es,
                 n_out, dt, dt);
    }
  });
}

}  // namespace

void linear_int8_fwd(const Exec& x, const void* in, const int8_t* q, const float* scale, const void* b, void* y,
                     int64_t N, int64_t n_in, int64_t n_out, DType dt) {
  if (N <= 0 || n_out <= 0) return;
  if (N > kGemvMaxN) return int8_dequant_gemm(x, in, q, scale, b, y, N, n_in, n_out, dt);
  by_dtype(dt, [&]<class S>() {
    const S* i = static_cast<const S*>(in);
    const S* bb = static_cast<const S*>(b);
    S* o = static_cast<S*>(y);
    const int n = int(N);
    if (n <= 1) launch_gemv<S, 1>(x, i, q, scale, bb, o, n, n_in, n_out);
    else if (n <= 2) launch_gemv<S, 2>(x, i, q, scale, bb, o, n, n_in, n_out);
    else if (n <= 4) launch_gemv<S, 4>(x, i, q, scale, bb, o, n, n_in, n_out);
    else if (n <= 8) launch_gemv<S, 8>(x, i, q, scale, bb, o, n, n_in, n_out);
    else launch_gemv<S, 16>(x, i, q, scale, bb, o, n, n_in, n_out);
  });
}

}  // namespace q3vl::dev::cuda
