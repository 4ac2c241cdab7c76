// The decode GEMV with its weights streamed by the TMA unit: y[n, n_out] = (x W^T) * scale + b for n <= 8 rows of
// 16-bit x, W int8, fp8 or the activations' type, one matrix or experts with R <= 8 rows in all (gemv.cuh's gemv()
// sends such products here with Q3VL_GEMV_TMA=1, dev::linear_fwd its bf16 ones with Q3VL_GEMV_TMA_DENSE=1: on trial
// until a GPU has timed them; the register-ring kernel gemv_tc takes the rest: more rows, rows not a multiple of 128
// bytes).
// Why: at one row a decode step's linears are each a few MB to 100 MB of weights read once. The register ring of
// gemv_tc keeps 16-48 KiB an SM in flight, too little to cover HBM's latency at full rate (Little's law: ~4.8 TB/s x
// ~1.5 us under load is ~7 MB, 55 KiB an SM), so the 8B's fp8 linears streamed at 1.5-2.8 TB/s (gemv_bench). Here
// one TMA copy moves a 16 KiB stage, and a ring of stages keeps ~96 KiB an SM in flight from the kernel's first
// instructions: before it waits for the kernel that writes x (launch_pdl), since nothing in a decode step writes
// weights.
//  - W is seen as 128-byte panels (tma.cuh's tmap_panels): a tile is 16 output rows (one mma row tile); a stage is
//    K::kP consecutive panels of one tile (16 x 128 K::kP bytes, swizzled: gemv_tc_map.hpp's tma_offset).
//  - a block is K::kCw consumer warps and one producer warp; blocks walk tiles blockIdx.x, + gridDim.x, ... (at most
//    one block an SM), the producer's one lane issuing every stage of the block's tiles into the ring (mbarriers
//    full/empty). Experts: the tiles of the experts with rows (found on the device after the wait), each expert's
//    rows of the map at e n_out.
//  - x is staged once, all of n_in (tc_stage: the RowsIn gather and SwiGLU, bf16 x scaled into f16 for 8-bit W);
//    consumer warp w takes panels w, w + kCw, ... of each stage, two warp steps of mma.m16n8k16 each (tc_step, lane
//    chunks tma_chunk), and the warps' partial sums of a tile are added through shared memory.
// Included by gemv.cuh after the tensor-core GEMV's pieces it shares (tc_stage, tc_step, XRows), before gemv().
#pragma once
#include "tensor/cuda/tma.cuh"

namespace q3vl::dev::cuda::wgemv {

template <int CW, int P, int STAGES> struct TmaKnobs {
  static_assert(CW >= 1 && CW <= 16 && P >= 1 && P <= 255 && STAGES >= 2, "wgemv: TMA knobs");
  static constexpr int kCw = CW, kP = P, kStages = STAGES;
};
using TmaAuto = TmaKnobs<4, 8, 6>;  // 4 consumer warps, 16 KiB stages, 96 KiB in flight

constexpr int kTmaTile = 16;                          // output rows a tile
constexpr int kTmaPanel = 128;                        // bytes of a panel's row (the 128-byte swizzle's span)
constexpr int kTmaPanelBytes = kTmaTile * kTmaPanel;  // 2 KiB
constexpr int kTmaNb = 8;                             // x rows at most (one n-tile)
constexpr size_t kTmaXBudget = 48 << 10;              // staged x: n rows of all n_in, as halves

// Whether gemv() (8-bit weights, experts) takes the TMA kernel where it can: with Q3VL_GEMV_TMA=1, on trial until a
// GPU has checked and timed it against the register ring (written 2026-12-05 with no device lent; tools/gpu/gemv_bench
// and the call scripts of docs/perf/2026-12-05-twentyfifth do both). Benchmarks may flip it.
inline bool& tma_on() {
  static bool on = env_is("Q3VL_GEMV_TMA", "1");
  return on;
}

template <class K> constexpr uint32_t tma_stage_bytes() { return uint32_t(K::kP) * kTmaPanelBytes; }

// start null: one matrix, n rows of x. Else experts (W [E, n_out, n_in], the map's rows E n_out): all n = R rows
// are staged, and the items are the tiles of the experts with rows (at most R), each against its own rows of x.
template <class S, class W, class K>
__global__ void __launch_bounds__((K::kCw + 1) * 32, 1)
    k_gemv_tma(const __grid_constant__ CUtensorMap wmap, const S* __restrict__ in, XRows xr,
               const float* __restrict__ scale, const S* __restrict__ b, S* __restrict__ y, int n, int64_t n_in,
               int64_t n_out, int rs, bool vec_x, const int32_t* __restrict__ start, int E) {
  constexpr int CW = K::kCw, P = K::kP, ST = K::kStages, NT = kTmaNb / 8, G = kGroup<W>;
  constexpr int PC = kTmaPanel / int(sizeof(W));  // columns of a panel
  constexpr uint32_t SB = tma_stage_bytes<K>();
  constexpr int EL = NT * 4 * 32;  // a warp's partial sums of a tile
  extern __shared__ float4 smem_tma[];
  __shared__ int busy[kTmaNb + 1];  // experts: the experts with rows in order, their count last
  unsigned char* smraw = reinterpret_cast<unsigned char*>(smem_tma);
  // ring (1024-aligned for the swizzle), full and empty barriers, xmul/wmax (kTcHeader), the partial sums, x
  const uint32_t ring = (su32(smraw) + 1023u) & ~1023u;
  unsigned char* after = smraw + (ring - su32(smraw)) + ST * SB;
  const uint32_t full0 = su32(after), empty0 = full0 + 8 * ST;
  char* head = reinterpret_cast<char*>(after + 16 * ST);
  float* xmul = reinterpret_cast<float*>(head);
  uint32_t* wmax = reinterpret_cast<uint32_t*>(head + 64);
  float* red = reinterpret_cast<float*>(head + kTcHeader);
  uint16_t* xs = reinterpret_cast<uint16_t*>(red + CW * EL);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int64_t tiles = (n_out + kTmaTile - 1) / kTmaTile;  // of one matrix
  const int panels = int(n_in * int64_t(sizeof(W)) / kTmaPanel);
  const int spt = (panels + P - 1) / P;  // stages a tile
  auto stages_of = [&](int64_t items) { return tma_block_stages(items, spt, blockIdx.x, gridDim.x); };
  auto item_of = [&](int64_t i) { return tma_stage_item(i, spt, blockIdx.x, gridDim.x); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; ++s) mbar_init(full0 + 8 * s, 1), mbar_init(empty0 + 8 * s, CW);
    mbar_init_fence();
  }
  __syncthreads();
  const bool producer = warp == CW;
  auto issue = [&](int64_t i, uint64_t policy) {  // stage i of the block into its ring slot
    const int slot = int(i % ST);
    const int64_t it = item_of(i), e = start ? busy[it / tiles] : 0;
    mbar_expect_tx(full0 + 8 * slot, SB);
    tma_load_3d(ring + slot * SB, &wmap, 0, int(e * n_out + it % tiles * kTmaTile), int(i % spt) * P,
                full0 + 8 * slot, policy);
  };
  // Dense: the first stages go out before the wait (weights only: nothing the kernels before write). Experts need
  // start, the router's output, first.
  int64_t total = start ? 0 : stages_of(tiles);
  const int64_t early = start ? 0 : total < ST ? total : ST;
  if (producer && lane == 0) {
    tmap_prefetch(&wmap);
    const uint64_t policy = l2_evict_first();
    for (int64_t i = 0; i < early; ++i) issue(i, policy);
  }
  pdl_wait();
  if (start && warp == 0) {
    int k = 0;
    for (; k < kTmaNb; ++k) {
      const int e = busy_expert(start, E, k);
      if (e < 0) break;
      if (lane == 0) busy[k] = e;
    }
    if (lane == 0) busy[kTmaNb] = k;
  }
  tc_stage<S, W, CW + 1>(in, xr, 0, n, n_in, 0, int(n_in), vec_x, xs, rs, xmul, wmax);
  __syncthreads();
  pdl_trigger();
  const int64_t items = start ? busy[kTmaNb] * tiles : tiles;
  if (start) total = stages_of(items);
  if (producer) {
    if (lane == 0) {
      const uint64_t policy = l2_evict_first();
      for (int64_t i = early; i < total; ++i) {
        if (i >= ST) mbar_wait(empty0 + 8 * int(i % ST), uint32_t((i / ST - 1) & 1));
        issue(i, policy);
      }
    }
    return;
  }

  int64_t i = 0;
  for (int64_t it = blockIdx.x; it < items; it += gridDim.x) {
    const int e = start ? busy[it / tiles] : 0;
    const int r0 = start ? start[e] : 0, m = start ? start[e + 1] - r0 : n;  // the item's x rows
    const int64_t tile = it % tiles;
    float acc[1][NT][4] = {};
    for (int kp = 0; kp < spt; ++kp, ++i) {
      const int slot = int(i % ST);
      mbar_wait(full0 + 8 * slot, uint32_t((i / ST) & 1));
      const unsigned char* stage = smraw + (ring - su32(smraw)) + slot * SB;
      for (int p = warp; p < P; p += CW) {
        const int pg = kp * P + p;  // the panel in the row
        if (pg >= panels) break;
        const unsigned char* pb = stage + p * kTmaPanelBytes;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int c = tma_chunk(lane, s);
          const uint4 w[1][2] = {{*reinterpret_cast<const uint4*>(pb + tma_offset(g, c)),
                                  *reinterpret_cast<const uint4*>(pb + tma_offset(g + 8, c))}};
          tc_step<W, kTmaNb, 1>(acc, w, xs + r0 * rs + pg * PC + c * G, rs, m, g);
        }
      }
      __syncwarp();
      mbar_arrive(empty0 + 8 * slot, lane == 0);
    }
    // The consumer warps' partial sums of the tile, added through shared memory.
    bar_sync(1, CW * 32);  // the previous tile's sums are read
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) red[warp * EL + (nt * 4 + k) * 32 + lane] = acc[0][nt][k];
    bar_sync(1, CW * 32);
    for (int el = threadIdx.x; el < EL; el += CW * 32) {
      float v = 0.f;
      for (int w = 0; w < CW; ++w) v += red[w * EL + el];
      const int ln = el & 31, k = (el >> 5) & 3, nt = el >> 7;
      const int64_t r = tile * kTmaTile + frag_c_row(ln, k);
      const int j = nt * 8 + frag_c_n(ln, k);
      if (r >= n_out || j >= m) continue;
      float sc = xmul[r0 + j];  // undoes x's scaling (1 where none)
      if constexpr (kScaled<W>) sc *= scale[int64_t(e) * n_out + r];
      st(y, int64_t(r0 + j) * n_out + r, v * sc + (b ? ld(b, r) : 0.f));
    }
  }
}

// Whether gemv_tma takes an n x n_in by n_in x n_out product of weights W (given 16-byte aligned weights and a driver
// that encodes the map): rows of whole 128-byte panels, n <= 8 rows of x (experts: all R rows) whose n_in columns
// fit kTmaXBudget as halves.
template <class W> bool tma_takes(int64_t n, int64_t n_in, int64_t n_out) {
  const int64_t row_bytes = n_in * int64_t(sizeof(W));
  return n >= 1 && n <= kTmaNb && n_out >= 1 && n_out / kTmaTile < (int64_t(1) << 31) && row_bytes >= kTmaPanel &&
         row_bytes % kTmaPanel == 0 && 2 * size_t(n) * size_t(n_in + kTcPad<W>) <= kTmaXBudget;
}

// The TMA GEMV when it takes the product, arguments as gemv_tc's (experts: start[E + 1] on the device, R rows in all,
// every row staged: R <= 8); false: not taken, nothing launched.
template <class S, class W, class K = TmaAuto>
bool gemv_tma(const Exec& x, const S* in, const W* q, const float* scale, const S* b, S* y, int64_t n, int64_t n_in,
              int64_t n_out, const XRows& xr = {}, const int32_t* start = nullptr, int64_t E = 0, int64_t R = 0) {
  static_assert(kTcOk<S, W>, "wgemv::gemv_tma: 16-bit activations, weights int8, fp8 or the activation type");
  const int64_t rows = start ? R : n;  // staged x rows
  if (!tma_takes<W>(rows, n_in, n_out) || (start && (E < 1 || E * n_out >= (int64_t(1) << 31)))) return false;
  const int64_t row_bytes = n_in * int64_t(sizeof(W)), rs = n_in + kTcPad<W>;
  const size_t xbytes = 2 * size_t(rows) * size_t(rs);
  CUtensorMap m;
  if (!tmap_panels(m, q, start ? E * n_out : n_out, row_bytes, kTmaTile, K::kP)) return false;
  const size_t smem = 1024 + size_t(K::kStages) * (tma_stage_bytes<K>() + 16) + kTcHeader +
                      sizeof(float) * size_t(K::kCw) * (kTmaNb / 8) * 128 + xbytes;
  const int64_t tiles = (n_out + kTmaTile - 1) / kTmaTile * (start ? std::min(E, R) : 1);  // at most
  const unsigned grid = unsigned(std::min<int64_t>(tiles, sm_count()));
  const bool vec_x = n_in % 8 == 0 && aligned16(in);
  launch_pdl(k_gemv_tma<S, W, K>, dim3(grid), (K::kCw + 1) * 32, smem, stream_of(x), m, in, xr, scale, b, y,
             int(rows), n_in, n_out, int(rs), vec_x, start, int(E));
  return true;
}

}  // namespace q3vl::dev::cuda::wgemv
