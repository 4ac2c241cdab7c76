// Flash attention over packed variable-length segments (ops::attention_fwd / attention_bwd semantics): online
// softmax over key tiles in shared memory, never an S x S score matrix in global memory.
//  - bf16/fp16 with hd in {64, 72, 128} and 16-byte aligned pointers: tensor cores (mma.sync m16n8k16, fp32
//    accumulation), 4 warps a block, cp.async double-buffered tiles (FwdCfg/DqCfg/DkvCfg give the tile sizes);
//    hd 72 is zero-padded to 80 in shared memory.
//    On a 9.0 device, attention_sm90.cu's wgmma kernels take over (forward hd 128, backward 64, 72 and 128;
//    attention_fwd_path / _bwd_path with wgmma = false keep these, for tools/gpu/attn_check.cu's comparisons).
//  - everything else (fp32 parity mode, other head dims up to 256): SIMT kernels, fp32 tiles, 4 threads per row.
// Backward: D = rowsum(dout*out) into Exec::ws, then dK/dV per (key block, kv head) looping over the group's query
// heads (race-free GQA), then dQ per query block looping over key blocks (deterministic, no atomics). The wgmma
// backward computes dQ in the dK/dV loop instead, into an fp32 accumulator after D in Exec::ws (atomics).
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/mma_util.cuh"

namespace q3vl::dev::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

// p[i] += x on one element of any S (acc false: p[i] = x, p unread).
template <class S> __device__ __forceinline__ void add1(S* p, int64_t i, float x, bool acc) {
  st(p, i, (acc ? ld(p, i) : 0.f) + x);
}

// ---- D = rowsum(dout * out), one warp per (token, head) row -------------------------------------------------------
template <class S>
__global__ void rowdot_kernel(const S* __restrict__ dout, const S* __restrict__ out, float* __restrict__ D,
                              int64_t rows, int hd) {
  const int lane = threadIdx.x & 31;
  const int64_t nw = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < rows; r += nw) {
    float acc = 0.f;
    for (int d = lane; d < hd; d += 32) acc += ld(dout, r * hd + d) * ld(out, r * hd + d);
    for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) D[r] = acc;
  }
}

// =====================================================================================================================
// Tensor-core kernels (bf16 / fp16). Tiles are rows of HD elements in shared memory with row stride LD = HDP + 8
// (HDP = HD rounded up to 16): an odd number of 16-byte chunks per row, so ldmatrix is free of bank conflicts.
// Fragment layouts are those of mma.m16n8k16: g = lane/4 is the row (col for B), t = lane%4 the column pair.
// =====================================================================================================================
template <int HD> struct Tc {
  static constexpr int HDP = (HD + 15) / 16 * 16;
  static constexpr int LD = HDP + 8;
  static constexpr int NCH = HD / 8;  // 16-byte chunks per global row
};
constexpr int kTcThreads = 128;

// ROWS rows [row0, row0+ROWS) of a segment (token stride ld) into smem; rows >= L are zero-filled.
template <class S, int HD, int ROWS, int NT = kTcThreads>
__device__ __forceinline__ void tile_load(S* sm, const S* g, int64_t ld, int row0, int L, int tid) {
  constexpr int NCH = Tc<HD>::NCH, LD = Tc<HD>::LD;
#pragma unroll
  for (int c = tid; c < ROWS * NCH; c += NT) {
    const int r = c / NCH, ch = c - r * NCH;
    const bool ok = row0 + r < L;
    cp16(sm + r * LD + ch * 8, ok ? g + int64_t(row0 + r) * ld + ch * 8 : g, ok);
  }
}
// Zero the padding columns [HD, HDP) that the k-loop reads (hd 72 -> 80); loads never touch them.
template <class S, int HD, int NT = kTcThreads> __device__ __forceinline__ void zero_pad(S* sm, int rows, int tid) {
  constexpr int P = Tc<HD>::HDP - HD, LD = Tc<HD>::LD;
  if constexpr (P > 0)
    for (int e = tid; e < rows * P; e += NT) sm[(e / P) * LD + HD + e % P] = S(0.f);
}

// ---- forward: block = 64*MT queries of one head of one segment; warp w owns MT m-tiles of 16 rows
// [16*MT*w, 16*MT*(w+1)), so each K/V fragment read from shared memory feeds MT mmas. ---------------------------------
template <class S, int HD, int MT, int BN>
__global__ void __launch_bounds__(kTcThreads) fwd_tc(const S* __restrict__ q, const S* __restrict__ k,
                                                     const S* __restrict__ v, S* __restrict__ out,
                                                     float* __restrict__ lse, const int32_t* __restrict__ cu, int nh,
                                                     int nkv, float sl2, bool causal) {
  constexpr int HDP = Tc<HD>::HDP, LD = Tc<HD>::LD, BM = 64 * MT, WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smraw[];
  S* sQ = reinterpret_cast<S*>(smraw);
  S* sK = sQ + BM * LD;  // 2 buffers
  S* sV = sK + 2 * BN * LD;

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;  // heaviest (causal) blocks first
  if (i0 >= L) return;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kh = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  const S* Qg = q + int64_t(b0) * ldq + int64_t(h) * HD;
  const S* Kg = k + int64_t(b0) * ldk + int64_t(kh) * HD;
  const S* Vg = v + int64_t(b0) * ldk + int64_t(kh) * HD;

  zero_pad<S, HD>(sQ, BM + 4 * BN, tid);
  tile_load<S, HD, BM>(sQ, Qg, ldq, i0, L, tid);
  tile_load<S, HD, BN>(sK, Kg, ldk, 0, L, tid);
  tile_load<S, HD, BN>(sV, Vg, ldk, 0, L, tid);
  cp_commit();

  const int kend = causal ? min(i0 + BM, L) : L;
  const int nkb = (kend + BN - 1) / BN;
  const int wr0 = i0 + w * WR;  // the warp's first row; thread rows wr0 + 16*mt + g (+8)

  float o[MT][HDP / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  float mrow[MT][2], lrow[MT][2];  // running max (log2 units), per-thread partial sum
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) mrow[mt][0] = mrow[mt][1] = kNegInf, lrow[mt][0] = lrow[mt][1] = 0.f;

  for (int kb = 0; kb < nkb; ++kb) {
    cp_wait_all();
    __syncthreads();  // tile kb landed; everyone is done with the buffer the prefetch below overwrites
    if (kb + 1 < nkb) {
      const int nb = (kb + 1) & 1;
      tile_load<S, HD, BN>(sK + nb * BN * LD, Kg, ldk, (kb + 1) * BN, L, tid);
      tile_load<S, HD, BN>(sV + nb * BN * LD, Vg, ldk, (kb + 1) * BN, L, tid);
    }
    cp_commit();
    const S* cK = sK + (kb & 1) * BN * LD;
    const S* cV = sV + (kb & 1) * BN * LD;
    const int j0 = kb * BN;
    if (causal && j0 > wr0 + WR - 1) continue;  // keys all after this warp's rows (warp-uniform)

    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldsm4(qa[mt], sQ + (w * WR + mt * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int n2 = 0; n2 < BN / 16; ++n2) {
        uint32_t b[4];
        ldsm4(b, cK + (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<S>(s[mt][2 * n2], qa[mt], b[0], b[1]);
          mma<S>(s[mt][2 * n2 + 1], qa[mt], b[2], b[3]);
        }
      }
    }
    const bool need_mask = (j0 + BN > L) || (causal && j0 + BN - 1 > wr0);  // warp-uniform
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float xv = s[mt][n][e] * sl2;
          if (need_mask) {
            const int j = j0 + n * 8 + 2 * t + (e & 1), i = wr0 + mt * 16 + g + (e >> 1) * 8;
            if (j >= L || (causal && j > i)) xv = kNegInf;
          }
          s[mt][n][e] = xv;
        }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = mrow[mt][r];
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = quad_max(mx);
        const float ms = mx == kNegInf ? 0.f : mx;  // a row with no key yet: keep everything 0, not NaN
        const float alpha = fexp2(mrow[mt][r] - ms);
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n) {
          s[mt][n][2 * r] = fexp2(s[mt][n][2 * r] - ms);
          s[mt][n][2 * r + 1] = fexp2(s[mt][n][2 * r + 1] - ms);
          sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
        }
        lrow[mt][r] = lrow[mt][r] * alpha + sum;
        mrow[mt][r] = mx;
#pragma unroll
        for (int n = 0; n < HDP / 8; ++n) {
          o[mt][n][2 * r] *= alpha;
          o[mt][n][2 * r + 1] *= alpha;
        }
      }
    }
    // O += P V: the score accumulators are already in A-fragment order.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<S>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<S>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<S>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<S>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int d2 = 0; d2 < HDP / 16; ++d2) {
        uint32_t b[4];
        ldsm4t(b, cV + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d2 * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<S>(o[mt][2 * d2], a[mt], b[0], b[1]);
          mma<S>(o[mt][2 * d2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(lrow[mt][r]);
      const int i = wr0 + mt * 16 + g + r * 8;
      if (i < L) {
        const float inv = 1.f / l;
        S* orow = out + int64_t(b0 + i) * ldq + int64_t(h) * HD;
#pragma unroll
        for (int n = 0; n < HDP / 8; ++n) {
          const int d = n * 8 + 2 * t;
          if (d < HD)
            *reinterpret_cast<uint32_t*>(orow + d) = pack2<S>(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
        }
        if (t == 0) lse[int64_t(b0 + i) * nh + h] = mrow[mt][r] * kLn2 + logf(l);
      }
    }
}

// ---- backward dK/dV: block = 16*NW keys of one kv head; warp w owns key rows [16w, 16w+16). Loops over the group's
// query heads and the query blocks that can see these keys, computing S^T = K Q^T and dP^T = V dO^T directly so
// that P^T and dS^T land in A-fragment order for dV += P^T dO and dK += dS^T Q. -----------------------------------
template <class S, int HD, int NW>
__global__ void __launch_bounds__(32 * NW) dkdv_tc(const S* __restrict__ dout, const S* __restrict__ q,
                                                      const S* __restrict__ k, const S* __restrict__ v,
                                                      const float* __restrict__ lse, const float* __restrict__ Dd,
                                                      S* __restrict__ dk, S* __restrict__ dv,
                                                      const int32_t* __restrict__ cu, int nh, int nkv, float scale,
                                                      float sl2, bool causal, bool acc) {
  constexpr int HDP = Tc<HD>::HDP, LD = Tc<HD>::LD, BN = 16 * NW, BM = 64, QS = 32, NT = 32 * NW;  // QS: queries
                                                                                                   // per inner step
  extern __shared__ __align__(16) unsigned char smraw[];
  S* sK = reinterpret_cast<S*>(smraw);
  S* sV = sK + BN * LD;
  S* sQ = sV + BN * LD;       // 2 buffers
  S* sO = sQ + 2 * BM * LD;   // dout, 2 buffers
  float* sL = reinterpret_cast<float*>(sO + 2 * BM * LD);  // lse, 2 buffers
  float* sD = sL + 2 * BM;                                  // D, 2 buffers

  const int seg = blockIdx.z, kh = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int j0 = blockIdx.x * BN;
  if (j0 >= L) return;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int grp = nh / nkv;
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  const int qb0 = causal ? j0 / BM : 0;  // earlier query blocks see none of these keys
  const int nqb = (L + BM - 1) / BM - qb0;
  const int nit = grp * nqb;

  zero_pad<S, HD, NT>(sK, 2 * BN + 4 * BM, tid);
  tile_load<S, HD, BN, NT>(sK, k + int64_t(b0) * ldk + int64_t(kh) * HD, ldk, j0, L, tid);
  tile_load<S, HD, BN, NT>(sV, v + int64_t(b0) * ldk + int64_t(kh) * HD, ldk, j0, L, tid);
  auto stage = [&](int it, int buf) {
    const int h = kh * grp + it / nqb, i0 = (qb0 + it % nqb) * BM;
    tile_load<S, HD, BM, NT>(sQ + buf * BM * LD, q + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
    tile_load<S, HD, BM, NT>(sO + buf * BM * LD, dout + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
    if (tid < BM) {
      const bool ok = i0 + tid < L;
      const int64_t idx = ok ? int64_t(b0 + i0 + tid) * nh + h : 0;
      cp4(sL + buf * BM + tid, lse + idx, ok);
      cp4(sD + buf * BM + tid, Dd + idx, ok);
    }
  };
  stage(0, 0);
  cp_commit();

  float dka[HDP / 8][4], dva[HDP / 8][4];
#pragma unroll
  for (int n = 0; n < HDP / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dka[n][e] = dva[n][e] = 0.f;
  const int kr0 = j0 + w * 16 + g;  // this thread's key rows: kr0, kr0 + 8

  // Small head dims keep the warp's K and V A-fragments in registers (fewer shared-memory reads per mma).
  constexpr bool kKVReg = HDP <= 80;
  uint32_t kf[kKVReg ? HDP / 16 : 1][4], vf[kKVReg ? HDP / 16 : 1][4];
  for (int it = 0; it < nit; ++it) {
    cp_wait_all();
    __syncthreads();
    if constexpr (kKVReg) {
      if (it == 0) {
#pragma unroll
        for (int kk = 0; kk < HDP / 16; ++kk) {
          ldsm4(kf[kk], sK + (w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
          ldsm4(vf[kk], sV + (w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
        }
      }
    }
    if (it + 1 < nit) stage(it + 1, (it + 1) & 1);
    cp_commit();
    const int buf = it & 1;
    const int i0 = (qb0 + it % nqb) * BM;
    const S* cQ = sQ + buf * BM * LD;
    const S* cO = sO + buf * BM * LD;
    const float* cL = sL + buf * BM;
    const float* cD = sD + buf * BM;
#pragma unroll
    for (int qo = 0; qo < BM; qo += QS) {
      // Warp-uniform skips: no valid query, or (causal) every query before this warp's keys.
      if (i0 + qo >= L) break;
      if (causal && i0 + qo + QS - 1 < j0 + w * 16) continue;
      float st[QS / 8][4], dpt[QS / 8][4];
#pragma unroll
      for (int n = 0; n < QS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HDP / 16; ++kk) {
        uint32_t ka[4], va[4];
        if constexpr (kKVReg) {
#pragma unroll
          for (int e = 0; e < 4; ++e) ka[e] = kf[kk][e], va[e] = vf[kk][e];
        } else {
          ldsm4(ka, sK + (w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
          ldsm4(va, sV + (w * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
        }
#pragma unroll
        for (int n2 = 0; n2 < QS / 16; ++n2) {
          const int off = (qo + n2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
          uint32_t b[4];
          ldsm4(b, cQ + off);
          mma<S>(st[2 * n2], ka, b[0], b[1]);
          mma<S>(st[2 * n2 + 1], ka, b[2], b[3]);
          ldsm4(b, cO + off);
          mma<S>(dpt[2 * n2], va, b[0], b[1]);
          mma<S>(dpt[2 * n2 + 1], va, b[2], b[3]);
        }
      }
#pragma unroll
      for (int n = 0; n < QS / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = qo + n * 8 + 2 * t + (e & 1), i = i0 + c, j = kr0 + (e >> 1) * 8;
          const bool ok = j < L && i < L && (!causal || j <= i);
          const float p = ok ? fexp2(st[n][e] * sl2 - cL[c] * kLog2e) : 0.f;
          st[n][e] = p;
          dpt[n][e] = p * (dpt[n][e] - cD[c]) * scale;
        }
#pragma unroll
      for (int kq = 0; kq < QS / 16; ++kq) {
        const uint32_t pa[4] = {pack2<S>(st[2 * kq][0], st[2 * kq][1]), pack2<S>(st[2 * kq][2], st[2 * kq][3]),
                                pack2<S>(st[2 * kq + 1][0], st[2 * kq + 1][1]),
                                pack2<S>(st[2 * kq + 1][2], st[2 * kq + 1][3])};
        const uint32_t da[4] = {pack2<S>(dpt[2 * kq][0], dpt[2 * kq][1]), pack2<S>(dpt[2 * kq][2], dpt[2 * kq][3]),
                                pack2<S>(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]),
                                pack2<S>(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3])};
#pragma unroll
        for (int d2 = 0; d2 < HDP / 16; ++d2) {
          const int off = (qo + kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d2 * 16 + (lane >> 4) * 8;
          uint32_t b[4];
          ldsm4t(b, cO + off);
          mma<S>(dva[2 * d2], pa, b[0], b[1]);
          mma<S>(dva[2 * d2 + 1], pa, b[2], b[3]);
          ldsm4t(b, cQ + off);
          mma<S>(dka[2 * d2], da, b[0], b[1]);
          mma<S>(dka[2 * d2 + 1], da, b[2], b[3]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = kr0 + r * 8;
    if (j >= L) continue;
    const int64_t row = int64_t(b0 + j) * ldk + int64_t(kh) * HD;
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) {
      const int d = n * 8 + 2 * t;
      if (d < HD) {
        add2<S>(dk + row + d, dka[n][2 * r], dka[n][2 * r + 1], acc);
        add2<S>(dv + row + d, dva[n][2 * r], dva[n][2 * r + 1], acc);
      }
    }
  }
}

// ---- backward dQ: block = 64*MT queries of one head, warp w owns MT m-tiles; loops over key blocks (a second
// recompute of S and dP, but deterministic: no atomics) -------------------------------------------------------------
template <class S, int HD, int MT, int BN>
__global__ void __launch_bounds__(kTcThreads) dq_tc(const S* __restrict__ dout, const S* __restrict__ q,
                                                    const S* __restrict__ k, const S* __restrict__ v,
                                                    const float* __restrict__ lse, const float* __restrict__ Dd,
                                                    S* __restrict__ dq, const int32_t* __restrict__ cu, int nh,
                                                    int nkv, float scale, float sl2, bool causal, bool acc) {
  constexpr int HDP = Tc<HD>::HDP, LD = Tc<HD>::LD, BM = 64 * MT, WR = 16 * MT;
  extern __shared__ __align__(16) unsigned char smraw[];
  S* sQ = reinterpret_cast<S*>(smraw);
  S* sO = sQ + BM * LD;
  S* sK = sO + BM * LD;  // 2 buffers
  S* sV = sK + 2 * BN * LD;

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;
  if (i0 >= L) return;
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kh = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  const S* Kg = k + int64_t(b0) * ldk + int64_t(kh) * HD;
  const S* Vg = v + int64_t(b0) * ldk + int64_t(kh) * HD;

  zero_pad<S, HD>(sQ, 2 * BM + 4 * BN, tid);
  tile_load<S, HD, BM>(sQ, q + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
  tile_load<S, HD, BM>(sO, dout + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
  tile_load<S, HD, BN>(sK, Kg, ldk, 0, L, tid);
  tile_load<S, HD, BN>(sV, Vg, ldk, 0, L, tid);
  cp_commit();

  const int wr0 = i0 + w * WR;
  float lse2[MT][2], Dr[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = wr0 + mt * 16 + g + r * 8;
      lse2[mt][r] = i < L ? lse[int64_t(b0 + i) * nh + h] * kLog2e : 0.f;
      Dr[mt][r] = i < L ? Dd[int64_t(b0 + i) * nh + h] : 0.f;
    }
  const int kend = causal ? min(i0 + BM, L) : L;
  const int nkb = (kend + BN - 1) / BN;

  float dqa[MT][HDP / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < HDP / 8; ++n) dqa[mt][n][0] = dqa[mt][n][1] = dqa[mt][n][2] = dqa[mt][n][3] = 0.f;

  for (int kb = 0; kb < nkb; ++kb) {
    cp_wait_all();
    __syncthreads();
    if (kb + 1 < nkb) {
      const int nb = (kb + 1) & 1;
      tile_load<S, HD, BN>(sK + nb * BN * LD, Kg, ldk, (kb + 1) * BN, L, tid);
      tile_load<S, HD, BN>(sV + nb * BN * LD, Vg, ldk, (kb + 1) * BN, L, tid);
    }
    cp_commit();
    const S* cK = sK + (kb & 1) * BN * LD;
    const S* cV = sV + (kb & 1) * BN * LD;
    const int j0 = kb * BN;
    if (causal && j0 > wr0 + WR - 1) continue;  // every key after this warp's rows (warp-uniform)

    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = dp[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HDP / 16; ++kk) {
      uint32_t qa[MT][4], oa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        ldsm4(qa[mt], sQ + (w * WR + mt * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
        ldsm4(oa[mt], sO + (w * WR + mt * 16 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
      }
#pragma unroll
      for (int n2 = 0; n2 < BN / 16; ++n2) {
        const int off = (n2 * 16 + (lane & 7) + (lane >> 4) * 8) * LD + kk * 16 + ((lane >> 3) & 1) * 8;
        uint32_t b[4];
        ldsm4(b, cK + off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<S>(s[mt][2 * n2], qa[mt], b[0], b[1]);
          mma<S>(s[mt][2 * n2 + 1], qa[mt], b[2], b[3]);
        }
        ldsm4(b, cV + off);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<S>(dp[mt][2 * n2], oa[mt], b[0], b[1]);
          mma<S>(dp[mt][2 * n2 + 1], oa[mt], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = j0 + n * 8 + 2 * t + (e & 1), r = e >> 1, i = wr0 + mt * 16 + g + r * 8;
          const bool ok = i < L && j < L && (!causal || j <= i);
          const float p = ok ? fexp2(s[mt][n][e] * sl2 - lse2[mt][r]) : 0.f;
          s[mt][n][e] = p * (dp[mt][n][e] - Dr[mt][r]) * scale;  // dS
        }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<S>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<S>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<S>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<S>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int d2 = 0; d2 < HDP / 16; ++d2) {
        uint32_t b[4];
        ldsm4t(b, cK + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + d2 * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma<S>(dqa[mt][2 * d2], a[mt], b[0], b[1]);
          mma<S>(dqa[mt][2 * d2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = wr0 + mt * 16 + g + r * 8;
      if (i >= L) continue;
      S* row = dq + int64_t(b0 + i) * ldq + int64_t(h) * HD;
#pragma unroll
      for (int n = 0; n < HDP / 8; ++n) {
        const int d = n * 8 + 2 * t;
        if (d < HD) add2<S>(row + d, dqa[mt][n][2 * r], dqa[mt][n][2 * r + 1], acc);
      }
    }
}

// Forward tiles per head dim: MT m-tiles per warp (64*MT queries a block), BN keys a step.
// Tiles per head dim, chosen by timing on an H200 (tools/gpu/attn_check.cu). MT: m-tiles of 16 rows per warp (64*MT
// queries a block), BN: keys a step. MT=2 halves the K/V fragment reads per mma but needs ~255 registers.
template <int HD> struct FwdCfg { static constexpr int MT = 2, BN = 64; };
template <int HD> struct DqCfg { static constexpr int MT = HD > 80 ? 2 : 1, BN = HD > 80 ? 32 : 64; };
template <int HD> constexpr size_t fwd_tc_smem(size_t es) {
  return size_t(64 * FwdCfg<HD>::MT + 4 * FwdCfg<HD>::BN) * Tc<HD>::LD * es;
}
template <int HD> struct DkvCfg { static constexpr int NW = 4; };  // 8 warps (128 keys) timed slower
template <int HD> constexpr size_t dkdv_tc_smem(size_t es) {
  return size_t(2 * 16 * DkvCfg<HD>::NW + 4 * 64) * Tc<HD>::LD * es + 4 * 64 * sizeof(float);
}
template <int HD> constexpr size_t dq_tc_smem(size_t es) {
  return size_t(2 * 64 * DqCfg<HD>::MT + 4 * DqCfg<HD>::BN) * Tc<HD>::LD * es;
}

// =====================================================================================================================
// SIMT kernels (any dtype, hd <= 4*DM): fp32 tiles in shared memory with row stride hd+1 (conflict-free column
// walks); a quad of 4 threads owns one row, thread t of it the columns t, t+4, ... of the row's accumulators.
// =====================================================================================================================
constexpr int kSimtThreads = 256;

// rows [row0, row0+rows) of a segment into fp32 smem (stride lds), zero past the segment's end.
template <class S>
__device__ __forceinline__ void simt_load(float* sm, int lds, const S* g, int64_t gld, int row0, int rows, int L,
                                          int hd, int tid) {
  for (int e = tid; e < rows * hd; e += kSimtThreads) {
    const int r = e / hd, d = e - r * hd;
    sm[r * lds + d] = row0 + r < L ? ld(g, int64_t(row0 + r) * gld + d) : 0.f;
  }
}

// forward: 64 queries x 32-key tiles.
template <class S, int DM>
__global__ void __launch_bounds__(kSimtThreads) fwd_simt(const S* __restrict__ q, const S* __restrict__ k,
                                                         const S* __restrict__ v, S* __restrict__ out,
                                                         float* __restrict__ lse, const int32_t* __restrict__ cu,
                                                         int nh, int nkv, int hd, float sl2, bool causal) {
  constexpr int BM = 64, BN = 32, NC = BN / 4;
  extern __shared__ __align__(16) unsigned char smraw[];
  const int lds = hd + 1;
  float* sQ = reinterpret_cast<float*>(smraw);
  float* sK = sQ + BM * lds;
  float* sV = sK + BN * lds;
  float* sP = sV + BN * lds;  // [BM][BN+1]

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;
  if (i0 >= L) return;
  const int tid = threadIdx.x, r = tid >> 2, t = tid & 3, i = i0 + r;
  const int kh = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  const S* Kg = k + int64_t(b0) * ldk + int64_t(kh) * hd;
  const S* Vg = v + int64_t(b0) * ldk + int64_t(kh) * hd;
  simt_load(sQ, lds, q + int64_t(b0) * ldq + int64_t(h) * hd, ldq, i0, BM, L, hd, tid);

  float acc[DM];
#pragma unroll
  for (int c = 0; c < DM; ++c) acc[c] = 0.f;
  float m = kNegInf, l = 0.f;
  const int kend = causal ? min(i0 + BM, L) : L;
  for (int j0 = 0; j0 < kend; j0 += BN) {
    __syncthreads();
    simt_load(sK, lds, Kg, ldk, j0, BN, L, hd, tid);
    simt_load(sV, lds, Vg, ldk, j0, BN, L, hd, tid);
    __syncthreads();
    float s[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) s[c] = 0.f;
    for (int d = 0; d < hd; ++d) {
      const float qd = sQ[r * lds + d];
#pragma unroll
      for (int c = 0; c < NC; ++c) s[c] += qd * sK[(t + 4 * c) * lds + d];
    }
    float mx = m;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = j0 + t + 4 * c;
      s[c] = (j < L && (!causal || j <= i)) ? s[c] * sl2 : kNegInf;
      mx = fmaxf(mx, s[c]);
    }
    mx = quad_max(mx);
    const float ms = mx == kNegInf ? 0.f : mx;
    const float alpha = exp2f(m - ms);
    float sum = 0.f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const float p = exp2f(s[c] - ms);
      sP[r * (BN + 1) + t + 4 * c] = p;
      sum += p;
    }
    l = l * alpha + sum;
    m = mx;
    __syncwarp();  // the quad's P row is read back by the same quad only
#pragma unroll
    for (int c = 0; c < DM; ++c) acc[c] *= alpha;
    for (int j = 0; j < BN; ++j) {
      const float p = sP[r * (BN + 1) + j];
#pragma unroll
      for (int c = 0; c < DM; ++c)
        if (t + 4 * c < hd) acc[c] += p * sV[j * lds + t + 4 * c];
    }
  }
  l = quad_sum(l);
  if (i < L) {
    const float inv = 1.f / l;
    const int64_t row = int64_t(b0 + i) * ldq + int64_t(h) * hd;
#pragma unroll
    for (int c = 0; c < DM; ++c)
      if (t + 4 * c < hd) st(out, row + t + 4 * c, acc[c] * inv);
    if (t == 0) lse[int64_t(b0 + i) * nh + h] = m * kLn2 + logf(l);
  }
}

// dK/dV: 64 keys of one kv head x 32-query tiles, looping over the group's heads.
template <class S, int DM>
__global__ void __launch_bounds__(kSimtThreads) dkdv_simt(const S* __restrict__ dout, const S* __restrict__ q,
                                                          const S* __restrict__ k, const S* __restrict__ v,
                                                          const float* __restrict__ lse, const float* __restrict__ Dd,
                                                          S* __restrict__ dk, S* __restrict__ dv,
                                                          const int32_t* __restrict__ cu, int nh, int nkv, int hd,
                                                          float scale, float sl2, bool causal, bool acc) {
  constexpr int BN = 64, BM = 32, NC = BM / 4;
  extern __shared__ __align__(16) unsigned char smraw[];
  const int lds = hd + 1;
  float* sK = reinterpret_cast<float*>(smraw);
  float* sV = sK + BN * lds;
  float* sQ = sV + BN * lds;
  float* sO = sQ + BM * lds;
  float* sP = sO + BM * lds;       // [BN][BM+1]
  float* sS = sP + BN * (BM + 1);  // dS, [BN][BM+1]
  float* sL = sS + BN * (BM + 1);
  float* sD = sL + BM;

  const int seg = blockIdx.z, kh = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int j0 = blockIdx.x * BN;
  if (j0 >= L) return;
  const int tid = threadIdx.x, r = tid >> 2, t = tid & 3, j = j0 + r;
  const int grp = nh / nkv;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  simt_load(sK, lds, k + int64_t(b0) * ldk + int64_t(kh) * hd, ldk, j0, BN, L, hd, tid);
  simt_load(sV, lds, v + int64_t(b0) * ldk + int64_t(kh) * hd, ldk, j0, BN, L, hd, tid);

  float dka[DM], dva[DM];
#pragma unroll
  for (int c = 0; c < DM; ++c) dka[c] = dva[c] = 0.f;
  const int qstart = causal ? (j0 / BM) * BM : 0;
  for (int h = kh * grp; h < (kh + 1) * grp; ++h) {
    for (int i0 = qstart; i0 < L; i0 += BM) {
      __syncthreads();
      simt_load(sQ, lds, q + int64_t(b0) * ldq + int64_t(h) * hd, ldq, i0, BM, L, hd, tid);
      simt_load(sO, lds, dout + int64_t(b0) * ldq + int64_t(h) * hd, ldq, i0, BM, L, hd, tid);
      if (tid < BM) {
        const bool ok = i0 + tid < L;
        sL[tid] = ok ? lse[int64_t(b0 + i0 + tid) * nh + h] * kLog2e : 0.f;
        sD[tid] = ok ? Dd[int64_t(b0 + i0 + tid) * nh + h] : 0.f;
      }
      __syncthreads();
      float s[NC], dp[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) s[c] = dp[c] = 0.f;
      for (int d = 0; d < hd; ++d) {
        const float kd = sK[r * lds + d], vd = sV[r * lds + d];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          s[c] += kd * sQ[(t + 4 * c) * lds + d];
          dp[c] += vd * sO[(t + 4 * c) * lds + d];
        }
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int col = t + 4 * c, i = i0 + col;
        const bool ok = j < L && i < L && (!causal || j <= i);
        const float p = ok ? exp2f(s[c] * sl2 - sL[col]) : 0.f;
        sP[r * (BM + 1) + col] = p;
        sS[r * (BM + 1) + col] = p * (dp[c] - sD[col]) * scale;
      }
      __syncwarp();
      for (int col = 0; col < BM; ++col) {
        const float p = sP[r * (BM + 1) + col], ds = sS[r * (BM + 1) + col];
#pragma unroll
        for (int c = 0; c < DM; ++c)
          if (t + 4 * c < hd) {
            dva[c] += p * sO[col * lds + t + 4 * c];
            dka[c] += ds * sQ[col * lds + t + 4 * c];
          }
      }
    }
  }
  if (j < L) {
    const int64_t row = int64_t(b0 + j) * ldk + int64_t(kh) * hd;
#pragma unroll
    for (int c = 0; c < DM; ++c)
      if (t + 4 * c < hd) {
        add1(dk, row + t + 4 * c, dka[c], acc);
        add1(dv, row + t + 4 * c, dva[c], acc);
      }
  }
}

// dQ: 64 queries x 32-key tiles.
template <class S, int DM>
__global__ void __launch_bounds__(kSimtThreads) dq_simt(const S* __restrict__ dout, const S* __restrict__ q,
                                                        const S* __restrict__ k, const S* __restrict__ v,
                                                        const float* __restrict__ lse, const float* __restrict__ Dd,
                                                        S* __restrict__ dq, const int32_t* __restrict__ cu, int nh,
                                                        int nkv, int hd, float scale, float sl2, bool causal,
                                                        bool accumulate) {
  constexpr int BM = 64, BN = 32, NC = BN / 4;
  extern __shared__ __align__(16) unsigned char smraw[];
  const int lds = hd + 1;
  float* sQ = reinterpret_cast<float*>(smraw);
  float* sO = sQ + BM * lds;
  float* sK = sO + BM * lds;
  float* sV = sK + BN * lds;
  float* sS = sV + BN * lds;  // dS, [BM][BN+1]

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * BM;
  if (i0 >= L) return;
  const int tid = threadIdx.x, r = tid >> 2, t = tid & 3, i = i0 + r;
  const int kh = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  const S* Kg = k + int64_t(b0) * ldk + int64_t(kh) * hd;
  const S* Vg = v + int64_t(b0) * ldk + int64_t(kh) * hd;
  simt_load(sQ, lds, q + int64_t(b0) * ldq + int64_t(h) * hd, ldq, i0, BM, L, hd, tid);
  simt_load(sO, lds, dout + int64_t(b0) * ldq + int64_t(h) * hd, ldq, i0, BM, L, hd, tid);
  const float lse2 = i < L ? lse[int64_t(b0 + i) * nh + h] * kLog2e : 0.f;
  const float Dr = i < L ? Dd[int64_t(b0 + i) * nh + h] : 0.f;

  float acc[DM];
#pragma unroll
  for (int c = 0; c < DM; ++c) acc[c] = 0.f;
  const int kend = causal ? min(i0 + BM, L) : L;
  for (int j0 = 0; j0 < kend; j0 += BN) {
    __syncthreads();
    simt_load(sK, lds, Kg, ldk, j0, BN, L, hd, tid);
    simt_load(sV, lds, Vg, ldk, j0, BN, L, hd, tid);
    __syncthreads();
    float s[NC], dp[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) s[c] = dp[c] = 0.f;
    for (int d = 0; d < hd; ++d) {
      const float qd = sQ[r * lds + d], od = sO[r * lds + d];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        s[c] += qd * sK[(t + 4 * c) * lds + d];
        dp[c] += od * sV[(t + 4 * c) * lds + d];
      }
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int j = j0 + t + 4 * c;
      const bool ok = i < L && j < L && (!causal || j <= i);
      const float p = ok ? exp2f(s[c] * sl2 - lse2) : 0.f;
      sS[r * (BN + 1) + t + 4 * c] = p * (dp[c] - Dr) * scale;
    }
    __syncwarp();
    for (int jj = 0; jj < BN; ++jj) {
      const float ds = sS[r * (BN + 1) + jj];
#pragma unroll
      for (int c = 0; c < DM; ++c)
        if (t + 4 * c < hd) acc[c] += ds * sK[jj * lds + t + 4 * c];
    }
  }
  if (i < L) {
    const int64_t row = int64_t(b0 + i) * ldq + int64_t(h) * hd;
#pragma unroll
    for (int c = 0; c < DM; ++c)
      if (t + 4 * c < hd) add1(dq, row + t + 4 * c, acc[c], accumulate);
  }
}

size_t fwd_simt_smem(int hd) { return (size_t(64 + 2 * 32) * (hd + 1) + 64 * 33) * sizeof(float); }
size_t dkdv_simt_smem(int hd) { return (size_t(2 * 64 + 2 * 32) * (hd + 1) + 2 * 64 * 33 + 2 * 32) * sizeof(float); }
size_t dq_simt_smem(int hd) { return (size_t(2 * 64 + 2 * 32) * (hd + 1) + 64 * 33) * sizeof(float); }

// ---- host side --------------------------------------------------------------------------------------------------------


// Shape checks shared by fwd and bwd; false: nothing to do.
bool check_shape(const char* op, int64_t nseg, int64_t max_len, int64_t N, int64_t nh, int64_t nkv, int64_t hd) {
  if (N == 0 || nseg == 0 || max_len <= 0) return false;
  Q3VL_CHECK(nkv > 0 && nh % nkv == 0, std::string(op) + ": heads must be a multiple of kv heads");
  Q3VL_CHECK(hd >= 1 && hd <= 256, std::string(op) + ": head dim " + std::to_string(hd) + " outside [1, 256]");
  Q3VL_CHECK(nh <= 65535 && nseg <= 65535 && max_len <= (int64_t(1) << 30),
             std::string(op) + ": too many heads or segments for one launch");
  return true;
}

}  // namespace

// attention_sm90.cu: the wgmma forward (hd 128) and backward (hd 64, 72, 128) for bf16/fp16 on a 9.0 device;
// false: not taken (other shapes or devices).
bool attention_fwd_sm90(cudaStream_t st, bool bf16, const void* q, const void* k, const void* v, void* out, float* lse,
                        const int32_t* cu, int nseg, int max_len, int64_t N, int nh, int nkv, int hd, bool causal,
                        float sl2);
bool attention_bwd_sm90(cudaStream_t st, bool bf16, const void* dout, const void* q, const void* k, const void* v,
                        const float* lse, const float* D, void* dq, void* dk, void* dv, float* dqacc, size_t acc_bytes,
                        const int32_t* cu, int nseg, int max_len, int64_t N, int nh, int nkv, int hd, bool causal,
                        float scale, float sl2, bool acc);

// wgmma: whether attention_fwd may take attention_sm90.cu's kernel; true: it did. attention_fwd passes true;
// tools/gpu/attn_check.cu calls both ways in one process (the same for attention_bwd_path).
bool attention_fwd_path(const Exec& x, const void* q, const void* k, const void* v, void* out, float* lse,
                        const int32_t* cu, int64_t nseg, int64_t max_len, int64_t N, int64_t nh, int64_t nkv,
                        int64_t hd, bool causal, float scale, DType dt, bool wgmma) {
  if (!check_shape("attention_fwd", nseg, max_len, N, nh, nkv, hd)) return false;
  bool took = false;
  const cudaStream_t st = stream_of(x);
  const float sl2 = scale * kLog2e;
  const dim3 grid(unsigned((max_len + 63) / 64), unsigned(nh), unsigned(nseg));
  const int inh = int(nh), inkv = int(nkv), ihd = int(hd);
  const bool al = aligned16(q) && aligned16(k) && aligned16(v) && aligned16(out);
  by_dtype(dt, [&]<class S>() {
    const S *Q = static_cast<const S*>(q), *K = static_cast<const S*>(k), *V = static_cast<const S*>(v);
    S* O = static_cast<S*>(out);
    if constexpr (!std::is_same_v<S, float>) {
      if (al) {
        // hd 128 (attention_fwd_sm90 says which and why)
        if (wgmma &&
            attention_fwd_sm90(st, std::is_same_v<S, __nv_bfloat16>, q, k, v, out, lse, cu, int(nseg), int(max_len), N,
                               inh, inkv, ihd, causal, sl2)) {
          took = true;
          return;
        }
        auto run = [&]<int HD>() {
          using C = FwdCfg<HD>;
          const dim3 gt(unsigned((max_len + 64 * C::MT - 1) / (64 * C::MT)), unsigned(nh), unsigned(nseg));
          launch(fwd_tc<S, HD, C::MT, C::BN>, gt, kTcThreads, fwd_tc_smem<HD>(sizeof(S)), st, Q, K, V, O, lse, cu,
                 inh, inkv, sl2, causal);
        };
        switch (hd) {
          case 64: run.template operator()<64>(); return;
          case 72: run.template operator()<72>(); return;
          case 128: run.template operator()<128>(); return;
          default: break;
        }
      }
    }
    if (hd <= 128)
      launch(fwd_simt<S, 32>, grid, kSimtThreads, fwd_simt_smem(ihd), st, Q, K, V, O, lse, cu, inh, inkv, ihd, sl2, causal);
    else
      launch(fwd_simt<S, 64>, grid, kSimtThreads, fwd_simt_smem(ihd), st, Q, K, V, O, lse, cu, inh, inkv, ihd, sl2, causal);
  });
  return took;
}

void attention_fwd(const Exec& x, const void* q, const void* k, const void* v, void* out, float* lse,
                   const int32_t* cu, int64_t nseg, int64_t max_len, int64_t N, int64_t nh, int64_t nkv, int64_t hd,
                   bool causal, float scale, DType dt) {
  attention_fwd_path(x, q, k, v, out, lse, cu, nseg, max_len, N, nh, nkv, hd, causal, scale, dt, true);
}

// wgmma: whether attention_bwd may take attention_sm90.cu's kernel; true: it did.
bool attention_bwd_path(const Exec& x, const void* dout, const void* q, const void* k, const void* v, const void* out,
                        const float* lse, void* dq, void* dk, void* dv, const int32_t* cu, int64_t nseg,
                        int64_t max_len, int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool causal, float scale,
                        bool accumulate, DType dt, bool wgmma) {
  if (!check_shape("attention_bwd", nseg, max_len, N, nh, nkv, hd)) return false;
  const size_t need = size_t(N) * size_t(nh) * sizeof(float);
  if (x.ws == nullptr || x.ws_bytes < need)
    fail("attention_bwd: the Exec workspace holds " + std::to_string(x.ws_bytes) + " bytes, the row statistics D " +
         "need " + std::to_string(need) + " (N*heads*4); make the Exec with a larger workspace");
  float* Dd = static_cast<float*>(x.ws);
  // The wgmma kernel's fp32 dQ accumulator follows D in the workspace (256-byte aligned).
  const size_t acc_off = (need + 255) / 256 * 256;
  float* dqacc = reinterpret_cast<float*>(static_cast<char*>(x.ws) + acc_off);
  const size_t acc_bytes = x.ws_bytes > acc_off ? x.ws_bytes - acc_off : 0;
  const cudaStream_t st = stream_of(x);
  const float sl2 = scale * kLog2e;
  const unsigned nb = unsigned((max_len + 63) / 64);
  const dim3 gq(nb, unsigned(nh), unsigned(nseg)), gk(nb, unsigned(nkv), unsigned(nseg));
  const int inh = int(nh), inkv = int(nkv), ihd = int(hd);
  const bool al = aligned16(dout) && aligned16(q) && aligned16(k) && aligned16(v) && aligned16(dq) &&
                  aligned16(dk) && aligned16(dv);
  bool took = false;
  by_dtype(dt, [&]<class S>() {
    const S *G = static_cast<const S*>(dout), *Q = static_cast<const S*>(q), *K = static_cast<const S*>(k),
            *V = static_cast<const S*>(v), *O = static_cast<const S*>(out);
    S *dQ = static_cast<S*>(dq), *dK = static_cast<S*>(dk), *dV = static_cast<S*>(dv);
    const int64_t rows = N * nh;
    launch(rowdot_kernel<S>, dim3(grid_for(rows * 32)), 256, 0, st, G, O, Dd, rows, ihd);
    if constexpr (!std::is_same_v<S, float>) {
      if (al && wgmma &&
          attention_bwd_sm90(st, std::is_same_v<S, __nv_bfloat16>, dout, q, k, v, lse, Dd, dq, dk, dv, dqacc,
                             acc_bytes, cu, int(nseg), int(max_len), N, inh, inkv, ihd, causal, scale, sl2,
                             accumulate)) {
        took = true;
        return;
      }
      if (al && (hd == 64 || hd == 72 || hd == 128)) {
        auto run = [&]<int HD>() {
          constexpr int NW = DkvCfg<HD>::NW;
          const dim3 gkt(unsigned((max_len + 16 * NW - 1) / (16 * NW)), unsigned(nkv), unsigned(nseg));
          launch(dkdv_tc<S, HD, NW>, gkt, 32 * NW, dkdv_tc_smem<HD>(sizeof(S)), st, G, Q, K, V, lse,
                 static_cast<const float*>(Dd), dK, dV, cu, inh, inkv, scale, sl2, causal, accumulate);
          using C = DqCfg<HD>;
          const dim3 gt(unsigned((max_len + 64 * C::MT - 1) / (64 * C::MT)), unsigned(nh), unsigned(nseg));
          launch(dq_tc<S, HD, C::MT, C::BN>, gt, kTcThreads, dq_tc_smem<HD>(sizeof(S)), st, G, Q, K, V, lse,
                 static_cast<const float*>(Dd), dQ, cu, inh, inkv, scale, sl2, causal, accumulate);
        };
        if (hd == 64) run.template operator()<64>();
        else if (hd == 72) run.template operator()<72>();
        else run.template operator()<128>();
        return;
      }
    }
    auto run = [&]<int DM>() {
      launch(dkdv_simt<S, DM>, gk, kSimtThreads, dkdv_simt_smem(ihd), st, G, Q, K, V, lse,
             static_cast<const float*>(Dd), dK, dV, cu, inh, inkv, ihd, scale, sl2, causal, accumulate);
      launch(dq_simt<S, DM>, gq, kSimtThreads, dq_simt_smem(ihd), st, G, Q, K, V, lse, static_cast<const float*>(Dd),
             dQ, cu, inh, inkv, ihd, scale, sl2, causal, accumulate);
    };
    if (hd <= 128) run.template operator()<32>();
    else run.template operator()<64>();
  });
  return took;
}

void attention_bwd(const Exec& x, const void* dout, const void* q, const void* k, const void* v, const void* out,
                   const float* lse, void* dq, void* dk, void* dv, const int32_t* cu, int64_t nseg, int64_t max_len,
                   int64_t N, int64_t nh, int64_t nkv, int64_t hd, bool causal, float scale, bool accumulate,
                   DType dt) {
  attention_bwd_path(x, dout, q, k, v, out, lse, dq, dk, dv, cu, nseg, max_len, N, nh, nkv, hd, causal, scale,
                     accumulate, dt, true);
}

}  // namespace q3vl::dev::cuda
