// The Backend op interface: what the model and the optimizer ask of a device. The CPU backend is the
// reference every other backend is tested against. Model-layer kernels (attention, norms, rotary, ...)
// live in tensor/ops.hpp with the same split: a CPU reference first, device versions later.
#pragma once
#include <memory>
#include <string>

#include "q3vl/tensor/tensor.hpp"

namespace q3vl {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;

  virtual Tensor alloc(std::vector<int64_t> shape, DType t) = 0;  // zero-filled
  // dst <- src, same element count; converts between bf16, fp16 and fp32 when the dtypes differ.
  virtual void copy(Tensor& dst, const Tensor& src) = 0;
  virtual void fill(Tensor& x, double value) = 0;

  // c = alpha * op(a) @ op(b) + beta * c for 2-D fp32 row-major tensors; op transposes when t* is set.
  virtual void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha = 1.f,
                      float beta = 0.f) = 0;
  // Elementwise on fp32 tensors of equal element count.
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;    // out = a + b
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& out) = 0;    // out = a * b
  virtual void axpy(float alpha, const Tensor& x, Tensor& y) = 0;         // y += alpha * x
  virtual void scale(Tensor& x, float alpha) = 0;                         // x *= alpha
  // Reductions over all elements, accumulated in fp64.
  virtual double sum(const Tensor& x) = 0;
  virtual double sum_squares(const Tensor& x) = 0;
  virtual double max_abs(const Tensor& x) = 0;
  virtual bool all_finite(const Tensor& x) = 0;

  virtual void synchronize() {}
};

// "cpu" or "cuda" (the latter only in a build with the CUDA backend).
std::unique_ptr<Backend> make_backend(const std::string& name);

}  // namespace q3vl
