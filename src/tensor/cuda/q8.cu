// Weight-only 8-bit linear (dev::linear_q8_fwd): q[out,in] int8 or fp8 E4M3 (QFormat) with one fp32 scale per output
// row; the two formats share every kernel, templated on the weight type W (int8_t, __nv_fp8_e4m3). Two paths:
//  - decode-sized N (<= kGemvMaxN): the weight-streaming GEMV of gemv.cuh (shared with moe.cu's bf16/fp16/fp32
//    experts), here on 8-bit rows: 16 columns per 16-byte load, half the bytes of bf16 weights (the point of 8-bit
//    weights when a step is bound by memory bandwidth), scale and bias applied to the fp32 sums.
//  - larger N (prefill chunks): tiles of rows dequantized into Exec::ws in dt (q * scale rounded to dt), each
//    multiplied by the cuBLASLt GEMM of gemm.cu into its columns of y (ldc = n_out); the bias is broadcast into y
//    first and the GEMMs accumulate onto it (beta = 1), so y is rounded to dt once.
// Experts (dev::grouped_linear_q8_fwd): q[E, out, in], one scale per row of every expert. Decode-sized R (<= 8 rows
// an expert on average) runs the same GEMV with grid.y over the experts that have rows (at most min(E, R) of them;
// the others' weights are never read), a block looping over its expert's rows 16 at a time; larger R dequantizes
// groups of experts into Exec::ws (experts without rows skipped) and runs grouped_linear_fwd (moe.cu) on each group
// (its tiled GEMM: R > 8 E rows never reach moe.cu's own GEMV).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "q3vl/core/env.hpp"

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv_chain.cuh"

namespace q3vl::dev::cuda {

namespace {

// f.template operator()<W>() with W the weight type of format qf.
template <class F> void by_qformat(QFormat qf, F&& f) {
  if (qf == QFormat::Int8) return f.template operator()<int8_t>();
  if (qf == QFormat::Fp8) return f.template operator()<__nv_fp8_e4m3>();
  fail("dev::linear_q8_fwd: 8-bit weights are int8 or fp8 (model.weight_dtype)");
}

// ---- GEMV (small N): gemv.cuh with 8-bit weights -----------------------------------------------------------------
constexpr int kGemvMaxN = wgemv::kMaxN;                // larger N takes the dequantize + GEMM path
constexpr int kGroupedGemvRows = wgemv::kGroupedRows;  // experts: the GEMV up to 8 rows per expert on average

// The GEMV for n rows (experts: up to n rows per expert and pass), the input rows read through rin.
void gemv(const Exec& x, const void* in, const void* q, const float* scale, const void* b, void* y, int64_t n,
          int64_t n_in, int64_t n_out, QFormat qf, DType dt, const int32_t* start = nullptr, int64_t E = 0,
          int64_t R = 0, const RowsIn& rin = {}, bool add = false) {
  by_dtype(dt, [&]<class S>() {
    by_qformat(qf, [&]<class W>() {
      wgemv::gemv<S, W>(x, static_cast<const S*>(in), static_cast<const W*>(q), scale, static_cast<const S*>(b),
                        static_cast<S*>(y), n, n_in, n_out, start, E, R, rin, add);
    });
  });
}

// ---- dequantize + GEMM (larger N) ---------------------------------------------------------------------------------
constexpr size_t kGemmWs = size_t(32) << 20;  // the head of ws left to cuBLASLt (as gemm.cu uses at most)
// The most bytes of one dequantized tile: all of ws after cuBLASLt's head (the 8B's whole gate_up fits the serving
// workspace's 224 MiB), so that a prefill chunk's product is one GEMM of the bf16 product's shape. Tiles of 32 MiB
// (to keep them in L2) cut the 8B's qkv into 4096 + 2048 and its down_proj into 1344-column GEMMs that cuBLASLt ran at
// 27-38 TFLOP/s at 274 rows; whole, the 8B's fp8 mixed step of one prompt went 26.5 -> 21.6 ms (H100,
// docs/perf/2026-12-06-twentyeighth/call3). Q3VL_Q8_TILE_MIB=N caps it at N MiB (A/B runs).
size_t tile_cap() {
  static const int64_t mib = env_positive("Q3VL_Q8_TILE_MIB", 0);
  return mib ? size_t(mib) << 20 : SIZE_MAX;
}

// Four consecutive weights (a 32-bit word, byte k weight k) and one weight, as fp32 (exact).
template <class W>
__device__ __forceinline__ void w4_f32(uint32_t w, float (&f)[4]) {
  if constexpr (std::is_same_v<W, int8_t>) wgemv::i8x4_to_f32(w, f);
  else wgemv::e4m3x4_to_f32(w, f);
}
template <class W>
__device__ __forceinline__ float w_f32(W q) {
  if constexpr (std::is_same_v<W, int8_t>) return float(q);
  else return __half2float(__half(__nv_cvt_fp8_to_halfraw(q.__x, __NV_E4M3)));
}

// t[r, :] = q[r, :] * scale[r] rounded to S, for r < R, in group z = blockIdx.z (an expert: q, scale and t R rows
// further on each; skipped when start says it has no rows). VEC4: n_in % 4 == 0 and q 4-byte aligned.
template <class S, class W, bool VEC4>
__global__ void k_dequant_rows(const W* __restrict__ q, const float* __restrict__ scale, S* __restrict__ t,
                               int64_t R, int64_t n_in, const int32_t* __restrict__ start) {
  const int64_t z = blockIdx.z;
  if (start && start[z + 1] == start[z]) return;
  q += z * R * n_in, scale += z * R, t += z * R * n_in;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
    const float s = scale[r];
    const W* qr = q + r * n_in;
    S* tr = t + r * n_in;
    if constexpr (VEC4) {
      for (int64_t c4 = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c4 * 4 < n_in; c4 += stride) {
        float v[4];
        w4_f32<W>(reinterpret_cast<const uint32_t*>(qr)[c4], v);
#pragma unroll
        for (int k = 0; k < 4; ++k) st(tr, c4 * 4 + k, v[k] * s);
      }
    } else {
      for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < n_in; c += stride)
        st(tr, c, w_f32(qr[c]) * s);
    }
  }
}
// groups x R rows of q into t (start: per-expert skip, see k_dequant_rows).
template <class S, class W>
void dequant_rows(const Exec& x, const W* q, const float* scale, S* t, int64_t R, int64_t n_in, int64_t groups,
                  const int32_t* start) {
  const bool vec4 = n_in % 4 == 0 && reinterpret_cast<uintptr_t>(q) % 4 == 0;
  const int64_t per_row = vec4 ? n_in / 4 : n_in;
  const dim3 grid(unsigned(std::clamp<int64_t>((per_row + 255) / 256, 1, 64)), unsigned(std::min<int64_t>(R, 65535)),
                  unsigned(groups));
  if (vec4) launch(k_dequant_rows<S, W, true>, grid, 256, 0, stream_of(x), q, scale, t, R, n_in, start);
  else launch(k_dequant_rows<S, W, false>, grid, 256, 0, stream_of(x), q, scale, t, R, n_in, start);
}

// y[i, :] = b for every row i < N.
template <class S>
__global__ void k_bias_broadcast(S* __restrict__ y, const S* __restrict__ b, int64_t N, int64_t n_out) {
  for (int64_t i = blockIdx.y; i < N; i += gridDim.y)
    for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < n_out; o += int64_t(gridDim.x) * blockDim.x)
      y[i * n_out + o] = b[o];
}

// add: y += the product, in the GEMM's epilogue (beta 1: one rounding; b must be null).
void q8_dequant_gemm(const Exec& x, const void* in, const void* q, const float* scale, const void* b, void* y,
                     int64_t N, int64_t n_in, int64_t n_out, QFormat qf, DType dt, bool add) {
  Q3VL_CHECK(!(add && b), "dev::linear_q8_fwd: add with a bias");
  const size_t es = dtype_size(dt);
  const size_t gemm_ws = std::min(kGemmWs, x.ws_bytes / 4) / 256 * 256;
  const size_t row_bytes = std::max<size_t>(1, size_t(std::max<int64_t>(n_in, 0)) * es);
  const size_t avail = std::min(x.ws_bytes - gemm_ws, std::max(tile_cap(), row_bytes));
  int64_t R = std::min<int64_t>(n_out, int64_t(avail / row_bytes));
  if (R < 1)
    fail("dev::linear_q8_fwd: the Exec's workspace (Exec::ws, " + std::to_string(x.ws_bytes) +
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
    by_qformat(qf, [&]<class W>() {
      for (int64_t r0 = 0; r0 < n_out; r0 += R) {
        const int64_t rt = std::min(R, n_out - r0);
        dequant_rows<S>(x, static_cast<const W*>(q) + r0 * n_in, scale + r0, static_cast<S*>(tile), rt, n_in, 1,
                        nullptr);
        cuda::gemm(xg, false, true, N, rt, n_in, 1.f, in, n_in, tile, n_in, b || add ? 1.f : 0.f,
                   static_cast<char*>(y) + r0 * es, n_out, dt, dt);
      }
    });
  });
}

// Experts by groups that fit the workspace: each group's experts with rows dequantized into the tile [g, n_out, n_in],
// then grouped_linear_fwd over the group (start + e0: the rows stay absolute). ws holds grouped_linear's tile index at
// its head, the tile after. False (nothing done) when ws cannot hold one expert.
bool q8_grouped_dequant(const Exec& x, const void* xg, const void* q, const float* scale, const int32_t* start, void* y,
                        int64_t R, int64_t E, int64_t n_in, int64_t n_out, QFormat qf, DType dt) {
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
    by_qformat(qf, [&]<class W>() {
      for (int64_t e0 = 0; e0 < E; e0 += g) {
        const int64_t ng = std::min(g, E - e0);
        dequant_rows<S>(x, static_cast<const W*>(q) + e0 * n_out * n_in, scale + e0 * n_out, static_cast<S*>(tile),
                        n_out, n_in, ng, start + e0);
        cuda::grouped_linear_fwd(xh, xg, tile, start + e0, y, R, ng, n_in, n_out, dt);
      }
    });
  });
  return true;
}

}  // namespace

void linear_q8_fwd(const Exec& x, const void* in, const void* q, const float* scale, const void* b, void* y, int64_t N,
                   int64_t n_in, int64_t n_out, QFormat qf, DType dt, const RowsIn& rin, bool add) {
  if (N <= 0 || n_out <= 0) return;
  if (N > kGemvMaxN)
    return q8_dequant_gemm(x, rows_in(x, in, rin, N, n_in, dt), q, scale, b, y, N, n_in, n_out, qf, dt, add);
  gemv(x, in, q, scale, b, y, N, n_in, n_out, qf, dt, nullptr, 0, 0, rin, add);
}

namespace {
// gemv_chain's grid barrier (two words) and the attention links' counters (one stream's chains run one after another)
__device__ uint32_t g_chain_bar[2 + wgemv::kAttnCounters];

// The chain as one persistent kernel, or false (nothing launched) where a link does not fit it.
template <class S, class W>
bool chain_kernel(const Exec& x, const ChainLink* links, int count, int64_t N) {
  if (N > wgemv::kTmaNb || count < 1 || count > wgemv::kChainMax) return false;
  auto p = std::make_unique<wgemv::ChainParams<S>>();
  p->count = 0, p->n = int(N);
  const void* paired = nullptr;  // the previous link's SwiGLU, written in its next link's scratch (ChainLink)
  for (int j = 0; j < count; ++j) {
    const ChainLink& l = links[j];
    const ChainLink* nx = j + 1 < count ? links + j + 1 : nullptr;
    const bool pair = l.swiglu_pair && !l.attn && !l.moe && nx && !nx->attn && !nx->moe && nx->in == l.y &&
                      nx->rin.swiglu && nx->rin.scratch && !nx->rin.rows && !nx->rin.norm;
    const void* in = paired ? paired : l.in;
    if (p->count + (l.moe ? kChainMoeJobs : 1) > wgemv::kChainMax) return false;
    wgemv::ChainJob<S>* jb = p->job + p->count;
    const bool ok =
        l.attn  ? wgemv::chain_attn_job<S>(x, *jb, *l.attn, static_cast<const S*>(l.in), static_cast<S*>(l.y), N)
        : l.moe ? wgemv::chain_moe_jobs<S, W>(jb, *l.moe, static_cast<const S*>(l.in), wgemv::x_rows(l.rin),
                                               static_cast<S*>(l.y), int(N), l.n_in, l.add)
                : wgemv::chain_job<S, W>(*jb, static_cast<const S*>(in), static_cast<const W*>(l.W), l.scale,
                                         static_cast<S*>(pair ? nx->rin.scratch : l.y), int(N), l.n_in, l.n_out,
                                         paired ? wgemv::XRows{} : wgemv::x_rows(l.rin), l.add, pair);
    if (!ok) return false;
    p->count += l.moe ? kChainMoeJobs : 1;
    paired = pair ? nx->rin.scratch : nullptr;
  }
  void* bar = nullptr;
  Q3VL_CU(cudaGetSymbolAddress(&bar, g_chain_bar));
  p->bar = static_cast<uint32_t*>(bar);
  return wgemv::gemv_chain<S, W>(x, *p);
}
}  // namespace

bool linear_chain_kernel(const Exec& x, const ChainLink* links, int count, int64_t N, QFormat qf, DType dt) {
  bool done = false;
  if (N > 0 && dt != DType::F32)
    by_dtype(dt, [&]<class S>() {
      if constexpr (!std::is_same_v<S, float>) {
        if (qf == QFormat::None) done = chain_kernel<S, S>(x, links, count, N);
        else by_qformat(qf, [&]<class W>() { done = chain_kernel<S, W>(x, links, count, N); });
      }
    });
  return done;
}

void grouped_linear_q8_fwd(const Exec& x, const void* xg, const void* q, const float* scale, const int32_t* start,
                           void* y, int64_t R, int64_t E, int64_t n_in, int64_t n_out, QFormat qf, DType dt,
                           const RowsIn& rin) {
  if (R <= 0 || n_out <= 0) return;
  Q3VL_CHECK(E >= 1 && E <= 65535, "grouped_linear_q8: expert count out of range");
  const int64_t n = std::min<int64_t>(R, kGemvMaxN);
  if (R > kGroupedGemvRows * E && n_in > 0) {  // the GEMMs of prefill chunks: the rows written out first
    xg = rows_in(x, xg, rin, R, n_in, dt);
    if (!q8_grouped_dequant(x, xg, q, scale, start, y, R, E, n_in, n_out, qf, dt))
      gemv(x, xg, q, scale, nullptr, y, n, n_in, n_out, qf, dt, start, E, R);
    return;
  }
  gemv(x, xg, q, scale, nullptr, y, n, n_in, n_out, qf, dt, start, E, R, rin);
}

}  // namespace q3vl::dev::cuda
