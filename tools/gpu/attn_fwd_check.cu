// GPU check and A/B timing of the Hopper wgmma attention forward (src/tensor/cuda/attention_sm90.cu, "new") against
// fwd_tc (src/tensor/cuda/attention.cu, "old") and a naive fp64 host reference. Build (from the repo root; the wgmma
// file needs sm_90a, the rest is built as the Makefile does):
//   F="-std=c++20 -O3 -Iinclude -Isrc --expt-relaxed-constexpr -ccbin g++ -I/usr/include/x86_64-linux-gnu/mpich -DQ3VL_CUDA=1"
//   nvcc $F -arch=sm_90 -c src/tensor/cuda/attention.cu -o /tmp/attn_old.o && \
//   nvcc $F -gencode=arch=compute_90a,code=sm_90a -c src/tensor/cuda/attention_sm90.cu -o /tmp/attn_sm90.o && \
//   nvcc $F -arch=sm_90 tools/gpu/attn_fwd_check.cu /tmp/attn_old.o /tmp/attn_sm90.o src/core/dtype.cpp \
//     -o /tmp/attn_fwd_check
// Run: /tmp/attn_fwd_check [--no-timing]. Exit 1 on any failed check (or if the new path was not taken).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tensor/cuda/common.cuh"

namespace q3vl::dev::cuda {
bool attention_fwd_sm90(cudaStream_t st, bool bf16, const void* q, const void* k, const void* v, void* out, float* lse,
                        const int32_t* cu, int nseg, int max_len, int nh, int nkv, int hd, bool causal, float sl2,
                        bool pipelined);
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

// Naive fp64 forward reference (attn_check.cu's, forward only), parallel over (head, segment).
void reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               const std::vector<int>& cu, int N, int nh, int nkv, int hd, bool causal, double scale,
               std::vector<double>& out, std::vector<double>& lse) {
  const int nseg = int(cu.size()) - 1, grp = nh / nkv;
  const int64_t ldq = int64_t(nh) * hd, ldk = int64_t(nkv) * hd;
  out.assign(size_t(N) * ldq, 0.0);
  lse.assign(size_t(N) * nh, 0.0);
  auto task = [&](int h, int s) {
    const int b0 = cu[s], L = cu[s + 1] - cu[s], kh = h / grp;
    std::vector<double> P(L);
    for (int i = 0; i < L; ++i) {
      const int n = causal ? i + 1 : L;
      double mx = -INFINITY;
      for (int j = 0; j < n; ++j) {
        double a = 0;
        for (int d = 0; d < hd; ++d) a += double(q[(b0 + i) * ldq + h * hd + d]) * k[(b0 + j) * ldk + kh * hd + d];
        mx = std::max(mx, P[j] = a * scale);
      }
      double sum = 0;
      for (int j = 0; j < n; ++j) sum += (P[j] = std::exp(P[j] - mx));
      lse[size_t(b0 + i) * nh + h] = mx + std::log(sum);
      for (int d = 0; d < hd; ++d) {
        double a = 0;
        for (int j = 0; j < n; ++j) a += P[j] * v[(b0 + j) * ldk + kh * hd + d];
        out[(b0 + i) * ldq + h * hd + d] = a / sum;
      }
    }
  };
  std::atomic<int> next{0};
  const int ntask = nh * nseg;
  std::vector<std::thread> th;
  for (unsigned t = 0; t < std::max(1u, std::thread::hardware_concurrency()); ++t)
    th.emplace_back([&] {
      for (int i; (i = next++) < ntask;) task(i % nh, i / nh);
    });
  for (auto& t : th) t.join();
}

// Values on a 1/16 grid: exact in bf16 and fp16, so both dtypes see the reference's inputs.
std::vector<float> grid_values(size_t n, double sigma, std::mt19937& rng) {
  std::normal_distribution<double> nd(0.0, sigma);
  std::vector<float> x(n);
  for (auto& e : x) e = float(std::clamp(std::round(nd(rng) * 16.0) / 16.0, -8.0, 127.0 / 16.0));
  return x;
}
void* upload(const std::vector<float>& x, DType dt) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = dt == DType::BF16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
  void* p;
  CK(cudaMalloc(&p, std::max<size_t>(b.size() * 2, 16)));
  CK(cudaMemcpy(p, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  return p;
}
std::vector<float> download(const void* p, size_t n, DType dt) {
  std::vector<uint16_t> b(n);
  CK(cudaMemcpy(b.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = dt == DType::BF16 ? bf16_to_f32(b[i]) : f16_to_f32(b[i]);
  return x;
}
// max|a - b| / max|b|
template <class A, class B> double nerr(const std::vector<A>& a, const std::vector<B>& b) {
  double e = 0, m = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(double(a[i]))) return INFINITY;
    e = std::max(e, std::fabs(double(a[i]) - double(b[i])));
    m = std::max(m, std::fabs(double(b[i])));
  }
  return m > 0 ? e / m : e;
}
// max |a - b| / max(1, |b|), elementwise (lse)
double lerr(const std::vector<float>& a, const std::vector<float>& b) {
  double e = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    e = std::max(e, std::fabs(double(a[i]) - b[i]) / std::max(1.0, std::fabs(double(b[i]))));
  }
  return e;
}

struct Launch {  // one problem on the device; old() / fresh(pipelined) run one forward into O, lse
  Exec& x;
  DType dt;
  void *Q, *K, *V, *O;
  float* lse;
  int32_t* cu;
  int nseg, max_len, N, nh, nkv, hd;
  bool causal;
  float scale;
  void old() const {
    dev::cuda::attention_fwd(x, Q, K, V, O, lse, cu, nseg, max_len, N, nh, nkv, hd, causal, scale, dt);
  }
  void fresh(bool pipelined) const {
    const float sl2 = scale * 1.4426950408889634f;
    if (!dev::cuda::attention_fwd_sm90(dev::cuda::stream_of(x), dt == DType::BF16, Q, K, V, O, lse, cu, nseg,
                                       max_len, nh, nkv, hd, causal, sl2, pipelined)) {
      std::fprintf(stderr, "FAIL: the sm90 path was not taken (device not 9.0?)\n");
      std::exit(1);
    }
  }
};

int run_checks(Exec& x) {
  // ragged: empty, 1, lengths off the 128 tile, exact tiles, one longer than several tiles
  const std::vector<int> lens = {1, 37, 0, 128, 200, 513, 129, 1000, 64};
  std::vector<int> cu = {0};
  for (int L : lens) cu.push_back(cu.back() + L);
  const int N = cu.back(), nseg = int(lens.size()), max_len = *std::max_element(lens.begin(), lens.end());
  int32_t* dcu;
  CK(cudaMalloc(&dcu, cu.size() * 4));
  CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  int fails = 0;
  for (int hd : {64, 128})
    for (int nkv : {8, 16})
      for (bool causal : {true, false}) {
        const int nh = 16;
        const double scale = 1.0 / std::sqrt(double(hd));
        std::mt19937 rng(99 + hd * 7 + nkv + causal);
        const size_t nq = size_t(N) * nh * hd, nk = size_t(N) * nkv * hd;
        auto q = grid_values(nq, 1.5, rng), k = grid_values(nk, 1.0, rng), v = grid_values(nk, 1.0, rng);
        std::vector<double> rout, rlse;
        reference(q, k, v, cu, N, nh, nkv, hd, causal, scale, rout, rlse);
        for (DType dt : {DType::BF16, DType::F16}) {
          void *Q = upload(q, dt), *K = upload(k, dt), *V = upload(v, dt), *O;
          float* lse;
          CK(cudaMalloc(&O, nq * 2));
          CK(cudaMalloc(&lse, size_t(N) * nh * 4));
          Launch l{x, dt, Q, K, V, O, lse, dcu, nseg, max_len, N, nh, nkv, hd, causal, float(scale)};
          // 0: fwd_tc (old), 1: wgmma pipelined (the default), 2: wgmma in sequence (kPipe false)
          std::vector<float> out[3], ls[3];
          for (int which = 0; which < 3; ++which) {
            CK(cudaMemset(O, 0xff, nq * 2));  // NaN: rows the kernel skips show up
            CK(cudaMemset(lse, 0xff, size_t(N) * nh * 4));
            which ? l.fresh(which == 1) : l.old();
            CK(cudaStreamSynchronize(dev::cuda::stream_of(x)));
            CK(cudaGetLastError());
            out[which] = download(O, nq, dt);
            ls[which].resize(size_t(N) * nh);
            CK(cudaMemcpy(ls[which].data(), lse, ls[which].size() * 4, cudaMemcpyDeviceToHost));
          }
          const double tol = dt == DType::F16 ? 1e-2 : 4e-2;    // vs fp64 (attn_check.cu's)
          const double tol_ab = dt == DType::F16 ? 4e-3 : 2e-2;  // new vs old: a few 16-bit roundings
          const double e_old = nerr(out[0], rout);
          for (int which = 1; which < 3; ++which) {
            const double e_new = nerr(out[which], rout), e_ab = nerr(out[which], out[0]);
            const double l_new = nerr(ls[which], rlse), l_ab = lerr(ls[which], ls[0]);
            const bool ok = e_new < tol && l_new < 2e-3 && e_ab < tol_ab && l_ab < 2e-5;
            fails += !ok;
            std::printf("%s hd=%3d nh=%d nkv=%2d causal=%d %-4s  out: old %.2e new %.2e new-old %.2e  lse: new %.2e "
                        "new-old %.2e  %s\n",
                        which == 1 ? "pipe" : "seq ", hd, nh, nkv, int(causal), dtype_name(dt), e_old, e_new, e_ab,
                        l_new, l_ab, ok ? "PASS" : "FAIL");
          }
          std::fflush(stdout);
          for (void* p : {Q, K, V, O, static_cast<void*>(lse)}) CK(cudaFree(p));
        }
      }
  CK(cudaFree(dcu));
  return fails;
}

__global__ void fill_random(void* p, size_t n, uint32_t seed, float amp, bool bf) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    const float f = (float(h) * (1.f / 4294967296.f) * 2.f - 1.f) * amp;
    if (bf) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(f);
    else static_cast<__half*>(p)[i] = __float2half(f);
  }
}

struct Row {
  std::string name;
  double ms_old, ms_new, ms_seq, tf_old, tf_new, diff;
};

Row time_case(Exec& x, const char* name, int nseg, int L, int nh, int nkv, int hd, bool causal, DType dt) {
  const int N = nseg * L;
  std::vector<int> cu(nseg + 1);
  for (int s = 0; s <= nseg; ++s) cu[s] = s * L;
  int32_t* dcu;
  CK(cudaMalloc(&dcu, cu.size() * 4));
  CK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  const size_t nq = size_t(N) * nh * hd, nk = size_t(N) * nkv * hd;
  void *Q, *K, *V, *O, *O2;
  float *lse, *lse2;
  for (void** p : {&Q, &O, &O2}) CK(cudaMalloc(p, nq * 2));
  for (void** p : {&K, &V}) CK(cudaMalloc(p, nk * 2));
  CK(cudaMalloc(&lse, size_t(N) * nh * 4));
  CK(cudaMalloc(&lse2, size_t(N) * nh * 4));
  fill_random<<<1024, 256>>>(Q, nq, 1, 2.f, dt == DType::BF16);
  fill_random<<<1024, 256>>>(K, nk, 2, 2.f, dt == DType::BF16);
  fill_random<<<1024, 256>>>(V, nk, 3, 2.f, dt == DType::BF16);
  CK(cudaDeviceSynchronize());
  Launch a{x, dt, Q, K, V, O, lse, dcu, nseg, L, N, nh, nkv, hd, causal, 1.f / std::sqrt(float(hd))};
  Launch b = a;
  b.O = O2, b.lse = lse2;
  cudaStream_t st = dev::cuda::stream_of(x);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto median_ms = [&](auto&& f) {
    for (int i = 0; i < 5; ++i) f();
    std::vector<float> t(50);
    for (float& ms : t) {
      CK(cudaEventRecord(e0, st));
      f();
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&ms, e0, e1));
    }
    std::sort(t.begin(), t.end());
    return double(t[t.size() / 2]);
  };
  Row r;
  r.name = std::string(name) + " nseg=" + std::to_string(nseg) + " L=" + std::to_string(L) + " " +
           std::to_string(nh) + "/" + std::to_string(nkv) + " hd" + std::to_string(hd) + (causal ? " causal" : "");
  r.ms_old = median_ms([&] { a.old(); });
  r.ms_new = median_ms([&] { b.fresh(true); });
  r.ms_seq = median_ms([&] { b.fresh(false); });
  b.fresh(true);
  const double flops = 4.0 * nh * hd * double(nseg) * double(L) * double(L) / (causal ? 2.0 : 1.0);
  r.tf_old = flops / r.ms_old * 1e-9;
  r.tf_new = flops / r.ms_new * 1e-9;
  r.diff = nerr(download(O2, nq, dt), download(O, nq, dt));  // new vs old on the timed inputs
  for (void* p : {Q, K, V, O, O2, static_cast<void*>(lse), static_cast<void*>(lse2), static_cast<void*>(dcu)})
    CK(cudaFree(p));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool timing = true;
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--no-timing") timing = false;
  setenv("Q3VL_ATTN_FWD", "old", 1);  // attention_fwd = fwd_tc ("old"); the new kernel is called directly
  Exec x;
  x.device = Device::CUDA;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  x.stream = st;
  int fails = 0;
  std::vector<Row> rows;
  try {
    fails = run_checks(x);
    if (timing) {
      rows.push_back(time_case(x, "text", 4, 4096, 16, 8, 128, true, DType::BF16));
      rows.push_back(time_case(x, "text", 4, 4096, 16, 8, 128, true, DType::F16));
      rows.push_back(time_case(x, "vision", 20, 784, 16, 16, 64, false, DType::BF16));
      rows.push_back(time_case(x, "vision", 1, 16384, 16, 16, 64, false, DType::BF16));
      rows.push_back(time_case(x, "hd64c", 4, 4096, 16, 8, 64, true, DType::BF16));
      for (const Row& r : rows) fails += !(r.diff < 2e-2);  // new vs old on the timed inputs too
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  if (!rows.empty()) {
    std::printf("\nold: fwd_tc; new: wgmma pipelined (the default); seq: wgmma without the softmax/PV overlap\n");
    std::printf("%-44s %8s %8s %8s %8s %8s %7s %9s\n", "case (median of 50)", "old ms", "new ms", "seq ms", "old TF",
                "new TF", "speedup", "new-old");
    for (const Row& r : rows)
      std::printf("%-44s %8.3f %8.3f %8.3f %8.1f %8.1f %6.2fx %9.2e\n", r.name.c_str(), r.ms_old, r.ms_new, r.ms_seq,
                  r.tf_old, r.tf_new, r.ms_old / r.ms_new, r.diff);
  }
  std::printf("%s: %d failed check(s)\n", fails ? "FAIL" : "PASS", fails);
  CK(cudaStreamDestroy(st));
  return fails ? 1 : 0;
}
