// CPU reference backend: BLAS for matmul, plain loops elsewhere.
#include <cblas.h>

#include <cmath>
#include <cstring>

#include "q3vl/core/error.hpp"
#include "q3vl/tensor/backend.hpp"

namespace q3vl {

namespace {

void need_f32(const Tensor& x, const char* op) {
  if (x.dtype() != DType::F32) fail(std::string("cpu ") + op + ": expects fp32, got " + x.describe());
}
void same_numel(const Tensor& a, const Tensor& b, const char* op) {
  if (a.numel() != b.numel()) fail(std::string("cpu ") + op + ": " + a.describe() + " vs " + b.describe());
}

float load(const Tensor& x, int64_t i) {
  switch (x.dtype()) {
    case DType::F32: return static_cast<const float*>(x.data())[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(x.data())[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(x.data())[i]);
    default: fail("cpu copy: cannot convert " + x.describe());
  }
}
void store(Tensor& x, int64_t i, float v) {
  switch (x.dtype()) {
    case DType::F32: static_cast<float*>(x.data())[i] = v; break;
    case DType::BF16: static_cast<uint16_t*>(x.data())[i] = f32_to_bf16(v); break;
    case DType::F16: static_cast<uint16_t*>(x.data())[i] = f32_to_f16(v); break;
    default: fail("cpu copy: cannot convert into " + x.describe());
  }
}

class CpuBackend : public Backend {
 public:
  Device device() const override { return Device::CPU; }
  std::string name() const override { return "cpu"; }

  Tensor alloc(std::vector<int64_t> shape, DType t) override { return Tensor::zeros(std::move(shape), t); }

  void copy(Tensor& dst, const Tensor& src) override {
    same_numel(dst, src, "copy");
    if (dst.dtype() == src.dtype()) {
      std::memmove(dst.data(), src.data(), src.nbytes());
      return;
    }
    for (int64_t i = 0; i < src.numel(); ++i) store(dst, i, load(src, i));
  }

  void fill(Tensor& x, double value) override {
    if (x.dtype() == DType::F32) {
      float* p = x.ptr<float>();
      for (int64_t i = 0; i < x.numel(); ++i) p[i] = float(value);
    } else {
      for (int64_t i = 0; i < x.numel(); ++i) store(x, i, float(value));
    }
  }

  void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) override {
    need_f32(a, "matmul"), need_f32(b, "matmul"), need_f32(c, "matmul");
    if (a.ndim() != 2 || b.ndim() != 2 || c.ndim() != 2) fail("cpu matmul: 2-D tensors expected");
    int64_t m = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1);
    int64_t kb = tb ? b.dim(1) : b.dim(0), n = tb ? b.dim(0) : b.dim(1);
    if (k != kb || c.dim(0) != m || c.dim(1) != n)
      fail("cpu matmul: shapes " + a.describe() + (ta ? "^T" : "") + " x " + b.describe() + (tb ? "^T" : "") +
           " -> " + c.describe() + " do not match");
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n), int(k),
                alpha, a.ptr<float>(), int(a.dim(1)), b.ptr<float>(), int(b.dim(1)), beta, c.ptr<float>(),
                int(c.dim(1)));
  }

  void add(const Tensor& a, const Tensor& b, Tensor& out) override { binary(a, b, out, "add", [](float x, float y) { return x + y; }); }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override { binary(a, b, out, "mul", [](float x, float y) { return x * y; }); }

  void axpy(float alpha, const Tensor& x, Tensor& y) override {
    need_f32(x, "axpy"), need_f32(y, "axpy"), same_numel(x, y, "axpy");
    const float* px = x.ptr<float>();
    float* py = y.ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) py[i] += alpha * px[i];
  }

  void scale(Tensor& x, float alpha) override {
    need_f32(x, "scale");
    float* p = x.ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] *= alpha;
  }

  double sum(const Tensor& x) override { return reduce(x, "sum", [](double acc, float v) { return acc + v; }); }
  double sum_squares(const Tensor& x) override {
    return reduce(x, "sum_squares", [](double acc, float v) { return acc + double(v) * v; });
  }
  double max_abs(const Tensor& x) override {
    return reduce(x, "max_abs", [](double acc, float v) { return std::fmax(acc, std::fabs(double(v))); });
  }
  bool all_finite(const Tensor& x) override {
    need_f32(x, "all_finite");
    const float* p = x.ptr<float>();
    for (int64_t i = 0; i < x.numel(); ++i)
      if (!std::isfinite(p[i])) return false;
    return true;
  }

 private:
  template <class F>
  void binary(const Tensor& a, const Tensor& b, Tensor& out, const char* op, F f) {
    need_f32(a, op), need_f32(b, op), need_f32(out, op), same_numel(a, b, op), same_numel(a, out, op);
    const float *pa = a.ptr<float>(), *pb = b.ptr<float>();
    float* po = out.ptr<float>();
    for (int64_t i = 0; i < a.numel(); ++i) po[i] = f(pa[i], pb[i]);
  }
  template <class F>
  double reduce(const Tensor& x, const char* op, F f) {
    need_f32(x, op);
    const float* p = x.ptr<float>();
    double acc = 0;
    for (int64_t i = 0; i < x.numel(); ++i) acc = f(acc, p[i]);
    return acc;
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

#ifdef Q3VL_CUDA
std::unique_ptr<Backend> make_cuda_backend();
#endif

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return make_cpu_backend();
#ifdef Q3VL_CUDA
  if (name == "cuda") return make_cuda_backend();
#endif
  fail_all("backend '" + name + "' is not available in this build (built with: cpu" +
#ifdef Q3VL_CUDA
           std::string(", cuda") +
#else
           std::string("") +
#endif
           ")");
}

}  // namespace q3vl
