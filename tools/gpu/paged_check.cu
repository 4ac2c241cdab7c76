// GPU check and A/B timing of paged attention (src/tensor/cuda/paged_attention.cu): the tensor-core path ("new")
// and the SIMT kernel ("old", paged_attention_path with tc false) against a naive fp64 host reference, on random
// pools with shuffled block tables (entries past a segment's blocks name other blocks), ragged contexts and chunks of odd sizes;
// then times old and new at the 8B's serving shapes (32 query heads, 8 kv heads, hd 128, block 16).
// Build and run (from the repo root, CUDA build): make bin/paged_check && bin/paged_check [--no-timing]
// Exit 1 on any failed check (NaN included, or the new path not taken where it should be).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {
bool paged_attention_path(const Exec& x, bool tc, const void* q, const void* k_pool, const void* v_pool, void* out,
                          const int32_t* cu, const int32_t* ctx, const int32_t* table, int64_t max_blocks,
                          int64_t block, int64_t nseg, int64_t max_q, int64_t max_ctx, int64_t N, int64_t nh,
                          int64_t nkv, int64_t hd, float scale, DType dt);
}

using namespace q3vl;
using q3vl::dev::Exec;

#define CK(call)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(2);                                                                               \
    }                                                                                             \
  } while (0)

namespace {

using Segs = std::vector<std::pair<int, int>>;  // (new rows, context) per segment

// Segment s's blocks are a shuffled subset of a pool with `spare` blocks more; table entries past a segment's
// blocks name spare blocks, so reading past the context reads random rows, not zeros. cap > 0: table rows of cap
// tokens and max_ctx = cap, as a decode step captured as a CUDA graph passes them (the contexts only on the device).
struct Layout {
  std::vector<int32_t> cu{0}, ctx, table;
  int N = 0, max_blocks = 0, pool_rows = 0, max_q = 0, max_ctx = 0;
};
Layout layout(const Segs& segs, int block, int spare, std::mt19937& rng, int cap = 0) {
  Layout L;
  int used = 0;
  for (auto [n, c] : segs) {
    const int nb = (c + block - 1) / block;
    used += nb;
    L.max_blocks = std::max(L.max_blocks, nb + 2);
    L.N += n;
    L.cu.push_back(L.N);
    L.ctx.push_back(c);
    L.max_q = std::max(L.max_q, n);
    L.max_ctx = std::max(L.max_ctx, c);
  }
  if (cap > 0) L.max_blocks = std::max(L.max_blocks, (cap + block - 1) / block), L.max_ctx = L.max_blocks * block;
  std::vector<int> ids(used + spare);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  int next = 0;
  for (auto [n, c] : segs) {
    const int nb = (c + block - 1) / block;
    for (int j = 0; j < L.max_blocks; ++j) L.table.push_back(j < nb ? ids[next++] : ids[used + j % spare]);
  }
  L.pool_rows = (used + spare) * block;
  return L;
}

// fp64 reference, rows in parallel: row cu[s]+i (position ctx - n + i) against keys [0, p] through the table.
std::vector<double> reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                              const Layout& L, int block, int nh, int nkv, int hd, double scale) {
  std::vector<double> out(size_t(L.N) * nh * hd);
  const int G = nh / nkv;
  std::atomic<int> next{0};
  auto work = [&] {
    std::vector<double> s;
    for (int row; (row = next++) < L.N;) {
      const int g = int(std::upper_bound(L.cu.begin(), L.cu.end(), row) - L.cu.begin()) - 1;
      const int n = L.cu[g + 1] - L.cu[g], p = L.ctx[g] - n + (row - L.cu[g]);
      s.assign(p + 1, 0.0);
      for (int h = 0; h < nh; ++h) {
        const float* qr = &q[(size_t(row) * nh + h) * hd];
        auto prow = [&](int j) { return int64_t(L.table[size_t(g) * L.max_blocks + j / block]) * block + j % block; };
        double mx = -INFINITY;
        for (int j = 0; j <= p; ++j) {
          const float* kr = &k[(prow(j) * nkv + h / G) * hd];
          double d = 0;
          for (int e = 0; e < hd; ++e) d += double(qr[e]) * kr[e];
          mx = std::max(mx, s[j] = d * scale);
        }
        double sum = 0;
        for (int j = 0; j <= p; ++j) sum += (s[j] = std::exp(s[j] - mx));
        double* o = &out[(size_t(row) * nh + h) * hd];
        for (int j = 0; j <= p; ++j) {
          const float* vr = &v[(prow(j) * nkv + h / G) * hd];
          for (int e = 0; e < hd; ++e) o[e] += s[j] / sum * vr[e];
        }
      }
    }
  };
  std::vector<std::thread> th;
  for (unsigned t = 0; t < std::max(1u, std::thread::hardware_concurrency()); ++t) th.emplace_back(work);
  for (auto& t : th) t.join();
  return out;
}

// Values on a 1/16 grid within [-8, 8): exact in bf16, fp16 and fp32, so every dtype sees the same inputs.
std::vector<float> grid_values(size_t n, double sigma, std::mt19937& rng) {
  std::normal_distribution<double> nd(0.0, sigma);
  std::vector<float> x(n);
  for (auto& e : x) e = float(std::clamp(std::round(nd(rng) * 16.0) / 16.0, -8.0, 127.0 / 16.0));
  return x;
}
std::vector<uint8_t> to_dt(const std::vector<float>& x, DType dt) {
  std::vector<uint8_t> b(x.size() * dtype_size(dt));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dt == DType::F32) std::memcpy(&b[i * 4], &x[i], 4);
    else {
      const uint16_t h = dt == DType::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
      std::memcpy(&b[i * 2], &h, 2);
    }
  }
  return b;
}
std::vector<float> from_dt(const std::vector<uint8_t>& b, DType dt) {
  std::vector<float> x(b.size() / dtype_size(dt));
  for (size_t i = 0; i < x.size(); ++i) {
    if (dt == DType::F32) std::memcpy(&x[i], &b[i * 4], 4);
    else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      x[i] = dt == DType::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
    }
  }
  return x;
}
template <class T> T* upload(const T* p, size_t bytes) {
  void* d;
  CK(cudaMalloc(&d, std::max<size_t>(bytes, 16)));
  CK(cudaMemcpy(d, p, bytes, cudaMemcpyHostToDevice));
  return static_cast<T*>(d);
}

// max|got - ref| / max|ref|; a non-finite value is an infinite error.
double nerr(const std::vector<float>& got, const std::vector<double>& ref) {
  double e = 0, m = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    e = std::max(e, std::fabs(got[i] - ref[i]));
    m = std::max(m, std::fabs(ref[i]));
  }
  return m > 0 ? e / m : e;
}

// One layout and head shape: old and new against the reference for each dtype; returns the failures.
int check(Exec& x, const char* name, const Segs& segs, int block, int nh, int nkv, int hd,
          std::vector<DType> dts = {DType::BF16, DType::F16}, int cap = 0) {
  std::mt19937 rng(1234 + block * 7 + nh * 3 + hd);
  const Layout L = layout(segs, block, 5, rng, cap);
  const double scale = 1.0 / std::sqrt(double(hd));
  const size_t nq = size_t(L.N) * nh * hd, nk = size_t(L.pool_rows) * nkv * hd;
  const auto q = grid_values(nq, 1.5, rng), k = grid_values(nk, 1.0, rng), v = grid_values(nk, 1.0, rng);
  const auto ref = reference(q, k, v, L, block, nh, nkv, hd, scale);
  int32_t *cu = upload(L.cu.data(), L.cu.size() * 4), *ctx = upload(L.ctx.data(), L.ctx.size() * 4),
          *tab = upload(L.table.data(), L.table.size() * 4);
  int fails = 0;
  for (DType dt : dts) {
    const size_t es = dtype_size(dt);
    const auto qb = to_dt(q, dt), kb = to_dt(k, dt), vb = to_dt(v, dt);
    uint8_t *Q = upload(qb.data(), qb.size()), *K = upload(kb.data(), kb.size()), *V = upload(vb.data(), vb.size());
    uint8_t* O;
    CK(cudaMalloc(&O, nq * es));
    const bool want_tc = dt != DType::F32 && (hd == 64 || hd == 128);
    for (bool tc : {false, true}) {
      if (tc && dt == DType::F32) continue;
      CK(cudaMemset(O, 0xff, nq * es));  // NaN in every dtype: a row left unwritten fails
      const bool took = dev::cuda::paged_attention_path(x, tc, Q, K, V, O, cu, ctx, tab, L.max_blocks, block,
                                                         int64_t(segs.size()), L.max_q, L.max_ctx, L.N, nh, nkv, hd,
                                                         float(scale), dt);
      CK(cudaStreamSynchronize(dev::cuda::stream_of(x)));
      CK(cudaGetLastError());
      std::vector<uint8_t> ob(nq * es);
      CK(cudaMemcpy(ob.data(), O, ob.size(), cudaMemcpyDeviceToHost));
      const double e = nerr(from_dt(ob, dt), ref);
      const double tol = dt == DType::F32 ? 2e-4 : dt == DType::F16 ? 1e-2 : 3e-2;
      const bool ok = e < tol && took == (tc && want_tc);
      fails += !ok;
      std::printf("%-34s b%-3d %2d/%d hd%-3d %-4s %s: err %.2e  %s\n", name, block, nh, nkv, hd, dtype_name(dt),
                  tc ? "new" : "old", e, ok ? "PASS" : "FAIL");
      std::fflush(stdout);
    }
    for (void* p : {(void*)Q, (void*)K, (void*)V, (void*)O}) CK(cudaFree(p));
  }
  for (void* p : {(void*)cu, (void*)ctx, (void*)tab}) CK(cudaFree(p));
  return fails;
}

int run_checks(Exec& x) {
  int f = 0;
  const Segs mixed{{1, 1}, {1, 700}, {37, 37}, {64, 264}, {130, 1000}, {333, 333}, {5, 77}};
  const Segs decode{{1, 650}, {1, 1}, {1, 4096}, {1, 17}, {1, 100}, {1, 129}};
  for (int block : {16, 7}) {
    f += check(x, "mixed (prefill tiles)", mixed, block, 32, 8, 128);
    f += check(x, "decode (split keys)", decode, block, 32, 8, 128);
  }
  f += check(x, "mixed fp32 (SIMT)", mixed, 16, 32, 8, 128, {DType::F32});
  f += check(x, "mixed G=1", {{1, 300}, {77, 77}, {200, 1000}, {1, 2}}, 16, 8, 8, 64);
  f += check(x, "decode G=1", {{1, 3000}, {1, 5}, {1, 64}}, 16, 4, 4, 64);
  f += check(x, "mixed G=4 hd64", mixed, 32, 16, 4, 64);
  f += check(x, "few rows, one tile (split keys)", {{5, 900}, {3, 3}, {1, 400}}, 16, 32, 8, 128);
  f += check(x, "spec rows G=1 (decode tile)", {{3, 500}, {16, 16}, {1, 9}}, 16, 4, 4, 128);
  f += check(x, "chunks of 512 on ctx 512..1024", {{512, 512}, {512, 683}, {512, 853}, {512, 1024}}, 16, 32, 8, 128,
             {DType::BF16});
  f += check(x, "hd 72 (SIMT both)", {{1, 300}, {40, 90}}, 16, 8, 2, 72, {DType::BF16});
  f += check(x, "decode, max_ctx = capacity 8192", decode, 16, 32, 8, 128, {DType::BF16, DType::F16}, 8192);
  f += check(x, "few rows, capacity 8192", {{5, 900}, {3, 3}, {1, 400}}, 16, 32, 8, 128, {DType::BF16}, 8192);
  return f;
}

__global__ void fill_random(void* p, size_t n, uint32_t seed, bool bf) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
    const float f = (float(h) * (1.f / 4294967296.f) * 2.f - 1.f) * 2.f;
    if (bf) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(f);
    else static_cast<__half*>(p)[i] = __float2half(f);
  }
}

struct Timing {
  std::string name;
  double us_old, us_new, amount;  // amount: GB (decode) or GFLOP (prefill) a call
  bool flops;
};

// Old and new on one layout (bf16, 32/8 heads, hd 128, block 16). The pool is replicated `layers` times (one copy
// a call, round robin) so that a decode step's KV is not served from L2, as across a model's layers.
Timing time_case(Exec& x, const char* name, const Segs& segs, bool flops, int cap = 0) {
  const int nh = 32, nkv = 8, hd = 128, block = 16;
  std::mt19937 rng(7);
  const Layout L = layout(segs, block, 5, rng, cap);
  const size_t pool = size_t(L.pool_rows) * nkv * hd * 2, nq = size_t(L.N) * nh * hd;
  const int layers = int(std::clamp<size_t>((size_t(512) << 20) / (2 * pool), 1, 36));
  int32_t *cu = upload(L.cu.data(), L.cu.size() * 4), *ctx = upload(L.ctx.data(), L.ctx.size() * 4),
          *tab = upload(L.table.data(), L.table.size() * 4);
  uint8_t *K, *V, *Q, *O;
  CK(cudaMalloc(&K, pool * layers));
  CK(cudaMalloc(&V, pool * layers));
  CK(cudaMalloc(&Q, nq * 2));
  CK(cudaMalloc(&O, nq * 2));
  fill_random<<<1024, 256>>>(K, pool * layers / 2, 1, true);
  fill_random<<<1024, 256>>>(V, pool * layers / 2, 2, true);
  fill_random<<<1024, 256>>>(Q, nq, 3, true);
  CK(cudaDeviceSynchronize());
  const cudaStream_t st = dev::cuda::stream_of(x);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto run = [&](bool tc, int l) {
    dev::cuda::paged_attention_path(x, tc, Q, K + pool * l, V + pool * l, O, cu, ctx, tab, L.max_blocks, block,
                                    int64_t(segs.size()), L.max_q, L.max_ctx, L.N, nh, nkv, hd,
                                    1.f / std::sqrt(float(hd)), DType::BF16);
  };
  auto timeit = [&](bool tc) {
    for (int i = 0; i < layers + 3; ++i) run(tc, i % layers);
    const int reps = std::max(20, 2 * layers);
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < reps; ++i) run(tc, i % layers);
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return 1e3 * double(ms) / reps;
  };
  Timing T{name, timeit(false), timeit(true), 0, flops};
  for (size_t s = 0; s < segs.size(); ++s) {
    const auto [n, c] = segs[s];
    if (flops)  // QK^T and PV over the causal key ranges of the new rows
      for (int i = 0; i < n; ++i) T.amount += 4.0 * nh * hd * (c - n + i + 1) * 1e-9;
    else
      T.amount += 2.0 * c * nkv * hd * 2 * 1e-9;  // K and V rows read
  }
  if (!flops) T.amount += 2.0 * nq * 2 * 1e-9;
  for (void* p : {(void*)K, (void*)V, (void*)Q, (void*)O, (void*)cu, (void*)ctx, (void*)tab}) CK(cudaFree(p));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return T;
}

void run_timing(Exec& x) {
  std::vector<Timing> T;
  T.push_back(time_case(x, "decode 1 x ctx 650", {{1, 650}}, false));
  T.push_back(time_case(x, "decode 1 x ctx 4096", {{1, 4096}}, false));
  T.push_back(time_case(x, "decode 64 x ctx 650", Segs(64, {1, 650}), false));
  Segs ragged;
  for (int s = 0; s < 64; ++s) ragged.push_back({1, 400 + (s * 97) % 500});
  T.push_back(time_case(x, "decode 64 x ctx 400..900", ragged, false));
  // As serving's decode steps (CUDA graphs) call it: max_ctx is the block table's capacity (serve.max_context).
  T.push_back(time_case(x, "decode 1 x ctx 300, capacity 8192", {{1, 300}}, false, 8192));
  T.push_back(time_case(x, "decode 1 x ctx 4096, capacity 8192", {{1, 4096}}, false, 8192));
  T.push_back(time_case(x, "decode 64 x ctx 400..900, cap 8192", ragged, false, 8192));
  T.push_back(time_case(x, "prefill 4 x 512 on ctx 512..1024", {{512, 512}, {512, 683}, {512, 853}, {512, 1024}},
                        true));
  T.push_back(time_case(x, "prefill 3 x 650 fresh", Segs(3, {650, 650}), true));
  Segs mixed(60, {1, 650});
  for (int c : {512, 683, 853, 1024}) mixed.push_back({512, c});
  T.push_back(time_case(x, "mixed 60 decode + 4 x 512 chunks", mixed, true));
  std::printf("\n%-34s %10s %10s %14s %8s\n", "bf16, 32/8 heads, hd 128, block 16", "old us", "new us", "new rate",
              "speedup");
  for (const Timing& t : T)
    std::printf("%-34s %10.1f %10.1f %9.1f %s %7.2fx\n", t.name.c_str(), t.us_old, t.us_new,
                t.amount / (t.us_new * 1e-6) * (t.flops ? 1e-3 : 1.0), t.flops ? "TF/s" : "GB/s",
                t.us_old / t.us_new);
}

}  // namespace

int main(int argc, char** argv) {
  bool timing = true;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--no-timing") timing = false;
  Exec x;
  x.device = Device::CUDA;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  x.stream = st;
  x.ws_bytes = size_t(64) << 20;
  CK(cudaMalloc(&x.ws, x.ws_bytes));
  int fails = 0;
  try {
    fails = run_checks(x);
    if (timing) run_timing(x);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  std::printf("%s: %d failed check(s)\n", fails ? "FAIL" : "PASS", fails);
  CK(cudaFree(x.ws));
  CK(cudaStreamDestroy(st));
  return fails ? 1 : 0;
}
