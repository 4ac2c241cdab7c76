// A chain of decode GEMVs in one persistent kernel: y_j = (x_j W_j^T) * scale_j (+ y_j with add), j = 0 .. count-1,
// W 8-bit with its row scales or of x's 16-bit type (no scale), where x_j may be an earlier product (another block's
// rows of it). One block an SM; its producer warp streams the
// weights of every product of the chain through one TMA ring without a pause, and its consumer warps compute product j
// once every block has written product j-1 (a grid barrier in global memory). So HBM stays busy across the boundary
// that separates two kernels: a block done with its tiles of product j has the first stages of product j+1 in its
// ring by the time the barrier opens, where a kernel of its own would start from an empty ring (issue 32: the 8B's
// small one-row matrices stream at 1.1-1.9 TB/s each, paying their own ramp and tail).
// A product's tiles, stages, panels and per-tile arithmetic are k_gemv_tma's (gemv_tma.cuh), so each tile's sums are
// that kernel's; only the staging of x differs (the consumer warps stage it, CW of them, not CW + 1: a norm's sum of
// squares is added in another order).
// Deadlock-free because every block is resident: grid = the SM count, at most one block an SM (its shared memory),
// and the kernel before it has ended (pdl_wait) before any block waits at a barrier.
// An attention link (chain_attn.cuh) has no weights: the producer skips it, streaming the next product's stages while
// the consumer warps attend.
// A MoE link (dev::ChainMoe, one row) is three jobs: the router's product into fp32 logits; gate_up of the k picked
// experts (a SwiGLU pair whose tiles' rows the producer takes from the picks, each pick's SwiGLU times its weight);
// down_proj of the picks as one product of k I columns (the producer takes each half stage's panels from its pick's
// matrix), adding to x. Past the router's grid barrier every block routes the logits itself (route.cuh's router_row,
// consumer warp 0) and hands the picks to its producer through shared memory (a count of routes, no phase to alias).
#pragma once
#include "tensor/cuda/chain_attn.cuh"
#include "tensor/cuda/gemv.cuh"
#include "tensor/cuda/route.cuh"

namespace q3vl::dev::cuda::wgemv {

constexpr int kChainMax = dev::kChainMaxLinks;  // links a chain
// 160 KiB of stages in flight (x's 48 KiB at most: 214 KiB). A tile's sums added a tile late, while the next tile
// streams (two sums buffers, ready and read mbarriers in place of the two block barriers a tile), lost on an H100:
// 84.7 against 81.9 us a layer of the 8B's fp8 linears (chain_bench, docs/perf/2026-12-07-thirtyfifth/callC). The
// flags shorten the synchronous tile ends instead, where the stamps put 18 of a layer's 82 us (thirty-sixth session):
// the scales already in shared memory, one barrier a tile, and two accumulators a warp.
using TmaChain = TmaKnobs<8, 8, 10, kTmaAcc2 | kTmaScales | kTmaRed2>;

// One link of a chain (built by chain_job or chain_attn_job on the host).
template <class S> struct ChainJob {
  union {
    CUtensorMap map;    // a product: W's 128-byte panels (tmap_panels), 16 rows x K::kP panels a box
    ChainAttnJob attn;  // an attention link: in the fused qkv rows, y the attention rows (n_in = n_out = 0)
  };
  const S* in;
  XRows xr;
  const float* scale;
  S* y;
  int64_t n_in, n_out;
  int64_t half;  // a SwiGLU pair (chain_job's pair): W's gate rows [0, half) and up rows [half, n_out) 8 and 8 a tile,
                 // y [n, half] = their SwiGLU (tc_store); else 0
  int rs;
  bool vec_x, add, is_attn;
  bool scl;  // 8-bit W whose tiles' scales the producer copies into shared memory (kTmaScales: 16-byte aligned, whole
             // tiles)
  // A MoE link's job (kMoeNone: a product or an attention): the router's writes the logits [E] in fp32 (yf); the
  // experts' gate_up routes `logits` first (block 0 writes the picks into idx, their weights into wout); seg: I, a
  // pick's gate rows (gate_up) or columns (down_proj).
  int moe, E, k;
  int64_t seg;
  float* yf;
  const float* logits;
  int32_t* idx;
  float* wout;
};
enum ChainMoePart { kMoeNone, kMoeRouter, kMoeUp, kMoeDown };
// The routing's shared memory past the staged x (ChainParams::route_off): the count of routes done, the picks and
// their weights, the logits' softmax buffers.
constexpr int kRouteMaxK = 32, kRouteMaxE = 1024;
struct RouteSmem {
  volatile uint32_t* seq;
  int* pick;
  float *pw, *buf, *probs;
  __device__ __forceinline__ RouteSmem(unsigned char* at, int E)
      : seq(reinterpret_cast<volatile uint32_t*>(at)), pick(reinterpret_cast<int*>(at + 16)),
        pw(reinterpret_cast<float*>(at + 16 + 4 * kRouteMaxK)), buf(pw + kRouteMaxK), probs(buf + E) {}
  static size_t bytes(int E) { return 16 + 8 * kRouteMaxK + 8 * size_t(E); }
};
template <class S> struct ChainParams {
  ChainJob<S> job[kChainMax];
  int count, n;
  int route_off, route_e;  // the routing's shared memory: bytes past sm.xs, the largest E (0: no MoE link)
  uint32_t* bar;  // zeroed words: blocks arrived, blocks done (the last block done zeroes both), then the attention
                  // links' kAttnCounters counters (each left zeroed by the split that combines)
  unsigned long long* stamps;  // null, or zeroed kStampWords words a (link, block), for tools/gpu/chain_bench
};
// A (link j, block b)'s stamps at stamps[(j * gridDim.x + b) * kStampWords]: the consumers' start of the link (past
// its grid barrier) and end (tiles stored, before arriving), in globaltimer ns and in the SM's clock64; the cycles
// consumer thread 0 waited for full stages (starved of weights) and the producer waited for empty ones (ring full);
// the clock64 when x was staged; the cycles from the end of the tiles' stages to the end of their stores; in an
// attention link, the clock64 when the block's unit had its queries and new keys, its keys' sums, its rows written
// and counted, and (the split that combines) the combine done (chain_attn.cuh; zero where the block had no unit).
enum ChainStamp {
  kStartNs, kEndNs, kStartClk, kEndClk, kFullWait, kEmptyWait, kStagedClk, kStoreWait,
  kAttnQ, kAttnKeys, kAttnCounted, kAttnDone, kStampWords
};

// Block-wide barrier of the consumer warps (tc_stage's Sync).
template <int CW> struct SyncConsumers {
  __device__ __forceinline__ void operator()() const { bar_sync(1, CW * 32); }
};
// Thread 0 of a block past the consumers' named barrier: a release add at gpu scope, so this block's products, stored
// by every consumer thread before that barrier, are seen by any block that acquires the count (CUTLASS's generic
// barrier; no separate fence).
__device__ __forceinline__ void grid_arrive(uint32_t* bar) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(bar) : "memory");
}
__device__ __forceinline__ void grid_wait(const uint32_t* bar, uint32_t target) {
  uint32_t v;
  do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
  while (v < target);
}

template <class S, class W, class K>
__global__ void __launch_bounds__((K::kCw + 1) * 32, 1) k_gemv_chain(const __grid_constant__ ChainParams<S> p) {
  constexpr int CW = K::kCw, P = K::kP, ST = K::kStages, NT = kTmaNb / 8;
  constexpr uint32_t SB = tma_stage_bytes<K>(), kSclSlots = kTmaSclSlots<K> > 0 ? kTmaSclSlots<K> : 1;
  extern __shared__ float4 smem_chain[];
  const TmaSmem<K> sm(reinterpret_cast<unsigned char*>(smem_chain));  // k_gemv_tma's layout
  const uint32_t ring = sm.ring, full0 = sm.full0, empty0 = sm.empty0;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = p.n;
  const RouteSmem rt(reinterpret_cast<unsigned char*>(sm.xs) + p.route_off, p.route_e);
  if (threadIdx.x == 0) *rt.seq = 0;
  __syncthreads();  // the barriers are initialized
  const auto tiles = [](const ChainJob<S>& jb) { return (jb.n_out + kTmaTile - 1) / kTmaTile; };
  const auto spt = [](const ChainJob<S>& jb) { return (int(jb.n_in * int64_t(sizeof(W)) / kTmaPanel) + P - 1) / P; };

  if (warp == CW) {  // the producer: every product's stages, in order, into the ring
    if (lane != 0) return;
    for (int j = 0; j < p.count; ++j)
      if (!p.job[j].is_attn) tmap_prefetch(&p.job[j].map);
    // A cursor over the block's stages of the whole chain: product j, its stage i of total, stages a tile sp.
    struct Cur {
      int j = -1, sp = 1;
      int64_t i = 0, total = 0;
    };
    uint32_t routes = 0;  // MoE links entered: their picks are in once the consumers' count reaches it
    // false past the chain's last stage, or (lead: the L2 prefetch's cursor) at a MoE link's routed stages
    const auto next = [&](Cur& c, bool lead = false) {
      for (++c.i; c.i >= c.total && c.j < p.count;) {
        if (++c.j == p.count) return false;
        if (p.job[c.j].moe == kMoeUp) {
          if (lead) return false;
          ++routes;
          while (*rt.seq < routes) {
          }
          __threadfence_block();
        }
        c.sp = spt(p.job[c.j]), c.total = tma_block_stages(tiles(p.job[c.j]), c.sp, blockIdx.x, gridDim.x), c.i = 0;
      }
      return c.j < p.count;
    };
    // f(map, offset in the stage, first row, first panel) for stage c's box of 16 rows, or a SwiGLU pair's two boxes
    // of 8 (the tile's gate rows, then their up rows half on, in the stage's second half: tma_tile's pair).
    const auto boxes = [&](const Cur& c, auto&& f) {
      const ChainJob<S>& jb = p.job[c.j];
      const int64_t item = tma_stage_item(c.i, c.sp, blockIdx.x, gridDim.x);
      const int panel = int(c.i % c.sp) * P;
      if (jb.moe == kMoeUp) {  // pick item / (I / 8)'s gate rows and their up rows, I on, in [E, 2 I] rows
        const int64_t tpp = jb.seg / (kTmaTile / 2), r = (item % tpp) * (kTmaTile / 2);
        const int64_t e0 = int64_t(rt.pick[item / tpp]) * 2 * jb.seg;
        f(jb.map, 0u, int(e0 + r), panel);
        f(jb.map, SB / 2, int(e0 + jb.seg + r), panel);
      } else if (jb.moe == kMoeDown) {  // half a stage's panels from one pick's [H, I] (P / 2 divides I's panels)
        const int ppe = int(jb.seg * int64_t(sizeof(W)) / kTmaPanel);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int pg = panel + h * (P / 2);
          f(jb.map, h * (SB / 2), int(int64_t(rt.pick[pg / ppe]) * jb.n_out + item * kTmaTile), pg % ppe);
        }
      } else if (!jb.half) {
        f(jb.map, 0u, int(item * kTmaTile), panel);
      } else {
        f(jb.map, 0u, int(item * (kTmaTile / 2)), panel);
        f(jb.map, SB / 2, int(jb.half + item * (kTmaTile / 2)), panel);
      }
    };
    // The first ST stages into L2 only before the wait, as k_gemv_tma does. (Asking L2 for stages further past the
    // ring, to keep HBM busy while the consumers wait at a barrier, lost 30-35 us a layer: chain_bench, H100,
    // docs/perf/2026-12-06-thirtieth/call4.)
    Cur lead;
    for (int k = 0; k < ST && next(lead, true); ++k)
      boxes(lead, [](const CUtensorMap& m, uint32_t, int r, int pn) { tma_prefetch_3d(&m, 0, r, pn); });
    pdl_wait();
    const uint64_t policy = l2_evict_first();
    Cur c;
    uint32_t tn = 0;                       // the block's tiles so far (the consumers count the same)
    for (int64_t gi = 0; next(c); ++gi) {  // gi: the block's stage across the chain
      const int slot = int(gi % ST);
      const long long t0 = p.stamps ? clock64() : 0;
      if (gi >= ST) mbar_wait(empty0 + 8 * slot, uint32_t((gi / ST - 1) & 1));
      if (p.stamps) p.stamps[(size_t(c.j) * gridDim.x + blockIdx.x) * kStampWords + kEmptyWait] += clock64() - t0;
      const ChainJob<S>& jb = p.job[c.j];
      // A tile's first stage brings its scales (kTmaScales) into slot tn of ST + 1: the slot's last tile, ST + 1
      // tiles back, ended before the stage ST back (of a later tile: a tile has one stage or more) was freed.
      const bool scl = (K::kFl & kTmaScales) && jb.scl && c.i % c.sp == 0;
      mbar_expect_tx(full0 + 8 * slot, SB + (scl ? 64u : 0u));
      boxes(c, [&](const CUtensorMap& m, uint32_t off, int r, int pn) {
        tma_load_3d(ring + slot * SB + off, &m, 0, r, pn, full0 + 8 * slot, policy);
      });
      if (scl) {
        const int64_t item = tma_stage_item(c.i, c.sp, blockIdx.x, gridDim.x);
        const uint32_t dst = su32(sm.scl + 16 * (tn % kSclSlots));
        if (jb.half) {
          bulk_load(dst, jb.scale + item * 8, 32, full0 + 8 * slot);
          bulk_load(dst + 32, jb.scale + jb.half + item * 8, 32, full0 + 8 * slot);
        } else {
          bulk_load(dst, jb.scale + item * kTmaTile, 64, full0 + 8 * slot);
        }
      }
      if (c.i % c.sp == 0) ++tn;
    }
    return;
  }

  pdl_wait();
  int64_t gi = 0;   // the block's stages so far
  uint32_t tn = 0;  // and tiles (the producer's count)
  for (int j = 0; j < p.count; ++j) {
    const ChainJob<S>& jb = p.job[j];
    if (j > 0) {  // every block has written product j - 1
      if (threadIdx.x == 0) grid_wait(p.bar, uint32_t(j) * gridDim.x);
      bar_sync(1, CW * 32);
    }
    if (j == p.count - 1) pdl_trigger();
    unsigned long long* st =
        p.stamps && threadIdx.x == 0 ? p.stamps + (size_t(j) * gridDim.x + blockIdx.x) * kStampWords : nullptr;
    if (st) st[kStartNs] = global_ns(), st[kStartClk] = clock64();
    if (jb.is_attn)  // no tiles: the loops below do nothing
      attn_link<S, CW>(jb.attn, jb.in, jb.y, n, reinterpret_cast<unsigned char*>(sm.xs), p.bar + 2,
                       st ? st + kAttnQ : nullptr);
    if (jb.moe == kMoeUp) {  // route the router's logits (written by other blocks: read at L2), picks to the producer
      if (warp == 0) {
        for (int e = lane; e < jb.E; e += 32) rt.buf[e] = __ldcg(jb.logits + e);
        __syncwarp();
        const Pick pk = router_row(rt.buf, rt.probs, jb.E, jb.k);
        if (lane < jb.k) {
          rt.pick[lane] = pk.e, rt.pw[lane] = pk.w;
          if (blockIdx.x == 0) jb.idx[lane] = pk.e, jb.wout[lane] = pk.w;
        }
        __syncwarp();
        if (lane == 0) __threadfence_block(), *rt.seq = *rt.seq + 1;
      }
      bar_sync(1, CW * 32);
    }
    TcEpi ep{jb.yf, jb.moe == kMoeUp ? rt.pw : nullptr, jb.seg};
    const int64_t nt = tiles(jb);
    const int sp = spt(jb), panels = int(jb.n_in * int64_t(sizeof(W)) / kTmaPanel);
    if (blockIdx.x < nt) {
      tc_stage<S, W, CW, false>(jb.in, jb.xr, 0, n, jb.n_in, 0, int(jb.n_in), jb.vec_x, sm.xs, jb.rs, sm.xmul,
                                sm.wmax, SyncConsumers<CW>{});
      bar_sync(1, CW * 32);
    }
    if (st) st[kStagedClk] = clock64();
    for (int64_t tile = blockIdx.x; tile < nt; tile += gridDim.x, ++tn) {
      float acc[1][NT][4] = {};
      tma_tile<W, K>(sm, gi, sp, panels, jb.rs, n, acc, st ? st + kFullWait : nullptr, jb.half != 0);
      const long long t0 = st ? clock64() : 0;
      // The previous tile's sums are read: its buffer's (kTmaRed2: the tile before it used the other buffer, whose
      // readers have all passed that tile's barrier since).
      if (!(K::kFl & kTmaRed2)) bar_sync(1, CW * 32);
      if ((K::kFl & kTmaScales) && jb.scl) ep.sg = sm.scl + 16 * (tn % kSclSlots);
      float* red = sm.red + ((K::kFl & kTmaRed2) ? (tn & 1u) * CW * TmaSmem<K>::kEl : 0u);
      tc_store<S, W, 1, NT, CW>(acc, red, warp, tile * kTmaTile, jb.scale, static_cast<const S*>(nullptr), sm.xmul,
                                jb.y, n, jb.n_out, jb.add, [] { bar_sync(1, CW * 32); }, jb.half, ep);
      if (st) st[kStoreWait] += clock64() - t0;
    }
    if (st) st[kEndNs] = global_ns(), st[kEndClk] = clock64();
    if (j + 1 < p.count) {
      bar_sync(1, CW * 32);  // every consumer's stores (and reads of xs, xmul) are done
      if (threadIdx.x == 0) grid_arrive(p.bar);
    }
  }
  if (threadIdx.x == 0 && atomicAdd(p.bar + 1, 1u) == gridDim.x - 1) {  // every block is past every barrier
    p.bar[0] = 0;
    p.bar[1] = 0;
  }
}

// Product j of a chain, or false where the TMA GEMV would not take it (tma_takes, the map). pair: a SwiGLU pair, y
// [n, n_out / 2] = silu(gate) * up of W's gate rows [0, n_out / 2) and up rows after them (n_out a multiple of 16,
// no add): a tile takes 8 gate rows and their 8 up rows, two TMA boxes of 8 rows a stage.
template <class S, class W, class K = TmaChain>
bool chain_job(ChainJob<S>& jb, const S* in, const W* q, const float* scale, S* y, int n, int64_t n_in,
               int64_t n_out, const XRows& xr, bool add, bool pair = false) {
  if (!tma_takes<W>(n, n_in, n_out) || (pair && (n_out % kTmaTile || add))) return false;
  if (!tmap_panels(jb.map, q, n_out, n_in * int64_t(sizeof(W)), pair ? kTmaTile / 2 : kTmaTile, K::kP)) return false;
  jb.in = in, jb.xr = xr, jb.scale = scale, jb.y = y, jb.n_in = n_in, jb.n_out = n_out, jb.half = pair ? n_out / 2 : 0;
  jb.rs = int(n_in + kTcPad<W>), jb.vec_x = x_vectors(in, xr, n_in), jb.add = add, jb.is_attn = false;
  jb.scl = kScaled<W> && scale && aligned16(scale) && n_out % kTmaTile == 0;
  jb.moe = kMoeNone, jb.E = jb.k = 0, jb.seg = 1, jb.yf = nullptr, jb.logits = nullptr, jb.idx = nullptr;
  jb.wout = nullptr;
  return true;
}

// A MoE link's three jobs (dev::ChainMoe over one row: x read through xr's norm, y (+)= the combine), or false where
// the kernel does not take it: weights in the activations' type, k <= kRouteMaxK, E <= kRouteMaxE, I's panels a
// multiple of P / 2 (a half stage of down_proj from one pick) and k of them a multiple of P (no stage past the picks).
template <class S, class W, class K = TmaChain>
bool chain_moe_jobs(ChainJob<S>* jb, const ChainMoe& m, const S* x, const XRows& xr, S* y, int n, int64_t H,
                    bool add) {
  constexpr int P = K::kP;
  const int64_t E = m.E, k = m.k, I = m.I, ppe = I * int64_t(sizeof(W)) / kTmaPanel;
  if (!std::is_same_v<S, W> || n != 1 || k < 1 || k > kRouteMaxK || E < k || E > kRouteMaxE || !xr.norm ||
      I * int64_t(sizeof(W)) % kTmaPanel || ppe % (P / 2) || (k * ppe) % P || I % (kTmaTile / 2) ||
      E * 2 * I >= (int64_t(1) << 31) || E * H >= (int64_t(1) << 31) || !tma_takes<W>(n, H, k * 2 * I) ||
      !tma_takes<W>(n, k * I, H) || !aligned16(m.act))
    return false;
  if (!chain_job<S, W, K>(jb[0], x, static_cast<const W*>(m.router), nullptr, nullptr, n, H, E, xr, false))
    return false;
  jb[0].moe = kMoeRouter, jb[0].yf = m.logits;
  if (!chain_job<S, W, K>(jb[1], x, static_cast<const W*>(m.gate_up), nullptr, static_cast<S*>(m.act), n, H,
                          k * 2 * I, xr, false, true) ||
      !tmap_panels(jb[1].map, m.gate_up, E * 2 * I, H * int64_t(sizeof(W)), kTmaTile / 2, P))
    return false;
  jb[1].moe = kMoeUp, jb[1].E = int(E), jb[1].k = int(k), jb[1].seg = I, jb[1].logits = m.logits;
  jb[1].idx = m.idx, jb[1].wout = m.w;
  if (!chain_job<S, W, K>(jb[2], static_cast<const S*>(m.act), static_cast<const W*>(m.down), nullptr, y, n, k * I,
                          H, XRows{}, add) ||
      !tmap_panels(jb[2].map, m.down, E * H, I * int64_t(sizeof(W)), kTmaTile, P / 2))
    return false;
  jb[2].moe = kMoeDown, jb[2].seg = I;
  return true;
}

// An attention link over n rows (dev::ChainAttn's arguments; in and y as dev::ChainLink's), or false where the kernel
// does not take it: head dims 64 and 128, up to kAttnItems query heads of a kv head over a segment's new rows, 16-byte
// aligned rows and pools, slots given. Key splits as paged attention's decode (about one unit a block; fewer where
// Exec::ws cannot hold the partial rows: none without it).
template <class S>
bool chain_attn_job(const Exec& x, ChainJob<S>& jb, const ChainAttn& a, const S* in, S* y, int64_t n) {
  const int64_t G = a.nkv > 0 ? a.nh / a.nkv : 0;
  if ((a.hd != 64 && a.hd != 128) || G < 1 || a.nh % a.nkv || a.max_q < 1 || a.max_q * G > kAttnItems ||
      a.nseg < 1 || a.nseg * a.nkv > kAttnCounters || a.block < 1 || a.max_ctx < a.max_q ||
      a.max_blocks * a.block >= (int64_t(1) << 31) || !a.slots || !aligned16(in) || !aligned16(y) ||
      !aligned16(a.k_pool) || !aligned16(a.v_pool))
    return false;
  int64_t ns = std::min<int64_t>({sm_count() / (a.nseg * a.nkv), a.max_ctx / kAttnMinKeys, kAttnMaxSplit});
  const size_t per = size_t(n * a.nh) * size_t(a.hd + 2) * sizeof(float);
  if (ns > 1) ns = std::min<int64_t>(ns, x.ws ? int64_t(x.ws_bytes / per) : 1);
  ns = std::max<int64_t>(ns, 1);
  jb.attn = {a.wq, a.wk, a.cos, a.sin, a.k_pool, a.v_pool, a.slots, a.cu, a.ctx, a.table,
             ns > 1 ? static_cast<float*>(x.ws) : nullptr, int(a.max_blocks), int(a.block), int(a.nseg), int(a.nh),
             int(a.nkv), int(a.hd), int(ns), int(a.max_q), float(a.eps), float(double(a.scale) * 1.4426950408889634)};
  jb.in = in, jb.xr = {}, jb.scale = nullptr, jb.y = y, jb.n_in = 0, jb.n_out = 0, jb.half = 0, jb.rs = 0;
  jb.vec_x = false, jb.add = false, jb.is_attn = true, jb.scl = false;
  jb.moe = kMoeNone, jb.E = jb.k = 0, jb.seg = 1, jb.yf = nullptr, jb.logits = nullptr, jb.idx = nullptr;
  jb.wout = nullptr;
  return true;
}

// The chain p.job[0 .. p.count) over p.n rows, p.bar two zeroed words of device memory (left zeroed); sets p's
// routing layout. False (nothing launched) where its shared memory would pass the device's.
template <class S, class W, class K = TmaChain>
bool gemv_chain(const Exec& x, ChainParams<S>& p) {
  static_assert(kTcOk<S, W>, "wgemv::gemv_chain: 16-bit activations, weights 8-bit or of their type");
  Q3VL_CHECK(p.count >= 1 && p.count <= kChainMax && p.n >= 1 && p.n <= kTmaNb && p.bar,
             "wgemv::gemv_chain: bad chain");
  size_t xb = 0;
  int route_e = 0;
  for (int j = 0; j < p.count; ++j) {
    const ChainJob<S>& jb = p.job[j];
    xb = std::max(xb, jb.is_attn ? attn_smem_bytes<S>(jb.attn.max_q * (jb.attn.nh / jb.attn.nkv), jb.attn.hd)
                                 : tma_x_bytes<W>(p.n, jb.n_in));
    route_e = std::max(route_e, jb.E);
  }
  p.route_off = int((xb + 15) / 16 * 16), p.route_e = route_e;
  const size_t smem = tma_smem_bytes<K>(p.route_off + RouteSmem::bytes(route_e));
  if (smem > smem_optin()) return false;
  launch_pdl(k_gemv_chain<S, W, K>, dim3(unsigned(sm_count())), (K::kCw + 1) * 32, smem, stream_of(x), p);
  return true;
}

}  // namespace q3vl::dev::cuda::wgemv
