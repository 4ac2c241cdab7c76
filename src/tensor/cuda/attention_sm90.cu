// Flash attention forward for Hopper (sm_90a): wgmma tensor-core instructions, called by attention.cu's
// attention_fwd for bf16/fp16, head dims 64 and 128, on a compute-capability 9.0 device. Same semantics as fwd_tc
// there (packed variable-length segments, GQA, causal or not; out [N, nh*hd], lse [N, nh] natural log).
//
// A block is 2 warpgroups (256 threads) and 128 queries of one head of one segment; warpgroup w owns query rows
// [64w, 64w+64). Per key tile of 128 keys: S = Q K^T by wgmma m64n128k16 with Q and K both from shared memory,
// online softmax in registers (the accumulator layout is that of mma.m16n8 per warp, rows 16*warp + g, g+8),
// P packed to 16-bit registers as wgmma's A operand, and O += P V by wgmma m64nHDk16 with V from shared memory read
// N-major (the descriptor's transpose bit). K/V tiles stream in with cp.async (16-byte copies of every thread), one
// or two tiles ahead of the compute (see kPipe below).
//
// Shared-memory tiles use wgmma's canonical 128-byte swizzle (wgmma.cuh): a Q/K/V tile of R rows x HD columns is
// HD/64 column panels of R rows of 128 bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "tensor/cuda/common.cuh"
#include "tensor/cuda/wgmma.cuh"

namespace q3vl::dev::cuda {
namespace {

using namespace sm90;

constexpr int kThreads = 256, kBM = 128, kBN = 128;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -INFINITY;

__device__ __forceinline__ float fexp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
// d (64 x N fp32) += A (64 x 16 from registers: per warp the A fragment of mma.m16n8k16) * B (16 x N, N-major
// smem: imm-trans-b 1).
#define Q3_WG_RS128(TY)                                                                                       \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " " Q3_R64                             \
               ", {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n"                                                    \
               : Q3_D64                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
#define Q3_WG_RS64(TY)                                                                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " Q3_R32                              \
               ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n"                                                    \
               : Q3_D32                                                                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))
template <class S, int N> __device__ __forceinline__ void wg_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
#ifdef Q3VL_WGMMA
  constexpr bool bf = std::is_same_v<S, __nv_bfloat16>;
  if constexpr (N == 128) {
    if constexpr (bf) Q3_WG_RS128("bf16");
    else Q3_WG_RS128("f16");
  } else {
    static_assert(N == 64);
    if constexpr (bf) Q3_WG_RS64("bf16");
    else Q3_WG_RS64("f16");
  }
#endif
}

// ROWS rows [row0, row0+ROWS) of a segment (token stride ld, HD columns) into the swizzled tile at shared address
// s; rows >= L are zero-filled. Consecutive threads take consecutive 16-byte chunks of a row (coalesced reads; the
// XOR keeps each 8-chunk row segment a permutation of its 128 bytes, so no bank conflicts on the writes).
template <class S, int HD, int ROWS>
__device__ __forceinline__ void load_tile(uint32_t s, const S* g, int64_t ld, int row0, int L, int tid) {
  constexpr int NCH = HD / 8;
#pragma unroll
  for (int c = tid; c < ROWS * NCH; c += kThreads) {
    const int r = c / NCH, ch = c % NCH;
    const bool ok = row0 + r < L;
    const uint32_t dst = s + (ch >> 3) * (ROWS * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4);
    cp16(dst, ok ? g + int64_t(row0 + r) * ld + ch * 8 : g, ok);
  }
}

// ---- per-tile steps of one warpgroup ------------------------------------------------------------------------------
// Accumulator element 4n+e of a thread: row tr0 + 8*(e>>1), column 8n + 2t + (e&1) (S: key j0 + column).
// s = Q K^T over the warpgroup's 64 rows (qa) and the 128 keys of the K tile at ka: panel kk/4, 32 bytes (16
// elements) per k-step inside the 128-byte rows.
template <class S, int HD> __device__ __forceinline__ void gemm_s(float (&s)[kBN / 2], uint32_t qa, uint32_t ka) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk)
    wg_ss128<S>(s, sdesc(qa + (kk >> 2) * (kBM * 128) + (kk & 3) * 32, 16),
                sdesc(ka + (kk >> 2) * (kBN * 128) + (kk & 3) * 32, 16), kk > 0);
}
// o += P V for the V tile at va: 16 keys = two 8-row groups (2048 bytes) of every panel; LBO = the panel distance.
template <class S, int HD>
__device__ __forceinline__ void gemm_pv(float (&o)[HD / 2], const uint32_t (&p)[kBN / 16][4], uint32_t va) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) wg_rs<S, HD>(o, p[kk], sdesc(va + kk * 2048, kBN * 128));
}
// Online softmax on one score tile (keys j0..): masks, moves the running max (log2 units), replaces s by
// exp2(s*sl2 - max), adds its row sums to lrow; alpha: the factor the accumulated output rows must take.
__device__ __forceinline__ void softmax_tile(float (&s)[kBN / 2], float (&mrow)[2], float (&lrow)[2],
                                             float (&alpha)[2], int j0, int L, int tr0, int t, bool causal,
                                             float sl2) {
  const bool need_mask = (j0 + kBN > L) || (causal && j0 + kBN - 1 > tr0);  // tr0: the thread's first row
#pragma unroll
  for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float xv = s[4 * n + e] * sl2;
      if (need_mask) {
        const int j = j0 + n * 8 + 2 * t + (e & 1), i = tr0 + (e >> 1) * 8;
        if (j >= L || (causal && j > i)) xv = kNegInf;
      }
      s[4 * n + e] = xv;
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = mrow[r];
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) mx = fmaxf(mx, fmaxf(s[4 * n + 2 * r], s[4 * n + 2 * r + 1]));
    mx = quad_max(mx);
    const float ms = mx == kNegInf ? 0.f : mx;  // a row with no key yet: keep everything 0, not NaN
    alpha[r] = fexp2(mrow[r] - ms);
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) {
      s[4 * n + 2 * r] = fexp2(s[4 * n + 2 * r] - ms);
      s[4 * n + 2 * r + 1] = fexp2(s[4 * n + 2 * r + 1] - ms);
      sum += s[4 * n + 2 * r] + s[4 * n + 2 * r + 1];
    }
    lrow[r] = lrow[r] * alpha[r] + sum;
    mrow[r] = mx;
  }
}
template <int N> __device__ __forceinline__ void rescale(float (&o)[N], const float (&alpha)[2]) {
#pragma unroll
  for (int n = 0; n < N / 4; ++n) o[4 * n] *= alpha[0], o[4 * n + 1] *= alpha[0], o[4 * n + 2] *= alpha[1],
                                  o[4 * n + 3] *= alpha[1];
}
// P in A-fragment order: keys 16kk.. are accumulator chunks 2kk (registers 0, 1) and 2kk+1 (registers 2, 3).
template <class S> __device__ __forceinline__ void to_p(const float (&s)[kBN / 2], uint32_t (&p)[kBN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) p[kk][e] = pack2<S>(s[8 * kk + 2 * e], s[8 * kk + 2 * e + 1]);
}
// cp.async wrote through the generic proxy, wgmma reads through the async proxy: each thread waits for its copies
// and fences, then the barrier publishes every thread's.
__device__ __forceinline__ void tiles_landed(bool all) {
  if (all) cp_wait_all();
  else asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

// Two schedules (the host picks; the harness times both). kPipe false: 2 K/V buffers, and per tile S, softmax, PV
// in sequence, the tensor cores idle during the softmax. kPipe true (FA3's intra-warpgroup overlap): 3 buffers, S of
// tile kb+1 and PV of tile kb issued together, the softmax of tile kb+1 computed while PV of tile kb runs; O is
// rescaled and P rebuilt once PV has finished with them.
template <bool kPipe> constexpr int kBufs = kPipe ? 3 : 2;
template <int HD, bool kPipe> constexpr size_t smem_bytes(size_t es) {
  return size_t(kBM + 2 * kBufs<kPipe> * kBN) * HD * es + 1024;  // Q, K and V buffers, + alignment slack
}

template <class S, int HD, bool kPipe>
__global__ void __launch_bounds__(kThreads, 1) fwd_wgmma(const S* __restrict__ q, const S* __restrict__ k,
                                                         const S* __restrict__ v, S* __restrict__ out,
                                                         float* __restrict__ lse, const int32_t* __restrict__ cu,
                                                         int nh, int nkv, float sl2, bool causal) {
#ifdef Q3VL_WGMMA
  constexpr int NB = kBufs<kPipe>, TQ = kBM * HD * 2, TK = kBN * HD * 2;  // tile bytes (16-bit elements)
  extern __shared__ __align__(16) unsigned char smraw[];
  const uint32_t sQ = (static_cast<uint32_t>(__cvta_generic_to_shared(smraw)) + 1023u) & ~1023u;
  const uint32_t sK = sQ + TQ, sV = sK + NB * TK;

  const int seg = blockIdx.z, h = blockIdx.y;
  const int b0 = cu[seg], L = cu[seg + 1] - b0;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest (causal) blocks first
  if (i0 >= L) return;
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int kh = h / (nh / nkv);
  const int64_t ldq = int64_t(nh) * HD, ldk = int64_t(nkv) * HD;
  const S* Kg = k + int64_t(b0) * ldk + int64_t(kh) * HD;
  const S* Vg = v + int64_t(b0) * ldk + int64_t(kh) * HD;
  auto load_kv = [&](int kb) {
    load_tile<S, HD, kBN>(sK + (kb % NB) * TK, Kg, ldk, kb * kBN, L, tid);
    load_tile<S, HD, kBN>(sV + (kb % NB) * TK, Vg, ldk, kb * kBN, L, tid);
  };

  const int kend = causal ? min(i0 + kBM, L) : L;
  const int nkb = (kend + kBN - 1) / kBN;
  const int wr0 = i0 + wg * 64;                     // the warpgroup's first row
  const int tr0 = wr0 + ((tid >> 5) & 3) * 16 + g;  // this thread's rows: tr0, tr0 + 8
  const uint32_t qa = sQ + wg * 64 * 128;           // the warpgroup's 64 rows inside each Q panel

  load_tile<S, HD, kBM>(sQ, q + int64_t(b0) * ldq + int64_t(h) * HD, ldq, i0, L, tid);
  load_kv(0);
  cp_commit();

  float o[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
  float mrow[2] = {kNegInf, kNegInf}, lrow[2] = {0.f, 0.f};  // running max (log2 units), per-thread partial sum
  float s[kBN / 2], alpha[2];
  uint32_t p[kBN / 16][4];

  if constexpr (!kPipe) {
    for (int kb = 0; kb < nkb; ++kb) {
      tiles_landed(true);  // tile kb landed; every wgmma on the other buffer has completed (wait_group 0 below)
      if (kb + 1 < nkb) load_kv(kb + 1);
      cp_commit();
      wg_fence();
      gemm_s<S, HD>(s, qa, sK + (kb % NB) * TK);
      wg_commit();
      wg_wait<0>();
      pin(s);
      softmax_tile(s, mrow, lrow, alpha, kb * kBN, L, tr0, t, causal, sl2);
      rescale(o, alpha);
      to_p<S>(s, p);
      pin(o);
      pin2(p);
      wg_fence();
      gemm_pv<S, HD>(o, p, sV + (kb % NB) * TK);
      wg_commit();
      wg_wait<0>();
      pin(o);
    }
  } else {
    if (nkb > 1) load_kv(1);
    cp_commit();
    tiles_landed(false);  // Q and tile 0 (tile 1 may still stream)
    wg_fence();
    gemm_s<S, HD>(s, qa, sK);
    wg_commit();
    wg_wait<0>();
    pin(s);
    softmax_tile(s, mrow, lrow, alpha, 0, L, tr0, t, causal, sl2);  // o is 0: no rescale
    to_p<S>(s, p);
    // Every wgmma group in the loop body is unconditional: issuing S under `if` made ptxas serialize the wgmmas
    // (C7514).
    for (int kb = 0; kb + 1 < nkb; ++kb) {
      // Tile kb+1 landed; buffer (kb+2)%3 held tile kb-1, whose wgmmas every thread waited for before arriving.
      tiles_landed(true);
      if (kb + 2 < nkb) load_kv(kb + 2);
      cp_commit();
      pin(o);
      pin2(p);
      wg_fence();
      gemm_s<S, HD>(s, qa, sK + ((kb + 1) % NB) * TK);
      wg_commit();
      gemm_pv<S, HD>(o, p, sV + (kb % NB) * TK);
      wg_commit();
      wg_wait<1>();  // S of tile kb+1 (the older group) is done; PV of tile kb keeps running
      pin(s);
      softmax_tile(s, mrow, lrow, alpha, (kb + 1) * kBN, L, tr0, t, causal, sl2);
      wg_wait<0>();
      pin(o);
      rescale(o, alpha);  // p and o are free again
      to_p<S>(s, p);
    }
    // PV of the last tile (landed before its S ran: no barrier needed, nothing is loaded any more).
    pin(o);
    pin2(p);
    wg_fence();
    gemm_pv<S, HD>(o, p, sV + ((nkb - 1) % NB) * TK);
    wg_commit();
    wg_wait<0>();
    pin(o);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(lrow[r]);
    const int i = tr0 + r * 8;
    if (i < L) {
      const float inv = 1.f / l;
      S* orow = out + int64_t(b0 + i) * ldq + int64_t(h) * HD;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n)
        *reinterpret_cast<uint32_t*>(orow + n * 8 + 2 * t) = pack2<S>(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      if (t == 0) lse[int64_t(b0 + i) * nh + h] = mrow[r] * kLn2 + logf(l);
    }
  }
#else
  __trap();
#endif
}


}  // namespace

bool attention_fwd_sm90(cudaStream_t st, bool bf16, const void* q, const void* k, const void* v, void* out, float* lse,
                        const int32_t* cu, int nseg, int max_len, int nh, int nkv, int hd, bool causal, float sl2,
                        bool pipelined) {
  if (hd != 64 && hd != 128) return false;
  int dev = 0, major = 0, minor = 0;
  Q3VL_CU(cudaGetDevice(&dev));
  Q3VL_CU(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  Q3VL_CU(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major != 9 || minor != 0) return false;  // the sm_90a cubin runs on 9.0 only
  const dim3 grid(unsigned((max_len + kBM - 1) / kBM), unsigned(nh), unsigned(nseg));
  auto run = [&]<class S, int HD>() {
    auto go = [&]<bool P>() {
      launch(fwd_wgmma<S, HD, P>, grid, kThreads, smem_bytes<HD, P>(sizeof(S)), st, static_cast<const S*>(q),
             static_cast<const S*>(k), static_cast<const S*>(v), static_cast<S*>(out), lse, cu, nh, nkv, sl2, causal);
    };
    pipelined ? go.template operator()<true>() : go.template operator()<false>();
  };
  if (bf16) hd == 128 ? run.template operator()<__nv_bfloat16, 128>() : run.template operator()<__nv_bfloat16, 64>();
  else hd == 128 ? run.template operator()<__half, 128>() : run.template operator()<__half, 64>();
  return true;
}

}  // namespace q3vl::dev::cuda
