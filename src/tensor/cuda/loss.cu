// Cross-entropy over a large vocabulary: one block per row, an online (max, sum) pass over the logits, then a pass
// that adds scale * (softmax - onehot) into dlogits (or writes it: dev.hpp's `accumulate`). The row losses are summed
// into *loss_sum by a second, single-block kernel in a fixed order (deterministic, unlike per-row double atomics).
// Serving's greedy argmax is the same shape: a block per row, a strided scan, then warp and block reductions.
#include <algorithm>
#include <cfloat>
#include <cmath>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {

namespace {

constexpr int kThreads = 512;

// Online softmax state: running max m and sum of exp(x - m).
struct MS {
  float m, s;
};
__device__ __forceinline__ MS ms_merge(MS a, MS b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // both empty (or all -inf)
  return {m, (a.m == -INFINITY ? 0.f : a.s * expf(a.m - m)) + (b.m == -INFINITY ? 0.f : b.s * expf(b.m - m))};
}
__device__ __forceinline__ void ms_add(MS& a, float x) {
  if (x > a.m) {
    a.s = (a.m == -INFINITY ? 0.f : a.s * expf(a.m - x)) + 1.f;
    a.m = x;
  } else if (x != -INFINITY) {
    a.s += expf(x - a.m);  // NaN x lands here and propagates
  }
}

template <class S, int V>
__global__ void __launch_bounds__(kThreads)
    k_cross_entropy(const S* __restrict__ logits, const int32_t* __restrict__ target, float* __restrict__ loss,
                    S* __restrict__ dlogits, int64_t N, int64_t Vocab, float scale, bool acc) {
  __shared__ MS sh[kThreads / 32];
  __shared__ MS total;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int32_t t = target[i];
    const bool valid = t >= 0 && t < Vocab;
    if (dlogits && !acc && !valid)  // no gradient: a written row is the zeroed row
      for (int64_t j = tid; j < Vocab; j += kThreads) st(dlogits + i * Vocab, j, 0.f);
    if (t == -100) {
      if (tid == 0) loss[i] = 0.f;
      continue;  // uniform across the block
    }
    const S* x = logits + i * Vocab;
    MS a{-INFINITY, 0.f};
    for (int64_t j = int64_t(tid) * V; j < Vocab; j += int64_t(kThreads) * V) {
      const Pack<S, V> pk = ldp<S, V>(x, j);
#pragma unroll
      for (int u = 0; u < V; ++u) ms_add(a, ld(pk.v, u));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      MS b{__shfl_xor_sync(0xffffffffu, a.m, o), __shfl_xor_sync(0xffffffffu, a.s, o)};
      a = ms_merge(a, b);
    }
    if (lane == 0) sh[wid] = a;
    __syncthreads();
    if (tid == 0) {
      MS r = sh[0];
      for (int w = 1; w < kThreads / 32; ++w) r = ms_merge(r, sh[w]);
      total = r;
    }
    __syncthreads();
    const float lse = total.m + logf(total.s);
    if (tid == 0) loss[i] = valid ? lse - ld(x, t) : NAN;  // a target outside the vocabulary poisons the loss
    if (dlogits && valid) {
      S* g = dlogits + i * Vocab;
      for (int64_t j = int64_t(tid) * V; j < Vocab; j += int64_t(kThreads) * V) {
        const Pack<S, V> pk = ldp<S, V>(x, j);
        Pack<S, V> gk{};  // zeros, unless accumulating
        if (acc) gk = ldp<S, V>(g, j);
#pragma unroll
        for (int u = 0; u < V; ++u) {
          float v = ld(gk.v, u) + scale * expf(ld(pk.v, u) - lse);
          if (j + u == t) v -= scale;
          st(gk.v, u, v);
        }
        stp<S, V>(g, j, gk);
      }
    }
    __syncthreads();  // `total` is rewritten for the next row
  }
}

// *sum += sum of loss[0..N) in double, one block, fixed order.
__global__ void k_sum_rows(const float* __restrict__ loss, int64_t N, double* sum) {
  __shared__ double sh[256];
  double a = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) a += double(loss[i]);
  sh[threadIdx.x] = a;
  __syncthreads();
  for (int w = 128; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) *sum += sh[0];
}

}  // namespace

void cross_entropy(const Exec& x, const void* logits, const int32_t* target, float* loss, void* dlogits,
                   double* loss_sum, int64_t N, int64_t V, float scale, bool accumulate, DType dt) {
  if (N <= 0) return;
  float* rows = loss;
  if (!rows) {  // the per-row losses still go somewhere for the sum
    Q3VL_CHECK(size_t(N) * sizeof(float) <= x.ws_bytes, "cross_entropy: workspace too small for the row losses");
    rows = static_cast<float*>(x.ws);
  }
  const int blocks = int(std::min<int64_t>(N, 1 << 20));
  by_dtype(dt, [&]<class S>() {
    constexpr int VW = 16 / sizeof(S);
    const auto al = reinterpret_cast<uintptr_t>(logits) | reinterpret_cast<uintptr_t>(dlogits);
    const auto* lg = static_cast<const S*>(logits);
    auto* dg = static_cast<S*>(dlogits);
    if (V % VW == 0 && al % 16 == 0)
      k_cross_entropy<S, VW><<<blocks, kThreads, 0, stream_of(x)>>>(lg, target, rows, dg, N, V, scale, accumulate);
    else
      k_cross_entropy<S, 1><<<blocks, kThreads, 0, stream_of(x)>>>(lg, target, rows, dg, N, V, scale, accumulate);
    Q3VL_LAUNCHED();
  });
  if (loss_sum) {
    k_sum_rows<<<1, 256, 0, stream_of(x)>>>(rows, N, loss_sum);
    Q3VL_LAUNCHED();
  }
}

// ---- greedy argmax --------------------------------------------------------------------------------------------------
namespace {
// (value, column) pairs: the larger value wins, ties to the lower column; column -1 is "none".
__device__ __forceinline__ bool better(float v, int c, float bv, int bc) {
  return bc < 0 || (c >= 0 && (v > bv || (v == bv && c < bc)));
}
// One block a row. A decode step's one row is 600 KB of logits read by one SM, so its loads are what the scan is:
// 16-byte loads, kArgmaxUnroll of them in flight a thread (one load at a time took 80 us a 151,936-entry row).
constexpr int kArgmaxThreads = 1024, kArgmaxUnroll = 4;
__global__ void __launch_bounds__(kArgmaxThreads)
    k_argmax_rows(const float* __restrict__ logits, int64_t V, int64_t v0, int64_t limit,
                  const int32_t* __restrict__ banned, int nb, bool vec, int32_t* __restrict__ idx,
                  float* __restrict__ val) {
  pdl_enter();  // launched by launch_pdl
  const float* r = logits + int64_t(blockIdx.x) * V;
  const int64_t n = min(V, max(limit - v0, int64_t(0)));
  float bv = -INFINITY;
  int bc = -1;
  auto see = [&](float v, int64_t c) {  // a thread's columns rise: strict > keeps the first
    if (bc >= 0 && !(v > bv)) return;
    bool ban = false;
    for (int j = 0; j < nb; ++j) ban |= banned[j] == v0 + c;
    if (!ban) bv = v, bc = int(c);
  };
  int64_t c0 = 0;  // vec: rows 16-byte aligned, columns [0, c0) as float4s
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(r);
    const int64_t n4 = n / 4, T = blockDim.x;
    for (int64_t i = threadIdx.x; i < n4; i += kArgmaxUnroll * T) {
      float4 q[kArgmaxUnroll];
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u)
        if (i + u * T < n4) q[u] = __ldg(r4 + i + u * T);
#pragma unroll
      for (int u = 0; u < kArgmaxUnroll; ++u) {
        const int64_t k = i + u * T;
        if (k >= n4) break;
        see(q[u].x, 4 * k), see(q[u].y, 4 * k + 1), see(q[u].z, 4 * k + 2), see(q[u].w, 4 * k + 3);
      }
    }
    c0 = 4 * n4;
  }
  for (int64_t c = c0 + threadIdx.x; c < n; c += blockDim.x) see(r[c], c);
  for (int o = 16; o; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oc = __shfl_xor_sync(0xffffffffu, bc, o);
    if (better(ov, oc, bv, bc)) bv = ov, bc = oc;
  }
  __shared__ float sv[kArgmaxThreads / 32];
  __shared__ int sc[kArgmaxThreads / 32];
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sv[w] = bv, sc[w] = bc;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int k = 1; k < int(blockDim.x / 32); ++k)
      if (better(sv[k], sc[k], bv, bc)) bv = sv[k], bc = sc[k];
    idx[blockIdx.x] = bc < 0 ? -1 : int32_t(v0 + bc);
    val[blockIdx.x] = bc < 0 ? -FLT_MAX : bv;
  }
}
}  // namespace

void argmax_rows(const Exec& x, const float* logits, int64_t S, int64_t V, int64_t v0, int64_t limit,
                 const int32_t* banned, int64_t nb, int32_t* idx, float* val) {
  if (S <= 0) return;
  Q3VL_CHECK(S <= 65535 * 16 && V < (int64_t(1) << 31) && nb >= 0 && nb <= 1024, "argmax_rows: sizes out of range");
  const bool vec = V % 4 == 0 && aligned16(logits);
  launch_pdl(k_argmax_rows, dim3(unsigned(S)), kArgmaxThreads, 0, stream_of(x), logits, V, v0, limit, banned, int(nb),
             vec, idx, val);
}

}  // namespace q3vl::dev::cuda
