// CUDA backend: cuBLAS for matmul, simple grid-stride kernels elsewhere. Tested against the CPU
// backend (tests/gpu) on the GPU machine; CI, which has no GPU, only compiles it.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "q3vl/core/error.hpp"
#include "q3vl/tensor/backend.hpp"

namespace q3vl {

namespace {

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(std::string("cuda ") + what + ": " + cudaGetErrorString(e));
}
void cublas_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) fail(std::string("cublas ") + what + ": status " + std::to_string(int(s)));
}

int blocks_for(int64_t n) { return int((n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535); }

__device__ float load_any(const void* p, int dt, int64_t i) {
  switch (dt) {
    case 0: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case 1: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ void store_any(void* p, int dt, int64_t i, float v) {
  switch (dt) {
    case 0: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case 1: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

__global__ void k_convert(void* dst, int ddt, const void* src, int sdt, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_any(dst, ddt, i, load_any(src, sdt, i));
}
__global__ void k_fill(void* dst, int dt, float v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_any(dst, dt, i, v);
}
// op 0: out = a + b, 1: out = a * b, 2: out += alpha * a, 3: out *= alpha
__global__ void k_elementwise(int op, const float* a, const float* b, float* out, float alpha, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    switch (op) {
      case 0: out[i] = a[i] + b[i]; break;
      case 1: out[i] = a[i] * b[i]; break;
      case 2: out[i] += alpha * a[i]; break;
      default: out[i] *= alpha;
    }
  }
}
// op 0: sum, 1: sum of squares, 2: max |x|, 3: count of non-finite. One double per block, reduced on the host.
__global__ void k_reduce(int op, const float* x, int64_t n, double* partial) {
  __shared__ double s[256];
  double acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    double v = x[i];
    if (op == 0) acc += v;
    else if (op == 1) acc += v * v;
    else if (op == 2) acc = fmax(acc, fabs(v));
    else acc += isfinite(x[i]) ? 0.0 : 1.0;
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) s[threadIdx.x] = op == 2 ? fmax(s[threadIdx.x], s[threadIdx.x + w]) : s[threadIdx.x] + s[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

int dt_code(const Tensor& t) {
  switch (t.dtype()) {
    case DType::BF16: return 0;
    case DType::F16: return 1;
    case DType::F32: return 2;
    default: fail("cuda: unsupported dtype in " + t.describe());
  }
}

void cuda_free(void* p) { cudaFree(p); }

class CudaBackend : public Backend {
 public:
  CudaBackend() { cublas_check(cublasCreate(&blas_), "create"); }
  ~CudaBackend() override { cublasDestroy(blas_); }
  Device device() const override { return Device::CUDA; }
  std::string name() const override { return "cuda"; }

  Tensor alloc(std::vector<int64_t> shape, DType t) override {
    Tensor probe = Tensor::wrap(nullptr, shape, t, Device::CUDA);
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, std::max<size_t>(probe.nbytes(), 1)), ("malloc " + probe.describe()).c_str());
    cuda_check(cudaMemset(p, 0, probe.nbytes()), "memset");
    return Tensor::adopt(p, std::move(shape), t, Device::CUDA, cuda_free);
  }

  void copy(Tensor& dst, const Tensor& src) override {
    if (dst.numel() != src.numel()) fail("cuda copy: " + dst.describe() + " <- " + src.describe());
    if (dst.dtype() == src.dtype()) {
      cuda_check(cudaMemcpy(dst.data(), src.data(), src.nbytes(), cudaMemcpyDefault), "memcpy");
      return;
    }
    if (dst.device() != Device::CUDA || src.device() != Device::CUDA)
      fail("cuda copy: dtype conversion needs both tensors on the device: " + dst.describe() + " <- " + src.describe());
    k_convert<<<blocks_for(src.numel()), 256>>>(dst.data(), dt_code(dst), src.data(), dt_code(src), src.numel());
    cuda_check(cudaGetLastError(), "convert");
  }

  void fill(Tensor& x, double value) override {
    k_fill<<<blocks_for(x.numel()), 256>>>(x.data(), dt_code(x), float(value), x.numel());
    cuda_check(cudaGetLastError(), "fill");
  }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    int64_t m = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1);
    int64_t kb = tb ? b.dim(1) : b.dim(0), n = tb ? b.dim(0) : b.dim(1);
    if (k != kb || c.dim(0) != m || c.dim(1) != n)
      fail("cuda matmul: shapes " + a.describe() + " x " + b.describe() + " -> " + c.describe() + " do not match");
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T.
    cublas_check(cublasSgemm(blas_, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(n), int(m),
                             int(k), &alpha, b.ptr<float>(), int(b.dim(1)), a.ptr<float>(), int(a.dim(1)), &beta,
                             c.ptr<float>(), int(c.dim(1))),
                 "sgemm");
  }

  void add(const Tensor& a, const Tensor& b, Tensor& out) override { ew(0, a.ptr<float>(), b.ptr<float>(), out, 0.f); }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override { ew(1, a.ptr<float>(), b.ptr<float>(), out, 0.f); }
  void axpy(float alpha, const Tensor& x, Tensor& y) override { ew(2, x.ptr<float>(), nullptr, y, alpha); }
  void scale(Tensor& x, float alpha) override { ew(3, nullptr, nullptr, x, alpha); }

  double sum(const Tensor& x) override { return reduce(0, x); }
  double sum_squares(const Tensor& x) override { return reduce(1, x); }
  double max_abs(const Tensor& x) override { return reduce(2, x); }
  bool all_finite(const Tensor& x) override { return reduce(3, x) == 0.0; }
  void synchronize() override { cuda_check(cudaDeviceSynchronize(), "synchronize"); }

 private:
  void ew(int op, const float* a, const float* b, Tensor& out, float alpha) {
    k_elementwise<<<blocks_for(out.numel()), 256>>>(op, a, b, out.ptr<float>(), alpha, out.numel());
    cuda_check(cudaGetLastError(), "elementwise");
  }
  double reduce(int op, const Tensor& x) {
    int nb = blocks_for(x.numel());
    double* partial = nullptr;
    cuda_check(cudaMalloc(&partial, sizeof(double) * nb), "malloc");
    k_reduce<<<nb, 256>>>(op, x.ptr<float>(), x.numel(), partial);
    std::vector<double> h(nb);
    cuda_check(cudaMemcpy(h.data(), partial, sizeof(double) * nb, cudaMemcpyDeviceToHost), "memcpy");
    cudaFree(partial);
    double acc = 0;
    for (double v : h) acc = op == 2 ? std::max(acc, v) : acc + v;
    return acc;
  }
  cublasHandle_t blas_{};
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) fail("model.backend = cuda, but no CUDA device is visible");
  return std::make_unique<CudaBackend>();
}

}  // namespace q3vl
