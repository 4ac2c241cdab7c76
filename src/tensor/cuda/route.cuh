// The MoE router's row on one warp (k_router_fwd, k_moe_route in moe.cu; the decode chain's MoE link in
// gemv_chain.cuh): one definition, so every path picks the same experts from the same logits.
#pragma once
#include <cmath>

namespace q3vl::dev::cuda {

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- router -----------------------------------------------------------------------------------------------------
// One row by one warp (k_router_fwd, k_moe_route): buf [E] (shared) holds the row's logits, written before a
// __syncwarp or a wider barrier. Softmax as the reference (sequential sum in expert order), in place, also written
// to probs; then k rounds of a warp argmax ordered by (probability desc, index asc): ties go to the lower index, as
// torch.topk and ops::router_fwd. Lane j < k gets the j-th pick and its renormalised weight.
struct Pick {
  int e;
  float w;
};
__device__ __forceinline__ Pick router_row(float* buf, float* __restrict__ probs, int E, int k) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) mx = fmaxf(mx, buf[e]);
  mx = warp_max(mx);
  for (int e = lane; e < E; e += 32) buf[e] = expf(buf[e] - mx);
  __syncwarp();
  float sum = 0.f;
  if (lane == 0)
    for (int e = 0; e < E; ++e) sum += buf[e];
  sum = __shfl_sync(0xffffffffu, sum, 0);
  __syncwarp();  // lane 0 read every buf[e] before they are overwritten
  for (int e = lane; e < E; e += 32) {
    const float p = buf[e] / sum;
    buf[e] = p;
    probs[e] = p;
  }
  uint32_t taken = 0;  // bit q: element lane + 32 q already selected
  float sel = 0.f, mine_v = 0.f;  // lane j keeps the j-th pick (k <= 32): no read back of idx
  int mine = -1;
  for (int j = 0; j < k; ++j) {
    int best = -1;
    float bv = 0.f;
    for (int e = lane, q = 0; e < E; e += 32, ++q)
      if (!((taken >> q) & 1u) && (best < 0 || buf[e] > bv)) best = e, bv = buf[e];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const int ob = __shfl_xor_sync(0xffffffffu, best, o);
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      if (ob >= 0 && (best < 0 || ov > bv || (!(bv > ov) && ob < best))) best = ob, bv = ov;
    }
    if ((best & 31) == lane) taken |= 1u << (best >> 5);
    sel += bv;
    if (lane == j) mine = best, mine_v = bv;
  }
  return {mine, mine_v / sel};
}

}  // namespace q3vl::dev::cuda
