// The decode GEMV with its weights streamed by the TMA unit: y[n, n_out] = (x W^T) * scale + b for n <= 8 rows of
// 16-bit x, W int8, fp8 or the activations' type, one matrix. gemv.cuh's gemv() sends the one-matrix products that
// tma_wanted() picks here; the register-ring kernel gemv_tc takes the rest: experts, more rows, rows not a multiple of
// 128 bytes, x over 48 KiB, and the small one-row matrices it streams faster.
// Measured: on an H100 (2026-12-05, docs/perf/2026-12-05-twentyfifth) one 8B stream's decode step went 6.73 -> 6.38
// ms in bf16 (against cuBLASLt), 4.44 -> 4.28 ms in fp8 (against the ring); on the H200 (2026-12-06,
// docs/perf/2026-12-06-twentyseventh/call1) bf16 lost (5.02 -> 5.24 ms: cuBLASLt streams the 8B's gate_up at 3.97
// TB/s, this kernel at 3.66) and fp8 gained little (3.78 -> 3.74 ms: the ring is faster on the one-row qkv, o_proj
// and down, this kernel on gate_up and the LM head and at 2-4 rows everywhere). Experts lost to the ring on both
// (a 30B-A3B expert's 1536 x 2048 is too few stages a block to fill the ring), so they were dropped from it.
// Why: at one row a decode step's linears are each a few MB to 100 MB of weights read once. The register ring of
// gemv_tc keeps 16-48 KiB an SM in flight, too little to cover HBM's latency at full rate (Little's law: ~4.8 TB/s x
// ~1.5 us under load is ~7 MB, 55 KiB an SM), so the 8B's fp8 linears streamed at 1.5-2.8 TB/s (gemv_bench). Here
// one TMA copy moves a 16 KiB stage, and a ring of stages keeps ~96 KiB an SM in flight. Before it waits for the
// kernel that writes x (launch_pdl), the first stages are prefetched into L2 only (a hint: a training step's kernel
// before may be writing the weights; loading them then could read stale data).
//  - W is seen as 128-byte panels (tma.cuh's tmap_panels): a tile is 16 output rows (one mma row tile); a stage is
//    K::kP consecutive panels of one tile (16 x 128 K::kP bytes, swizzled: gemv_tc_map.hpp's tma_offset).
//  - a block is K::kCw consumer warps and one producer warp; blocks walk tiles blockIdx.x, + gridDim.x, ... (at most
//    one block an SM), the producer's one lane issuing every stage of the block's tiles into the ring (mbarriers
//    full/empty).
//  - x is staged once, all of n_in (tc_stage: the RowsIn gather and SwiGLU, bf16 x scaled into f16 for 8-bit W);
//    consumer warp w takes panels w, w + kCw, ... of each stage, two warp steps of mma.m16n8k16 each (tc_step, lane
//    chunks tma_chunk), and the warps' partial sums of a tile are added through shared memory.
// Included by gemv.cuh after the tensor-core GEMV's pieces it shares (tc_stage, tc_step, XRows), before gemv().
#pragma once
#include "tensor/cuda/tma.cuh"

namespace q3vl::dev::cuda::wgemv {

// FL: kTmaAcc2 (tma_tile's two warp steps of a panel into two accumulators, added at the tile's end: two chains of 4
// dependent mmas a stage, not one of 8), and for the chain kernel (gemv_chain.cuh) kTmaScales (the producer copies a
// tile's 16 row scales into shared memory with its first stage, so that the tile's end reads no global memory) and
// kTmaRed2 (two buffers of partial sums used in turn: one block barrier a tile's end, not two).
constexpr int kTmaAcc2 = 1, kTmaScales = 2, kTmaRed2 = 4;
template <int CW, int P, int STAGES, int FL = 0> struct TmaKnobs {
  static_assert(CW >= 1 && CW <= 16 && P >= 1 && P <= 255 && STAGES >= 2 && FL >= 0 && FL < 8, "wgemv: TMA knobs");
  static constexpr int kCw = CW, kP = P, kStages = STAGES, kFl = FL;
};
using TmaAuto = TmaKnobs<8, 8, 6>;  // 8 consumer warps, 16 KiB stages, 96 KiB in flight (gemv_bench's best)

constexpr int kTmaTile = 16;                          // output rows a tile
constexpr int kTmaPanel = 128;                        // bytes of a panel's row (the 128-byte swizzle's span)
constexpr int kTmaPanelBytes = kTmaTile * kTmaPanel;  // 2 KiB
constexpr int kTmaNb = 8;                             // x rows at most (one n-tile)
constexpr size_t kTmaXBudget = 48 << 10;              // staged x: n rows of all n_in, as halves

// Whether the TMA kernel should take a product of n rows of a [n_out, n_in] matrix of `wsize`-byte weights that
// tma_takes(): Q3VL_GEMV_TMA unset, where the H200 measured it fastest (gemv_bench, docs/perf/2026-12-06-twentyseventh):
// 8-bit weights at 2 to 8 rows, or a matrix of 64 MiB or more (the 8B's fp8 gate_up 32.4 us against the ring's 36.2,
// its LM head 152 against 186; qkv, o_proj and down, 17-50 MB, lose by 0-15% at one row); never for 16-bit weights
// (`dense16`: linear_fwd's, where cuBLASLt is faster at every 8B shape but o_proj). "0": never; "1": wherever it takes
// the product (A/B timings, and the op table's cases through it at one row).
inline bool tma_wanted(int64_t n, int64_t n_in, int64_t n_out, size_t wsize, bool dense16) {
  static const int mode = env_is("Q3VL_GEMV_TMA", "0") ? 0 : env_is("Q3VL_GEMV_TMA", "1") ? 2 : 1;
  if (mode != 1) return mode == 2;
  return !dense16 && (n >= 2 || double(n_in) * double(n_out) * double(wsize) >= double(64 << 20));
}

template <class K> constexpr uint32_t tma_stage_bytes() { return uint32_t(K::kP) * kTmaPanelBytes; }
template <class K> constexpr int kTmaRedBufs = (K::kFl & kTmaRed2) ? 2 : 1;
template <class K> constexpr int kTmaSclSlots = (K::kFl & kTmaScales) ? K::kStages + 1 : 0;  // tiles' scales, 16 each
// A block's dynamic shared memory (k_gemv_tma's, gemv_chain.cuh's): the ring (1024-aligned) and its full and empty
// barriers, the header (xmul, wmax), the consumer warps' partial sums, the tiles' scales, and x_bytes of staged x.
template <class K> size_t tma_smem_bytes(size_t x_bytes) {
  return 1024 + size_t(K::kStages) * (tma_stage_bytes<K>() + 16) + kTcHeader +
         sizeof(float) * size_t(K::kCw * kTmaRedBufs<K>) * (kTmaNb / 8) * 128 +
         sizeof(float) * 16 * size_t(kTmaSclSlots<K>) + x_bytes;
}

// A TMA block's shared memory (dynamic, tma_smem_bytes): the ring (1024-aligned for the swizzle), its full and empty
// barriers (initialized by the constructor's thread 0; the caller synchronizes before using them), xmul/wmax
// (kTcHeader), the consumer warps' partial sums of a tile (kTmaRedBufs buffers), the tiles' scales (kTmaSclSlots
// of 16 floats), and the staged x. k_gemv_tma's and k_gemv_chain's.
template <class K> struct TmaSmem {
  static constexpr int kEl = (kTmaNb / 8) * 4 * 32;  // a warp's partial sums of a tile
  uint32_t ring, full0, empty0;                      // shared-window addresses
  unsigned char* ring_p;                             // the ring, a generic pointer
  float *xmul, *red, *scl;
  uint32_t* wmax;
  uint16_t* xs;
  __device__ __forceinline__ explicit TmaSmem(unsigned char* raw) {
    ring = (su32(raw) + 1023u) & ~1023u;
    ring_p = raw + (ring - su32(raw));
    unsigned char* after = ring_p + K::kStages * tma_stage_bytes<K>();
    full0 = su32(after), empty0 = full0 + 8 * K::kStages;
    char* head = reinterpret_cast<char*>(after + 16 * K::kStages);
    xmul = reinterpret_cast<float*>(head);
    wmax = reinterpret_cast<uint32_t*>(head + 64);
    red = reinterpret_cast<float*>(head + kTcHeader);
    scl = red + K::kCw * kEl * kTmaRedBufs<K>;
    xs = reinterpret_cast<uint16_t*>(scl + 16 * kTmaSclSlots<K>);
    if (threadIdx.x == 0) {
      for (int s = 0; s < K::kStages; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, K::kCw);
      mbar_init_fence();
    }
  }
};

// A consumer warp's share of one tile: its panels of the tile's spt stages, taken from the ring from the block's
// stage gi on (gi advanced past them), against the staged x (rs halves a row, n rows), summed into acc. pair: each
// stage holds two boxes of 8 rows (gemv_chain.cuh's SwiGLU pair: the gate rows, then the up rows, P panels each), in
// place of one box of 16: rows 8 on of a panel sit half a stage after its rows 0 to 7, not 1 KiB.
template <class W, class K>
__device__ __forceinline__ void tma_tile(const TmaSmem<K>& sm, int64_t& gi, int spt, int panels, int rs, int n,
                                         float (&acc)[1][kTmaNb / 8][4], unsigned long long* waited = nullptr,
                                         bool pair = false) {
  constexpr int CW = K::kCw, P = K::kP, ST = K::kStages, G = kGroup<W>;
  constexpr int PC = kTmaPanel / int(sizeof(W));  // columns of a panel
  constexpr uint32_t SB = tma_stage_bytes<K>();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  constexpr bool A2 = (K::kFl & kTmaAcc2) != 0;
  float a2[1][kTmaNb / 8][4] = {};  // kTmaAcc2: the panels' second warp steps
  for (int kp = 0; kp < spt; ++kp, ++gi) {
    const int slot = int(gi % ST);
    const long long t0 = waited ? clock64() : 0;
    mbar_wait(sm.full0 + 8 * slot, uint32_t((gi / ST) & 1));
    if (waited) *waited += (unsigned long long)(clock64() - t0);  // chain stamps (gemv_chain.cuh): cycles starved
    const unsigned char* stage = sm.ring_p + slot * SB;
    for (int p = warp; p < P; p += CW) {
      const int pg = kp * P + p;  // the panel in the row
      if (pg >= panels) break;
      const unsigned char* pb = stage + p * (pair ? kTmaPanelBytes / 2 : kTmaPanelBytes);
      const int hi = pair ? P * kTmaPanelBytes / 2 : kTmaPanelBytes / 2;  // row g + 8 from row g (tma_offset)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int c = tma_chunk(lane, s);
        const uint4 w[1][2] = {{*reinterpret_cast<const uint4*>(pb + tma_offset(g, c)),
                                *reinterpret_cast<const uint4*>(pb + hi + tma_offset(g, c))}};
        if (A2 && s == 1) tc_step<W, kTmaNb, 1>(a2, w, sm.xs + pg * PC + c * G, rs, n, g);
        else tc_step<W, kTmaNb, 1>(acc, w, sm.xs + pg * PC + c * G, rs, n, g);
      }
    }
    __syncwarp();
    mbar_arrive(sm.empty0 + 8 * slot, lane == 0);
  }
  if constexpr (A2)
#pragma unroll
    for (int nt = 0; nt < kTmaNb / 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][nt][i] += a2[0][nt][i];
}

// One block's tiles: blockIdx.x, + gridDim.x, ... of the n_out / 16 tiles, against all n rows of x.
template <class S, class W, class K>
__global__ void __launch_bounds__((K::kCw + 1) * 32, 1)
    k_gemv_tma(const __grid_constant__ CUtensorMap wmap, const S* __restrict__ in, XRows xr,
               const float* __restrict__ scale, const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in,
               int64_t n_out, int rs, bool vec_x, bool add) {
  constexpr int CW = K::kCw, P = K::kP, ST = K::kStages, NT = kTmaNb / 8;
  constexpr uint32_t SB = tma_stage_bytes<K>();
  extern __shared__ float4 smem_tma[];
  const TmaSmem<K> sm(reinterpret_cast<unsigned char*>(smem_tma));
  const uint32_t ring = sm.ring, full0 = sm.full0, empty0 = sm.empty0;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t tiles = (n_out + kTmaTile - 1) / kTmaTile;
  const int panels = int(n_in * int64_t(sizeof(W)) / kTmaPanel);
  const int spt = (panels + P - 1) / P;  // stages a tile
  const int64_t total = tma_block_stages(tiles, spt, blockIdx.x, gridDim.x);
  __syncthreads();  // the barriers are initialized
  const bool producer = warp == CW;
  // stage i of the block: its tile's first row in the map, then the copy into its ring slot
  auto at = [&](int64_t i) { return int(tma_stage_item(i, spt, blockIdx.x, gridDim.x) * kTmaTile); };
  auto issue = [&](int64_t i, uint64_t policy) {
    const int slot = int(i % ST);
    if (i >= ST) mbar_wait(empty0 + 8 * slot, uint32_t((i / ST - 1) & 1));
    mbar_expect_tx(full0 + 8 * slot, SB);
    tma_load_3d(ring + slot * SB, &wmap, 0, at(i), int(i % spt) * P, full0 + 8 * slot, policy);
  };
  const int64_t early = total < ST ? total : ST;
  const bool issuer = producer && lane == 0;
  if (issuer) {  // before the wait, the first stages into L2 only: the kernel before may be writing W (training)
    tmap_prefetch(&wmap);
    for (int64_t i = 0; i < early; ++i) tma_prefetch_3d(&wmap, 0, at(i), int(i % spt) * P);
  }
  pdl_wait();
  const uint64_t policy = l2_evict_first();
  if (issuer)
    for (int64_t i = 0; i < early; ++i) issue(i, policy);  // then into the ring, while x is staged
  tc_stage<S, W, CW + 1>(in, xr, 0, n, n_in, 0, int(n_in), vec_x, sm.xs, rs, sm.xmul, sm.wmax);
  __syncthreads();
  pdl_trigger();
  if (producer) {
    if (issuer)
      for (int64_t i = early; i < total; ++i) issue(i, policy);
    return;
  }

  int64_t i = 0;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    float acc[1][NT][4] = {};
    tma_tile<W, K>(sm, i, spt, panels, rs, n, acc);
    // The consumer warps' partial sums of the tile, added through shared memory.
    bar_sync(1, CW * 32);  // the previous tile's sums are read
    tc_store<S, W, 1, NT, CW>(acc, sm.red, warp, tile * kTmaTile, scale, b, sm.xmul, y, n, n_out, add,
                              [] { bar_sync(1, CW * 32); });
  }
}

// Whether gemv_tma takes an n x n_in by n_in x n_out product of weights W (given 16-byte aligned weights and a driver
// that encodes the map): rows of whole 128-byte panels, n <= 8 rows of x whose n_in columns fit kTmaXBudget as halves.
template <class W> size_t tma_x_bytes(int64_t n, int64_t n_in) {  // n staged rows of x as halves, padded
  return 2 * size_t(n) * size_t(n_in + kTcPad<W>);
}
template <class W> bool tma_takes(int64_t n, int64_t n_in, int64_t n_out) {
  const int64_t row_bytes = n_in * int64_t(sizeof(W));
  return n >= 1 && n <= kTmaNb && n_out >= 1 && n_out < (int64_t(1) << 31) && row_bytes >= kTmaPanel &&
         row_bytes % kTmaPanel == 0 && tma_x_bytes<W>(n, n_in) <= kTmaXBudget;
}

// The TMA GEMV when it takes the product, arguments as gemv_tc's for one matrix; false: not taken, nothing launched.
template <class S, class W, class K = TmaAuto>
bool gemv_tma(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
              int64_t n_out, const XRows& xr = {}, bool add = false) {
  static_assert(kTcOk<S, W>, "wgemv::gemv_tma: 16-bit activations, weights int8, fp8 or the activation type");
  if (!tma_takes<W>(n, n_in, n_out)) return false;
  const int64_t row_bytes = n_in * int64_t(sizeof(W)), rs = n_in + kTcPad<W>;
  CUtensorMap m;
  if (!tmap_panels(m, q, n_out, row_bytes, kTmaTile, K::kP)) return false;
  const size_t smem = tma_smem_bytes<K>(tma_x_bytes<W>(n, n_in));
  const unsigned grid = unsigned(std::min<int64_t>((n_out + kTmaTile - 1) / kTmaTile, sm_count()));
  launch_pdl(k_gemv_tma<S, W, K>, dim3(grid), (K::kCw + 1) * 32, smem, stream_of(x), m, in, xr, scale, b, y, int(n),
             n_in, n_out, int(rs), x_vectors(in, xr, n_in), add);
  return true;
}

}  // namespace q3vl::dev::cuda::wgemv
