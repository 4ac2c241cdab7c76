// MoE on the device: router softmax/top-k, the load-balancing loss, the expert bucketing plan (a stable counting
// sort), the grouped expert GEMMs and the combine/unpermute row moves. Everything is deterministic: no floating-point
// atomics, fixed reduction orders.
// Grouped expert forward: decode-sized R (<= 8 rows an expert on average) runs the weight-streaming GEMV of gemv.cuh
// over only the experts that have rows (found on the device from start), so a decode step reads the weights of the
// few experts its tokens chose instead of walking every expert's tiles; larger R (prefill, training batches) and the
// backward run the tiled grouped GEMM below (one launch for all experts, tensor cores for bf16/fp16).
#include <cooperative_groups.h>

#include <algorithm>
#include <mutex>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv.cuh"
#include "tensor/cuda/grouped_dw.cuh"
#include "tensor/cuda/route.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxExperts = 1024;  // router: a 32-bit "taken" mask per lane

// One warp per row: the logits into the warp's buffer, then router_row.
template <class S>
__global__ void k_router_fwd(const S* __restrict__ logits, float* __restrict__ probs, int32_t* __restrict__ idx,
                             float* __restrict__ w, int64_t N, int E, int k) {
  pdl_enter();  // launched by launch_pdl
  extern __shared__ float sbuf[];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, wpb = blockDim.x >> 5;
  float* buf = sbuf + wid * E;
  for (int64_t i = blockIdx.x * int64_t(wpb) + wid; i < N; i += int64_t(gridDim.x) * wpb) {
    const S* z = logits + i * E;
    for (int e = lane; e < E; e += 32) buf[e] = ld(z, e);
    const Pick p = router_row(buf, probs + i * E, E, k);
    if (lane < k) idx[i * k + lane] = p.e, w[i * k + lane] = p.w;
    __syncwarp();  // buf is reused by the next row
  }
}

// What a gradient output adds to: its value (accumulate), or the 0 of a zeroed buffer, unread (dev.hpp).
template <class S> __device__ __forceinline__ float prior(const S* p, int64_t i, bool acc) {
  return acc ? ld(p, i) : 0.f;
}

// One warp per row: dw[N,k] -> dlogits (+= or =) through the renormalisation and the softmax (ops::router_bwd).
template <class S>
__global__ void k_router_bwd(const float* __restrict__ dw, const float* __restrict__ probs,
                             const int32_t* __restrict__ idx, S* __restrict__ dlogits, int64_t N, int E, int k,
                             bool acc) {
  const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  for (int64_t i = blockIdx.x * int64_t(wpb) + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * wpb) {
    const float* p = probs + i * E;
    const int32_t* id = idx + i * k;
    const float* g = dw + i * k;
    float sel = 0.f, dot = 0.f, pdp = 0.f;
    for (int j = 0; j < k; ++j) sel += p[id[j]];
    for (int j = 0; j < k; ++j) dot += g[j] * p[id[j]] / sel;
    for (int j = 0; j < k; ++j) pdp += p[id[j]] * ((g[j] - dot) / sel);
    for (int e = lane; e < E; e += 32) {
      float dp = 0.f;
      for (int j = 0; j < k; ++j)
        if (id[j] == e) dp = (g[j] - dot) / sel;
      st(dlogits, i * E + e, prior(dlogits, i * E + e, acc) + p[e] * (dp - pdp));
    }
  }
}

// ---- load-balancing loss ----------------------------------------------------------------------------------------
// Selection counts per expert (integer atomics: exact whatever the order).
__global__ void k_expert_counts(const int32_t* __restrict__ idx, int64_t R, int E, int32_t* cnt) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < R; r += int64_t(gridDim.x) * blockDim.x) {
    const int32_t e = idx[r];
    if (e >= 0 && e < E) atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (hist[e]) atomicAdd(&cnt[e], hist[e]);
}
// Column sums of probs over a chunk of rows, in double: block (32 experts x 8 row lanes), partial per chunk.
__global__ void k_prob_colsum(const float* __restrict__ probs, int64_t N, int E, int64_t rows_per, double* part) {
  __shared__ double sh[8][33];
  const int64_t e = blockIdx.x * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per, r1 = min(N, r0 + rows_per);
  double a = 0;
  if (e < E)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) a += double(probs[r * E + e]);
  sh[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double s = 0;
    for (int y = 0; y < 8; ++y) s += sh[y][threadIdx.x];
    part[blockIdx.y * E + e] = s;
  }
}
// f[e] = count / N; *aux += E * sum_e f_e * mean_e (as ops::aux_loss_fwd, the expert sum in order).
__global__ void k_aux_final(const int32_t* __restrict__ cnt, const double* __restrict__ part, int64_t chunks, int64_t N,
                            int E, float* f, double* aux) {
  __shared__ double term[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    double pm = 0;
    for (int64_t c = 0; c < chunks; ++c) pm += part[c * E + e];
    const float fe = float(double(cnt[e]) / double(N));
    f[e] = fe;
    term[e] = double(fe) * (pm / double(N));
  }
  __syncthreads();
  if (threadIdx.x == 0 && aux) {
    double a = 0;
    for (int e = 0; e < E; ++e) a += term[e];
    *aux += a * E;
  }
}

template <class S>
__global__ void k_aux_bwd(const float* __restrict__ probs, const float* __restrict__ f, float coef,
                          S* __restrict__ dlogits, int64_t N, int E, bool acc) {
  const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  for (int64_t i = blockIdx.x * int64_t(wpb) + (threadIdx.x >> 5); i < N; i += int64_t(gridDim.x) * wpb) {
    const float* p = probs + i * E;
    float pg = 0.f;
    for (int e = lane; e < E; e += 32) pg += p[e] * (coef * float(E) * f[e] / float(N));
    pg = warp_sum(pg);
    for (int e = lane; e < E; e += 32) {
      const float g = coef * float(E) * f[e] / float(N);
      st(dlogits, i * E + e, prior(dlogits, i * E + e, acc) + p[e] * (g - pg));
    }
  }
}

// ---- plan: a stable counting sort of the R = N*k (token, slot) pairs by expert -------------------------------------
// Each warp owns a chunk of kChunk consecutive pairs. Pass 1 counts per (chunk, expert); pass 2 turns the counts into
// each chunk's first slot per expert (experts in order, chunks in order inside an expert); pass 3 places the pairs,
// 32 at a time in increasing order, ranking equal experts by lane (__match_any_sync). Pair r lands at the same place
// as in the sequential reference: after every earlier pair of its expert.
constexpr int kChunk = 512;

__global__ void k_plan_count(const int32_t* __restrict__ idx, int64_t R, int E, int64_t nchunks, int32_t* cnt) {
  const int lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x * int64_t(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (b >= nchunks) return;  // whole warp
  int32_t* row = cnt + b * E;
  for (int e = lane; e < E; e += 32) row[e] = 0;
  __syncwarp();
  for (int64_t r0 = b * kChunk; r0 < min(R, (b + 1) * kChunk); r0 += 32) {
    const int64_t r = r0 + lane;
    const int32_t e = r < R ? idx[r] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) row[e] += __popc(peers);  // one writer per expert per step
    __syncwarp();
  }
}

// One block: exclusive offsets per (chunk, expert) and start[E+1].
__global__ void k_plan_scan(int32_t* cnt, int64_t nchunks, int E, int32_t* start) {
  __shared__ int32_t tot[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t t = 0;
    for (int64_t b = 0; b < nchunks; ++b) {
      const int32_t c = cnt[b * E + e];
      cnt[b * E + e] = t;
      t += c;
    }
    tot[e] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t s = 0;
    for (int e = 0; e < E; ++e) {
      start[e] = s;
      const int32_t t = tot[e];
      tot[e] = s;
      s += t;
    }
    start[E] = s;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    for (int64_t b = 0; b < nchunks; ++b) cnt[b * E + e] += tot[e];
}

__global__ void k_plan_fill(const int32_t* __restrict__ idx, int64_t R, int E, int64_t nchunks, int32_t* off,
                            int32_t* rows, int32_t* pos) {
  pdl_trigger();  // the experts' GEMV after this may start (launch_pdl)
  const int lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x * int64_t(blockDim.x >> 5) + (threadIdx.x >> 5);
  if (b >= nchunks) return;
  int32_t* next = off + b * E;
  for (int64_t r0 = b * kChunk; r0 < min(R, (b + 1) * kChunk); r0 += 32) {
    const int64_t r = r0 + lane;
    const int32_t e = r < R ? idx[r] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0) {
      const int32_t j = next[e] + __popc(peers & ((1u << lane) - 1u));
      rows[j] = int32_t(r);
      pos[r] = j;
    }
    __syncwarp();  // every lane read next[e] before the leader advances it
    if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
    __syncwarp();
  }
}

// Decode-sized plans (R <= kPlanOneBlockR pairs, counts fitting kPlanSmem): the three passes in one block, so a
// decode layer launches one kernel, not three (at one row the three took 10 us a layer on an H200, the launches'
// latency). Chunks of 32 pairs, one warp step each: counts per (chunk, expert) in shared memory, then each expert's
// chunk offsets (experts in order, chunks in order inside an expert), then every pair placed by its warp rank. The
// same stable order as the three-pass plan and the sequential reference.
constexpr int kPlanOneBlockR = 2048;
constexpr size_t kPlanSmem = 48 << 10;

// The one-block plan by the calling block (k_plan_one_block, k_moe_route): idx [R] (global or shared), cnt shared
// scratch of (ceil(R / 32) + 1) E int32.
__device__ __forceinline__ void plan_block(const int32_t* idx, int R, int E, int32_t* cnt, int32_t* __restrict__ start,
                                           int32_t* __restrict__ rows, int32_t* __restrict__ pos) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5, nch = (R + 31) / 32;
  int32_t* base = cnt + nch * E;  // cnt [nch][E], then base[E]
  for (int i = threadIdx.x; i < nch * E; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  for (int c = warp; c < nch; c += warps) {
    const int r = c * 32 + lane;
    const int32_t e = r < R ? idx[r] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0 && lane == __ffs(peers) - 1) cnt[c * E + e] = __popc(peers);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // chunk offsets inside each expert; its total in base
    int32_t t = 0;
    for (int c = 0; c < nch; ++c) {
      const int32_t n = cnt[c * E + e];
      cnt[c * E + e] = t;
      t += n;
    }
    base[e] = t;
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // experts' first slots (E <= kMaxExperts: a short serial scan)
    int32_t s = 0;
    for (int e = 0; e < E; ++e) {
      const int32_t t = base[e];
      start[e] = base[e] = s;
      s += t;
    }
    start[E] = s;
  }
  __syncthreads();
  for (int c = warp; c < nch; c += warps) {
    const int r = c * 32 + lane;
    const int32_t e = r < R ? idx[r] : -1;
    const unsigned peers = __match_any_sync(kFull, e);
    if (e >= 0) {
      const int32_t j = base[e] + cnt[c * E + e] + __popc(peers & ((1u << lane) - 1u));
      rows[j] = r;
      pos[r] = j;
    }
  }
}

__global__ void __launch_bounds__(1024) k_plan_one_block(const int32_t* __restrict__ idx, int R, int E,
                                                         int32_t* __restrict__ start, int32_t* __restrict__ rows,
                                                         int32_t* __restrict__ pos) {
  pdl_enter();  // launched by launch_pdl
  extern __shared__ int32_t cnt[];
  plan_block(idx, R, E, cnt, start, rows, pos);
}

// ---- routing in one launch: router GEMM, router and plan (decode steps) ---------------------------------------------
// A decode layer's MoE block began with three small launches, the router GEMM (cuBLAS, fp32 logits), k_router_fwd
// and k_plan_one_block: 8.7 + 7.3 + 5.8 us a layer at one row on an H200, for 0.5 MB of router weights (30B-A3B:
// E = 128 experts of H = 2048). k_moe_route does the three in one launch of one thread-block cluster of C blocks (8,
// the portable size; 16 with Q3VL_ROUTE_CLUSTER=16): block b computes the fp32 logits of experts
// [b E / C, (b + 1) E / C) for all N rows and stores them into the leader block's shared memory (distributed shared
// memory); after a cluster barrier the leader alone runs router_row (a warp a row) and plan_block on them there.
// The logits: thread t owns the 16-byte column vectors t and t + 256 (VPT of them) of a row and keeps EC = 16 / VPT
// experts' weights at those columns in registers as fp32 (128 values a thread in bf16/fp16, 64 in fp32); the N rows
// of x stream past them, each read once a block (16-byte loads; two rows' loads in flight while two are multiplied).
// A warp reduce-scatter (warp_reduce_scatter) leaves each expert's warp sum on 32 / EC lanes, and the 8 warps' sums
// are added in warp order through shared memory: the logits are deterministic (fp32 accumulation; another summation
// order than cuBLAS's, so not its bits). More experts than EC a block: passes over x, EC experts each. At E = 128,
// C = 8 a block reads 16 rows of Wr (64 KiB in bf16) and holds 1.5 KiB of shared memory at N = 1, 16 KiB at N = 16.
// The leader's router runs a warp a row, N / 8 rows each: at large N the serial softmax sums and top-k rounds, not
// the GEMV, bound the kernel (kRouteMaxN, below, is where the three launches take over).
// Launched programmatically dependent: each block prefetches its experts' weights into L2 (cp.async.bulk.prefetch)
// before it waits for the kernel that wrote x (pdl_wait), so the weights' HBM reads overlap it; the wait is followed
// by the trigger (the experts' GEMV after this may launch; it waits for start and rows itself).
constexpr int kRouteThreads = 256, kRouteWarps = kRouteThreads / 32;
// Rows of the fused path; more: the three launches. The leader's router is a warp a row with a serial 128-term
// sum and k argmax rounds (~3 us a row), so 64 rows would serialize ~8 rows a warp there: up to 16 (2 a warp).
constexpr int kRouteMaxN = 16;
constexpr int kRouteMaxVpt = 2;               // 16-byte vectors a thread a row: H * sizeof(S) <= 8 KiB
constexpr size_t kRouteSmem = size_t(128) << 10;  // shared memory a block (the leader's logits and plan counts)

inline __host__ __device__ int round4(int n) { return (n + 3) & ~3; }

// Warp reduce-scatter of V partial sums a lane (V a power of two, 2 <= V <= 32): afterwards lane l holds the warp's
// total of value l / (32 / V). log2 V halving steps (lanes whose bit o is set keep the upper half and send the lower:
// V - 1 shuffles), then log2(32 / V) butterflies; a fixed order, the same total on the 32 / V lanes.
template <int Hf, int O, int V>
__device__ __forceinline__ void halve(float (&a)[V], int lane) {  // values [0, 2 Hf) -> [0, Hf) over lane pairs ^ O
  const bool up = lane & O;
#pragma unroll
  for (int i = 0; i < Hf; ++i) {
    const float lo = a[i], hi = a[i + Hf];  // values, not a selected address (which put a[] in local memory)
    a[i] = (up ? hi : lo) + __shfl_xor_sync(kFull, up ? lo : hi, O);
  }
  if constexpr (Hf > 1) halve<Hf / 2, O / 2>(a, lane);
}
template <int V>
__device__ __forceinline__ float warp_reduce_scatter(float (&a)[V]) {
  static_assert(V >= 2 && V <= 32 && (V & (V - 1)) == 0, "warp_reduce_scatter: V a power of two");
  halve<V / 2, 16>(a, threadIdx.x & 31);
#pragma unroll
  for (int o = 16 / V; o >= 1; o /= 2) a[0] += __shfl_xor_sync(kFull, a[0], o);
  return a[0];
}

// A 16-byte vector of S as fp32 (wgemv's piece conversion).
template <class S>
__device__ __forceinline__ void vec_f32(const uint4& v, float* f) {
#pragma unroll
  for (int p = 0; p < wgemv::kPieces<S>; ++p) {
    float q[4];
    wgemv::piece_f32<S>(v, p, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) f[4 * p + i] = q[i];
  }
}

// Experts e .. e + n - 1 (n <= EC; the others zero) at the thread's columns as fp32: wf[j][v * L + i].
template <class S, int VPT, int EC>
__device__ __forceinline__ void route_weights(const S* __restrict__ Wr, int e, int n, int H, int nv,
                                              float (&wf)[EC][VPT * wgemv::kGroup<S>]) {
  constexpr int L = wgemv::kGroup<S>;
  uint4 raw[EC][VPT];
#pragma unroll
  for (int j = 0; j < EC; ++j)
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int col = threadIdx.x + v * kRouteThreads;
      raw[j][v] = j < n && col < nv ? wgemv::ld_stream16(Wr + int64_t(e + j) * H + int64_t(col) * L) : uint4{};
    }
#pragma unroll
  for (int j = 0; j < EC; ++j)
#pragma unroll
    for (int v = 0; v < VPT; ++v) vec_f32<S>(raw[j][v], &wf[j][v * L]);
}

// Rows n0 .. n0 + RB - 1 of x at the thread's columns (zeros past N or the row).
template <class S, int VPT, int RB>
__device__ __forceinline__ void route_rows(uint4 (&xr)[RB][VPT], const S* __restrict__ in, int n0, int N, int H,
                                           int nv) {
#pragma unroll
  for (int r = 0; r < RB; ++r)
#pragma unroll
    for (int v = 0; v < VPT; ++v) {
      const int col = threadIdx.x + v * kRouteThreads;
      xr[r][v] = n0 + r < N && col < nv
                     ? *reinterpret_cast<const uint4*>(in + int64_t(n0 + r) * H + int64_t(col) * wgemv::kGroup<S>)
                     : uint4{};
    }
}

// One pass over the N rows of x against wf: the warps' partial logits into part [kRouteWarps][N][EC]. Rows RB at a
// time, the next RB's loads issued before the current ones' products (8 warps a block hide little latency else).
template <class S, int VPT, int EC>
__device__ __forceinline__ void route_dots(const S* __restrict__ in, const float (&wf)[EC][VPT * wgemv::kGroup<S>],
                                           int N, int H, int nv, float* part) {
  constexpr int L = wgemv::kGroup<S>, RB = 2;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4 cur[RB][VPT], nxt[RB][VPT];
  route_rows<S, VPT, RB>(cur, in, 0, N, H, nv);
  for (int n0 = 0; n0 < N; n0 += RB) {
    route_rows<S, VPT, RB>(nxt, in, n0 + RB, N, H, nv);
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      if (n0 + r >= N) break;  // uniform over the block
      float xf[VPT * L], acc[EC];
#pragma unroll
      for (int v = 0; v < VPT; ++v) vec_f32<S>(cur[r][v], &xf[v * L]);
#pragma unroll
      for (int j = 0; j < EC; ++j) {
        acc[j] = 0.f;
#pragma unroll
        for (int i = 0; i < VPT * L; ++i) acc[j] = fmaf(wf[j][i], xf[i], acc[j]);
      }
      const float s = warp_reduce_scatter<EC>(acc);
      if ((lane & (32 / EC - 1)) == 0) part[(warp * N + n0 + r) * EC + lane / (32 / EC)] = s;
    }
#pragma unroll
    for (int r = 0; r < RB; ++r)
#pragma unroll
      for (int v = 0; v < VPT; ++v) cur[r][v] = nxt[r][v];
  }
}

// Shared memory (floats): z [N][E] (the leader's: every block's logits land there), then part [kRouteWarps][N][EC],
// which the leader reuses after the cluster barrier for its picks [round4(N k)] and plan_block's counts.
template <class S, int VPT>
__global__ void __launch_bounds__(kRouteThreads, 1)
    k_moe_route(const S* __restrict__ in, const S* __restrict__ Wr, float* __restrict__ logits,
                float* __restrict__ probs, int32_t* __restrict__ idx, float* __restrict__ w,
                int32_t* __restrict__ start, int32_t* __restrict__ rows, int32_t* __restrict__ pos, int N, int H,
                int E, int k) {
  constexpr int EC = 16 / VPT;
  namespace cg = cooperative_groups;
  const cg::cluster_group cl = cg::this_cluster();
  extern __shared__ float4 smem4[];
  float* z = reinterpret_cast<float*>(smem4);
  float* part = z + round4(N * E);
  const int Eb = E / int(cl.num_blocks()), e0 = int(cl.block_rank()) * Eb, nv = H / wgemv::kGroup<S>;
  __cluster_barrier_arrive_relaxed();  // this block has started: its shared memory may be written (waited below)
  const char* wblk = reinterpret_cast<const char*>(Wr + int64_t(e0) * H);  // the block's rows, contiguous
  const int64_t bytes = int64_t(Eb) * H * int64_t(sizeof(S)), piece = 4096;
  for (int64_t b = threadIdx.x * piece; b < bytes; b += kRouteThreads * piece)
    l2_prefetch(wblk + b, uint32_t(min(piece, bytes - b)));
  pdl_enter();  // x is the kernel before's output; everything written here is read after it
  float* zl = cl.map_shared_rank(z, 0);
  for (int c = 0; c < Eb; c += EC) {
    float wf[EC][VPT * wgemv::kGroup<S>];
    route_weights<S, VPT, EC>(Wr, e0 + c, min(EC, Eb - c), H, nv, wf);
    route_dots<S, VPT, EC>(in, wf, N, H, nv, part);
    __syncthreads();
    if (c == 0) __cluster_barrier_wait();  // every block has started
    for (int q = threadIdx.x; q < N * EC; q += kRouteThreads) {
      const int n = q / EC, j = q % EC, e = e0 + c + j;
      if (c + j >= Eb) continue;
      float s = 0.f;
#pragma unroll
      for (int wp = 0; wp < kRouteWarps; ++wp) s += part[(wp * N + n) * EC + j];
      zl[n * E + e] = s;
      if (logits) logits[int64_t(n) * E + e] = s;
    }
    __syncthreads();  // part is reused by the next pass
  }
  cl.sync();  // release/acquire: the leader's z holds every logit
  if (cl.block_rank() != 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, R = N * k;
  int32_t* pick = reinterpret_cast<int32_t*>(part);
  for (int i = warp; i < N; i += kRouteWarps) {
    const Pick p = router_row(z + i * E, probs + int64_t(i) * E, E, k);
    if (lane < k) idx[i * k + lane] = pick[i * k + lane] = p.e, w[i * k + lane] = p.w;
  }
  __syncthreads();
  plan_block(pick, R, E, pick + round4(R), start, rows, pos);
}

// The fused kernel's shared memory in bytes for N rows at VPT.
size_t route_smem(int64_t N, int64_t E, int64_t k, int vpt) {
  const int64_t R = N * k, ec = 16 / vpt;
  const int64_t leader = round4(int(R)) + ((R + 31) / 32 + 1) * E;
  return size_t(round4(int(N * E)) + std::max<int64_t>(kRouteWarps * N * ec, leader)) * sizeof(float);
}

// The cluster size: 8 (portable), or 16 under Q3VL_ROUTE_CLUSTER=16 (non-portable; for A/B runs).
int route_cluster() {
  static const int c = env_is("Q3VL_ROUTE_CLUSTER", "16") ? 16 : 8;
  return c;
}

// ---- grouped expert GEMM --------------------------------------------------------------------------------------------
// C = op(A) op(B) per expert, one launch. Modes:
//   FWD: y[s+m, n]  = sum_k xg[s+m, k] W[e][n, k]      (M = bucket rows, N = n_out, K = n_in; overwrite)
//   DX:  dxg[s+m, n] (+)= sum_k dy[s+m, k] W[e][k, n]  (M = bucket rows, N = n_in,  K = n_out)
//   DW:  dW[e][m, n] (+)= sum_k dy[s+k, m] xg[s+k, n]  (M = n_out, N = n_in, K = bucket rows; F32)
// FWD/DX: blockIdx.y walks the M tiles of all experts back to back (tile_prefix, so no block idles on an empty
// expert); DW: blockIdx.z = expert. Shared tiles keep the operand's contiguous dimension contiguous (16-byte
// cp.async copies into rows padded by 16 bytes, so the 8 rows of an ldmatrix phase hit 8 distinct bank quads). No
// split-K, one block per output tile: dW and dxg accumulate deterministically.
// bf16/fp16 run mma.sync m16n8k16 fed by ldmatrix (.trans where the operand is MN-major): 128 x 256 block tiles, a
// 64 x 64 warp tile (8 ldmatrix.x4 feed 32 mma a k16 step), k tiles of 64 in 3 stages; FWD/DX store pairs of
// adjacent columns straight from the accumulators (bf16x2). DW's output is large against its K (a bucket: 256 rows
// on average at the 30B-A3B shape, so 2 K FLOPs an fp32 element read and written), so its epilogue is the kernel's
// cost: the tile goes out through shared memory (grouped_dw.cuh), not read at all when the caller's dW is fresh
// (accumulate false). fp32 keeps its SIMT path.
// On a 9.0 device (H100/H200) bf16/fp16 run wgmma instead (moe_sm90.cu), every mode, where rows are whole 16-byte
// chunks; this kernel is the fallback elsewhere (other devices, other row lengths, unaligned operands).
enum Mode { FWD = 0, DX = 1, DW = 2 };
}  // namespace
// moe_sm90.cu (wgmma, sm_90a): mode on a 9.0 device for bf16/fp16; false where it does not apply.
bool grouped_sm90(cudaStream_t st, bool bf16, int mode, const void* A, const void* B, void* C, const int32_t* start,
                  const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                  const SumSq& sq, double* psum);
namespace {
constexpr int BM = 128;  // the M tile of every variant and of moe_sm90.cu (tile_prefix counts in it)
template <class S> constexpr int pad() { return 16 / int(sizeof(S)); }  // keeps rows 16-byte multiples

template <class S> __device__ __forceinline__ S zero_of() {
  S z;
  st(&z, 0, 0.f);
  return z;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned sa = unsigned(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// sh[r][c] (row stride LD) = g[(r0 + r) * ldg + c0 + c], zero outside [rmax, cmax); c is the contiguous dimension.
// Whole 16-byte vectors go through cp.async (waited for by the pipeline); edges and unaligned operands are stored
// directly (visible after the pipeline's next __syncthreads).
template <class S, int ROWS, int COLS, int LD>
__device__ __forceinline__ void load_tile(S* sh, const S* g, int64_t ldg, int64_t r0, int64_t c0, int64_t rmax,
                                          int64_t cmax, bool vec) {
  constexpr int VEC = 16 / int(sizeof(S));
  constexpr int CV = COLS / VEC;
#pragma unroll
  for (int v = threadIdx.x; v < ROWS * CV; v += 256) {
    const int r = v / CV, c = (v % CV) * VEC;
    const int64_t gr = r0 + r, gc = c0 + c;
    S* d = sh + r * LD + c;
    if (vec && gr < rmax && gc + VEC <= cmax) {
      cp_async16(d, g + gr * ldg + gc);
    } else {
#pragma unroll
      for (int u = 0; u < VEC; ++u) d[u] = (gr < rmax && gc + u < cmax) ? g[gr * ldg + gc + u] : zero_of<S>();
    }
  }
}

// The last expert e with tile_prefix[e] <= t (empty experts share their successor's prefix).
__device__ __forceinline__ int expert_of_tile(const int32_t* tile_prefix, int E, int32_t t) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_prefix[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

template <class S, int MODE> struct GTile {
  static constexpr bool kMma = sizeof(S) == 2;  // mma.sync for bf16/fp16, SIMT for fp32
  static constexpr int BK = kMma ? 64 : 16, P = pad<S>(), BN = kMma ? 256 : 128;
  static constexpr int ST = 3;  // cp.async pipeline depth
  static constexpr int MIN_BLOCKS = kMma ? 1 : 2;  // mma: 128 fp32 accumulators a thread need up to 255 registers
  static constexpr bool A_KC = MODE != DW;  // A's contiguous dimension is k (else m)
  static constexpr bool B_KC = MODE == FWD;  // B's contiguous dimension is k (else n)
  static constexpr int LDA = A_KC ? BK + P : BM + P, LDB = B_KC ? BK + P : BN + P;
  static constexpr int SA = A_KC ? BM * LDA : BK * LDA, SB = B_KC ? BN * LDB : BK * LDB;
  static constexpr size_t smem = size_t(ST) * (SA + SB) * sizeof(S);
  static constexpr bool kStagedDW = MODE == DW && kMma;  // DW's epilogue through shared memory
  static constexpr int LDC = BN + 8;  // floats, the staged tile's row stride: 8 mod 32 banks (see the epilogue)
  static_assert((SA * sizeof(S)) % 128 == 0 && ((SA + SB) * sizeof(S)) % 128 == 0, "stage alignment");
  static_assert(!kStagedDW || smem >= size_t(BM) * LDC * sizeof(float), "DW's staging reuses the pipeline buffers");
};

// ldmatrix.x4: four 8x8 b16 matrices, lane l giving the address of row l % 8 of matrix l / 8. Without .trans lane
// i receives (row i/4, columns 2(i%4), +1) of each; with .trans (rows 2(i%4), +1, column i/4).
template <bool TRANS> __device__ __forceinline__ void ldsm4(uint32_t (&r)[4], const void* p) {
  const unsigned a = unsigned(__cvta_generic_to_shared(p));
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
// d += a b, m16n8k16, fp32 accumulators: a = (row g, k 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..);
// b = (k 2t.., col g), (k 2t+8.., col g); d = (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) with g = lane/4, t = lane%4.
template <class S> __device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <class S> struct alignas(2 * sizeof(S)) Pair { S x, y; };

// DW's epilogue for k_grouped's mma.sync warp tiles: the accumulators into shared memory (sc, the free pipeline
// buffers; a half-warp's float2 writes, rows g 0-3 and columns 2t, hit 32 distinct banks as LDC = 8 mod 32), then
// grouped_dw::rows_out.
template <int BN, int LDC>
__device__ __forceinline__ void stage_out_dw(const float (&acc)[4][8][4], float* sc, float* c, int64_t ldc,
                                             int64_t m0, int64_t n0, int64_t M, int64_t N, bool accumulate, int wm,
                                             int wn, int g, int t2) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float* p = sc + (wm * 64 + 16 * i + g) * LDC + wn * 64 + 8 * j + t2;
      *reinterpret_cast<float2*>(p) = make_float2(acc[i][j][0], acc[i][j][1]);
      *reinterpret_cast<float2*>(p + 8 * LDC) = make_float2(acc[i][j][2], acc[i][j][3]);
    }
  __syncthreads();
  grouped_dw::rows_out<BM, BN, LDC>(sc, c, ldc, m0, n0, M, N, accumulate);
}

template <class S, int MODE>
__global__ void __launch_bounds__(256, GTile<S, MODE>::MIN_BLOCKS)
    k_grouped(const S* __restrict__ A, const S* __restrict__ B, void* C, const int32_t* __restrict__ start,
              const int32_t* __restrict__ tile_prefix, int E, int64_t n_in, int64_t n_out, bool vecA, bool vecB,
              bool accumulate) {
  using T = GTile<S, MODE>;
  constexpr int BK = T::BK, BN = T::BN, LDA = T::LDA, LDB = T::LDB, SA = T::SA, SB = T::SB, kStages = T::ST;
  constexpr bool A_KC = T::A_KC, B_KC = T::B_KC;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  S* const smem = reinterpret_cast<S*>(smem_raw);

  int e;
  int64_t m0;
  if constexpr (MODE == DW) {
    e = blockIdx.z;
    m0 = int64_t(blockIdx.y) * BM;
  } else {
    const int32_t t = int32_t(blockIdx.y);
    if (t >= tile_prefix[E]) return;
    e = expert_of_tile(tile_prefix, E, t);
    m0 = int64_t(t - tile_prefix[e]) * BM;
  }
  const int64_t n0 = int64_t(blockIdx.x) * BN;
  const int64_t s = start[e], rows = start[e + 1] - s;
  int64_t M, N, K, lda, ldb, ldc;
  const S *a0, *b0;
  if constexpr (MODE == FWD) {
    M = rows, N = n_out, K = n_in;
    a0 = A + s * n_in, lda = n_in;
    b0 = B + int64_t(e) * n_out * n_in, ldb = n_in;
    ldc = n_out;
  } else if constexpr (MODE == DX) {
    M = rows, N = n_in, K = n_out;
    a0 = A + s * n_out, lda = n_out;
    b0 = B + int64_t(e) * n_out * n_in, ldb = n_in;
    ldc = n_in;
  } else {
    M = n_out, N = n_in, K = rows;
    a0 = A + s * n_out, lda = n_out;
    b0 = B + s * n_in, ldb = n_in;
    ldc = n_in;
  }
  if (m0 >= M || n0 >= N) return;
  if (K <= 0 && (MODE != DW || accumulate)) return;  // DW of an expert without rows adds nothing, or writes zeros

  const int tid = threadIdx.x;
  auto load = [&](int st, int64_t k0) {
    S* As = smem + st * (SA + SB);
    S* Bs = As + SA;
    if constexpr (A_KC) load_tile<S, BM, BK, LDA>(As, a0, lda, m0, k0, M, K, vecA);
    else load_tile<S, BK, BM, LDA>(As, a0, lda, k0, m0, K, M, vecA);
    if constexpr (B_KC) load_tile<S, BN, BK, LDB>(Bs, b0, ldb, n0, k0, N, K, vecB);
    else load_tile<S, BK, BN, LDB>(Bs, b0, ldb, k0, n0, K, N, vecB);
  };
  // Output element (m, n) of this tile, m and n inside the tile.
  auto put = [&](int64_t m, int64_t n, float v) {
    if (m >= M || n >= N) return;
    if constexpr (MODE == FWD) {
      st(static_cast<S*>(C) + s * n_out, m * ldc + n, v);
    } else if constexpr (MODE == DX) {
      S* c = static_cast<S*>(C) + s * n_in;
      st(c, m * ldc + n, prior(c, m * ldc + n, accumulate) + v);
    } else {
      float* c = static_cast<float*>(C) + int64_t(e) * n_out * n_in;
      c[m * ldc + n] = prior(c, m * ldc + n, accumulate) + v;
    }
  };
  // FWD/DX's output elements (m, n), (m, n + 1), n even: one paired access where the pair is aligned (ldc even, C
  // aligned to a pair), else put() twice. Same arithmetic as put(), so the result does not depend on the path.
  const bool pairs = (ldc & 1) == 0 && (reinterpret_cast<uintptr_t>(C) & (2 * sizeof(S) - 1)) == 0;
  auto put2 = [&](int64_t m, int64_t n, float v0, float v1) {
    if (m >= M || n >= N) return;
    if (!pairs || n + 1 >= N) {
      put(m, n, v0);
      put(m, n + 1, v1);
    } else {
      Pair<S>* c = reinterpret_cast<Pair<S>*>(static_cast<S*>(C) + s * ldc + m * ldc + n);
      Pair<S> q;
      if (MODE == DX && accumulate) {
        q = *c;
        v0 += ld(&q.x, 0), v1 += ld(&q.y, 0);
      }
      st(&q.x, 0, v0);
      st(&q.y, 0, v1);
      *c = q;
    }
  };
  // Multi-stage pipeline: tile kt computes while tiles kt+1 .. kt+kStages-1 are in flight. The barrier at the top of
  // an iteration both publishes tile kt and frees the stage that tile kt+kStages-1 overwrites (read at kt-1).
  const int64_t nk = (K + BK - 1) / BK;
  auto mainloop = [&](auto&& compute) {
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) {
      if (st < nk) load(st, st * int64_t(BK));
      cp_commit();
    }
    for (int64_t kt = 0; kt < nk; ++kt) {
      cp_wait<kStages - 2>();
      __syncthreads();
      const int64_t nt = kt + kStages - 1;
      if (nt < nk) load(int(nt % kStages), nt * BK);
      cp_commit();
      const S* As = smem + int(kt % kStages) * (SA + SB);
      compute(As, As + SA);
    }
    cp_wait<0>();
    __syncthreads();  // the buffers are free for the epilogue
  };

  if (T::kStagedDW && accumulate)  // the prior dW tile into L2 while the main loop runs
    grouped_dw::prefetch_tile<BM, BN>(static_cast<const float*>(C) + int64_t(e) * n_out * n_in, ldc, m0, n0, M, N);

  if constexpr (sizeof(S) == 4) {
    // fp32: SIMT, 8x8 outputs a thread at (ty + 16 i, tx + 16 j).
    const int tx = tid & 15, ty = tid >> 4;
    float acc[8][8] = {};
    mainloop([&](const S* As, const S* Bs) {
#pragma unroll
      for (int kk = 0; kk < BK; ++kk) {
        float av[8], bv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) av[i] = A_KC ? As[(ty + 16 * i) * LDA + kk] : As[kk * LDA + ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 8; ++j) bv[j] = B_KC ? Bs[(tx + 16 * j) * LDB + kk] : Bs[kk * LDB + tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] += av[i] * bv[j];
      }
    });
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) put(m0 + ty + 16 * i, n0 + tx + 16 * j, acc[i][j]);
  } else if constexpr (T::kMma) {
    // 8 warps as 2 (m) x 4 (n), 64 x 64 outputs a warp: acc[i][j] is the m16n8 tile at (wm 64 + 16 i, wn 64 + 8 j).
    const int warp = tid >> 5, lane = tid & 31, wm = warp >> 2, wn = warp & 3;
    const int l8 = lane & 7, q1 = (lane >> 3) & 1, q2 = lane >> 4;
    float acc[4][8][4] = {};
    mainloop([&](const S* As, const S* Bs) {
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        uint32_t a[4][4], b[8][2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15)
          const int mr = wm * 64 + 16 * i;
          ldsm4<!A_KC>(a[i], A_KC ? As + (mr + l8 + 8 * q1) * LDA + kk + 8 * q2
                                  : As + (kk + l8 + 8 * q2) * LDA + mr + 8 * q1);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
          const int nc = wn * 64 + 16 * j;
          uint32_t r[4];
          ldsm4<!B_KC>(r, B_KC ? Bs + (nc + l8 + 8 * q2) * LDB + kk + 8 * q1
                               : Bs + (kk + l8 + 8 * q1) * LDB + nc + 8 * q2);
          b[2 * j][0] = r[0], b[2 * j][1] = r[1], b[2 * j + 1][0] = r[2], b[2 * j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) mma16816<S>(acc[i][j], a[i], b[j][0], b[j][1]);
      }
    });
    const int g = lane >> 2, t2 = 2 * (lane & 3);
    if constexpr (T::kStagedDW) {
      stage_out_dw<BN, T::LDC>(acc, reinterpret_cast<float*>(smem_raw), static_cast<float*>(C) +
                               int64_t(e) * n_out * n_in, ldc, m0, n0, M, N, accumulate, wm, wn, g, t2);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int64_t m = m0 + wm * 64 + 16 * i + g, n = n0 + wn * 64 + 8 * j + t2;
          put2(m, n, acc[i][j][0], acc[i][j][1]);
          put2(m + 8, n, acc[i][j][2], acc[i][j][3]);
        }
    }
  }
}

// tile_prefix[e] = sum over e' < e of ceil(rows(e') / BM), tile_prefix[E] = the total (one warp).
__global__ void k_tile_prefix(const int32_t* __restrict__ start, int E, int32_t* tile_prefix) {
  const int lane = threadIdx.x;
  const int per = (E + 31) / 32, e0 = lane * per, e1 = min(E, e0 + per);
  int32_t local = 0;
  for (int e = e0; e < e1; ++e) local += (start[e + 1] - start[e] + BM - 1) / BM;
  int32_t incl = local;
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  int32_t run = incl - local;
  for (int e = e0; e < e1; ++e) {
    tile_prefix[e] = run;
    run += (start[e + 1] - start[e] + BM - 1) / BM;
  }
  if (lane == 31) tile_prefix[E] = incl;
}

template <class S, int MODE>
void grouped_launch(const Exec& x, const void* A, const void* B, void* C, const int32_t* start,
                    const int32_t* tile_prefix, int64_t R, int64_t E, int64_t n_in, int64_t n_out, int64_t lda,
                    int64_t ldb, bool accumulate) {
  constexpr int VEC = 16 / int(sizeof(S)), BN = GTile<S, MODE>::BN;
  const bool vecA = aligned16(A) && lda % VEC == 0, vecB = aligned16(B) && ldb % VEC == 0;
  const int64_t N = MODE == FWD ? n_out : n_in;
  dim3 grid(unsigned((N + BN - 1) / BN), 1, 1);
  if (MODE == DW) {
    grid.y = unsigned((n_out + BM - 1) / BM);
    grid.z = unsigned(E);
  } else {
    const int64_t tiles = (R + BM - 1) / BM + E;  // >= sum over experts of ceil(rows / BM)
    Q3VL_CHECK(tiles <= 65535, "grouped_linear: too many rows for one launch");
    grid.y = unsigned(tiles);
  }
  constexpr size_t smem = GTile<S, MODE>::smem;
  static std::once_flag once;  // per instantiation: allow more than 48 KiB of dynamic shared memory
  std::call_once(once, [] {
    Q3VL_CU(cudaFuncSetAttribute(k_grouped<S, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  });
  k_grouped<S, MODE><<<grid, 256, smem, stream_of(x)>>>(static_cast<const S*>(A), static_cast<const S*>(B), C, start,
                                                        tile_prefix, int(E), n_in, n_out, vecA, vecB, accumulate);
  Q3VL_LAUNCHED();
}

// ---- combine / unpermute ----------------------------------------------------------------------------------------
template <class S>
__global__ void k_combine_fwd(const S* __restrict__ y, const int32_t* __restrict__ pos, const float* __restrict__ w,
                              S* __restrict__ out, int64_t N, int k, int64_t H, bool add) {
  pdl_enter();  // launched by launch_pdl
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < N * H; q += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = q / H, d = q % H;
    float acc = 0.f;
    for (int s = 0; s < k; ++s) acc += w[t * k + s] * ld(y, int64_t(pos[t * k + s]) * H + d);
    store_y(out, q, acc, add);  // with add the sum rounded to S, then added (as axpy of a written sum)
  }
}
// One warp per (token, slot) pair r: dw[r] = <dout[t], y[pos]>, dy[pos] += w[r] dout[t] (pos distinct: no races).
template <class S>
__global__ void k_combine_bwd(const S* __restrict__ dout, const S* __restrict__ y, const int32_t* __restrict__ pos,
                              const float* __restrict__ w, float* __restrict__ dw, S* __restrict__ dy, int64_t R,
                              int k, int64_t H, bool accumulate) {
  const int lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
  for (int64_t r = blockIdx.x * int64_t(wpb) + (threadIdx.x >> 5); r < R; r += int64_t(gridDim.x) * wpb) {
    const S* g = dout + (r / k) * H;
    const int64_t pr = int64_t(pos[r]) * H;
    const float wr = w[r];
    float acc = 0.f;
    for (int64_t d = lane; d < H; d += 32) {
      const float gd = ld(g, d);
      acc += gd * ld(y, pr + d);
      st(dy, pr + d, prior(dy, pr + d, accumulate) + wr * gd);
    }
    acc = warp_sum(acc);
    if (lane == 0) dw[r] = acc;
  }
}
template <class S>
__global__ void k_unpermute_add(const S* __restrict__ src, const int32_t* __restrict__ pos, S* __restrict__ dst,
                                int64_t N, int k, int64_t H, bool accumulate) {
  for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < N * H; q += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = q / H, d = q % H;
    float acc = prior(dst, q, accumulate);
    for (int s = 0; s < k; ++s) acc += ld(src, int64_t(pos[t * k + s]) * H + d);
    st(dst, q, acc);
  }
}

int warp_rows_grid(int64_t rows, int warps_per_block) { return grid_for(rows, warps_per_block); }

}  // namespace

// ---- public launchers -------------------------------------------------------------------------------------------------
void router_fwd(const Exec& x, const void* logits, float* probs, int32_t* idx, float* w, int64_t N, int64_t E,
                int64_t k, DType dt) {
  Q3VL_CHECK(k >= 1 && k <= E, "router: experts_per_tok must be in [1, num_experts]");
  Q3VL_CHECK(E <= kMaxExperts && k <= 32, "router: at most 1024 experts, 32 a token, on CUDA");
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    launch_pdl(k_router_fwd<S>, dim3(warp_rows_grid(N, 4)), 128, 4 * E * sizeof(float), stream_of(x),
               static_cast<const S*>(logits), probs, idx, w, N, int(E), int(k));
  });
}

void router_bwd(const Exec& x, const float* dw, const float* probs, const int32_t* idx, void* dlogits, int64_t N,
                int64_t E, int64_t k, bool accumulate, DType dt) {
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_router_bwd<S><<<warp_rows_grid(N, 8), 256, 0, stream_of(x)>>>(dw, probs, idx, static_cast<S*>(dlogits), N,
                                                                     int(E), int(k), accumulate);
    Q3VL_LAUNCHED();
  });
}

void aux_loss_fwd(const Exec& x, const float* probs, const int32_t* idx, float* f, double* aux, int64_t N, int64_t E,
                  int64_t k) {
  if (N <= 0) return;  // as the reference: f untouched, aux += 0
  Q3VL_CHECK(E <= kMaxExperts, "aux_loss: at most 1024 experts on CUDA");
  const auto s = stream_of(x);
  const int64_t tiles = (E + 31) / 32;
  const size_t cnt_bytes = (size_t(E) * sizeof(int32_t) + 15) / 16 * 16;
  int64_t chunks = std::min<int64_t>(std::max<int64_t>(1, 1024 / tiles), (N + 63) / 64);
  chunks = std::min<int64_t>(chunks, int64_t((x.ws_bytes - std::min(x.ws_bytes, cnt_bytes)) / (sizeof(double) * E)));
  Q3VL_CHECK(chunks >= 1, "aux_loss: workspace too small");
  const int64_t rows_per = (N + chunks - 1) / chunks;
  chunks = (N + rows_per - 1) / rows_per;
  auto* cnt = static_cast<int32_t*>(x.ws);
  auto* part = reinterpret_cast<double*>(static_cast<char*>(x.ws) + cnt_bytes);
  Q3VL_CU(cudaMemsetAsync(cnt, 0, size_t(E) * sizeof(int32_t), s));
  const int64_t R = N * k;
  k_expert_counts<<<std::min(grid_for(R), 1024), 256, E * sizeof(int32_t), s>>>(idx, R, int(E), cnt);
  Q3VL_LAUNCHED();
  k_prob_colsum<<<dim3(unsigned(tiles), unsigned(chunks)), dim3(32, 8), 0, s>>>(probs, N, int(E), rows_per, part);
  Q3VL_LAUNCHED();
  k_aux_final<<<1, 1024, 0, s>>>(cnt, part, chunks, N, int(E), f, aux);
  Q3VL_LAUNCHED();
}

void aux_loss_bwd(const Exec& x, const float* probs, const float* f, float coef, void* dlogits, int64_t N, int64_t E,
                  bool accumulate, DType dt) {
  if (N <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_aux_bwd<S><<<warp_rows_grid(N, 8), 256, 0, stream_of(x)>>>(probs, f, coef, static_cast<S*>(dlogits), N, int(E),
                                                                  accumulate);
    Q3VL_LAUNCHED();
  });
}

void moe_plan(const Exec& x, const int32_t* idx, int64_t N, int64_t k, int64_t E, int32_t* start, int32_t* rows,
              int32_t* pos) {
  Q3VL_CHECK(E >= 1 && E <= kMaxExperts, "moe_plan: expert count out of range (at most 1024 on CUDA)");
  const auto s = stream_of(x);
  const int64_t R = N * k;
  if (R <= 0) {
    Q3VL_CU(cudaMemsetAsync(start, 0, size_t(E + 1) * sizeof(int32_t), s));
    return;
  }
  const size_t one_block_smem = (size_t((R + 31) / 32) + 1) * size_t(E) * sizeof(int32_t);
  if (R <= kPlanOneBlockR && one_block_smem <= kPlanSmem) {
    launch_pdl(k_plan_one_block, dim3(1), 1024, one_block_smem, s, idx, int(R), int(E), start, rows, pos);
    return;
  }
  const int64_t nchunks = (R + kChunk - 1) / kChunk;
  Q3VL_CHECK(size_t(nchunks) * size_t(E) * sizeof(int32_t) <= x.ws_bytes, "moe_plan: workspace too small");
  auto* cnt = static_cast<int32_t*>(x.ws);
  const int blocks = int((nchunks + 7) / 8);  // 8 warps a block, a chunk a warp
  k_plan_count<<<blocks, 256, 0, s>>>(idx, R, int(E), nchunks, cnt);
  Q3VL_LAUNCHED();
  k_plan_scan<<<1, 1024, 0, s>>>(cnt, nchunks, int(E), start);
  Q3VL_LAUNCHED();
  k_plan_fill<<<blocks, 256, 0, s>>>(idx, R, int(E), nchunks, cnt, rows, pos);
  Q3VL_LAUNCHED();
}

void moe_route(const Exec& x, const void* in, const void* Wr, float* logits, float* probs, int32_t* idx, float* w,
               int32_t* start, int32_t* rows, int32_t* pos, int64_t N, int64_t H, int64_t E, int64_t k, DType dt) {
  const int C = E % route_cluster() == 0 ? route_cluster() : 8;
  bool fused = false;
  if (N >= 1 && N <= kRouteMaxN && H >= 1 && E >= C && E % C == 0 && E <= kMaxExperts && k >= 1 && k <= 32 &&
      k <= E && aligned16(in) && aligned16(Wr))
    by_dtype(dt, [&]<class S>() {
      constexpr int L = wgemv::kGroup<S>;
      const int64_t vpt = (H / L + kRouteThreads - 1) / kRouteThreads;
      if (H % L != 0 || vpt > kRouteMaxVpt || route_smem(N, E, k, int(vpt)) > kRouteSmem) return;
      fused = true;
      launch_pdl_cluster(vpt == 1 ? k_moe_route<S, 1> : k_moe_route<S, 2>, C, dim3(unsigned(C)), kRouteThreads,
                         route_smem(N, E, k, int(vpt)), stream_of(x), static_cast<const S*>(in),
                         static_cast<const S*>(Wr), logits, probs, idx, w, start, rows, pos, int(N), int(H), int(E),
                         int(k));
    });
  if (fused) return;
  Q3VL_CHECK(logits, "moe_route: logits may be null only where the fused kernel runs (decode sizes)");
  cuda::gemm(x, false, true, N, E, H, 1.f, in, H, Wr, H, 0.f, logits, E, dt, DType::F32);  // qualified: not ADL's dev::
  cuda::router_fwd(x, logits, probs, idx, w, N, E, k, DType::F32);
  cuda::moe_plan(x, idx, N, k, E, start, rows, pos);
}

// The grouped expert GEMM of one mode (0 FWD, 1 DX, 2 DW: see k_grouped) with the path chosen by the caller
// (tools/gpu/moe_bench.cu times both in one process): wgmma takes moe_sm90.cu's kernel where it applies (bf16/fp16
// on a 9.0 device, rows of whole 16-byte chunks, aligned operands), else k_grouped; returns whether wgmma ran.
// accumulate: DX's dxg and DW's dW are added to (else written).
// sq (DW with accumulate false): C's squares added, in the wgmma kernel's epilogue (its blocks' partials in x.ws,
// where DW keeps no tile_prefix) or by sum_squares after the other kernels.
bool grouped_linear_path(const Exec& x, int mode, bool wgmma, const void* A, const void* B, void* C,
                         const int32_t* start, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                         DType dt, const SumSq& sq) {
  Q3VL_CHECK(mode >= FWD && mode <= DW, "grouped_linear: mode out of range");
  Q3VL_CHECK(E >= 1 && E <= 65535, "grouped_linear: expert count out of range");
  Q3VL_CHECK(!sq.sum || (mode == DW && !accumulate), "grouped_linear: squares of a written dW only");
  const auto s = stream_of(x);
  int32_t* tile_prefix = static_cast<int32_t*>(x.ws);
  if (mode != DW) {
    Q3VL_CHECK(size_t(E + 1) * sizeof(int32_t) <= x.ws_bytes, "grouped_linear: workspace too small");
    k_tile_prefix<<<1, 32, 0, s>>>(start, int(E), tile_prefix);
    Q3VL_LAUNCHED();
  }
  // A double and an int32 for each of up to 1024 blocks (a persistent grid: one an SM).
  const bool room = x.ws_bytes >= size_t(1024) * (sizeof(double) + sizeof(int32_t));
  bool took = false;
  by_dtype(dt, [&]<class S>() {
    if constexpr (sizeof(S) == 2)
      took = wgmma && (room || !sq.sum) &&
             grouped_sm90(s, std::is_same_v<S, __nv_bfloat16>, mode, A, B, C, start, tile_prefix, R, E, n_in, n_out,
                          accumulate, sq, static_cast<double*>(x.ws));
    if (took) return;
    const int64_t lda = mode == FWD ? n_in : n_out, ldb = n_in;
    if (mode == FWD) grouped_launch<S, FWD>(x, A, B, C, start, tile_prefix, R, E, n_in, n_out, lda, ldb, accumulate);
    else if (mode == DX) grouped_launch<S, DX>(x, A, B, C, start, tile_prefix, R, E, n_in, n_out, lda, ldb, accumulate);
    else grouped_launch<S, DW>(x, A, B, C, start, tile_prefix, R, E, n_in, n_out, lda, ldb, accumulate);
  });
  if (sq.sum && !took) cuda::sum_squares(x, C, E * n_out * n_in, DType::F32, sq.sum, sq.nonfinite);
  return took;
}

void grouped_linear_fwd(const Exec& x, const void* xg, const void* W, const int32_t* start, void* y, int64_t R,
                        int64_t E, int64_t n_in, int64_t n_out, DType dt, const RowsIn& rin) {
  if (R <= 0 || n_out <= 0) return;
  if (n_in <= 0) {  // empty inner dimension: y = 0
    by_dtype(dt, [&]<class S>() { Q3VL_CU(cudaMemsetAsync(y, 0, size_t(R * n_out) * sizeof(S), stream_of(x))); });
    return;
  }
  if (R <= wgemv::kGroupedRows * E) {  // decode: the GEMV, up to kMaxN rows an expert a pass
    Q3VL_CHECK(E >= 1 && E <= 65535, "grouped_linear: expert count out of range");
    by_dtype(dt, [&]<class S>() {
      wgemv::gemv<S, S>(x, static_cast<const S*>(xg), static_cast<const S*>(W), nullptr, nullptr, static_cast<S*>(y),
                        std::min<int64_t>(R, wgemv::kMaxN), n_in, n_out, start, E, R, rin);
    });
    return;
  }
  grouped_linear_path(x, FWD, true, rows_in(x, xg, rin, R, n_in, dt), W, y, start, R, E, n_in, n_out, false, dt, {});
}

void grouped_linear_bwd(const Exec& x, const void* dy, const void* xg, const void* W, const int32_t* start, void* dxg,
                        float* dW, int64_t R, int64_t E, int64_t n_in, int64_t n_out, bool accumulate,
                        bool accumulate_dW, DType dt, const SumSq& dw_sq) {
  if (n_in <= 0) return;
  if (R <= 0 || n_out <= 0) {  // an empty inner dimension adds nothing; a written output is zeros
    const auto s = stream_of(x);
    if (dxg && !accumulate && R > 0)
      by_dtype(dt, [&]<class S>() { Q3VL_CU(cudaMemsetAsync(dxg, 0, size_t(R * n_in) * sizeof(S), s)); });
    if (dW && !accumulate_dW && n_out > 0) Q3VL_CU(cudaMemsetAsync(dW, 0, size_t(E * n_out * n_in) * 4, s));
    return;
  }
  if (dxg) grouped_linear_path(x, DX, true, dy, W, dxg, start, R, E, n_in, n_out, accumulate, dt, {});
  if (dW) grouped_linear_path(x, DW, true, dy, xg, dW, start, R, E, n_in, n_out, accumulate_dW, dt, dw_sq);
}

void moe_combine_fwd(const Exec& x, const void* y, const int32_t* pos, const float* w, void* out, int64_t N, int64_t k,
                     int64_t H, DType dt, bool add) {
  if (N * H <= 0) return;
  by_dtype(dt, [&]<class S>() {
    launch_pdl(k_combine_fwd<S>, dim3(unsigned(grid_for(N * H))), 256, 0, stream_of(x), static_cast<const S*>(y), pos,
               w, static_cast<S*>(out), N, int(k), H, add);
  });
}

void moe_combine_bwd(const Exec& x, const void* dout, const void* y, const int32_t* pos, const float* w, float* dw,
                     void* dy, int64_t N, int64_t k, int64_t H, bool accumulate, DType dt) {
  const int64_t R = N * k;
  if (R <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_combine_bwd<S><<<warp_rows_grid(R, 8), 256, 0, stream_of(x)>>>(static_cast<const S*>(dout),
                                                                      static_cast<const S*>(y), pos, w, dw,
                                                                      static_cast<S*>(dy), R, int(k), H, accumulate);
    Q3VL_LAUNCHED();
  });
}

void unpermute_add(const Exec& x, const void* src, const int32_t* pos, void* dst, int64_t N, int64_t k, int64_t H,
                   bool accumulate, DType dt) {
  if (N * H <= 0) return;
  by_dtype(dt, [&]<class S>() {
    k_unpermute_add<S><<<grid_for(N * H), 256, 0, stream_of(x)>>>(static_cast<const S*>(src), pos,
                                                                   static_cast<S*>(dst), N, int(k), H, accumulate);
    Q3VL_LAUNCHED();
  });
}

}  // namespace q3vl::dev::cuda
