// Weight-only int8 linear (dev::linear_int8_fwd): q[out,in] int8 with one fp32 scale per output row. Two paths:
//  - decode-sized N (<= kGemvMaxN): a GEMV that streams each int8 weight row once with 16-byte loads (half the bytes
//    of bf16 weights: the point of int8 when a step is bound by memory bandwidth). Each warp owns kRows output rows,
//    all N input rows are staged in shared memory as fp32 (in column chunks when they do not fit), every x value
//    read from shared memory feeds kRows rows, fp32 accumulation, warp-shuffle reduction, scale and bias at the end.
//  - larger N (prefill chunks): tiles of rows dequantized into Exec::ws in dt (q * scale rounded to dt), each
//    multiplied by the cuBLASLt GEMM of gemm.cu into its columns of y (ldc = n_out); the bias is broadcast into y
//    first and the GEMMs accumulate onto it (beta = 1), so y is rounded to dt once.
// Experts (dev::grouped_linear_int8_fwd): q[E, out, in], one scale per row of every expert. Decode-sized R runs the
// same GEMV with grid.y over the experts that have rows (at most min(E, R) of them; the others' weights are never
// read), a block looping over its expert's rows 16 at a time; larger R dequantizes groups of experts into Exec::ws
// (experts without rows skipped) and runs grouped_linear_fwd (moe.cu) on each group.
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
constexpr int kGroupedGemvRows = 8;     // experts: the GEMV up to 8 rows per expert on average (decode steps)
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

// One block's rows of y = (in q^T) * scale + b: kWarps warps, warp w owning rows (blockIdx.x * kWarps + w) * kRows +
// [0, kRows). x[n, n_in] staged kc columns at a time into xs (n * kc floats of dynamic shared memory); the block
// synchronizes before it stages, so it may be called again on other rows.
template <class S, int NB, bool VEC>
__device__ __forceinline__ void gemv_rows(const S* __restrict__ in, const int8_t* __restrict__ q,
                                          const float* __restrict__ scale, const S* __restrict__ b, S* __restrict__ y,
                                          int n, int64_t n_in, int64_t n_out, int kc, float* xs) {
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
template <class S, int NB, bool VEC>
__global__ void __launch_bounds__(kWarps * 32, 2)
    k_int8_gemv(const S* __restrict__ in, const int8_t* __restrict__ q, const float* __restrict__ scale,
                const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in, int64_t n_out, int kc,
                const int32_t* __restrict__ start, int E) {
  extern __shared__ float4 smem_f4[];
  float* xs = reinterpret_cast<float*>(smem_f4);
  if (!start) return gemv_rows<S, NB, VEC>(in, q, scale, b, y, n, n_in, n_out, kc, xs);
  const int e = busy_expert(start, E, int(blockIdx.y));
  if (e < 0) return;
  const int64_t r1 = start[e + 1];
  for (int64_t r = start[e]; r < r1; r += n)
    gemv_rows<S, NB, VEC>(in + r * n_in, q + int64_t(e) * n_out * n_in, scale + int64_t(e) * n_out, b,
                          y + r * n_out, int(min(int64_t(n), r1 - r)), n_in, n_out, kc, xs);
}

// n: rows of in (experts: at most NB per pass); start/E: the experts (null: one matrix), R their rows.
template <class S, int NB>
void launch_gemv(const Exec& x, const S* in, const int8_t* q, const float* scale, const S* b, S* y, int n,
                 int64_t n_in, int64_t n_out, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0) {
  // Columns staged per chunk: a multiple of kStep (keeps the swizzle's 128-byte rows), all of n_in when it fits.
  const int64_t fit = std::max<int64_t>(kStep, int64_t(kSmemBudget / (sizeof(float) * size_t(n))) / kStep * kStep);
  const int kc = int(std::min<int64_t>(fit, std::max<int64_t>(kStep, (n_in + kStep - 1) / kStep * kStep)));
  const size_t smem = sizeof(float) * size_t(n) * size_t(kc);
  // Every expert's rows stay 16-byte aligned when n_in is a multiple of 16.
  const bool vec = n_in % kGroup == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  const dim3 grid(unsigned((n_out + kWarps * kRows - 1) / (kWarps * kRows)), start ? unsigned(std::min(E, R)) : 1u);
  auto go = [&](auto kernel) {
    launch(kernel, grid, kWarps * 32, smem, stream_of(x), in, q, scale, b, y, n, n_in, n_out, kc, start, int(E));
  };
  if (vec) go(k_int8_gemv<S, NB, true>);
  else go(k_int8_gemv<S, NB, false>);
}

// The GEMV for n rows (experts: up to n rows per expert and pass), NB the smallest bucket that holds n.
void gemv(const Exec& x, const void* in, const int8_t* q, const float* scale, const void* b, void* y, int64_t n,
          int64_t n_in, int64_t n_out, DType dt, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0) {
  by_dtype(dt, [&]<class S>() {
    const S* i = static_cast<const S*>(in);
    const S* bb = static_cast<const S*>(b);
    S* o = static_cast<S*>(y);
    const int m = int(n);
    if (m <= 1) launch_gemv<S, 1>(x, i, q, scale, bb, o, m, n_in, n_out, start, E, R);
    else if (m <= 2) launch_gemv<S, 2>(x, i, q, scale, bb, o, m, n_in, n_out, start, E, R);
    else if (m <= 4) launch_gemv<S, 4>(x, i, q, scale, bb, o, m, n_in, n_out, start, E, R);
    else if (m <= 8) launch_gemv<S, 8>(x, i, q, scale, bb, o, m, n_in, n_out, start, E, R);
    else launch_gemv<S, 16>(x, i, q, scale, bb, o, m, n_in, n_out, start, E, R);
  });
}

// ---- dequantize + GEMM (larger N) ---------------------------------------------------------------------------------
constexpr size_t kGemmWs = size_t(32) << 20;    // the head of ws left to cuBLASLt (as gemm.cu uses at most)
constexpr size_t kTileBytes = size_t(32) << 20;  // a dequantized tile: large GEMMs, still mostly L2-resident

// t[r, :] = q[r, :] * scale[r] rounded to S, for r < R, in group z = blockIdx.z (an expert: q, scale and t R rows
// further on each; skipped when start says it has no rows). VEC4: n_in % 4 == 0 and q 4-byte aligned.
template <class S, bool VEC4>
__global__ void k_dequant_rows(const int8_t* __restrict__ q, const float* __restrict__ scale, S* __restrict__ t,
                               int64_t R, int64_t n_in, const int32_t* __restrict__ start) {
  const int64_t z = blockIdx.z;
  if (start && start[z + 1] == start[z]) return;
  q += z * R * n_in, scale += z * R, t += z * R * n_in;
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
// groups x R rows of q into t (start: per-expert skip, see k_dequant_rows).
template <class S>
void dequant_rows(const Exec& x, const int8_t* q, const float* scale, S* t, int64_t R, int64_t n_in, int64_t groups,
                  const int32_t* start) {
  const bool vec4 = n_in % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
  const int64_t per_row = vec4 ? n_in / 4 : n_in;
  const dim3 grid(unsigned(std::clamp<int64_t>((per_row + 255) / 256, 1, 64)), unsigned(std::min<int64_t>(R, 65535)),
                  unsigned(groups));
  if (vec4) launch(k_dequant_rows<S, true>, grid, 256, 0, stream_of(x), q, scale, t, R, n_in, start);
  else launch(k_dequant_rows<S, false>, grid, 256, 0, stream_of(x), q, scale, t, R, n_in, start);
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
    for (int64_t r0 = 0; r0 < n_out; r0 += R) {
      const int64_t rt = std::min(R, n_out - r0);
      dequant_rows<S>(x, q + r0 * n_in, scale + r0, static_cast<S*>(tile), rt, n_in, 1, nullptr);
      cuda::gemm(xg, false, true, N, rt, n_in, 1.f, in, n_in, tile, n_in, b ? 1.f : 0.f, static_cast<char*>(y) + r0 * es,
                 n_out, dt, dt);
    }
  });
}

// Experts by groups that fit the workspace: each group's experts with rows dequantized into the tile [g, n_out, n_in],
// then grouped_linear_fwd over the group (start + e0: the rows stay absolute). ws holds grouped_linear's tile index at
// its head, the tile after. False (nothing done) when ws cannot hold one expert.
bool int8_grouped_dequant(const Exec& x, const void* xg, const int8_t* q, const float* scale, const int32_t* start,
                          void* y, int64_t R, int64_t E, int64_t n_in, int64_t n_out, DType dt) {
  const size_t head = (size_t(E + 1) * sizeof(int32_t) + 255) / 256 * 256;
  const size_t expert = size_t(n_out * n_in) * dtype_size(dt);
  if (x.ws_bytes < head + expert) return false;
  // As many experts per group as ws holds: each group is two launches (in 32 MiB groups the 30B-A3B's gate_up took
  // 26 groups per layer and prefill chunk).
  const int64_t g = std::min<int64_t>(E, int64_t((x.ws_bytes - head) / expert));
  Exec xh = x;  // grouped_linear's share: the head
  xh.ws_bytes = head;
  void* tile = static_cast<char*>(x.ws) + head;
  by_dtype(dt, [&]<class S>() {
    for (int64_t e0 = 0; e0 < E; e0 += g) {
      const int64_t ng = std::min(g, E - e0);
      dequant_rows<S>(x, q + e0 * n_out * n_in, scale + e0 * n_out, static_cast<S*>(tile), n_out, n_in, ng,
                      start + e0);
      cuda::grouped_linear_fwd(xh, xg, tile, start + e0, y, R, ng, n_in, n_out, dt);
    }
  });
  return true;
}

}  // namespace

void linear_int8_fwd(const Exec& x, const void* in, const int8_t* q, const float* scale, const void* b, void* y,
                     int64_t N, int64_t n_in, int64_t n_out, DType dt) {
  if (N <= 0 || n_out <= 0) return;
  if (N > kGemvMaxN) return int8_dequant_gemm(x, in, q, scale, b, y, N, n_in, n_out, dt);
  gemv(x, in, q, scale, b, y, N, n_in, n_out, dt);
}

void grouped_linear_int8_fwd(const Exec& x, const void* xg, const int8_t* q, const float* scale, const int32_t* start,
                             void* y, int64_t R, int64_t E, int64_t n_in, int64_t n_out, DType dt) {
  if (R <= 0 || n_out <= 0) return;
  Q3VL_CHECK(E >= 1 && E <= 65535, "grouped_linear_int8: expert count out of range");
  if (R > kGroupedGemvRows * E && n_in > 0 && int8_grouped_dequant(x, xg, q, scale, start, y, R, E, n_in, n_out, dt))
    return;
  gemv(x, xg, q, scale, nullptr, y, std::min<int64_t>(R, kGemvMaxN), n_in, n_out, dt, start, E, R);
}

}  // namespace q3vl::dev::cuda
