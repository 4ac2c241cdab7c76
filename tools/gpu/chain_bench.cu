// Micro-benchmark of one stream's decode chain of 8-bit GEMVs, for issue 32's question: can a decode step stream its
// weights closer to HBM's bandwidth if the small matrices of the next layer are prefetched into L2 while the big ones
// before them stream? (The twenty-ninth session found the norm kernels between the GEMVs hidden already: what is
// left is each GEMV's ramp and tail, qkv 25 MB, o_proj 17 MB and down_proj 50 MB streaming at 1.1-1.9 TB/s on an
// H100 against ~3 TB/s for gate_up.)
// L layers of the 8B's fp8 linears, one row of bf16 x, through wgemv::gemv as dev_decoder_infer's decode folds call
// them: qkv (4096 -> 6144) reads x through its RMSNorm, o_proj (4096 -> 4096, its input the first 4096 of qkv's
// output: attention is left out) adds to x, gate_up (4096 -> 24576, the TMA-fed GEMV) reads x through its norm, and
// down_proj (12288 -> 4096) reads the SwiGLU of gate_up's output (written to scratch first, as the 8B's is) and adds
// to x. Each layer has its own weights (L x 193 MB, far past L2). The L layers are one CUDA graph (launched
// programmatically dependent, as decode steps are), which first resets x, replayed `reps` times; reported: the
// median microseconds a layer and the weight bandwidth (W bytes a layer / time).
// Modes: "none"; "qkv@o" and "qkv+o@o": after layer l's o_proj a side branch of the graph prefetches layer l+1's qkv
// (and o_proj) into L2 (cp.async.bulk.prefetch.L2, 16 KiB a thread), joined before layer l+1's qkv, so that the
// prefetch runs under gate_up and down_proj; "qkv@gu" and "qkv+o@gu": the same after gate_up (under down_proj only).
// A prefetch is a hint: every mode's x after one pass must equal "none"'s bit for bit (else FAIL, exit 1).
// "chain": each layer's four products as one persistent kernel (gemv_chain.cuh: one TMA ring streaming them back to
// back, grid barriers between them); "chain xL": all L layers' 4 L products as one; "qkv, chain o+gu+down": qkv
// by its own kernel, the other three as one (a decode layer, whose attention sits between qkv and o_proj). Their
// tiles add as the TMA GEMV's, so under Q3VL_GEMV_TMA=1 their x equals none's bit for bit (H100, call 4); by default
// none runs qkv, o_proj and down_proj on the register ring, whose other summation order moves x by up to ~2% over 16
// random layers, so their x is compared to none's within 2% of its largest element (printed: the largest difference
// relative to it).
// "chain xL stamped": "chain xL" with gemv_chain.cuh's stamps on (their cost shows in its time), then one replay's
// stamps of the first chain (16 layers) as a table by kind of product: where a layer's time goes between the grid
// barriers, the tails and the ring (consumers starved of weights, or the producer blocked by a full ring).
// Modes 9-11 give each layer its attention (400 keys, the 8B's heads): 9 the link, layers chained, 10 the same
// stamped (with the attention units' phases), 11 the attention's two ops and a chain of o_proj, gate_up, down_proj and
// the next qkv. Every chain pairs gate_up's rows so that its tiles write the SwiGLU that down_proj reads (ChainJob's
// half); modes 12 and 13 are 6 and 9 without that (down_proj's staging computes the SwiGLU in each block), the A/B.
// Modes 14-19 run the chain kernel with other TmaKnobs flags than the product's (TmaChain: kTmaAcc2, kTmaScales and
// kTmaRed2): 14 none of them, 15 kTmaAcc2 alone, 16 kTmaScales alone, 17 kTmaRed2 alone (each as mode 6), 18 none as
// mode 9, 19 none as mode 8 (stamped): the A/B of each flag.
// Build and run (from the repo root, on a GPU machine):
//   make FFMPEG=0 bin/chain_bench && bin/chain_bench [layers] [reps] [modes]
// (defaults 16, 50 and "0,5,6,7": modes by number, 0 none ... 7 qkv and a chain). The chain's producer once also
// asked L2 for stages past its ring ("ahead"): 30-35 us a layer slower on an H100
// (docs/perf/2026-12-06-thirtieth/call4), so it was dropped.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "q3vl/core/dtype.hpp"
#include "q3vl/tensor/dev.hpp"
#include "tensor/cuda/common.cuh"
#include "tensor/cuda/gemv_chain.cuh"
#include "timing.cuh"

using namespace q3vl;
using bf16 = __nv_bfloat16;
using fp8 = __nv_fp8_e4m3;
namespace wg = dev::cuda::wgemv;

namespace {

constexpr int64_t kH = 4096, kQkv = 6144, kI = 12288;
// Modes 9-11's attention: the 8B's heads, one segment of kCtx keys (one new) in pools of a captured graph's
// capacity kCap, blocks of kBlock rows.
constexpr int64_t kNh = 32, kNkv = 8, kHd = 128, kCtx = 400, kCap = 4096, kBlock = 16;
constexpr int64_t kChunk = 16 << 10;  // bytes a prefetching thread asks for

__device__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}
// n fp8 weights uniform in [-1.7, 1.7] (variance ~1; no NaN codes).
__global__ void k_init_w(fp8* w, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    w[i] = fp8(float(int(hash32(uint64_t(i), seed) % 2001u) - 1000) * (1.7f / 1000.f));
}
template <class T>
__global__ void k_fill(T* p, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = T(v);
}
__global__ void k_init_x(bf16* x, int64_t n, uint32_t seed = 7u) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = bf16(float(int(hash32(uint64_t(i), seed) % 2001u) - 1000) * 1e-3f);
}
__global__ void k_prefetch(const char* p, int64_t bytes) {
  for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c * kChunk < bytes;
       c += int64_t(gridDim.x) * blockDim.x)
    dev::cuda::l2_prefetch(p + c * kChunk, uint32_t(min(kChunk, bytes - c * kChunk)));
}

struct Mat {
  fp8* w = nullptr;
  float* s = nullptr;
  int64_t n_in = 0, n_out = 0;
  int64_t bytes() const { return n_in * n_out; }
};
struct Layer {
  Mat qkv, o, gu, down;
  bf16 *kp = nullptr, *vp = nullptr;  // modes 9-11: the layer's pools [kCap, kNkv, kHd]
};

Mat make_mat(cudaStream_t st, int64_t n_in, int64_t n_out, uint32_t seed) {
  Mat m{nullptr, nullptr, n_in, n_out};
  Q3VL_CU(cudaMalloc(&m.w, size_t(n_in * n_out)));
  Q3VL_CU(cudaMalloc(&m.s, sizeof(float) * size_t(n_out)));
  k_init_w<<<1024, 256, 0, st>>>(m.w, n_in * n_out, seed);
  k_fill<<<64, 256, 0, st>>>(m.s, n_out, 1.f / std::sqrt(float(n_in)));
  Q3VL_LAUNCHED();
  return m;
}

struct Bufs {
  bf16 *x0, *x, *qkv, *gu, *ln, *act, *norm;
  uint32_t* bar;               // 2 + kAttnCounters words
  unsigned long long* stamps;  // modes 8 and 10 (gemv_chain.cuh's ChainStamp)
  // Modes 9-11: the attention's arguments (one segment, one new row at position kCtx - 1), its q scratch and output.
  int32_t *slots, *cu, *ctx, *table;
  float *cos, *sin;
  bf16 *wn, *q, *att;
};
// The modes whose layers have their attention, those whose down_proj stages the SwiGLU (gate_up not paired), those
// stamped, and the chain kernel's TmaKnobs flags by mode (-1: TmaChain's, the product's).
bool with_attn(int mode) { return (mode >= 9 && mode <= 11) || mode == 13 || mode == 18; }
bool staged_swiglu(int mode) { return mode == 12 || mode == 13; }
bool stamped(int mode) { return mode == 8 || mode == 10 || mode == 19; }
int chain_flags(int mode) {
  switch (mode) {
    case 14: case 18: case 19: return 0;
    case 15: return wg::kTmaAcc2;
    case 16: return wg::kTmaScales;
    case 17: return wg::kTmaRed2;
    default: return -1;
  }
}
template <int FL> using Knobs = wg::TmaKnobs<8, 8, 10, FL>;
// The chain p with the kernel of mode's flags.
void run_chain(const dev::Exec& ex, wg::ChainParams<bf16>& p, int mode) {
  bool ok = false;
  switch (chain_flags(mode)) {
    case 0: ok = wg::gemv_chain<bf16, fp8, Knobs<0>>(ex, p); break;
    case wg::kTmaAcc2: ok = wg::gemv_chain<bf16, fp8, Knobs<wg::kTmaAcc2>>(ex, p); break;
    case wg::kTmaScales: ok = wg::gemv_chain<bf16, fp8, Knobs<wg::kTmaScales>>(ex, p); break;
    case wg::kTmaRed2: ok = wg::gemv_chain<bf16, fp8, Knobs<wg::kTmaRed2>>(ex, p); break;
    default: ok = wg::gemv_chain<bf16, fp8>(ex, p);
  }
  Q3VL_CHECK(ok, "chain_bench: the chain kernel did not take the chain");
}
dev::ChainAttn chain_attn(const Layer& y, const Bufs& b) {
  return {b.wn, b.wn, b.cos, b.sin, y.kp, y.vp, b.slots, b.cu, b.ctx, b.table, kCap / kBlock, kBlock, 1, 1, kCap, kCtx,
          kNh, kNkv, kHd, 1e-6, float(1 / std::sqrt(double(kHd))), b.q};
}

void gemv(const dev::Exec& ex, const bf16* in, const Mat& m, bf16* y, const dev::RowsIn& ri, bool add) {
  wg::gemv<bf16, fp8>(ex, in, m.w, m.s, nullptr, y, 1, m.n_in, m.n_out, nullptr, 0, 0, ri, add);
}

// The graph of L layers in mode `mode` (0 none; 1/2 qkv, qkv+o after o_proj; 3/4 after gate_up).
cudaGraph_t record(const dev::Exec& ex, cudaStream_t side, const std::vector<Layer>& L, const Bufs& b, int mode,
                   std::vector<cudaEvent_t>& ev) {
  cudaStream_t st = dev::cuda::stream_of(ex);
  Q3VL_CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  Q3VL_CU(cudaMemcpyAsync(b.x, b.x0, sizeof(bf16) * kH, cudaMemcpyDeviceToDevice, st));
  const dev::RowsIn norm{nullptr, 1, false, b.ln, b.norm, 1e-6f}, swiglu{nullptr, 1, true, b.act};
  const auto fork = [&](size_t l) {  // layer l + 1's qkv (and o_proj) into L2 on the side branch
    if (mode == 0 || l + 1 >= L.size()) return;
    Q3VL_CU(cudaEventRecord(ev[2 * l], st));
    Q3VL_CU(cudaStreamWaitEvent(side, ev[2 * l], 0));
    k_prefetch<<<64, 256, 0, side>>>(reinterpret_cast<const char*>(L[l + 1].qkv.w), L[l + 1].qkv.bytes());
    if (mode == 2 || mode == 4)
      k_prefetch<<<64, 256, 0, side>>>(reinterpret_cast<const char*>(L[l + 1].o.w), L[l + 1].o.bytes());
    Q3VL_LAUNCHED();
    Q3VL_CU(cudaEventRecord(ev[2 * l + 1], side));
  };
  const bool attn = with_attn(mode);
  // gate_up and down_proj: gate_up's tiles write the SwiGLU into act (a SwiGLU pair), or (modes 12, 13) gate_up's
  // rows into gu, whose SwiGLU down_proj's staging computes
  const auto mlp = [&](wg::ChainParams<bf16>& p, const Layer& y) {
    const wg::XRows xn{nullptr, 1, false, b.norm, 1e-6f}, xs{nullptr, 1, true};
    const bool pair = !staged_swiglu(mode);
    bf16* h = pair ? b.act : b.gu;
    return wg::chain_job(p.job[p.count++], b.x, y.gu.w, y.gu.s, h, 1, kH, 2 * kI, xn, false, pair) &&
           wg::chain_job(p.job[p.count++], h, y.down.w, y.down.s, b.x, 1, kI, kH, pair ? wg::XRows{} : xs, true);
  };
  if (attn) {  // decode layers with their attention
    wg::ChainParams<bf16> p{};
    p.n = 1, p.bar = b.bar, p.stamps = stamped(mode) ? b.stamps : nullptr;
    const wg::XRows xn{nullptr, 1, false, b.norm, 1e-6f};
    bool ok = true;
    const auto flush = [&] {
      if (p.count) run_chain(ex, p, mode);
      p.count = 0, p.stamps = nullptr;  // mode 10 stamps the first chain (12 layers)
    };
    for (size_t l = 0; l < L.size(); ++l) {
      const Layer& y = L[l];
      const dev::ChainAttn at = chain_attn(y, b);
      if (l == 0 || mode != 11)
        ok = ok && wg::chain_job(p.job[p.count++], b.x, y.qkv.w, y.qkv.s, b.qkv, 1, kH, kQkv, xn, false);
      if (mode == 11) {  // the attention's two ops, then o, gate_up, down and the next qkv as one chain
        flush();
        dev::qkv_to_cache_fwd(ex, b.qkv, b.wn, b.wn, b.q, y.kp, y.vp, b.slots, nullptr, nullptr, b.cos, b.sin, 1, kNh,
                              kNkv, kHd, at.eps, DType::BF16);
        dev::paged_attention_fwd(ex, b.q, y.kp, y.vp, b.att, b.cu, b.ctx, b.table, at.max_blocks, kBlock, 1, 1, kCap,
                                 kCtx, 1, kNh, kNkv, kHd, at.scale, DType::BF16);
      } else {
        ok = ok && wg::chain_attn_job(ex, p.job[p.count++], at, b.qkv, b.att, 1);
      }
      ok = ok && wg::chain_job(p.job[p.count++], b.att, y.o.w, y.o.s, b.x, 1, kH, kH, {}, true);
      ok = ok && mlp(p, y);
      if (mode == 11 && l + 1 < L.size())
        ok = ok && wg::chain_job(p.job[p.count++], b.x, L[l + 1].qkv.w, L[l + 1].qkv.s, b.qkv, 1, kH, kQkv, xn, false);
      Q3VL_CHECK(ok, "chain_bench: a link the chain does not take");
      if (mode == 11 || l + 1 == L.size() || p.count + 5 > wg::kChainMax) flush();
    }
  } else if (mode >= 5) {  // the persistent chain: a kernel a layer (5), one for all (6, 8 stamped), qkv apart (7)
    wg::ChainParams<bf16> p{};
    p.n = 1, p.bar = b.bar, p.stamps = stamped(mode) ? b.stamps : nullptr;
    const wg::XRows xn{nullptr, 1, false, b.norm, 1e-6f};
    for (size_t l = 0; l < L.size(); ++l) {
      const Layer& y = L[l];
      bool ok = true;
      if (mode == 7) gemv(ex, b.x, y.qkv, b.qkv, norm, false);
      else ok = wg::chain_job(p.job[p.count++], b.x, y.qkv.w, y.qkv.s, b.qkv, 1, kH, kQkv, xn, false);
      ok = ok && wg::chain_job(p.job[p.count++], b.qkv, y.o.w, y.o.s, b.x, 1, kH, kH, {}, true);
      ok = ok && mlp(p, y);
      Q3VL_CHECK(ok, "chain_bench: a product the chain does not take");
      if (mode == 5 || mode == 7 || l + 1 == L.size() || p.count + 4 > wg::kChainMax) {
        run_chain(ex, p, mode);
        p.count = 0, p.stamps = nullptr;  // modes 8 and 19 stamp the first chain (16 layers)
      }
    }
  }
  for (size_t l = 0; mode < 5 && l < L.size(); ++l) {  // a kernel a product
    if (mode != 0 && l > 0) Q3VL_CU(cudaStreamWaitEvent(st, ev[2 * (l - 1) + 1], 0));
    gemv(ex, b.x, L[l].qkv, b.qkv, norm, false);
    gemv(ex, b.qkv, L[l].o, b.x, {}, true);
    if (mode == 1 || mode == 2) fork(l);
    gemv(ex, b.x, L[l].gu, b.gu, norm, false);
    if (mode == 3 || mode == 4) fork(l);
    gemv(ex, b.gu, L[l].down, b.x, swiglu, true);
  }
  cudaGraph_t g;
  Q3VL_CU(cudaStreamEndCapture(st, &g));
  return g;
}

// Mode 8's stamps of one replay (a chain of every layer's four products: links j = 4 l + {qkv, o, gate_up, down}),
// a row a kind of product over layers 1 .. L-1: its time (the last block's end after the previous link's last end),
// the weight bandwidth in it, the barrier (the first block's start after the previous link's last end), the start's
// skew over the blocks, the tail (the last block's end after the median's), and the consumers' cycles starved of
// stages and the producer's blocked by a full ring, as shares of the blocks' time in the link.
void print_stamps(const std::vector<unsigned long long>& st, int links, int grid, const std::vector<Layer>& L,
                  bool attn) {
  using W = wg::ChainStamp;
  const int K = attn ? 5 : 4;  // links a layer
  const char* kinds[2][5] = {{"qkv", "o_proj", "gate_up", "down_proj"},
                             {"qkv", "attention", "o_proj", "gate_up", "down_proj"}};
  const char* const* kind = kinds[attn];
  const auto at = [&](int j, int b, int w) {
    return double(st[(size_t(j) * size_t(grid) + size_t(b)) * W::kStampWords + w]);
  };
  std::vector<double> ghz;  // the SM clock, from each block's two clocks over the whole chain
  for (int b = 0; b < grid; ++b)
    ghz.push_back((at(links - 1, b, W::kEndClk) - at(0, b, W::kStartClk)) /
                  std::max(1.0, at(links - 1, b, W::kEndNs) - at(0, b, W::kStartNs)));
  std::sort(ghz.begin(), ghz.end());
  const double clk = ghz[ghz.size() / 2];
  double sum[5][9] = {};
  int cnt[5] = {};
  double ph[4] = {}, nph[4] = {};  // the attention units' phases (us): queries, keys, rows counted, combine
  double prev_end = 0;
  for (int j = 0; j < links; ++j) {
    std::vector<double> ends, starts;
    double full = 0, empty = 0, busy = 0, staged = 0, stores = 0;
    for (int b = 0; b < grid; ++b) {
      ends.push_back(at(j, b, W::kEndNs)), starts.push_back(at(j, b, W::kStartNs));
      full += at(j, b, W::kFullWait), empty += at(j, b, W::kEmptyWait);
      busy += at(j, b, W::kEndClk) - at(j, b, W::kStartClk);
      staged += at(j, b, W::kStagedClk) - at(j, b, W::kStartClk), stores += at(j, b, W::kStoreWait);
      if (attn && j % K == 1 && j >= K && at(j, b, W::kAttnQ) > 0) {
        double prev = at(j, b, W::kStartClk);
        for (int k = 0; k < 4; ++k) {
          const double t = at(j, b, W::kAttnQ + k);
          if (t <= 0) break;
          ph[k] += (t - prev) / (clk * 1e3), nph[k] += 1, prev = t;
        }
      }
    }
    std::sort(ends.begin(), ends.end()), std::sort(starts.begin(), starts.end());
    const double end = ends.back();
    if (j >= K) {
      const Layer& y = L[size_t(j / K)];
      const double kv = double(2 * kCtx * kNkv * kHd * sizeof(bf16));  // the attention's keys and values
      const double qkv = double(y.qkv.bytes()), o = double(y.o.bytes()), gu = double(y.gu.bytes());
      const double by[2][5] = {{qkv, o, gu, double(y.down.bytes())}, {qkv, kv, o, gu, double(y.down.bytes())}};
      const double t = end - prev_end;
      const double v[9] = {t / 1e3,
                           by[attn][j % K] / t / 1e3,
                           (starts.front() - prev_end) / 1e3,
                           (starts.back() - starts.front()) / 1e3,
                           (end - ends[ends.size() / 2]) / 1e3,
                           full / busy,
                           empty / (t * clk * grid),
                           staged / (clk * 1e3 * grid),
                           stores / (clk * 1e3 * grid)};
      for (int k = 0; k < 9; ++k) sum[j % K][k] += v[k];
      ++cnt[j % K];
    }
    prev_end = end;
  }
  std::printf("\n# stamps (mode %d, one replay, SM clock %.2f GHz): means over layers 1..%d of the first chain\n\n| "
              "link | us | TB/s | barrier us | start skew us | tail us | consumers starved | producer blocked | "
              "x staged us | tile ends us |\n|---|---|---|---|---|---|---|---|---|---|\n",
              attn ? 10 : 8, clk, links / K - 1);
  for (int k = 0; k < K; ++k) {
    const double c = std::max(1, cnt[k]);
    std::printf("| %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.0f%% | %.0f%% | %.2f | %.2f |\n", kind[k], sum[k][0] / c,
                sum[k][1] / c, sum[k][2] / c, sum[k][3] / c, sum[k][4] / c, 100 * sum[k][5] / c, 100 * sum[k][6] / c,
                sum[k][7] / c, sum[k][8] / c);
  }
  if (attn)
    std::printf("\nattention units (means over units, us from the link's start): queries and new key %.2f "
                "(%.0f units), then keys %.2f, rows written and counted %.2f (%.0f), combine %.2f (%.0f)\n",
                ph[0] / std::max(1.0, nph[0]), nph[0] / (links / K - 1), ph[1] / std::max(1.0, nph[1]),
                ph[2] / std::max(1.0, nph[2]), nph[2] / (links / K - 1), ph[3] / std::max(1.0, nph[3]),
                nph[3] / (links / K - 1));
}

}  // namespace

int main(int argc, char** argv) {
  const int layers = std::max(2, argc > 1 ? std::atoi(argv[1]) : 16);
  const int reps = std::max(10, argc > 2 ? std::atoi(argv[2]) : 50);
  const char* names[] = {"none",     "qkv@o",    "qkv+o@o", "qkv@gu", "qkv+o@gu", "chain", "chain xL",
                         "qkv, chain o+gu+down", "chain xL stamped", "attn link, layers chained",
                         "attn link, layers chained, stamped", "attn ops, chain o+gu+down+qkv",
                         "chain xL, SwiGLU staged", "attn link, layers chained, SwiGLU staged",
                         "chain xL, flags 0", "chain xL, flag acc2", "chain xL, flag scales", "chain xL, flag red2",
                         "attn link, layers chained, flags 0", "chain xL stamped, flags 0"};
  // The modes run (argv[3], default 0,5,6,7): 0 always first, the reference.
  std::vector<int> runs{0};
  for (const char* c = argc > 3 ? argv[3] : "0,5,6,7"; *c;) {
    const int m = std::atoi(c);
    if (m > 0 && m < 20) runs.push_back(m);
    while (*c && *c != ',') ++c;
    if (*c) ++c;
  }
  bool bad = false;
  try {
    dev::Exec ex = dev::cuda::make_exec(size_t(64) << 20, 0);
    cudaStream_t st = dev::cuda::stream_of(ex), side;
    Q3VL_CU(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaDeviceProp prop{};
    Q3VL_CU(cudaGetDeviceProperties(&prop, 0));
    std::vector<Layer> L(static_cast<size_t>(layers));
    for (size_t l = 0; l < L.size(); ++l) {
      const uint32_t s = uint32_t(10 * l);
      L[l] = {make_mat(st, kH, kQkv, s + 1), make_mat(st, kH, kH, s + 2), make_mat(st, kH, 2 * kI, s + 3),
              make_mat(st, kI, kH, s + 4)};
    }
    Bufs b{};
    for (auto [p, n] : {std::pair<bf16**, int64_t>{&b.x0, kH}, {&b.x, kH}, {&b.qkv, kQkv}, {&b.gu, 2 * kI},
                        {&b.ln, kH}, {&b.act, kI}, {&b.norm, kH}})
      Q3VL_CU(cudaMalloc(p, sizeof(bf16) * size_t(n)));
    const size_t bar_words = 2 + wg::kAttnCounters;
    Q3VL_CU(cudaMalloc(&b.bar, bar_words * sizeof(uint32_t)));
    const int grid = dev::cuda::sm_count();
    const size_t stamp_words = size_t(wg::kChainMax) * size_t(grid) * wg::ChainStamp::kStampWords;
    Q3VL_CU(cudaMalloc(&b.stamps, sizeof(unsigned long long) * stamp_words));
    Q3VL_CU(cudaMemsetAsync(b.bar, 0, bar_words * sizeof(uint32_t), st));
    // Modes 9-11: each layer's pools (random keys and values in the first kCtx rows), the segment's tables.
    const size_t pool = size_t(kCap * kNkv * kHd);
    for (size_t l = 0; l < L.size(); ++l)
      for (bf16** p : {&L[l].kp, &L[l].vp}) {
        Q3VL_CU(cudaMalloc(p, sizeof(bf16) * pool));
        k_init_x<<<256, 256, 0, st>>>(*p, pool, uint32_t(100 + 2 * l + (p == &L[l].vp)));
      }
    for (auto [p, n] : {std::pair<int32_t**, int64_t>{&b.slots, 1}, {&b.cu, 2}, {&b.ctx, 1}, {&b.table, kCap / kBlock}})
      Q3VL_CU(cudaMalloc(p, sizeof(int32_t) * size_t(n)));
    std::vector<int32_t> table(static_cast<size_t>(kCap / kBlock));
    for (size_t i = 0; i < table.size(); ++i) table[i] = int32_t(i);
    const int32_t slot = int32_t(kCtx - 1), cu[2] = {0, 1}, ctx = int32_t(kCtx);
    Q3VL_CU(cudaMemcpy(b.slots, &slot, sizeof(slot), cudaMemcpyHostToDevice));
    Q3VL_CU(cudaMemcpy(b.cu, cu, sizeof(cu), cudaMemcpyHostToDevice));
    Q3VL_CU(cudaMemcpy(b.ctx, &ctx, sizeof(ctx), cudaMemcpyHostToDevice));
    Q3VL_CU(cudaMemcpy(b.table, table.data(), sizeof(int32_t) * table.size(), cudaMemcpyHostToDevice));
    for (auto [p, n] : {std::pair<float**, int64_t>{&b.cos, kHd / 2}, {&b.sin, kHd / 2}})
      Q3VL_CU(cudaMalloc(p, sizeof(float) * size_t(n)));
    for (auto [p, n] : {std::pair<bf16**, int64_t>{&b.wn, kHd}, {&b.q, kNh * kHd}, {&b.att, kNh * kHd}})
      Q3VL_CU(cudaMalloc(p, sizeof(bf16) * size_t(n)));
    k_fill<<<1, 64, 0, st>>>(b.cos, kHd / 2, 0.8f);
    k_fill<<<1, 64, 0, st>>>(b.sin, kHd / 2, 0.6f);
    k_fill<<<1, 128, 0, st>>>(b.wn, kHd, 1.f);
    k_init_x<<<16, 256, 0, st>>>(b.x0, kH);
    k_fill<<<16, 256, 0, st>>>(b.norm, kH, 1.f);
    Q3VL_LAUNCHED();
    Q3VL_CU(cudaStreamSynchronize(st));
    const double wbytes = double(L[0].qkv.bytes() + L[0].o.bytes() + L[0].gu.bytes() + L[0].down.bytes());
    std::printf("# chain_bench on %s (L2 %d MB): %d layers of the 8B's fp8 linears (%.1f MB a layer), one row, "
                "median of %d graph replays\n\n| mode | us a layer | TB/s | x equal to none's |\n|---|---|---|---|\n",
                prop.name, prop.l2CacheSize >> 20, layers, wbytes / 1e6, reps);
    std::vector<cudaEvent_t> ev(static_cast<size_t>(2 * layers));
    for (auto& e : ev) Q3VL_CU(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::vector<uint16_t> ref(static_cast<size_t>(kH)), got(static_cast<size_t>(kH)), ref_attn;
    bool have_attn_ref = false;
    for (int mode : runs) {
      cudaGraph_t g = record(ex, side, L, b, mode, ev);
      cudaGraphExec_t ge;
      Q3VL_CU(cudaGraphInstantiate(&ge, g, 0));
      Q3VL_CU(cudaGraphLaunch(ge, st));
      Q3VL_CU(cudaMemcpyAsync(got.data(), b.x, sizeof(bf16) * kH, cudaMemcpyDeviceToHost, st));
      Q3VL_CU(cudaStreamSynchronize(st));
      if (mode == 0) ref = got;
      const bool attn = with_attn(mode);
      if (attn && !have_attn_ref) ref_attn = got, have_attn_ref = true;  // the first of those run
      const std::vector<uint16_t>& want = attn ? ref_attn : ref;
      const bool same = std::memcmp(want.data(), got.data(), sizeof(uint16_t) * size_t(kH)) == 0;
      double dmax = 0, xmax = 0;
      for (int64_t i = 0; i < kH; ++i) {
        const double r = bf16_to_f32(want[size_t(i)]), d = std::fabs(double(bf16_to_f32(got[size_t(i)])) - r);
        xmax = std::max(xmax, std::fabs(r));
        dmax = std::isnan(d) ? INFINITY : std::max(dmax, d);
      }
      const double rel = dmax / std::max(xmax, 1e-30);
      const bool ok = mode >= 5 ? rel <= 2e-2 : same;
      bad |= !ok;
      const gpu_bench::Timing t =
          gpu_bench::time_median(st, reps, 3, [&](int) { Q3VL_CU(cudaGraphLaunch(ge, st)); });
      const double us = t.us / layers;
      std::printf("| %s | %.1f%s | %.2f | %s |\n", names[mode], us, t.host_bound ? " (host-bound)" : "",
                  wbytes / (us * 1e-6) / 1e12, same ? "yes" : !ok ? "FAIL" : "");
      if (mode >= 5) std::printf("|   (largest difference / largest |x|: %.2e) | | | |\n", rel);
      if (stamped(mode)) {  // one more replay, its stamps
        std::vector<unsigned long long> h(stamp_words);
        Q3VL_CU(cudaMemsetAsync(b.stamps, 0, sizeof(unsigned long long) * stamp_words, st));
        Q3VL_CU(cudaGraphLaunch(ge, st));
        Q3VL_CU(cudaMemcpyAsync(h.data(), b.stamps, sizeof(unsigned long long) * stamp_words, cudaMemcpyDeviceToHost,
                                st));
        Q3VL_CU(cudaStreamSynchronize(st));
        const int per = mode == 10 ? 5 : 4, first = std::min(layers, wg::kChainMax / per);
        print_stamps(h, per * first, grid, L, mode == 10);
      }
      Q3VL_CU(cudaGraphExecDestroy(ge));
      Q3VL_CU(cudaGraphDestroy(g));
    }
    for (auto& e : ev) Q3VL_CU(cudaEventDestroy(e));
    for (bf16* p : {b.x0, b.x, b.qkv, b.gu, b.ln, b.act, b.norm}) Q3VL_CU(cudaFree(p));
    Q3VL_CU(cudaFree(b.bar));
    Q3VL_CU(cudaFree(b.stamps));
    for (int32_t* p : {b.slots, b.cu, b.ctx, b.table}) Q3VL_CU(cudaFree(p));
    for (float* p : {b.cos, b.sin}) Q3VL_CU(cudaFree(p));
    for (bf16* p : {b.wn, b.q, b.att}) Q3VL_CU(cudaFree(p));
    for (Layer& l : L) {
      for (Mat* m : {&l.qkv, &l.o, &l.gu, &l.down}) {
        Q3VL_CU(cudaFree(m->w));
        Q3VL_CU(cudaFree(m->s));
      }
      for (bf16* p : {l.kp, l.vp}) Q3VL_CU(cudaFree(p));
    }
    Q3VL_CU(cudaStreamDestroy(side));
    dev::cuda::destroy_exec(ex);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "chain_bench: %s\n", e.what());
    return 2;
  }
  return bad ? 1 : 0;
}
